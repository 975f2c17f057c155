"""An RL-style loop on the GPU: generate rollouts, take one optimizer step, generate again (as TRL's GRPO does).

Seconds per iteration of (generate P prompts x N new tokens, one AdamW step on a training batch), for:
- stock: stock `generate()` + the step;
- hf_accel: accelerated once, trained in place (the engine keeps its compiled code and graphs);
- reaccelerate: `restore()` + `accelerate_model()` around every step (what users had to do before).

Also the cost of the prefix-cache weight check per call (`model_state.prefix_key`, content vs version) beside a W1
call, for the qwen3-0.6b and (with --digest-8b) llama-3.1-8b shapes. Prints a table and writes JSON.

    python examples/train_generate_loop.py --iters 3 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import transformers

from hf_accel import accelerate_model, restore
from hf_accel.bench import shape_config
from hf_accel.engine import model_state
from hf_accel.engine.model_state import prefix_key, take_snapshot


def build(shape: str) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(shape_config(shape), dtype=torch.bfloat16).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def sync_time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def loop(model, mode: str, iters: int, prompts: torch.Tensor, new: int, train_ids: torch.Tensor) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def one():
        if mode == "reaccelerate":
            accelerate_model(model)
        model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                       do_sample=False)
        if mode == "reaccelerate":
            restore(model)
        model.train()
        loss = model(input_ids=train_ids, labels=train_ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.eval()

    if mode == "hf_accel":
        accelerate_model(model)
    one()  # warm-up (ours: first call; stock: kernels and allocator)
    times = [sync_time(one) for _ in range(iters)]
    if mode == "hf_accel":
        restore(model)
    return times


def digest_cost(shape: str, repeats: int = 5, w1: bool = True) -> dict:
    """The per-call weight check's cost: version counters only, the content digest (one kernel launch on a GPU) and
    the content digest through the chunked torch path it replaced (`content_torch_ms`)."""
    model = build(shape)
    out = {}
    for check in ("version", "content", "content_torch"):
        if check == "content_torch":
            model_state._gpu_digest_fn = False  # the torch path, as where triton is missing
        key = check.removesuffix("_torch")
        prefix_key(take_snapshot(model), key)
        out[f"{check}_ms"] = 1e3 * statistics.median(
            sync_time(lambda c=key: prefix_key(take_snapshot(model), c)) for _ in range(repeats))
    model_state._gpu_digest_fn = None  # chosen again on next use
    if not w1:
        return out
    accelerate_model(model)
    ids = torch.randint(10, 10000, (1, 128), device="cuda")
    model.generate(input_ids=ids, max_new_tokens=256, do_sample=False)
    out["w1_call_ms"] = 1e3 * statistics.median(
        sync_time(lambda: model.generate(input_ids=ids, max_new_tokens=256, do_sample=False)) for _ in range(3))
    restore(model)
    out["content_share_of_w1"] = out["content_ms"] / out["w1_call_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--modes", default="stock,hf_accel,reaccelerate")
    ap.add_argument("--digest-8b", action="store_true")
    ap.add_argument("--digest-only", action="store_true", help="only the weight-check costs, no training loop")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 10000, (args.prompts, 128), generator=g).cuda()
    train_ids = torch.randint(10, 10000, (8, 256), generator=g).cuda()
    base = build("qwen3-0.6b")
    result: dict = {"shape": "qwen3-0.6b", "prompts": args.prompts, "new_tokens": args.new_tokens,
                    "device": torch.cuda.get_device_name(), "loop_s": {}}
    for mode in [] if args.digest_only else args.modes.split(","):
        model = copy.deepcopy(base)
        times = loop(model, mode, args.iters, prompts, args.new_tokens, train_ids)
        result["loop_s"][mode] = {"median": statistics.median(times), "all": times}
        print(f"{mode:>14}: {statistics.median(times):7.2f} s / iteration  ({', '.join(f'{t:.2f}' for t in times)})",
              flush=True)
        del model
        torch.cuda.empty_cache()
    del base
    torch.cuda.empty_cache()
    result["weight_check"] = {"qwen3-0.6b": digest_cost("qwen3-0.6b", w1=not args.digest_only)}
    torch.cuda.empty_cache()
    if args.digest_8b:
        result["weight_check"]["llama-3.1-8b"] = digest_cost("llama-3.1-8b", w1=False)
    for shape, d in result["weight_check"].items():
        if "w1_call_ms" not in d:
            print(f"prefix-cache weight check {shape}: content {d['content_ms']:.2f} ms (torch path "
                  f"{d['content_torch_ms']:.2f}), version {d['version_ms']:.2f} ms")
            continue
        print(f"prefix-cache weight check {shape}: content {d['content_ms']:.2f} ms (torch path "
              f"{d['content_torch_ms']:.2f}), version {d['version_ms']:.2f} ms,"
              f" W1 call {d['w1_call_ms']:.0f} ms -> content check = {100 * d['content_share_of_w1']:.2f} % of W1")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
