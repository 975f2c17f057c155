"""Where a decode step's time goes: host (Python) profile and GPU kernel time of W1/W2-style generate() calls.

Builds a WORKLOADS.md shape with random weights, accelerates it and runs `generate()` for a batch of prompts,
then prints: wall time per step, the host functions that take the most time (cProfile), and the GPU time the
step's kernels take (torch.profiler), so "GPU busy" and "host overhead" can be told apart.

    python examples/profile_decode.py --shape qwen3-0.6b --batch 1 [--backend auto] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import pstats
import time

import torch

from hf_accel import accelerate_model, engine_info
from hf_accel.bench import build_model, disable_eos, random_prompts, resolve_device, shape_config
from hf_accel.bench.workloads import quantize_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--cudagraph-mode", default=None)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--quantization", default="none", help="a bench --quantization method")
    ap.add_argument("--layers", type=int, default=None, help="keep only this many decoder layers of the shape")
    ap.add_argument("--cudagraph-capture-sizes", default=None, help="comma-separated batch sizes")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--gated-gemm", action=argparse.BooleanOptionalAction, default=True,
                    help="AccelConfig.gated_gemm (default: on); --no-gated-gemm for the A/B")
    ap.add_argument("--log", action="store_true", help="log hf_accel's startup phases (INFO)")
    ap.add_argument("--runs", type=int, default=3, help="timed generate() calls; the median is printed")
    ap.add_argument("--walls-only", action="store_true",
                    help="print the timed calls' wall times and stop (no host or GPU profile): for A/Bs run as "
                         "alternating processes")
    args = ap.parse_args()
    if args.log:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = resolve_device(None)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.layers is None:
        model = build_model(args.shape, None, dtype, device, args.quantization)
    else:  # fewer layers of the same shape: per-layer kernels and costs in a fraction of the time
        from transformers import AutoModelForCausalLM

        config = shape_config(args.shape)
        config.num_hidden_layers = args.layers
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
        model = quantize_model(model, args.quantization, dtype, device)
    disable_eos(model)
    t0 = time.perf_counter()
    kw = {"cudagraph_mode": args.cudagraph_mode} if args.cudagraph_mode else {}
    if args.cudagraph_capture_sizes:
        kw["cudagraph_capture_sizes"] = [int(x) for x in args.cudagraph_capture_sizes.split(",")]
    if args.no_compile:
        kw["compile"] = False
    if not args.gated_gemm:
        from hf_accel.config import AccelConfig

        kw["config"] = AccelConfig(gated_gemm=False)
    accelerate_model(model, attention_backend=args.backend, **kw)
    info = engine_info(model)
    keep = ("attention_backend", "cudagraph_mode", "startup", "compile_error")
    print(f"accelerate_model: {time.perf_counter() - t0:.1f} s; engine: { {k: info.get(k) for k in keep} }")
    prompts = torch.tensor(random_prompts([args.prompt_len] * args.batch, 0, model.config.vocab_size), device=device)

    def run() -> None:
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                       do_sample=False)
        if device.type == "cuda":
            torch.cuda.synchronize()

    run()
    walls = []
    for _ in range(max(1, args.runs)):
        t = time.perf_counter()
        run()
        walls.append(time.perf_counter() - t)
    wall = sorted(walls)[len(walls) // 2]
    print(f"generate: {wall * 1e3:.1f} ms for {args.new_tokens} steps -> {wall / args.new_tokens * 1e3:.3f} ms/step, "
          f"{args.batch * args.new_tokens / wall:.0f} tok/s")
    if args.walls_only:
        print("walls (ms): " + " ".join(f"{w * 1e3:.1f}" for w in walls))
        return

    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
        print(f"--- host profile by {key} ---")
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:6000])

    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            run()
        events = p.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events)
        print(f"--- GPU: kernels {gpu_us / 1e3:.1f} ms of {wall * 1e3:.1f} ms wall "
              f"({gpu_us / 1e3 / args.new_tokens:.3f} ms/step) ---")
        print(events.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=60))
        print(f"--- GPU kernel time per decode step by kind (us/step; {args.new_tokens} steps) ---")
        kinds: dict[str, list[float]] = {}
        for e in events:
            if e.self_device_time_total <= 0 or getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            kinds.setdefault(kernel_kind(e.key), [0.0, 0])
            kinds[kernel_kind(e.key)][0] += e.self_device_time_total
            kinds[kernel_kind(e.key)][1] += e.count
        for kind, (us, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
            print(f"{kind:28s} {us / args.new_tokens:9.1f} us/step  {n / args.new_tokens:7.1f} kernels/step  "
                  f"{us / max(n, 1):6.2f} us each")
        total_n = sum(n for _, n in kinds.values())
        print(f"{'all kernels':28s} {gpu_us / args.new_tokens:9.1f} us/step  {total_n / args.new_tokens:7.1f} "
              f"kernels/step; wall {wall / args.new_tokens * 1e6:.1f} us/step")


def kernel_kind(name: str) -> str:
    """A coarse class of a kernel's name, for the per-step table."""
    n = name.lower()
    if "attention" in n or "split_kv" in n or "merge_splits" in n or "flash" in n or "batchdecode" in n:
        return "attention"
    if "write_kv" in n or "append_paged" in n:
        return "kv write"
    if "nvjet" in n or "gemm" in n or "cutlass" in n or "splitk" in n or "gemv" in n or "skinny" in n \
            or "split_reduce" in n:
        return "gemm"
    if "triton_" in n and ("mean" in n or "rsqrt" in n or "pow" in n):
        return "inductor: norm (+ residual)"
    if "triton_" in n and "silu" in n:
        return "inductor: silu*mul"
    if "triton_" in n:
        return "inductor: other"
    if "argmax" in n or "reduce_kernel" in n or "softmax" in n:
        return "sampling"
    if "memcpy" in n or "copy" in n or "fill" in n:
        return "copies"
    return "other"


if __name__ == "__main__":
    main()
