"""Greedy A/B against stock transformers, token for token, across families and engine situations (CPU, fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from hf_accel import accelerate_model, restore

VOCAB = 256
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, pad_token_id=0)

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=8),  # window shorter than the prompt
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16),
    "gemma": lambda: transformers.GemmaConfig(**COMMON, head_dim=16),
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=8,
                                                attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "phi3": lambda: transformers.Phi3Config(**COMMON),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, decoder_sparse_step=1),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    # multi-head latent attention: q/k head dim 16 + 8, values 8 wide (padded in the cache), routed + shared experts
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=8, n_group=1, topk_group=1),
}

_models: dict[str, torch.nn.Module] = {}


def tiny_model(family: str) -> torch.nn.Module:
    if family not in _models:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=torch.float32).eval()
        model.generation_config.pad_token_id = 0
        _models[family] = model
    return _models[family]


def left_padded_batch(lengths: list[int], seed: int = 1, prefix: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        row = torch.randint(3, VOCAB, (n,), generator=g)
        if prefix is not None:
            row[: len(prefix)] = torch.tensor(prefix)
        ids[i, width - n :] = row
        mask[i, width - n :] = 1
    return ids, mask


def ab(model, ids, mask, accel_kwargs: dict, **gen_kwargs):
    """Stock vs accelerated greedy output; returns the engine that served the call."""
    gen_kwargs.setdefault("max_new_tokens", 12)
    gen_kwargs.setdefault("do_sample", False)
    restore(model)
    expected = model.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)
    accelerate_model(model, **accel_kwargs)
    try:
        got = model.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)
        engine = model._hf_accel_state.engine
    finally:
        restore(model)
    assert got.shape == expected.shape
    assert torch.equal(got, expected), f"\nexpected {expected[:, ids.shape[1]:]}\ngot      {got[:, ids.shape[1]:]}"
    return engine


@pytest.mark.parametrize("family", list(FAMILIES))
def test_left_padded_batch(family):
    ids, mask = left_padded_batch([20, 7, 13, 1])
    ab(tiny_model(family), ids, mask, {})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_prefill_tiny_budget(family):
    ids, mask = left_padded_batch([23, 9, 17], seed=2)
    ab(tiny_model(family), ids, mask, dict(max_num_batched_tokens=5, block_size=16))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_budget_smaller_than_running_batch(family):
    """A token budget below the running batch leaves steps of one token per request where some tokens are prompt
    chunks mid-prompt: only requests at the end of their prompt (or decoding) may sample."""
    ids, mask = left_padded_batch([10, 10, 10, 10, 10, 10], seed=4)
    ab(tiny_model(family), ids, mask, dict(max_num_batched_tokens=4, block_size=16))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_preemption_tiny_cache(family):
    ids, mask = left_padded_batch([30, 25, 28, 22], seed=3)
    model = tiny_model(family)
    # 4 rows need ~4 blocks each at the end; 9 usable blocks force preemption and recompute
    engine = ab(model, ids, mask, dict(num_kv_blocks=10, block_size=16), max_new_tokens=20)
    assert engine.stats.preemptions > 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shared_prefix_with_prefix_caching(family):
    prefix = list(range(40, 40 + 35))
    ids, mask = left_padded_batch([40, 38, 36], seed=4, prefix=None)
    for i in range(ids.shape[0]):
        start = int((mask[i] == 0).sum())
        ids[i, start : start + len(prefix)] = torch.tensor(prefix)
    model = tiny_model(family)
    engine = ab(model, ids, mask, dict(block_size=16, max_num_seqs=1))  # one at a time: later rows hit the cache
    assert engine.scheduler.prefix_hit_tokens >= 2 * 32


@pytest.mark.parametrize("family", list(FAMILIES))
def test_eos_list_ends_one_row_early(family):
    model = tiny_model(family)
    ids, mask = left_padded_batch([10, 14], seed=5)
    restore(model)
    free_run = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    new = free_run[:, ids.shape[1]:]
    eos_row0 = int(new[0, 3])  # row 0 stops at its 4th new token, unless row 1 meets it earlier
    eos = [eos_row0, VOCAB - 1]
    ab(model, ids, mask, {}, max_new_tokens=12, eos_token_id=eos)


def test_prefix_cache_hits_are_used():
    model = tiny_model("llama")
    prompt = torch.arange(3, 3 + 50)[None]
    accelerate_model(model, block_size=16)
    try:
        model.generate(input_ids=prompt, max_new_tokens=2, do_sample=False)
        engine = model._hf_accel_state.engine
        assert engine.scheduler.prefix_hit_tokens == 0
        out = model.generate(input_ids=prompt, max_new_tokens=2, do_sample=False)
        assert engine.scheduler.prefix_hit_tokens == 48  # (50 - 1) // 16 full blocks; the last is recomputed
    finally:
        restore(model)
    assert torch.equal(out, model.generate(input_ids=prompt, max_new_tokens=2, do_sample=False))


def test_prefix_cache_forgotten_after_an_in_place_weight_update():
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    ids, mask = left_padded_batch([40, 33])
    accelerate_model(model, block_size=16)
    try:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)  # fills the cache
        with torch.no_grad():  # e.g. an optimizer step between two calls
            for p, q in zip(model.model.layers[0].parameters(), reference.model.layers[0].parameters()):
                p.mul_(1.5)
                q.mul_(1.5)
        engine = model._hf_accel_state.engine
        hits = engine.scheduler.prefix_hit_tokens
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert engine.scheduler.prefix_hit_tokens == hits  # nothing reused from before the update
        assert torch.equal(got, reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                                                   do_sample=False))
        # a parameter replaced outright (not updated in place): the eager engine reads the modules' current
        # parameters, so the call is right; compiled engines are rebuilt (tests/test_model_changes.py)
        for m in (model, reference):
            with torch.no_grad():
                m.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(m.model.layers[0].mlp.up_proj.weight * 2)
        hits = engine.scheduler.prefix_hit_tokens
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert engine.scheduler.prefix_hit_tokens == hits
    finally:
        restore(model)
    expected = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)
