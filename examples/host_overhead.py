"""Host time per engine step with the model's forward stubbed out: what the scheduler, packing, upload, sampler,
read-back and hand-off to the caller cost for a decode batch, on any machine (CPU is enough).

At batch 64 the H200 runs a qwen3-0.6b decode step in about 1.5 ms and the host's work per step was measured at
about 1.3 ms there (examples/results, session 22): the engine loop is close to host-bound, so each microsecond per
request counts. This script isolates that work. The model is a tiny random Llama; its forward is replaced by a table
lookup that returns logits (so tokens vary step to step), and the attention backend's per-step `prepare` by a no-op
(the reference backend's CPU preparation is not what a GPU step pays). Everything else (the engine thread, the
continuous-batching scheduler, the prefix-cache commits, packing and the copies into the persistent buffers, the
greedy sampler, the read-back and the per-call events) runs as in `generate_batch`.

    python examples/host_overhead.py --batch 64 --prompt-len 256 --new-tokens 256
    python examples/host_overhead.py --batch 256 --profile tottime   # cProfile of the steps (inflated times)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from collections import defaultdict

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from hf_accel import accelerate_model
from hf_accel.engine.engine import LLMEngine
from hf_accel.engine.loop import EngineLoop


def tiny_model(max_len: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_len)
    return LlamaForCausalLM(cfg).eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="generate_batch calls timed (after one warm-up)")
    ap.add_argument("--profile", metavar="SORT", help="cProfile the engine steps of the last call, sorted by SORT")
    args = ap.parse_args()

    model = accelerate_model(tiny_model(args.prompt_len + args.new_tokens), max_num_seqs=max(256, args.batch),
                           num_kv_blocks=args.batch * (-(-(args.prompt_len + args.new_tokens) // 16) + 1) + 8)
    state = model._hf_accel_state
    runner = state.engine.runner
    vocab = model.config.vocab_size
    table = torch.randn(4096, vocab)

    def stub_forward(input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return table[(positions[logits_indices] * 7 + input_ids[logits_indices]) % table.shape[0]]

    runner.model_forward = stub_forward
    runner.backend.prepare = lambda meta: None

    # perf_counter around the host's stages (no profiler): time per call, summed per step
    spent: dict[str, float] = defaultdict(float)
    wrapped = [(LLMEngine, "step"), (LLMEngine, "_read_back"), (LLMEngine, "_launch"), (EngineLoop, "_dispatch")]
    wrapped += [(type(state.engine.scheduler), "schedule"), (type(runner), "pack"), (type(runner), "_upload"),
                (type(state.engine.sampler), "__call__")]
    for owner, name in wrapped:
        original = getattr(owner, name)

        def timed(*a, _original=original, _key=f"{owner.__name__}.{name}", **kw):
            t = time.perf_counter()
            try:
                return _original(*a, **kw)
            finally:
                spent[_key] += time.perf_counter() - t
        setattr(owner, name, timed)

    rng = random.Random(0)
    prompts = [[rng.randrange(5, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    gc = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(prompts[:2], generation_config=gc)  # warm-up
    walls, per_stage = [], []
    profiler = None
    for rep in range(args.repeats):
        if args.profile and rep == args.repeats - 1:
            profiler = cProfile.Profile()
            step = LLMEngine.step

            def profiled(self, _step=step, _profiler=profiler):
                _profiler.enable()
                try:
                    return _step(self)
                finally:
                    _profiler.disable()
            LLMEngine.step = profiled
        spent.clear()
        steps0 = state.engine.stats.steps
        t = time.perf_counter()
        model.generate_batch(prompts, generation_config=gc)
        walls.append(time.perf_counter() - t)
        steps = state.engine.stats.steps - steps0
        per_stage.append({k: v / steps * 1e6 for k, v in spent.items()})
        print(f"call {rep}: {steps} steps, {walls[-1] / steps * 1e6:7.1f} us/step wall"
              + (" (profiled)" if profiler else ""))
    timed_runs = per_stage[:-1] if profiler and len(per_stage) > 1 else per_stage
    print(f"batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens; medians over "
          f"{len(timed_runs)} calls, us per step:")
    for key in sorted(timed_runs[0], key=lambda k: -timed_runs[0][k]):
        print(f"  {key:28s} {statistics.median(r[key] for r in timed_runs):8.1f}")
    if profiler:
        pstats.Stats(profiler).sort_stats(args.profile).print_stats(40)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
