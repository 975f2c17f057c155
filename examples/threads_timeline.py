"""Where the time of N threads x generate() goes, against one batch-N call: submit times, engine steps and call
completions on one timeline (issue 13's threads figure). Usage: python examples/threads_timeline.py [--threads 64]"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
import transformers

from hf_accel import accelerate_model
from hf_accel.engine import loop as loop_module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=28, help="fewer for a quick look on a CPU")
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cfg = transformers.Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=args.layers,
                                   num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                   tie_word_embeddings=True, rope_theta=1e6)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(dev).eval()
    accelerate_model(model)
    n, kw = args.threads, dict(max_new_tokens=args.new, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = torch.randint(10, 10000, (n, args.prompt), device=dev)
    model.generate(input_ids=ids, **kw)  # warm-up (batch)
    eng = model._hf_accel_state.engine
    marks: dict[str, list[float]] = {"submit": [], "done": [], "step": []}
    orig_submit, orig_finish, orig_step = loop_module.EngineLoop.submit, loop_module.EngineCall._finish, eng.step

    def submit(self, call):
        marks["submit"].append(time.perf_counter())
        return orig_submit(self, call)

    def finish(self, error=None):
        marks["done"].append(time.perf_counter())
        return orig_finish(self, error)

    def step():
        out = orig_step()
        marks["step"].append(time.perf_counter())
        return out

    for rep in range(3):
        sync()
        t0 = time.perf_counter()
        model.generate(input_ids=ids, **kw)
        sync()
        t_batch = time.perf_counter() - t0
        loop_module.EngineLoop.submit, loop_module.EngineCall._finish, eng.step = submit, finish, step
        for v in marks.values():
            v.clear()
        barrier = threading.Barrier(n + 1)

        def work(i, barrier=barrier):
            barrier.wait()
            model.generate(input_ids=ids[i : i + 1], **kw)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        steps0 = eng.stats.steps
        barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        t_end = time.perf_counter()
        loop_module.EngineLoop.submit, loop_module.EngineCall._finish = orig_submit, orig_finish
        eng.step = orig_step
        s, d, st = (sorted(marks[k]) for k in ("submit", "done", "step"))
        gaps = [b - a for a, b in zip(st, st[1:])]
        print(f"rep {rep}: batch call {t_batch * 1e3:.0f} ms; {n} threads {1e3 * (t_end - t0):.0f} ms "
              f"({t_batch / (t_end - t0):.1%}); steps {eng.stats.steps - steps0}")
        print(f"  submits {1e3 * (s[0] - t0):.1f}..{1e3 * (s[-1] - t0):.1f} ms; first step ends "
              f"{1e3 * (st[0] - t0):.1f} ms; steps ending before the last submit: "
              f"{sum(1 for x in st if x < s[-1])}")
        p90 = sorted(gaps)[len(gaps) * 9 // 10]
        print(f"  step gap median {1e3 * statistics.median(gaps):.2f} ms, p90 {1e3 * p90:.2f} ms; "
              f"last step ends {1e3 * (st[-1] - t0):.0f} ms; calls done {1e3 * (d[0] - t0):.0f}.."
              f"{1e3 * (d[-1] - t0):.0f} ms; joined {1e3 * (t_end - t0):.0f} ms")


if __name__ == "__main__":
    main()
