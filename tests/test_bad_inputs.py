"""Bad inputs get clear errors, and an error never leaves the model (or the engine) broken."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    LLAMA_KW,
    PAD_ID,
    PROMPTS,
    assert_engine_idle,
    engine_of,
    engine_steps,
    fresh_copy,
    left_pad,
)
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    GenerationConfig,
    GPTNeoConfig,
    GPTNeoForCausalLM,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    MptConfig,
    MptForCausalLM,
    StableLmConfig,
    StableLmForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)
from transformers.generation.streamers import BaseStreamer

from hf_accel import AccelConfig, accelerate_model, restore

pytestmark = pytest.mark.usefixtures("single_thread")

GEN = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID)


def _batch():
    ids, mask = left_pad(PROMPTS)
    return dict(input_ids=ids, attention_mask=mask)


@pytest.fixture(scope="module")
def expected(stock_model):
    """Stock output of the reference call used to check that a model still works."""
    return stock_model.generate(**_batch(), **GEN)


def assert_still_accelerated_and_correct(model, expected):
    assert_engine_idle(model)
    before = engine_steps(model)
    out = model.generate(**_batch(), **GEN)
    assert engine_steps(model) > before
    assert torch.equal(out, expected), f"after the error: {out} != stock {expected}"
    assert_engine_idle(model)


def assert_untouched(model, original_attn, expected):
    """A failed accelerate_model() left the model exactly as stock."""
    assert not hasattr(model, "_hf_accel_state")
    assert "generate" not in vars(model) and "generate_batch" not in vars(model)
    assert model.generate.__func__ is type(model).generate
    assert model.config._attn_implementation == original_attn
    if expected is not None:
        assert torch.equal(model.generate(**_batch(), **GEN), expected)


# -- generate()-time errors on an accelerated model ----------------------------------------------------------------
def test_empty_prompt(accel_model, expected):
    with pytest.raises(ValueError, match="empty"):
        accel_model.generate(input_ids=torch.zeros((1, 0), dtype=torch.long), max_new_tokens=3)
    with pytest.raises(ValueError):
        accel_model.generate(input_ids=torch.zeros((0, 4), dtype=torch.long), max_new_tokens=3)
    assert_still_accelerated_and_correct(accel_model, expected)


def test_all_padding_row_names_the_row(accel_model, expected):
    ids = torch.tensor([[5, 6, 7], [0, 0, 0], [8, 9, 10]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match=r"row 1\b"):
        accel_model.generate(input_ids=ids, attention_mask=mask, **GEN)
    assert_still_accelerated_and_correct(accel_model, expected)


@pytest.mark.parametrize("how", ["max_new_tokens", "max_length"])
def test_longer_than_max_position_embeddings(accel_model, expected, how):
    limit = LLAMA_KW["max_position_embeddings"]
    ids = torch.tensor([list(range(3, 53))])  # 50 tokens
    kw = {"max_new_tokens": limit - 49} if how == "max_new_tokens" else {"max_length": limit + 1}
    with pytest.raises(ValueError, match="max_position_embeddings"):
        accel_model.generate(input_ids=ids, do_sample=False, **kw)
    # exactly at the limit is fine
    ok = accel_model.generate(input_ids=ids, do_sample=False, max_new_tokens=limit - 50, eos_token_id=None)
    assert ok.shape[1] <= limit
    assert_still_accelerated_and_correct(accel_model, expected)


def test_max_new_tokens_zero_raises_like_stock(stock_model, accel_model, expected):
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError) as stock_err:
        stock_model.generate(input_ids=ids, max_new_tokens=0)
    with pytest.raises(ValueError) as ours:
        accel_model.generate(input_ids=ids, max_new_tokens=0)
    assert "max_new_tokens" in str(ours.value) and "max_new_tokens" in str(stock_err.value)
    with pytest.raises(ValueError):
        accel_model.generate(input_ids=ids, max_new_tokens=-3)
    assert_still_accelerated_and_correct(accel_model, expected)


def test_max_length_not_above_prompt_raises_like_stock(stock_model, accel_model, expected):
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="max_length"):
        stock_model.generate(input_ids=ids, max_length=4)
    with pytest.raises(ValueError, match="max_length"):
        accel_model.generate(input_ids=ids, max_length=4)
    assert_still_accelerated_and_correct(accel_model, expected)


def test_malformed_tensors(accel_model, expected):
    with pytest.raises(ValueError):
        accel_model.generate(input_ids=torch.tensor([5, 6, 7]), max_new_tokens=3)  # 1-D
    with pytest.raises(ValueError, match="attention_mask"):
        accel_model.generate(input_ids=torch.tensor([[5, 6, 7, 8]]),
                             attention_mask=torch.ones((1, 3), dtype=torch.long), max_new_tokens=3)
    with pytest.raises(ValueError):
        accel_model.generate(torch.tensor([[5, 6]]), input_ids=torch.tensor([[5, 6]]), max_new_tokens=3)
    assert_still_accelerated_and_correct(accel_model, expected)


def test_errors_stock_also_raises(stock_model, accel_model, expected):
    ids = torch.tensor([[5, 6, 7, 8]])
    for kw in (dict(stop_strings=["ab"]), dict(num_return_sequences=2, do_sample=False)):
        with pytest.raises(ValueError):
            stock_model.generate(input_ids=ids, max_new_tokens=3, **kw)
        with pytest.raises(ValueError):
            accel_model.generate(input_ids=ids, max_new_tokens=3, **kw)
    assert_still_accelerated_and_correct(accel_model, expected)


def test_out_of_vocab_token_leaves_engine_clean(accel_model, expected):
    with pytest.raises((IndexError, ValueError, RuntimeError)):
        accel_model.generate(input_ids=torch.tensor([[5, 6, 10_000]]), max_new_tokens=3)
    assert_still_accelerated_and_correct(accel_model, expected)


class Boom(Exception):
    pass


class ExplodingProcessor(LogitsProcessor):
    """Raises at its `after`-th call: mid-generation, with requests running and blocks held."""

    def __init__(self, after: int) -> None:
        self.calls = 0
        self.after = after

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls >= self.after:
            raise Boom("user processor failed")
        return scores


class ExplodingStreamer(BaseStreamer):
    def __init__(self) -> None:
        self.n = 0

    def put(self, value):
        self.n += 1
        if self.n == 4:
            raise Boom("user streamer failed")

    def end(self):
        pass


def test_user_callback_error_mid_generation_leaves_engine_clean(accel_model, expected):
    with pytest.raises(Boom):
        accel_model.generate(**_batch(), **GEN, logits_processor=LogitsProcessorList([ExplodingProcessor(after=7)]))
    assert_still_accelerated_and_correct(accel_model, expected)
    with pytest.raises(Boom):
        accel_model.generate(**_batch(), **GEN, streamer=ExplodingStreamer())
    assert_still_accelerated_and_correct(accel_model, expected)


def test_request_larger_than_kv_pool(stock_model):
    m = accelerate_model(fresh_copy(stock_model), num_kv_blocks=4, block_size=16)  # 3 usable blocks = 48 tokens
    big = torch.tensor([list(range(3, 43))])  # 40 + 20 tokens need 4 blocks
    with pytest.raises(ValueError, match="num_kv_blocks"):
        m.generate(input_ids=big, max_new_tokens=20, do_sample=False)
    # in a batch with a request that fits: nothing half-run stays queued
    ids, mask = left_pad([[5, 6, 7], list(range(3, 43))])
    with pytest.raises(ValueError):
        m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD_ID)
    assert_engine_idle(m)
    small = torch.tensor([[5, 6, 7]])
    kw = dict(input_ids=small, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert torch.equal(m.generate(**kw), stock_model.generate(**kw))
    assert_engine_idle(m)


def test_generate_batch_bad_inputs(accel_model, expected):
    gc = GenerationConfig(max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError):
        accel_model.generate_batch([[5, 6], []], generation_config=gc)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        accel_model.generate_batch([[5, 6]], generation_config=gc, max_new_tokens=LLAMA_KW["max_position_embeddings"])
    with pytest.raises(ValueError, match="max_new_tokens"):
        accel_model.generate_batch([[5, 6]], generation_config=gc, max_new_tokens=0)
    assert_still_accelerated_and_correct(accel_model, expected)


# -- accelerate_model() option errors --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def victim(stock_model):
    """A stock copy that only ever sees failing accelerate_model() calls."""
    return fresh_copy(stock_model)


def test_unknown_attention_backend_lists_choices(victim, expected):
    original = victim.config._attn_implementation
    with pytest.raises(ValueError) as err:
        accelerate_model(victim, attention_backend="fastest")
    msg = str(err.value)
    assert "fastest" in msg
    for choice in ("auto", "torch", "triton", "flashinfer", "flash_attn"):
        assert choice in msg, f"{choice!r} missing from: {msg}"
    assert_untouched(victim, original, expected)


def test_unknown_cudagraph_mode(victim, expected):
    original = victim.config._attn_implementation
    with pytest.raises(ValueError) as err:
        accelerate_model(victim, cudagraph_mode="sometimes")
    msg = str(err.value)
    assert "sometimes" in msg and "piecewise" in msg and "full_and_piecewise" in msg
    assert_untouched(victim, original, expected)


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "flash_attn"])
def test_gpu_backend_on_cpu_raises_with_reasons(victim, expected, backend):
    original = victim.config._attn_implementation
    with pytest.raises(ValueError) as err:
        accelerate_model(victim, attention_backend=backend)
    msg = str(err.value)
    assert backend in msg
    reasons = msg.split(":", 1)[1].strip() if ":" in msg else ""
    assert reasons, f"no reason given: {msg!r}"
    assert_untouched(victim, original, expected)


@pytest.mark.parametrize("options", [
    dict(block_size=3),
    dict(block_size=0),
    dict(block_size=-16),
    dict(block_size=8),  # a power of two, but not one the torch backend supports
    dict(gpu_memory_utilization=0),
    dict(gpu_memory_utilization=1.5),
    dict(num_kv_blocks=1),
    dict(max_num_seqs=0),
    dict(max_num_batched_tokens=0),
    dict(cudagraph_capture_sizes=[0, 8]),
    dict(config=AccelConfig(block_size=3)),
    dict(config=AccelConfig(gpu_memory_utilization=0.0)),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_invalid_config_values(victim, expected, options):
    original = victim.config._attn_implementation
    with pytest.raises(ValueError):
        accelerate_model(victim, **options)
    assert_untouched(victim, original, None)


def test_unknown_option(victim, expected):
    original = victim.config._attn_implementation
    with pytest.raises(TypeError):
        accelerate_model(victim, turbo=True)
    with pytest.raises(TypeError):
        AccelConfig().updated(turbo=True)
    assert_untouched(victim, original, expected)


def test_keyword_overrides_config(stock_model, expected):
    m = accelerate_model(fresh_copy(stock_model), config=AccelConfig(block_size=3), block_size=32)
    assert engine_of(m).block_size == 32
    assert_still_accelerated_and_correct(m, expected)


def test_failed_reaccelerate_keeps_a_working_model(stock_model, expected):
    """accelerate_model() on an accelerated model with bad options: the model must not be left half-patched."""
    m = accelerate_model(fresh_copy(stock_model))
    with pytest.raises(ValueError):
        accelerate_model(m, block_size=3)
    assert hasattr(m, "_hf_accel_state")  # invalid options are caught before the current engine is undone
    with pytest.raises(ValueError):
        accelerate_model(m, attention_backend="flashinfer")  # not runnable on CPU
    assert hasattr(m, "_hf_accel_state")
    out = m.generate(**_batch(), **GEN)
    assert torch.equal(out, expected)


def test_auto_with_nothing_runnable_keeps_the_model(stock_model, expected, monkeypatch):
    """"auto" with no backend able to run (the probe finds none): the error comes before the engine is undone."""
    from hf_accel import api

    m = accelerate_model(fresh_copy(stock_model))

    def nothing_runs(name, spec, device):
        raise RuntimeError("no attention backend can run this model here")

    monkeypatch.setattr(api, "probable_auto_names", lambda spec, device: [])
    monkeypatch.setattr(api, "select_backend", nothing_runs)
    with pytest.raises(RuntimeError, match="no attention backend"):
        accelerate_model(m)
    assert hasattr(m, "_hf_accel_state")
    monkeypatch.undo()
    assert torch.equal(m.generate(**_batch(), **GEN), expected)


# -- models that cannot be accelerated -------------------------------------------------------------------------------
def _tiny(cls, config):
    torch.manual_seed(0)
    return cls(config).eval()


NO_ATTENTION_INTERFACE = {
    "bloom": lambda: _tiny(BloomForCausalLM, BloomConfig(vocab_size=200, hidden_size=32, n_layer=1, n_head=4)),
    "gpt_neo": lambda: _tiny(GPTNeoForCausalLM, GPTNeoConfig(
        vocab_size=200, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        max_position_embeddings=64, window_size=16)),
    "falcon": lambda: _tiny(FalconForCausalLM, FalconConfig(vocab_size=200, hidden_size=32, num_hidden_layers=1,
                                                            num_attention_heads=4)),
    "mpt": lambda: _tiny(MptForCausalLM, MptConfig(vocab_size=200, d_model=32, n_heads=4, n_layers=1)),
    "stablelm": lambda: _tiny(StableLmForCausalLM, StableLmConfig(
        vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4)),
}


@pytest.mark.parametrize("family", sorted(NO_ATTENTION_INTERFACE))
def test_family_without_attention_interface(family):
    model = NO_ATTENTION_INTERFACE[family]()
    assert not model._supports_attention_backend, f"{family} now supports the attention interface"
    ids = torch.tensor([[5, 6, 7, 8]])
    expected = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD_ID)
    original = model.config._attn_implementation
    with pytest.raises(NotImplementedError, match="AttentionInterface"):
        accelerate_model(model)
    assert not hasattr(model, "_hf_accel_state")
    assert "generate" not in vars(model)
    assert model.config._attn_implementation == original
    out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD_ID)
    assert torch.equal(out, expected)


class LlamaWithoutAttentionInterface(LlamaForCausalLM):
    _supports_attention_backend = False


def test_model_class_opting_out_of_attention_interface(stock_model, expected):
    model = LlamaWithoutAttentionInterface(stock_model.config).eval()
    model.load_state_dict(stock_model.state_dict())
    original = model.config._attn_implementation
    with pytest.raises(NotImplementedError):
        accelerate_model(model)
    assert_untouched(model, original, expected)


def test_encoder_decoder_rejected():
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=200, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                num_heads=4, decoder_start_token_id=0)).eval()
    with pytest.raises(NotImplementedError):
        accelerate_model(model)
    assert not hasattr(model, "_hf_accel_state") and "generate" not in vars(model)


def test_not_a_language_model():
    with pytest.raises(TypeError):
        accelerate_model(torch.nn.Linear(4, 4))


def test_attention_sinks_rejected():
    """GPT-OSS adds learned per-head sink logits to the softmax; dropping them silently would change answers."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss")
    torch.manual_seed(0)
    config = gpt_oss.GptOssConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
                                  num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * 2)
    model = gpt_oss.GptOssForCausalLM(config).eval()
    with pytest.raises(NotImplementedError, match="sinks"):
        accelerate_model(model)
    assert not hasattr(model, "_hf_accel_state") and "generate" not in vars(model)


def test_attention_that_disagrees_with_the_config_is_a_clear_error():
    """A config naming num_key_value_heads that the model's attention does not use (GPT-NeoX is multi-head)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           vocab_size=256, max_position_embeddings=512)
    config.num_key_value_heads = 2
    model = GPTNeoXForCausalLM(config).eval()
    accelerate_model(model, attention_backend="torch")
    try:
        with pytest.raises(ValueError, match="key/value heads"):
            model.generate(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, do_sample=False)
        assert_engine_idle(model)
    finally:
        restore(model)


def test_chunked_attention_model_is_served_up_to_one_chunk_exactly_and_refused_beyond():
    """Llama 4's chunked attention is not implemented by the backends: within one chunk it is causal attention, so a
    sequence of up to one chunk is exact (greedy equals stock) and a longer one is refused with the reason, never
    answered with full attention across chunks (a hostile test found the wrong tokens, 2026-12-01)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    cfg = Llama4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_local_experts=1, attention_chunk_size=16, max_position_embeddings=256,
                           pad_token_id=0, eos_token_id=None)
    model = Llama4ForCausalLM(cfg).eval()
    ids = torch.randint(3, 128, (2, 6))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    ref = model.generate(ids, **kw)
    accelerate_model(model, compile=False)
    try:
        assert torch.equal(model.generate(ids, **kw), ref)  # 16 tokens: one chunk
        with pytest.raises(ValueError, match="attention_chunk_size=16"):
            model.generate(ids, **{**kw, "max_new_tokens": 11})
    finally:
        restore(model)


# a one-layer multi-head latent attention model (DeepSeek-V3's family): q/k head dim 16 + 8, values 8 wide
TINY_MLA = dict(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                v_head_dim=8, n_group=1, topk_group=1)


def test_latent_attention_with_values_wider_than_keys_is_refused():
    """The paged cache holds one head dim for keys and values; narrower values are padded into it (DeepSeek's
    MLA, tests/test_families_ab.py), wider ones cannot be, so accelerate_model says so instead of failing later."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**{**TINY_MLA, "v_head_dim": 32})
    with pytest.raises(NotImplementedError, match="v_head_dim=32"):
        accelerate_model(DeepseekV3ForCausalLM(cfg).eval())


def test_llama4_no_rope_temperature_layers_stay_exact_within_their_limit():
    """Llama 4's no-rope layers with attn_temperature_tuning scale each query by its index within the forward
    (transformers counts 0..T-1, not the positions), which a packed engine step would get wrong once an index
    reaches floor_scale - 1 (a review found logits off by up to 6.5). Context and step size stay below it: exact
    within, refused beyond."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    cfg = Llama4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_local_experts=1, attention_chunk_size=64, max_position_embeddings=256,
                           pad_token_id=0, eos_token_id=None, no_rope_layers=[1, 0], floor_scale=12,
                           attn_scale=2.0, attn_temperature_tuning=True)
    model = Llama4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)  # attention sharp enough for a query scale to change tokens
    ids = torch.randint(3, 128, (8, 4))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=7, do_sample=False)
    ref = model.generate(ids, **kw)
    accelerate_model(model, compile=False)
    try:
        assert engine_of(model).scheduler.max_num_batched_tokens == 11  # 8 rows x 4 prompt tokens: three steps
        assert torch.equal(model.generate(ids, **kw), ref)
        with pytest.raises(ValueError, match="floor_scale - 1"):
            model.generate(ids, **{**kw, "max_new_tokens": 8})
    finally:
        restore(model)


def test_sparse_indexer_attention_is_refused():
    """DeepSeek-V3.2-style sparse attention (an indexer picks index_topk keys per query) has MLA head dims, so it
    passed as dense MLA and then failed inside generate(); the backends implement dense attention only."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    cfg = DeepseekV32Config(**TINY_MLA)
    with pytest.raises(NotImplementedError, match="index_topk"):
        accelerate_model(DeepseekV32ForCausalLM(cfg).eval())
