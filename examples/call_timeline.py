"""Where one generate() call's wall time goes, outside the GPU-bound decode steps.

`decode_timeline.py` looks inside the steady decode step; this looks at the whole call as a user makes it: the
host phases before the first step (`_plan_generate`, the admission with `LLMEngine.sync_with_model`, building the
requests), the first step (the prefill: only launched there, so its time is host time), the decode steps, the host
time between steps (the engine loop's own bookkeeping) and after the last one (assembling the output). Each step's
`read_back` wait is timed too: a step whose wait is near zero found the GPU idle (the host was the bottleneck).

Builds a WORKLOADS.md shape with random weights, accelerates it and runs W2-style (batch 64) and W1-style
(batch 1) calls, prompts of 128 tokens, fresh prompts per call (no prefix-cache hits), greedy, no EOS.

    python examples/call_timeline.py --shape qwen3-0.6b [--new-tokens 256] [--batches 64,1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hf_accel.api as api
import hf_accel.engine.engine as engine_module
import hf_accel.generation as generation
from hf_accel import accelerate_model
from hf_accel.api import _state_of
from hf_accel.bench import build_model, disable_eos, random_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batches", default="64,1", help="comma-separated batch sizes")
    ap.add_argument("--calls", type=int, default=3, help="calls per batch size")
    ap.add_argument("--device", default="cuda", help="cuda (what it is for), or cpu for a quick look at a tiny shape")
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = build_model(a.shape, None, torch.bfloat16, dev, "none")
    disable_eos(model)
    accelerate_model(model)
    eng = _state_of(model).engine

    marks: list[tuple[str, float]] = []
    waits: list[float] = []

    def wrap(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            marks.append((label + ">", time.perf_counter()))
            try:
                return fn(*args, **kwargs)
            finally:
                marks.append((label + "<", time.perf_counter()))
        setattr(owner, name, timed)

    wrap(api, "_plan_generate", "plan")
    wrap(api, "_admit", "admit")
    wrap(engine_module.LLMEngine, "sync_with_model", "sync")
    wrap(generation.EngineGenerator, "prepare_generate", "prepare")
    wrap(engine_module.LLMEngine, "step", "step")
    read_back = engine_module.LLMEngine._read_back

    def timed_read_back(self, flight):
        if flight.ready is not None:  # the step's one wait for the GPU, timed on its own
            t = time.perf_counter()
            flight.ready.synchronize()
            waits.append(time.perf_counter() - t)
        return read_back(self, flight)
    engine_module.LLMEngine._read_back = timed_read_back

    def ms(t0: float, t1: float) -> float:
        return (t1 - t0) * 1e3

    for batch in (int(b) for b in a.batches.split(",")):
        for call in range(a.calls):
            seed = 100 * (call + 11) + batch
            prompts = torch.tensor(random_prompts([128] * batch, seed, model.config.vocab_size), device=dev)
            sync()
            marks.clear()
            waits.clear()
            t0 = time.perf_counter()
            model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=a.new_tokens,
                           do_sample=False)
            t1 = time.perf_counter()
            at: dict[str, list[float]] = {}
            for label, t in marks:
                at.setdefault(label, []).append(t)
            steps = list(zip(at["step>"], at["step<"]))
            durations = [ms(s, e) for s, e in steps]
            gaps = [ms(steps[i][1], steps[i + 1][0]) for i in range(len(steps) - 1)]
            print(f"batch {batch} call {call}: total {ms(t0, t1):.1f} ms; "
                  f"plan {ms(at['plan>'][0], at['plan<'][0]):.2f}; "
                  f"admit {ms(at['admit>'][0], at['admit<'][0]):.2f} (sync_with_model "
                  f"{ms(at['sync>'][0], at['sync<'][0]):.2f}); prepare {ms(at['prepare>'][0], at['prepare<'][0]):.2f}; "
                  f"call start -> first step {ms(t0, steps[0][0]):.2f}; last step -> return {ms(steps[-1][1], t1):.2f}")
            print(f"   {len(steps)} steps: first five {[round(x, 2) for x in durations[:5]]}, median "
                  f"{statistics.median(durations):.3f}, sum {sum(durations):.1f}; between steps: sum {sum(gaps):.2f}, "
                  f"max {max(gaps):.2f}; read_back waits: sum {sum(waits) * 1e3:.1f} ms, steps waiting < 50 us: "
                  f"{sum(w < 5e-5 for w in waits)}")
    print("engine stats:", {"steps": eng.stats.steps, "async_steps": eng.stats.async_steps})


if __name__ == "__main__":
    main()
