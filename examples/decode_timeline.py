"""Where a decode step's wall time goes: host time per engine call, GPU busy and idle time, and the largest GPU
idle gaps by the operations either side of them (CUDA only).

Builds a WORKLOADS.md shape with random weights, accelerates it and runs W1-style `generate()` calls (prompt 128
tokens, greedy). It prints the wall time per step without any profiler, then the host time of the engine's calls
(`step`, `_launch`, `upload`, the sampler, `_read_back`: the last is mostly the wait for the GPU), then one
torch.profiler run's GPU timeline: busy and idle time per step and the kernels by total time. Under PDL a kernel's
duration includes the time it waits for its predecessor, so kernel sums overstate the step.

    python examples/decode_timeline.py --shape qwen3-0.6b --batch 1 [--new-tokens 256]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import time

import torch

from hf_accel import accelerate_model
from hf_accel.api import _state_of
from hf_accel.bench import build_model, disable_eos, random_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"), help="where the profiler trace is written")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    model = build_model(a.shape, None, torch.bfloat16, dev, "none")
    disable_eos(model)
    accelerate_model(model)
    eng = _state_of(model).engine
    prompts = torch.tensor(random_prompts([128] * a.batch, 0, model.config.vocab_size), device=dev)

    def run():
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=a.new_tokens,
                       do_sample=False)
        torch.cuda.synchronize()

    run()
    walls = []
    for _ in range(3):
        t = time.perf_counter()
        run()
        walls.append(time.perf_counter() - t)
    wall = sorted(walls)[1]
    # host: time per engine.step, and time blocked reading tokens back
    acc = collections.defaultdict(float)
    cnt = collections.Counter()
    orig_step, orig_rb, orig_launch = eng.step, eng._read_back, eng._launch

    def timed(name, fn):
        def w(*x, **k):
            t = time.perf_counter()
            try:
                return fn(*x, **k)
            finally:
                acc[name] += time.perf_counter() - t
                cnt[name] += 1
        return w

    eng.step = timed("step", orig_step)
    eng._read_back = timed("read_back", orig_rb)
    eng._launch = timed("launch", orig_launch)
    eng.runner.upload = timed("upload", eng.runner.upload)
    sampler_cls = type(eng.sampler)
    orig_sampler = sampler_cls.__call__
    sampler_cls.__call__ = timed("sampler", orig_sampler)
    t = time.perf_counter()
    run()
    wall_i = time.perf_counter() - t
    host = {k: (acc[k] / max(cnt[k], 1) * 1e6, cnt[k]) for k in acc}
    del eng.step, eng._read_back, eng._launch, eng.runner.upload  # the class's own methods again
    sampler_cls.__call__ = orig_sampler

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        run()
    path = os.path.join(a.out, f"trace-{a.shape}-b{a.batch}{a.tag}.json")
    p.export_chrome_trace(path)
    ev = [e for e in json.load(open(path))["traceEvents"]
          if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    os.remove(path)
    ev.sort(key=lambda e: e["ts"])
    t0, t1 = ev[0]["ts"], max(e["ts"] + e["dur"] for e in ev)
    busy, end = 0.0, ev[0]["ts"]
    gaps = collections.defaultdict(lambda: [0.0, 0])
    prev = None
    for e in ev:
        s, d = e["ts"], e["dur"]
        if s > end:
            if prev is not None and s - end > 1.5:
                key = (prev[:50], e["name"][:50])
                gaps[key][0] += s - end
                gaps[key][1] += 1
        if s + d > end:
            busy += s + d - max(s, end)
            end = s + d
            prev = e["name"]
    span = t1 - t0
    n = a.new_tokens
    print(f"=== {a.shape} batch {a.batch}: wall {wall / n * 1e6:.1f} us/step ({a.batch * n / wall:.0f} tok/s); "
          f"instrumented {wall_i / n * 1e6:.1f}")
    print("host per call (us, count):", {k: (round(v[0], 1), v[1]) for k, v in host.items()})
    print(f"profiled GPU span {span / n:.1f} us/step, busy {busy / n:.1f}, idle {(span - busy) / n:.1f}")
    print("largest idle gaps (>1.5us) by neighbours: total us/step, count/step")
    for (pa, pb), (us, c) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {us / n:7.1f} {c / n:5.2f}  {pa} -> {pb}")
    kinds = collections.defaultdict(lambda: [0.0, 0])
    for e in ev:
        kinds[e["name"][:60]][0] += e["dur"]
        kinds[e["name"][:60]][1] += 1
    print("kernels by total time: us/step, count/step, us each")
    for name, (us, c) in sorted(kinds.items(), key=lambda kv: -kv[1][0])[:22]:
        print(f"  {us / n:7.1f} {c / n:6.2f} {us / c:6.2f}  {name}")


if __name__ == "__main__":
    main()
