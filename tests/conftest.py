"""Shared tiny-model fixtures for the CPU test suite.

Everything here is built in memory (no downloads): a 2-layer Llama with a 200-token vocabulary and a character-level
tokenizer over the same 200 ids. Models are built once per test module; a test that needs a model it can break
(restore, re-accelerate, failing accelerate) takes a fresh copy with `fresh_copy(stock_model)`.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList, PreTrainedTokenizerFast
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_accel import accelerate_model
from hf_accel.engine.request import Request, SamplingParams

# no detached kernel builds from a test run (tests/test_startup_builds.py checks the launcher with this unset)
os.environ.setdefault("HF_ACCEL_BACKGROUND_BUILDS", "0")

VOCAB_SIZE = 200
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the tiny tokenizer's specials; the model's generation_config has eos 2, bos 1

LLAMA_KW = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB_SIZE, max_position_embeddings=256)


def make_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A tiny random Llama in float32, eval mode, deterministic for a given seed."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**LLAMA_KW, **overrides})).eval()
    return model


def small_stock_cb():
    """A ContinuousBatchingConfig for stock generate_batch() on the tiny test models: on the CPU, transformers sizes
    its paged cache and attention mask from a fraction of host RAM and zero-fills them on every call (16 s of a
    3-prompt call on the CI machine); a cache of 16 pages holds every test's requests and changes no token."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256)


def fresh_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy (same weights) that a test may accelerate, restore or break."""
    return copy.deepcopy(model)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: ids 0/1/2 are <pad>/<s>/</s>, ids 3..199 are single printable characters.

    Decoding concatenates the characters (Fuse decoder), so `StopStringCriteria` can map every token to its string.
    """
    chars = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(192, 192 + 103)]
    vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    for i, ch in enumerate(chars):
        vocab[ch] = i + 3
    assert len(vocab) == VOCAB_SIZE
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                   unk_token="<pad>", padding_side="left")


def left_pad(rows: list[list[int]], pad: int = PAD_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch: (input_ids [B, L], attention_mask [B, L])."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask


def engine_of(model):
    """The hf_accel engine behind an accelerated model."""
    return model._hf_accel_state.engine


def engine_steps(model) -> int:
    return engine_of(model).stats.steps


def run_requests(model, requests) -> None:
    """Run engine requests directly on the model's engine loop (as one call) and wait for them."""
    from hf_accel.engine.loop import EngineCall

    model._hf_accel_state.loop.run_sync(EngineCall(list(requests)))


def assert_engine_idle(model) -> None:
    """No request left queued or running, and every KV block (except the null block 0) back in the free pool."""
    assert model._hf_accel_state.loop.wait_idle(30), "the engine loop did not become idle"
    eng = engine_of(model)
    assert not eng.scheduler.waiting and not eng.scheduler.running
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks - 1
    assert all(c == 0 for c in bm.ref_counts)


# prompts reused across modules: different lengths so that the batch really is left padded
PROMPTS = [
    [5, 17, 42, 99, 7, 150, 33, 64, 12],
    [88, 3, 120],
    [45, 46, 47, 48, 49, 50],
]


@pytest.fixture(scope="module")
def stock_model():
    """The reference: a tiny Llama that is never accelerated."""
    return make_llama(0)


@pytest.fixture(scope="module")
def accel_model(stock_model):
    """Same weights as `stock_model`, accelerated (CPU: torch backend, no graphs, no compile)."""
    return accelerate_model(fresh_copy(stock_model))


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread: tiny models are dominated by threading overhead, worst on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


# -- engine parts driven directly ---------------------------------------------------------------------------------
def make_request(rid: int, tokens, max_new: int = 4) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), max_new_tokens=max_new)


def compute_all(bm, req: Request) -> None:
    """Allocate and 'compute' the whole request, then register its full blocks."""
    assert bm.ensure(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.commit(req)


# -- stock transformers' sampling processors ---------------------------------------------------------------------
def stock_processors(sp: SamplingParams, prompt_len: int = 0, eos: tuple[int, ...] = (),
                     device: str | torch.device = "cpu") -> LogitsProcessorList:
    """transformers' own processors for one request, in generate()'s order."""
    procs = LogitsProcessorList()
    if sp.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(sp.repetition_penalty))
    if sp.min_new_tokens and eos:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, sp.min_new_tokens, list(eos), device=device))
    if sp.do_sample:
        if sp.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(sp.temperature))
        if sp.top_k:
            procs.append(TopKLogitsWarper(sp.top_k))
        if sp.top_p < 1.0:
            procs.append(TopPLogitsWarper(sp.top_p))
        if sp.min_p:
            procs.append(MinPLogitsWarper(sp.min_p))
    return procs


def kill_process_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (Linux /proc): torchrun starts its workers in sessions of their own,
    so killing torchrun's process group would leave them running."""
    import os
    import signal
    from pathlib import Path

    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    todo, found = [pid], []
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    for p in reversed(found):
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def random_left_padded(lengths: list[int], seed: int = 0, high: int = 10000) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths (token ids 10..high-1, seeded), left-padded with 0: (ids, mask) on CPU."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(10, high, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def save_compressed_tensors_checkpoint(model: torch.nn.Module, path: str, preset: str = "W4A16",
                                       group_size: int = 32) -> None:
    """Save `model` as a compressed-tensors checkpoint (the format llm-compressor writes for GPTQ / AWQ-style
    weight-only models): every linear but the lm_head quantized with `preset` ("W4A16": int4 symmetric,
    "W4A16_ASYM": with zero points, "W8A16": int8) in groups of `group_size`, scales from each group's min / max
    (round-to-nearest; what GPTQ or AWQ would refine does not change the format), packed ("pack-quantized").
    Changes `model` in place (its linears end up compressed)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.weights.group_size = group_size
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            groups = module.weight.float().reshape(module.weight.shape[0], -1, args.group_size)
            scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            module.weight_scale.copy_(scale.to(module.weight_scale.dtype))
            module.weight_zero_point.copy_(zero_point.to(module.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)


class LaunchRecorder:
    """Stands in for a Triton kernel: records each launch (`kernel[grid](...)`) or build (`kernel.warmup(...)`)
    with tensors reduced to their dtypes, which with the integers and keywords is what Triton specializes on."""

    def __init__(self, calls: list, name: str):
        self.calls, self.name = calls, name

    def _record(self, grid, args, kwargs):
        args = tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args)
        self.calls.append((self.name, grid, args, tuple(sorted(kwargs.items()))))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._record(grid, args, kwargs)

    def warmup(self, *args, grid, **kwargs):
        return self._record(grid, args, kwargs)


# tiny Llama / Qwen3 models for the compile passes' tests (norm folding, the gated GEMM, the residual chain)
PASS_MODEL_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=200, max_position_embeddings=256)


def tiny_pass_model(family: str, layers: int = 3):
    """A seeded bf16 Llama ("llama") or Qwen3 (anything else) of `layers` layers, in eval mode."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **PASS_MODEL_COMMON))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, head_dim=16, **PASS_MODEL_COMMON))
    return model.eval().to(torch.bfloat16)


def graph_replays_with_and_without_pdl(chain) -> dict:
    """{use_pdl: outputs}: `chain(use_pdl)` (a callable returning tensors) run once, captured in a CUDA graph and
    replayed three times, with PDL off and on; the outputs are copies after the last replay."""
    outs = {}
    for use_pdl in (False, True):
        chain(use_pdl)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            res = chain(use_pdl)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        outs[use_pdl] = [t.clone() for t in res]
    return outs


def stand_in_tuner_gpu(monkeypatch, build=lambda todo: None) -> torch.device:
    """Lets `ops.linear.tune_linears`'s bookkeeping run without a GPU (its timing faked by the caller): a named
    device, no syncs or cache release, and candidate builds handed to `build`. Returns the device to tune for."""
    from hf_accel.ops import linear as linear_op

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in GPU")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(linear_op, "build_candidates", lambda todo, *a: build(todo) or {"kernels": 1})
    return torch.device("cuda", 0)
