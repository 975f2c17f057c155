"""Decode GEMMs on the GPU: cuBLAS (F.linear) against hf_accel's small-M Triton GEMM, with and without PDL.

For each WORKLOADS.md shape's linears (q/k/v and gate/up packed, as the engine runs them) and M rows (default 1,
16, 64), times cuBLAS and a grid of tile configurations of `hf_accel.ops.skinny_gemm` and prints the best, in us and
TB/s of weight bytes. Weights are cycled through enough copies that L2 (50 MB) cannot hold them. Then a "layer
chain": every layer's four GEMMs in sequence, captured in one CUDA graph, cuBLAS vs ours without and with PDL, which
is what a decode step's GEMM time looks like.

    python examples/bench_skinny_gemm.py [--shapes qwen3-0.6b llama-3.2-1b] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from hf_accel.ops import pdl
from hf_accel.ops.linear import time_in_graph
from hf_accel.ops.skinny_gemm import SkinnyConfig, skinny_linear

SHAPES = {  # name: (hidden, intermediate, heads, kv heads, head dim, layers, vocab)
    "qwen3-0.6b": (1024, 3072, 16, 8, 128, 28, 151936),
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, 16, 128256),
    "llama-3.1-8b": (4096, 14336, 32, 8, 128, 32, 128256),
}


def linears(shape: str) -> dict[str, tuple[int, int]]:
    h, i, nh, nkv, d, _, v = SHAPES[shape]
    return {"qkv": ((nh + 2 * nkv) * d, h), "o": (h, nh * d), "gate_up": (2 * i, h), "down": (h, i),
            "lm_head": (v, h)}


def time_graph(fn, reps: int = 20, samples: int = 7) -> float:
    """Median microseconds per call of `fn`, `reps` calls captured in one CUDA graph (the tuner's own timing)."""
    return time_in_graph(fn, reps, samples) * 1e6


def candidates(m: int, k: int) -> list[SkinnyConfig]:
    """A wider grid than the tuner's (ops/linear.py) for exploring: five tiles (four at M > 16) x four splits."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    tiles = [(16, 512), (32, 256), (64, 128), (64, 256), (128, 128)] if bm == 16 else [(32, 128), (64, 64),
                                                                                      (64, 128), (128, 64)]
    return [SkinnyConfig(bm, bn, bk, split, 4, 4) for (bn, bk), split in itertools.product(tiles, (1, 2, 4, 8))
            if split == 1 or k // (split * bk) >= 1]


def gemv_candidates(k: int) -> list[SkinnyConfig]:
    """The one-row kernel's grid (M = 1 only): rows per program x K tile x splits."""
    tiles = [(2, 1024), (4, 512), (4, 1024), (8, 512), (8, 1024), (16, 256), (16, 512)]
    return [SkinnyConfig(1, bn, bk, split, 4, 4, gemv=True) for (bn, bk), split in itertools.product(tiles, (1, 2, 4))
            if split == 1 or k // (split * bk) >= 1]


def sweep_linear(shape: str, name: str, n: int, k: int, ms: list[int], use_pdl: bool) -> list[dict]:
    """cuBLAS and the best of the candidate tiles for one weight shape at each M."""
    dev = torch.device("cuda")
    nbytes = n * k * 2
    copies = max(1, -(-200_000_000 // nbytes))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    counters = torch.zeros(-(-n // 2), dtype=torch.int32, device=dev)  # split-K reduces in the launch, as in a step
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x, ws[0])

        def run(cfg: SkinnyConfig | None, x=x) -> float:
            it = itertools.cycle(ws)
            if cfg is None:
                return time_graph(lambda: F.linear(x, next(it)))
            return time_graph(lambda: skinny_linear(x, next(it), None, cfg, use_pdl, counters=counters))

        def best_of(cfgs: list[SkinnyConfig], x=x, ref=ref) -> tuple | None:
            best = None
            for cfg in cfgs:
                try:
                    out = skinny_linear(x, ws[0], None, cfg, use_pdl, counters=counters)
                    err = (out.float() - ref.float()).abs().max().item()
                    t = run(cfg)
                except Exception as exc:  # a config that does not compile here
                    print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg, err)
            return best

        t_cublas = run(None)
        best = best_of(candidates(m, k))
        row = {"shape": shape, "linear": name, "n": n, "k": k, "m": m, "cublas_us": t_cublas,
               "ours_best_us": best[0], "best": best[1].__dict__,
               "max_abs_err": best[2], "cublas_tbps": nbytes / t_cublas / 1e6, "ours_best_tbps": nbytes / best[0] / 1e6}
        line = (f"{shape:13s} {name:8s} m={m:3d} n={n:6d} k={k:5d}: cublas {t_cublas:7.2f} us "
                f"({row['cublas_tbps']:.2f} TB/s)  best {best[0]:7.2f} us "
                f"({row['ours_best_tbps']:.2f} TB/s) {best[1]} err {best[2]:.3g}")
        gemv = best_of(gemv_candidates(k)) if m == 1 else None
        if gemv is not None:
            row.update(gemv_best_us=gemv[0], gemv_best=gemv[1].__dict__, gemv_max_abs_err=gemv[2],
                       gemv_best_tbps=nbytes / gemv[0] / 1e6)
            line += f"\n{'':13s} {'':8s} one-row kernel: {gemv[0]:7.2f} us ({row['gemv_best_tbps']:.2f} TB/s) " \
                    f"block_n={gemv[1].block_n} block_k={gemv[1].block_k} split={gemv[1].split_k} err {gemv[2]:.3g}"
        rows.append(row)
        print(line, flush=True)
    return rows


def layer_chain(shape: str, results: list[dict], ms: list[int]) -> list[dict]:
    """Every layer's four GEMMs in sequence (own weights per layer), one graph: cuBLAS vs ours vs ours + PDL."""
    dev = torch.device("cuda")
    layers = SHAPES[shape][5]
    lin = linears(shape)
    names = ("qkv", "o", "gate_up", "down")
    layer_ws = [[torch.randn(*lin[nm], device=dev, dtype=torch.bfloat16) * 0.02 for nm in names]
                for _ in range(layers)]
    wbytes = sum(w.numel() * 2 for ws in layer_ws for w in ws)
    out = []
    for m in ms:
        xs = {nm: torch.randn(m, lin[nm][1], device=dev, dtype=torch.bfloat16) for nm in names}
        rows = {nm: next(r for r in results if r["shape"] == shape and r["linear"] == nm and r["m"] == m)
                for nm in names}
        cfgs = {nm: SkinnyConfig(**r["best"]) for nm, r in rows.items()}
        # the one-row kernel where it beat the tensor-core tiles (M = 1 only)
        mixed = {nm: SkinnyConfig(**r["gemv_best"]) if r.get("gemv_best_us", float("inf")) < r["ours_best_us"]
                 else cfgs[nm] for nm, r in rows.items()}
        counters = torch.zeros(max(lin[nm][0] for nm in names), dtype=torch.int32, device=dev)

        def chain(kind: str, xs=xs, cfgs=cfgs, mixed=mixed, counters=counters) -> None:
            for ws in layer_ws:
                for nm, w in zip(names, ws, strict=True):
                    if kind == "cublas":
                        F.linear(xs[nm], w)
                    else:
                        cfg = mixed[nm] if kind == "gemv" else cfgs[nm]
                        skinny_linear(xs[nm], w, None, cfg, kind != "ours", counters=counters)

        kinds = ("cublas", "ours", "pdl") + (("gemv",) if m == 1 else ())
        t = {kind: time_graph(lambda k=kind: chain(k), reps=1, samples=9) for kind in kinds}
        out.append({"shape": shape, "m": m, **{f"{k}_us": v for k, v in t.items()}, "weight_bytes": wbytes,
                    "gemv_linears": [nm for nm in names if mixed[nm].gemv]})
        extra = f"  ours+pdl with the one-row kernel {t['gemv']:8.1f} ({[nm for nm in names if mixed[nm].gemv]})" \
            if "gemv" in t else ""
        print(f"CHAIN {shape:13s} m={m:3d}: cublas {t['cublas']:8.1f} us  ours {t['ours']:8.1f}  "
              f"ours+pdl {t['pdl']:8.1f}{extra}  (weights {wbytes / 1e9:.2f} GB, roofline at 4.25 TB/s "
              f"{wbytes / 4.25e6:.1f} us)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--ms", nargs="*", type=int, default=[1, 16, 64])
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    use_pdl = pdl.supported(dev)
    print(f"device {torch.cuda.get_device_name()} sms={sms} pdl supported={use_pdl} "
          f"triton_supports_pdl={pdl.triton_supports_pdl()}")
    results: list[dict] = []
    chains: list[dict] = []
    for shape in args.shapes:
        for name, (n, k) in linears(shape).items():
            results += sweep_linear(shape, name, n, k, args.ms, use_pdl)
            torch.cuda.empty_cache()
        chains += layer_chain(shape, results, args.ms)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gemms": results, "chains": chains}, f, indent=1)


if __name__ == "__main__":
    main()
