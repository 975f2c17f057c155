"""Where a W3 `generate_batch()` call's time goes: steps that hold a prefill chunk against pure decode steps.

W3 (WORKLOADS.md) sends 256 prompts of 100-1,024 tokens with 512 new tokens each through one `generate_batch()`
call. Its steps are of two kinds: the first few hold prefill chunks (up to `max_num_batched_tokens` tokens, with
the running requests' decode tokens beside them), the rest are uniform decode steps of up to 256 sequences whose
contexts grow to ~1,500 tokens. This prints, per kind: how many steps, their wall time (from one step's start to
the next one's), and how long the host waited in `read_back` (near zero: the GPU was idle, the host the
bottleneck). With `--kernels`, a torch.profiler pass over one more call adds the GPU time per kernel name, split
the same way by the step each kernel ran in, so attention, GEMMs and the rest can be weighed against the roofline.

    python examples/w3_timeline.py --shape qwen3-0.6b [--calls 2] [--kernels] [--piecewise-capture-sizes 1,2,...]
        [--no-gated-gemm] [--no-split-mixed-attention]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

import hf_accel.engine.engine as engine_module
from hf_accel import accelerate_model, engine_info
from hf_accel.bench import build_model, disable_eos, random_prompts
from hf_accel.bench.workloads import SCALES, _generation_config
from hf_accel.config import AccelConfig


def _ints(text: str | None) -> list[int] | None:
    return [int(x) for x in text.split(",")] if text else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--calls", type=int, default=2, help="timed calls (after one warm-up call)")
    ap.add_argument("--scale", default="full", choices=tuple(SCALES))
    ap.add_argument("--piecewise-capture-sizes", default=None, help="comma-separated token counts")
    ap.add_argument("--gated-gemm", action=argparse.BooleanOptionalAction, default=True,
                    help="AccelConfig.gated_gemm (default: on); --no-gated-gemm for the A/B")
    ap.add_argument("--split-mixed-attention", action=argparse.BooleanOptionalAction, default=None,
                    help="AccelConfig.split_mixed_attention (default: on where it applies)")
    ap.add_argument("--kernels", action="store_true", help="one more call under torch.profiler: GPU time per kernel")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = build_model(a.shape, None, torch.bfloat16 if dev.type == "cuda" else torch.float32, dev, "none")
    disable_eos(model)
    fields = {} if a.gated_gemm else {"gated_gemm": False}
    if a.split_mixed_attention is not None:
        fields["split_mixed_attention"] = a.split_mixed_attention
    if a.piecewise_capture_sizes:
        fields["piecewise_capture_sizes"] = _ints(a.piecewise_capture_sizes)
    kw = {"config": AccelConfig(**fields)} if fields else {}
    t0 = time.perf_counter()
    accelerate_model(model, **kw)
    info = engine_info(model)
    print(f"accelerate_model {time.perf_counter() - t0:.1f} s; backend {info.get('attention_backend')}; "
          f"graph pool {info.get('graph_pool_bytes', 0) / 2**20:.0f} MiB; capture "
          f"{info.get('startup', {}).get('capture_s', 0):.2f} s; piecewise graph sizes above 512: "
          f"{[s for s in info.get('piecewise_graph_sizes', []) if s > 512]}")
    if a.gated_gemm:
        print(f"gated linears {info.get('gated_linears')}; decisions {(info.get('gated_gemm') or {}).get('decisions')}")

    spec = SCALES[a.scale]["w3"]
    lengths = spec.prompt_lengths()
    steps: list[dict] = []  # one per engine step: start time, kind, tokens, wait in read_back

    step = engine_module.LLMEngine.step
    launch = engine_module.LLMEngine._launch
    read_back = engine_module.LLMEngine._read_back

    def timed_step(self):
        steps.append({"t": time.perf_counter(), "kind": None, "tokens": 0, "seqs": 0, "wait": 0.0})
        return step(self)

    def timed_launch(self, sched, previous):
        rec = steps[-1]
        rec["tokens"], rec["seqs"] = sched.total_tokens, len(sched)
        rec["kind"] = "decode" if sched.total_tokens == len(sched) else "prefill"
        return launch(self, sched, previous)

    def timed_read_back(self, flight):
        if flight.ready is not None:
            t = time.perf_counter()
            flight.ready.synchronize()
            steps[-1]["wait"] += time.perf_counter() - t
        return read_back(self, flight)

    engine_module.LLMEngine.step = timed_step
    engine_module.LLMEngine._launch = timed_launch
    engine_module.LLMEngine._read_back = timed_read_back

    def one_call(seed: int) -> float:
        prompts = random_prompts(lengths, seed, model.config.vocab_size)
        sync()
        steps.clear()
        t = time.perf_counter()
        model.generate_batch(prompts, generation_config=_generation_config(spec.new_tokens), progress_bar=False)
        sync()
        end = time.perf_counter()
        for i, rec in enumerate(steps):
            rec["wall"] = (steps[i + 1]["t"] if i + 1 < len(steps) else end) - rec["t"]
        return end - t

    one_call(2500)
    for c in range(a.calls):
        secs = one_call(2000 + c)
        by_kind: dict[str, list[dict]] = defaultdict(list)
        for rec in steps:
            by_kind[rec["kind"] or "empty"].append(rec)
        print(f"call {c}: {secs * 1e3:.0f} ms, {spec.expected_tokens / secs:,.0f} output tok/s, {len(steps)} steps")
        for kind, recs in by_kind.items():
            walls = [r["wall"] * 1e3 for r in recs]
            waits = [r["wait"] * 1e3 for r in recs]
            toks = [r["tokens"] for r in recs]
            print(f"   {kind:8s} {len(recs):4d} steps, {sum(walls):8.1f} ms (median {statistics.median(walls):.2f}, "
                  f"max {max(walls):.2f}); tokens/step median {statistics.median(toks):.0f}; read_back waits "
                  f"{sum(waits):.1f} ms, steps waiting < 50 us: {sum(w < 0.05 for w in waits)}")
        prefill = [r for r in steps if r["kind"] == "prefill"]
        if prefill:
            print("   prefill steps (tokens, seqs, wall ms, read_back wait ms):",
                  [(r["tokens"], r["seqs"], round(r["wall"] * 1e3, 1), round(r["wait"] * 1e3, 1))
                   for r in prefill[:24]])

    if a.kernels and dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            one_call(2100)
        totals: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                totals[ev.name] += ev.device_time
                counts[ev.name] += 1
        grand = sum(totals.values())
        print(f"GPU kernel time over the call: {grand / 1e3:.1f} ms")
        for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[: a.top]:
            print(f"   {us / 1e3:8.1f} ms {100 * us / grand:5.1f} % {counts[name]:7d} x  {name[:110]}")


if __name__ == "__main__":
    main()
