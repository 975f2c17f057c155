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
    from hf_accel.api import engine_of, follow_tensor_parallel, lead_tensor_parallel, stop_leading_tensor_parallel

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

            from hf_accel.api import _state_of

            # once this rank follows (a fixed sleep raced on a loaded 2-core CI box: the call ran before the main
            # thread had started following, stepped alone, and broke the job's pairing)
            deadline = time.monotonic() + 120
            while not _state_of(model).following and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # and a step or two into rank 0's schedule
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
        assert stop_leading_tensor_parallel(model, timeout=60)
        record["leader_free_blocks"] = engine_of(model).block_manager.num_free_blocks
        record["after_stop"] = model.generate(torch.tensor([PROMPTS[2]]), max_new_tokens=12, do_sample=False,
                                              eos_token_id=None, pad_token_id=0)[0, len(PROMPTS[2]):].tolist()
    if rank != 0:  # rank 0's plain generate() after it stopped leading pairs with this one (same call, every rank)
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


def channel(out_dir: str) -> None:
    """Plans of every size through the plan channel (one fixed buffer; a second broadcast past it): rank 1 records
    whether each arrived equal to what rank 0 sent."""
    from hf_accel.engine.request import SamplingParams
    from hf_accel.engine.tensor_parallel import TensorParallel
    from hf_accel.engine.tp_driver import PlanChannel, RequestSpec, StepPlan

    rank = dist.get_rank()
    group = dist.new_group([0, 1], backend="gloo", use_local_synchronization=True)
    ch = PlanChannel(TensorParallel(2, rank, group, torch.device("cpu")))

    def spec(i: int, n: int) -> RequestSpec:
        return RequestSpec(i, list(range(n)), 7, SamplingParams(do_sample=True, seed=i, top_p=0.5),
                           frozenset({2}), False, True, (0, 0))

    plans = [StepPlan(), StepPlan(step=True, allow_async=True), StepPlan(ops=[("add", spec(1, 10)), ("abort", 1)]),
             StepPlan(ops=[("add", spec(i, 5000)) for i in range(3)], step=True),  # past the fixed buffer
             StepPlan(ops=[("abort", 7)], stop=True)]
    same = [(ch.send(p) if rank == 0 else ch.receive() == p) for p in plans]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"same": same}, f)


# llama-3.1-8b layer shapes, 4 layers (as tests/test_gpu_ab.py), and its float32 judgement batch
GPU_CONFIG = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000)
GPU_LENGTHS = [16 + (37 * i) % 49 for i in range(48)]
GPU_NEW = 64


def _gpu_batch():
    from conftest import random_left_padded

    ids, mask = random_left_padded(GPU_LENGTHS, seed=7)
    return ids.cuda(), mask.cuda()


def gpu_judge(out_dir: str) -> None:
    """Two GPUs (NCCL): stock TP generate(), then ours with every available backend in the default graph mode, then
    ours led (concurrent streams, rank 1 following), each judged on rank 0 by a float32 copy of the unsharded weights;
    and seeded sampling on both ranks."""
    import asyncio

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from hf_accel import accelerate_model, available_backends, engine_info, restore
    from hf_accel.api import follow_tensor_parallel, lead_tensor_parallel, stop_leading_tensor_parallel

    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    holder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    path = os.path.join(holder[0], "llama-8b-4l")
    if rank == 0:
        torch.manual_seed(0)
        with torch.device("cuda"):
            LlamaForCausalLM(LlamaConfig(**GPU_CONFIG)).to(torch.bfloat16).save_pretrained(path)
        torch.cuda.empty_cache()
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.bfloat16).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    ids, mask = _gpu_batch()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=GPU_NEW, do_sample=False)
    record: dict = {"stock": model.generate(**kw).tolist(), "backends": {}}
    for name, why in available_backends(model).items():
        if why is not None:
            record["backends"][name] = {"unavailable": why}
            continue
        entry: dict = {}
        try:
            accelerate_model(model, attention_backend=name)
            info = engine_info(model)
            entry.update(cudagraph_mode=info["cudagraph_mode"], fallbacks=info["fallbacks"],
                         num_kv_blocks=info["num_kv_blocks"])
            entry["out"] = model.generate(**kw).tolist()
        except Exception as exc:  # recorded; the test fails on it
            entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        finally:
            restore(model)
        record["backends"][name] = entry
    accelerate_model(model)
    torch.manual_seed(100 + rank)  # ranks seeded differently on purpose: rank 0's seed is broadcast
    record["sampled"] = model.generate(input_ids=ids[:4], attention_mask=mask[:4], max_new_tokens=16,
                                       do_sample=True, temperature=1.0, top_k=0).tolist()
    if rank != 0:
        follow_tensor_parallel(model)
    else:
        lead_tensor_parallel(model)

        async def streams():
            async def one(row):
                n = int(mask[row].sum())
                s = model.agenerate_stream(ids[row:row + 1, -n:], max_new_tokens=GPU_NEW, do_sample=False)
                toks = []
                async for delta in s:
                    toks += delta.token_ids
                return toks
            return await asyncio.gather(*(one(r) for r in range(len(GPU_LENGTHS))))

        led = asyncio.run(streams())
        assert stop_leading_tensor_parallel(model, timeout=120)
        width = ids.shape[1]
        record["led"] = [ids[r].tolist() + t for r, t in enumerate(led)]  # as generate() rows: prompt then tokens
        assert all(len(t) == GPU_NEW for t in led)
    restore(model)
    if rank == 0:  # the judge: float32, unsharded, on this GPU
        del model
        torch.cuda.empty_cache()
        judge = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
        width = ids.shape[1]
        full = torch.cat([mask, torch.ones(mask.shape[0], GPU_NEW, dtype=mask.dtype, device=mask.device)], dim=1)
        positions = (full.cumsum(-1) - 1).clamp(min=0)

        @torch.no_grad()
        def agreement(rows) -> float:
            seq = torch.tensor(rows, device="cuda")
            logits = judge(input_ids=seq, attention_mask=full, position_ids=positions).logits[:, width - 1:-1]
            return float((logits.argmax(-1) == seq[:, width:]).float().mean())

        record["agreement"] = {"stock": agreement(record["stock"])}
        for name, entry in record["backends"].items():
            if "out" in entry:
                record["agreement"][name] = agreement(entry["out"])
        record["agreement"]["led"] = agreement(record["led"])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "gpu_judge":  # NCCL for the model's collectives, gloo for the script's own CPU objects
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("cuda:nccl,cpu:gloo")
    elif not dist.is_initialized():
        dist.init_process_group("gloo")
    if mode == "check":
        check(out)
    elif mode == "lead":
        lead(out)
    elif mode == "lead_fault":
        lead_fault(out)
    elif mode == "gpu_judge":
        gpu_judge(out)
    elif mode == "channel":
        channel(out)
    else:
        fault(mode)
    dist.destroy_process_group()
