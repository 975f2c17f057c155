"""Two decode micro-batches on two CUDA streams: would W3's decode step gain from overlapping them? (a study)

W3's decode step (256 sequences, contexts of 356-1,280 tokens, qwen3-0.6b) spends about 5.7 ms of its ~7.7 ms on the
H200 in the attention kernel, which reads the KV cache at the copy bandwidth, and about 2 ms in the rest: the four
linears of each layer (cuBLAS, 6-8 us each at 256 rows, bound by latency: 16-96 output tiles for 132 SMs) and
about five short kernels. Splitting the batch into two halves that run side by side on two streams could let one
half's latency-bound kernels fill the SMs while the other half's attention streams its KV. The halves are
independent sequences, so they meet only at the step's start and end.

This script builds qwen3-0.6b's decode step from the kernels the engine runs (hf_accel's Triton decode attention
over a paged KV cache, cuBLAS linears, hf_accel's add + RMSNorm and SiLU-and-mul kernels, a copy standing in for the
q/k norm + RoPE), 28 layers with their own weights and KV caches (no layer finds another's bytes in L2), then the
final norm, the lm_head and the argmax. It times one CUDA graph of each:

- `full`: the 256 rows as one batch on one stream (what the engine does);
- `halves, one stream`: two batches of 128, one after the other (the cost of twice the launches, no overlap);
- `halves, two streams`: the same two batches forked onto two streams inside the graph and joined at the end;
- the three again without the attention kernel (`no attention`), to see what the rest alone gains.

It also checks that the two-stream graph gives the bits of the one-stream halves (no race between the streams).
Medians of `--samples` replays. On a CPU (`TRITON_INTERPRET=1`, `--scale tiny`) it only runs the check, eagerly.

`--workload w2` asks the same of W2's decode step (64 sequences of 129-384 tokens: attention about a third of it).

    python examples/bench_two_batch_overlap.py [--workload w3|w2] [--layers 28] [--pdl] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from bench_attention_kernels import BLOCK_SIZE, capture_graph, decode_metadata, median_seconds  # examples/

from hf_accel.attention.backend import AttentionSpec
from hf_accel.attention.metadata import StepMetadata

# qwen3-0.6b's decode shapes (`--scale tiny`: a few layers and narrow dims for the CPU check)
SCALES = {
    "full": dict(hidden=1024, heads=16, kv_heads=8, head_dim=128, inter=3072, vocab=151936, batch=256),
    "tiny": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, vocab=256, batch=8),
}
EPS = 1e-6


@dataclass
class Layer:
    norm1: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    norm2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


@dataclass
class Batch:
    """One micro-batch: its sequences' step metadata and an attention backend prepared for exactly that step."""

    meta: StepMetadata
    backend: object
    x: torch.Tensor  # the hidden states the step starts from, [rows, hidden]


def make_layers(n: int, dims: dict, num_blocks: int, device: torch.device, dtype: torch.dtype) -> list[Layer]:
    h, inter = dims["hidden"], dims["inter"]
    q, kv = dims["heads"] * dims["head_dim"], dims["kv_heads"] * dims["head_dim"]

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device, dtype=dtype) * cols**-0.5

    cache = (num_blocks, BLOCK_SIZE, dims["kv_heads"], dims["head_dim"])
    return [Layer(torch.ones(h, device=device, dtype=dtype), w(q + 2 * kv, h), w(h, q),
                  torch.ones(h, device=device, dtype=dtype), w(2 * inter, h), w(h, inter),
                  torch.randn(cache, device=device, dtype=dtype), torch.randn(cache, device=device, dtype=dtype))
            for _ in range(n)]


def make_batch(lengths: list[int], first_block: int, max_blocks: int, dims: dict, device: torch.device,
               dtype: torch.dtype, use_pdl: bool) -> Batch:
    """Sequences of these KV lengths on consecutive pages from `first_block` (the halves are given the pages of
    their rows in the full batch, so every variant reads the same KV bytes)."""
    from hf_accel.attention.triton_backend import TritonAttentionBackend

    batch = len(lengths)
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
    at = first_block
    for i, n in enumerate(lengths):
        need = -(-n // BLOCK_SIZE)
        tables[i, :need] = torch.arange(at, at + need, dtype=torch.int32)
        at += need
    meta = decode_metadata(lengths, tables, device)
    spec = AttentionSpec(dims["heads"], dims["kv_heads"], dims["head_dim"], dtype)
    backend = TritonAttentionBackend(spec, device, BLOCK_SIZE, batch, batch, max_blocks)
    backend.use_pdl = use_pdl
    backend.fused_split_reductions = True
    backend.prepare(meta)
    x = torch.randn(batch, dims["hidden"], device=device, dtype=dtype)
    return Batch(meta, backend, x)


def decode_step(b: Batch, layers: list[Layer], final_norm: torch.Tensor, lm_head: torch.Tensor, dims: dict,
                attention: bool, use_pdl: bool) -> torch.Tensor:
    """One decode step of `b` through every layer, then the greedy tokens: the kernels the engine runs per layer."""
    from hf_accel.ops.fused_kernels import add_rms_norm, silu_and_mul

    heads, d, inter = dims["heads"], dims["head_dim"], dims["inter"]
    scale = d**-0.5
    x, residual = b.x, None
    for layer in layers:
        h, residual = add_rms_norm(x, residual, layer.norm1, EPS, use_pdl)
        qkv = F.linear(h, layer.qkv)
        q = qkv[:, : heads * d].reshape(-1, heads, d).contiguous()  # stands in for the q/k norm + RoPE kernel
        out = q
        if attention:
            out = torch.empty_like(q)
            b.backend.forward(q, layer.k_cache, layer.v_cache, b.meta, out, scale, 0, 0.0)
        x = F.linear(out.view(-1, heads * d), layer.o)
        h, residual = add_rms_norm(x, residual, layer.norm2, EPS, use_pdl)
        gu = F.linear(h, layer.gate_up)
        x = F.linear(silu_and_mul(gu[:, :inter], gu[:, inter:], use_pdl), layer.down)
    h, _ = add_rms_norm(x, residual, final_norm, EPS, use_pdl)
    return F.linear(h, lm_head).argmax(-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=tuple(SCALES), default="full")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 28, tiny: 2)")
    ap.add_argument("--samples", type=int, default=20, help="graph replays timed (median reported)")
    ap.add_argument("--pdl", action="store_true", help="launch hf_accel's kernels with PDL, as the engine does")
    ap.add_argument("--workload", choices=("w3", "w2"), default="w3",
                    help="w3: 256 sequences of 356-1,280 tokens (default); w2: 64 sequences of 129-384 tokens")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    dims = SCALES[args.scale]
    n_layers = args.layers or (28 if args.scale == "full" else 2)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    use_pdl = bool(args.pdl and on_gpu)
    torch.manual_seed(0)
    rng = random.Random(0)
    if args.workload == "w3":  # W3 in the middle of its decode phase: a prompt of U[100, 1024] tokens, 256 generated
        lengths = [rng.randint(100, 1024) + 256 for _ in range(dims["batch"])]
    else:  # W2 over its decode phase: 64 prompts of 128 tokens, 1-256 generated
        lengths = [128 + rng.randint(1, 256) for _ in range(64)]
    if args.scale == "tiny":
        lengths = [rng.randint(5, 60) for _ in range(dims["batch"])]
    half = len(lengths) // 2
    need = [-(-n // BLOCK_SIZE) for n in lengths]
    num_blocks, max_blocks = sum(need) + 1, max(need)  # page 0 unused; the halves read the full batch's pages
    layers = make_layers(n_layers, dims, num_blocks, device, dtype)
    final_norm = torch.ones(dims["hidden"], device=device, dtype=dtype)
    lm_head = torch.randn(dims["vocab"], dims["hidden"], device=device, dtype=dtype) * dims["hidden"] ** -0.5
    full = make_batch(lengths, 1, max_blocks, dims, device, dtype, use_pdl)
    # the halves read the same pages as the full batch's rows (the second half's pages follow the first's)
    a = make_batch(lengths[:half], 1, max_blocks, dims, device, dtype, use_pdl)
    b = make_batch(lengths[half:], 1 + sum(need[:half]), max_blocks, dims, device, dtype, use_pdl)
    a.x.copy_(full.x[:half])
    b.x.copy_(full.x[half:])
    kv_gb = sum(lengths) * dims["kv_heads"] * dims["head_dim"] * 2 * torch.finfo(dtype).bits // 8 * n_layers / 1e9
    print(f"device: {torch.cuda.get_device_name() if on_gpu else 'cpu'}  {args.workload}, {n_layers} layers, "
          f"batch {len(lengths)} (halves {half} + {len(lengths) - half}), KV read per step {kv_gb:.2f} GB, "
          f"pdl={use_pdl}")

    def step(batch: Batch, attention: bool) -> torch.Tensor:
        return decode_step(batch, layers, final_norm, lm_head, dims, attention, use_pdl)

    def halves_one_stream(attention: bool):
        return lambda: (step(a, attention), step(b, attention))

    def halves_two_streams(attention: bool):
        def run():
            main = torch.cuda.current_stream(device)
            side = streams["side"]
            side.wait_stream(main)
            out_a = step(a, attention)
            with torch.cuda.stream(side):
                out_b = step(b, attention)
            main.wait_stream(side)
            return out_a, out_b
        return run

    if not on_gpu:  # the CPU check: the halves give the full batch's tokens (eager; float32 in the interpreter)
        whole = step(full, True)
        parts = torch.cat(halves_one_stream(True)())
        print("tokens equal between the full batch and its halves:", torch.equal(whole, parts))
        return 0 if torch.equal(whole, parts) else 1

    streams = {"side": torch.cuda.Stream(device)}
    rows = []
    for attention in (True, False):
        variants = {"full": lambda att=attention: step(full, att), "halves, one stream": halves_one_stream(attention),
                    "halves, two streams": halves_two_streams(attention)}
        outs = {}
        for name, fn in variants.items():
            graph, out = capture_graph(fn, reps=1)
            graph.replay()
            ms = median_seconds(graph.replay, args.samples) * 1e3
            torch.cuda.synchronize()
            outs[name] = torch.cat(out) if isinstance(out, tuple) else out.clone()
            label = name if attention else f"{name}, no attention"
            rows.append(dict(variant=label, ms=round(ms, 4)))
            print(f"  {label:38s} {ms * 1e3:9.1f} us per step")
            del graph
        same = torch.equal(outs["halves, one stream"], outs["halves, two streams"])
        agree = (outs["full"] == outs["halves, one stream"]).float().mean().item()
        print(f"  two streams give the one-stream halves' tokens: {same}; full batch vs halves: {agree:.1%} equal"
              f"{'' if attention else ' (no attention)'}")
        rows.append(dict(variant=f"check{'' if attention else ', no attention'}", two_streams_equal=same,
                         full_vs_halves_equal=agree))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), workload=args.workload, layers=n_layers, pdl=use_pdl,
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
