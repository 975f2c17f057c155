"""One rank of the tensor-parallel CPU tests (tests/test_tensor_parallel.py runs it under torchrun, gloo).

Usage: python -m torch.distributed.run --nproc-per-node 2 tests/tp_worker.py MODE OUT_DIR
MODE "check": for each tiny family, the same model saved once, loaded unsharded (the reference) and with
`tp_plan="auto"`; accelerate the sharded one and record what each call returns, per rank, as JSON in OUT_DIR.
MODE "fault": rank 1 raises after accelerating; rank 0 then calls generate() (the job must end, not hang).
MODE "compile_fault": torch.compile fails on rank 1 alone (the job must end with that cause, not hang or diverge).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
warnings.simplefilter("ignore")


def _families() -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=200,
                  max_position_embeddings=256, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    return {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **common)),
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                      **common)),
        "llama-mha": lambda: LlamaForCausalLM(LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **common)),
        # the same Llama with torch.compile on (piecewise pieces around attention, collectives inside them)
        "llama-compiled": lambda: LlamaForCausalLM(LlamaConfig(num_attention_heads=4, num_key_value_heads=2,
                                                               **common)),

        "uneven-kv": lambda: LlamaForCausalLM(LlamaConfig(num_attention_heads=4, num_key_value_heads=1, **common)),
    }


def _save(name: str, root: str) -> str:
    path = os.path.join(root, name)
    if dist.get_rank() == 0:
        torch.manual_seed(7)
        model = _families()[name]()
        with torch.no_grad():  # larger weights than the init: fewer near-ties between the top logits
            for p in model.parameters():
                p.mul_(4.0 if p.dim() > 1 else 1.0)
        model.save_pretrained(path)
    dist.barrier()
    return path


PROMPTS = [[5, 9, 13, 77], [3, 4, 5, 6, 7, 8, 9], [11]]


def _batch():
    from conftest import left_pad

    return left_pad(PROMPTS)


PIPELINE_PROMPTS = ["hello", "abc", "xyz!"]


def _pipeline_texts(model) -> list[str]:
    """pipeline("text-generation") with the character-level test tokenizer, greedy, batched."""
    from conftest import make_tokenizer
    from transformers import pipeline

    pipe = pipeline("text-generation", model=model, tokenizer=make_tokenizer())
    out = pipe(PIPELINE_PROMPTS, max_new_tokens=8, do_sample=False, batch_size=2, return_full_text=False,
               eos_token_id=None, pad_token_id=0)
    return [o[0]["generated_text"] for o in out]


def _calls(model) -> dict:
    """Greedy batch, EOS on; a second identical call (prefix cache); sampling with per-rank seeds."""
    from transformers import GenerationConfig

    ids, mask = _batch()
    out = {}
    out["greedy"] = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False).tolist()
    out["greedy_again"] = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False).tolist()
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    res = model.generate_batch(PROMPTS, generation_config=gc)
    out["generate_batch"] = [res[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))] if res else None
    from hf_accel.api import engine_of

    before = engine_of(model).stats.steps
    out["pipeline"] = _pipeline_texts(model)
    out["pipeline_engine_steps"] = engine_of(model).stats.steps - before  # served by the engine, not stock
    torch.manual_seed(1000 + dist.get_rank())  # ranks seeded differently on purpose
    out["sampled"] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True,
                                    temperature=1.0, top_k=0).tolist()
    return out


def _refusals(model) -> dict:
    """Calls whose end could land at a different step on each rank are refused, on every rank alike."""
    import asyncio

    ids, mask = _batch()
    out = {}
    for name, call in {
        "max_time": lambda: model.generate(ids, attention_mask=mask, max_new_tokens=4, max_time=5.0),
        "agenerate": lambda: asyncio.run(model.agenerate(ids, attention_mask=mask, max_new_tokens=4)),
        "agenerate_stream": lambda: model.agenerate_stream(ids, attention_mask=mask, max_new_tokens=4),
        "MaxTimeCriteria": lambda: model.generate(ids, attention_mask=mask, max_new_tokens=4,
                                                  stopping_criteria=_max_time_criteria()),
    }.items():
        try:
            call()
            out[name] = "ran"
        except NotImplementedError as exc:
            out[name] = f"NotImplementedError: {exc}"
    return out


def _max_time_criteria():
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import MaxTimeCriteria

    return StoppingCriteriaList([MaxTimeCriteria(5.0)])


def check(out_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from hf_accel import accelerate_model, engine_info, restore
    from hf_accel.api import engine_of

    rank = dist.get_rank()
    root = tempfile.mkdtemp() if rank == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder, src=0)
    root = holder[0]
    record: dict = {}
    for name in _families():
        path = _save(name, root)
        entry: dict = {}
        ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ids, mask = _batch()
        entry["reference"] = ref_model.generate(ids, attention_mask=mask, max_new_tokens=10,
                                                do_sample=False).tolist()
        gc_ref = [ref_model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
        entry["reference_generate_batch"] = gc_ref
        entry["reference_pipeline"] = _pipeline_texts(ref_model)
        tp_model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
        try:
            entry["stock_tp"] = tp_model.generate(ids, attention_mask=mask, max_new_tokens=10,
                                                  do_sample=False).tolist()
        except Exception as exc:  # transformers' own TP cannot run it (a head split across ranks)
            entry["stock_tp_error"] = f"{type(exc).__name__}: {exc}"
        compiled = name.endswith("-compiled")
        try:
            accelerate_model(tp_model, compile=compiled)
            if compiled:
                entry["compile_error"] = engine_of(tp_model).compile_info.get("compile_error")
        except Exception as exc:
            entry["accelerate_error"] = f"{type(exc).__name__}: {exc}"
            record[name] = entry
            continue
        info = engine_info(tp_model)
        entry["tensor_parallel"] = info["tensor_parallel"]
        entry["num_kv_blocks"] = info["num_kv_blocks"]
        entry["kv_heads_local"] = engine_of(tp_model).shape.num_kv_heads
        entry.update(_calls(tp_model))
        entry["refused"] = _refusals(tp_model)
        # rank 1 alone changes its shard of a K projection: every rank must drop its cached prefixes
        k_proj = tp_model.model.layers[0].self_attn.k_proj.weight
        if rank == 1:
            with torch.no_grad():
                local = k_proj.to_local() if hasattr(k_proj, "to_local") else k_proj
                local.mul_(-1.0)
        entry["after_change"] = tp_model.generate(ids, attention_mask=mask, max_new_tokens=10,
                                                  do_sample=False).tolist()
        restore(tp_model)
        entry["after_change_stock"] = tp_model.generate(ids, attention_mask=mask, max_new_tokens=10,
                                                        do_sample=False).tolist()
        record[name] = entry
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def fault(mode: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_accel import accelerate_model

    rank = dist.get_rank()
    root = tempfile.mkdtemp() if rank == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder, src=0)
    path = os.path.join(holder[0], "m")
    if rank == 0:
        LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=200,
                                     max_position_embeddings=256)).save_pretrained(path)
    dist.barrier()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    if mode == "compile_fault":  # torch.compile fails on rank 1 alone: the job must end, naming the cause
        if rank == 1:
            from hf_accel.compilation import piecewise

            def broken(self, *args):
                raise RuntimeError("injected compile failure on rank 1")

            piecewise.PiecewiseForward.compile = broken
        accelerate_model(model, compile=True)
    else:
        accelerate_model(model)
    if rank == 1:
        raise RuntimeError("injected fault on rank 1")
    ids = torch.tensor([[5, 6, 7]])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=50, do_sample=False)


def lead(out_dir: str) -> None:
    """Rank 0 drives (`lead_tensor_parallel`), rank 1 follows: concurrent streams that start at different steps,
    one aborted mid-way, a sync generate() from a thread, seeded sampling twice, a refused stopping criterion."""
    import asyncio
    import threading

    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    from hf_accel import accelerate_model
    from hf_accel.api import engine_of, follow_tensor_parallel, lead_tensor_parallel, stop_leading

    rank = dist.get_rank()
    holder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    path = _save("llama", holder[0])
    record: dict = {}
    if rank == 0:
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        record["reference"] = [ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                            pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    accelerate_model(model)
    if rank != 0:
        def call_while_following(box):
            import time

            time.sleep(0.5)
            try:
                model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=2, do_sample=False)
                box.append("ran")
            except RuntimeError as exc:
                box.append(f"RuntimeError: {exc}")

        box: list = []
        side = threading.Thread(target=call_while_following, args=(box,))
        side.start()
        follow_tensor_parallel(model)
        side.join()
        record["call_while_following"] = box[0]
        record["follower_steps"] = engine_of(model).stats.steps
        record["follower_free_blocks"] = engine_of(model).block_manager.num_free_blocks
    else:
        lead_tensor_parallel(model)

        async def stream(prompt, delay, abort_after=None):
            await asyncio.sleep(delay)
            s = model.agenerate_stream(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
            toks, reason = [], None
            async for delta in s:
                toks += delta.token_ids
                reason = delta.finish_reason or reason
                if abort_after is not None and len(toks) >= abort_after and reason is None:
                    s.abort()
            return toks, reason

        def sync_call(box):
            p = PROMPTS[1]
            box.append(model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(p):].tolist())

        async def scenario():
            box: list = []
            thread = threading.Thread(target=sync_call, args=(box,))
            thread.start()
            got = await asyncio.gather(stream(PROMPTS[0], 0.0), stream(PROMPTS[1], 0.05, abort_after=3),
                                       stream(PROMPTS[2], 0.2), stream(PROMPTS[0], 0.3))
            thread.join()
            sampled = [await model.agenerate(torch.tensor([PROMPTS[0]]), max_new_tokens=8, do_sample=True,
                                             temperature=1.0, top_k=0, seed=123, eos_token_id=None, pad_token_id=0)
                       for _ in range(2)]
            return got, box, [s[0].tolist() for s in sampled]

        got, box, sampled = asyncio.run(scenario())
        record["streams"] = got
        record["sync_generate"] = box[0]
        record["sampled"] = sampled

        class Never(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        try:
            model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=4,
                           stopping_criteria=StoppingCriteriaList([Never()]))
            record["criteria"] = "ran"
        except NotImplementedError as exc:
            record["criteria"] = f"NotImplementedError: {exc}"
        refusals = {}
        for name, call in {
            "stock_fallback": lambda: model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=3, num_beams=2,
                                                     do_sample=False, pad_token_id=0),
            "lead_again": lambda: lead_tensor_parallel(model),
            "follow_on_rank_0": lambda: follow_tensor_parallel(model),
        }.items():
            try:
                call()
                refusals[name] = "ran"
            except (NotImplementedError, RuntimeError, ValueError) as exc:
                refusals[name] = f"{type(exc).__name__}: {exc}"
        record["refusals"] = refusals
        record["leader_steps"] = engine_of(model).stats.steps
        assert stop_leading(model, timeout=60)
        record["leader_free_blocks"] = engine_of(model).block_manager.num_free_blocks
        record["after_stop"] = model.generate(torch.tensor([PROMPTS[2]]), max_new_tokens=12, do_sample=False,
                                              eos_token_id=None, pad_token_id=0)[0, len(PROMPTS[2]):].tolist()
    if rank != 0:  # rank 0's plain generate() after stop_leading pairs with this one (same call on every rank)
        p = PROMPTS[2]
        record["after_stop"] = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def lead_fault(out_dir: str) -> None:
    """Rank 1 follows and its third step raises: rank 0, mid-call, must end (not hang) and the job with it."""
    from transformers import AutoModelForCausalLM

    from hf_accel import accelerate_model
    from hf_accel.api import engine_of, follow_tensor_parallel, lead_tensor_parallel

    rank = dist.get_rank()
    holder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    path = _save("llama", holder[0])
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    accelerate_model(model)
    if rank == 1:
        engine = engine_of(model)
        step, calls = engine.step, [0]

        def failing_step():
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("injected step failure on follower rank 1")
            return step()

        engine.step = failing_step
        follow_tensor_parallel(model)
        return
    lead_tensor_parallel(model)
    model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    with open(os.path.join(out_dir, "rank0-finished"), "w") as f:  # must not be reached
        f.write("the call returned although rank 1 had failed")


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if mode == "check":
        check(out)
    elif mode == "lead":
        lead(out)
    elif mode == "lead_fault":
        lead_fault(out)
    else:
        fault(mode)
    dist.destroy_process_group()
