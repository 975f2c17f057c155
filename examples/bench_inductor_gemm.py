"""Inductor's max-autotune Triton GEMM templates against cuBLAS for qwen3-0.6b's decode linears (GPU only).

The question: could a per-shape choice of Inductor's autotuned GEMM beat cuBLAS for the W2 (64 rows) and W3 (256
rows) decode linears, where cuBLAS runs latency-bound at 5-8 us each? Each of the four linears of a layer (q/k/v, o,
gate/up, down) is compiled alone with `max_autotune_gemm` (backends from `--backends`), then all 28 layers x 4 linears
(distinct weights, so no layer reads another's weight from L2) are captured in one CUDA graph and timed against the
same chain through `F.linear` (cuBLAS); also each linear alone (L2-warm) and the largest difference from cuBLAS.

    python examples/bench_inductor_gemm.py [--rows 64 256] [--backends TRITON]

Session 29 (an H100): chains of 725.6 us (cuBLAS) against 762.4 (Inductor) at 64 rows, 892.9 against 1,038.7 at 256
(`examples/results/h100-2026-12-07-session29-inductor-max-autotune-gemm.txt`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

from hf_accel.ops.linear import time_in_graph

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # q/k/v, o, gate/up, down: (N, K)
LAYERS = 28


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", type=int, default=[64, 256])
    ap.add_argument("--backends", default="TRITON", help="Inductor's max_autotune_gemm_backends")
    args = ap.parse_args()
    inductor_config.max_autotune = True
    inductor_config.max_autotune_gemm = True
    inductor_config.max_autotune_gemm_backends = args.backends
    inductor_config.coordinate_descent_tuning = False
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    weights = [[torch.randn(n, k, device=dev, dtype=dt) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    for m in args.rows:
        xs = [torch.randn(m, k, device=dev, dtype=dt) for _n, k in SHAPES]
        t0 = time.perf_counter()
        compiled = []
        for i in range(len(SHAPES)):
            fn = torch.compile(linear, dynamic=False, fullgraph=True)
            fn(xs[i], weights[0][i])
            compiled.append(fn)
        compile_s = time.perf_counter() - t0

        def chain(fns, xs=xs):
            def run():
                for layer in weights:
                    for i, fn in enumerate(fns):
                        fn(xs[i], layer[i])
            return run

        times: dict[str, list[float]] = {"cublas": [], "inductor": []}
        for _ in range(3):
            times["cublas"].append(time_in_graph(chain([linear] * len(SHAPES)), reps=2, samples=5) * 1e6)
            times["inductor"].append(time_in_graph(chain(compiled), reps=2, samples=5) * 1e6)
        single = {}
        for i, shape in enumerate(SHAPES):
            w = weights[3][i]
            x, fn = xs[i], compiled[i]
            ours = time_in_graph(lambda x=x, w=w: linear(x, w), reps=16) * 1e6
            theirs = time_in_graph(lambda x=x, w=w, fn=fn: fn(x, w), reps=16) * 1e6
            err = (compiled[i](xs[i], w).float() - linear(xs[i], w).float()).abs().max().item()
            single[shape] = (round(ours, 2), round(theirs, 2), err)
        print(f"M={m} compile+autotune {compile_s:.1f} s; chain of {LAYERS}x{len(SHAPES)} (us): cublas "
              f"{statistics.median(times['cublas']):.1f} inductor {statistics.median(times['inductor']):.1f}; single "
              f"(L2-warm) cublas/inductor/maxerr {single}", flush=True)


if __name__ == "__main__":
    main()
