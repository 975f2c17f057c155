"""The transformers generate()/generate_batch()/pipeline contract, A/B against stock transformers on CPU.

Stock `generate()` on an identical copy of the model is the reference for everything here; every accelerated call
is also checked to have really run on the engine (its step counter moved), so a silent fallback to the stock path
cannot make a test pass.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import (
    EOS_ID,
    PAD_ID,
    PROMPTS,
    assert_engine_idle,
    engine_of,
    engine_steps,
    fresh_copy,
    left_pad,
    make_llama,
    run_requests,
    small_stock_cb,
    stock_processors,
)
from transformers import (
    EosTokenCriteria,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
    pipeline,
)
from transformers.generation.continuous_batching.requests import GenerationOutput
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_accel import accelerate_model, restore
from hf_accel.attention.op import ATTN_IMPLEMENTATION_NAME
from hf_accel.engine.request import Request, SamplingParams

ATOL = 1e-4
pytestmark = pytest.mark.usefixtures("single_thread")


# -- helpers -------------------------------------------------------------------------------------------------------
def accel_generate(model, **kwargs):
    """generate() on the accelerated model, asserting it ran on the engine and left it idle."""
    before = engine_steps(model)
    out = model.generate(**kwargs)
    assert engine_steps(model) > before, "the call did not run on the hf_accel engine"
    assert_engine_idle(model)
    return out


def ab(stock, accel, **kwargs):
    """The same generate() call on both models."""
    return stock.generate(**kwargs), accel_generate(accel, **kwargs)


def assert_same_tokens(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape, f"shape {tuple(b.shape)} != stock {tuple(a.shape)}\nstock={a}\ngot={b}"
    assert torch.equal(a, b), f"tokens differ from stock\nstock={a}\ngot={b}"


def finish_steps(sequences: torch.Tensor, prompt_width: int, eos: set[int]) -> list[int]:
    """Per row, the step whose token ended it (EOS), or a number past the end if it never ended."""
    gen = sequences[:, prompt_width:]
    steps = []
    for row in gen.tolist():
        hit = [k for k, t in enumerate(row) if t in eos]
        steps.append(hit[0] if hit else len(row) + 1)
    return steps


def pick_early_eos(sequences: torch.Tensor, prompt_width: int, exclude: set[int] = frozenset()) -> tuple[int, int]:
    """A token that ends one row early (first seen at a step in [1, n-3]) but does not occur in some other row.

    Returns (token, row it ends).
    """
    gen = sequences[:, prompt_width:].tolist()
    n = len(gen[0])
    for r, row in enumerate(gen):
        for k in range(1, n - 2):
            t = row[k]
            if t in exclude or t in row[:k] or t in (PAD_ID, EOS_ID):
                continue
            if any(t not in other for j, other in enumerate(gen) if j != r):
                return t, r
    raise AssertionError(f"no usable early-EOS token in {gen}")


def early_eos_call(stock_model, max_new_tokens: int) -> tuple[dict, int, int]:
    """Greedy generate() kwargs over the left-padded PROMPTS, their prompt width, and a token that ends one row early
    (`pick_early_eos` on stock's output)."""
    ids, mask = left_pad(PROMPTS)
    width = ids.shape[1]
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                  pad_token_id=PAD_ID)
    eos, _ = pick_early_eos(stock_model.generate(**common), width)
    return common, width, eos


class RecordingStreamer(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ends = 0

    def put(self, value):
        assert self.ends == 0, "put() after end()"
        self.puts.append(value.detach().cpu().clone())

    def end(self):
        self.ends += 1


# -- plain greedy ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [PROMPTS[:1], PROMPTS, [PROMPTS[1], PROMPTS[1]]])
def test_greedy_left_padded_batch_equals_stock(stock_model, accel_model, rows):
    ids, mask = left_pad(rows)
    a, b = ab(stock_model, accel_model, input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
              pad_token_id=PAD_ID)
    assert_same_tokens(a, b)


def test_positional_inputs_and_no_attention_mask(stock_model, accel_model):
    ids = torch.tensor([PROMPTS[2], PROMPTS[2][::-1]])
    a = stock_model.generate(ids, max_new_tokens=8, do_sample=False)
    b = accel_generate(accel_model, inputs=ids, max_new_tokens=8, do_sample=False)
    assert_same_tokens(a, b)


def test_int32_prompt_with_early_eos_equals_stock(stock_model, accel_model):
    """int32 ids come back as stock returns them (int64, the prompt rows as given), rows ended by EOS padded."""
    common, width, eos = early_eos_call(stock_model, 10)
    a, b = ab(stock_model, accel_model, **{**common, "input_ids": common["input_ids"].int()}, eos_token_id=eos)
    assert a.dtype == b.dtype == torch.int64
    assert_same_tokens(a, b)
    assert min(finish_steps(a, width, {eos})) < 9, "no row ended early"


def test_attention_mask_inferred_from_pad_token(stock_model, accel_model):
    ids, _ = left_pad(PROMPTS)
    a, b = ab(stock_model, accel_model, input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=PAD_ID)
    assert_same_tokens(a, b)


def test_use_cache_false_equals_stock(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS)
    a, b = ab(stock_model, accel_model, input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
              pad_token_id=PAD_ID, use_cache=False)
    assert_same_tokens(a, b)


def test_kwargs_override_generation_config(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS[:2])
    a, b = ab(stock_model, accel_model, input_ids=ids, attention_mask=mask, pad_token_id=PAD_ID,
              generation_config=GenerationConfig(max_new_tokens=4, do_sample=False), max_new_tokens=7)
    assert a.shape[1] == ids.shape[1] + 7
    assert_same_tokens(a, b)


def test_generation_config_only(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID)
    a, b = ab(stock_model, accel_model, input_ids=ids, attention_mask=mask, generation_config=gc)
    assert_same_tokens(a, b)


# -- return_dict_in_generate, scores, logits -----------------------------------------------------------------------
def test_return_dict_scores_and_logits(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS)
    width, n = ids.shape[1], 12
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=PAD_ID)
    ref = stock_model.generate(**common)
    eos, row = pick_early_eos(ref, width)
    a, b = ab(stock_model, accel_model, **common, eos_token_id=eos, return_dict_in_generate=True,
              output_scores=True, output_logits=True)
    assert isinstance(b, GenerateDecoderOnlyOutput)
    assert_same_tokens(a.sequences, b.sequences)
    fin = finish_steps(a.sequences, width, {eos})
    assert fin[row] < n - 1, "the chosen EOS must end a row early"
    assert max(fin) > n, "some row must run to max_new_tokens"
    assert b.scores is not None and b.logits is not None
    assert len(b.scores) == len(a.scores) == a.sequences.shape[1] - width
    assert len(b.logits) == len(a.logits) == len(a.scores)
    for k in range(len(a.scores)):
        for name, ours, theirs in (("scores", b.scores[k], a.scores[k]), ("logits", b.logits[k], a.logits[k])):
            assert ours.shape == theirs.shape == (len(PROMPTS), 200), f"{name}[{k}] shape {tuple(ours.shape)}"
            for r in range(len(PROMPTS)):
                if k <= fin[r]:  # the row is still generating (the EOS step itself included)
                    torch.testing.assert_close(ours[r].float(), theirs[r].float(), atol=ATOL, rtol=ATOL,
                                               msg=lambda m, k=k, r=r, name=name: f"{name}[{k}] row {r}: {m}")
                else:  # documented convention: -inf everywhere except 0 at pad_token_id
                    expect = torch.full((200,), float("-inf"))
                    expect[PAD_ID] = 0.0
                    assert torch.equal(ours[r].float().cpu(), expect), f"{name}[{k}] row {r} (finished)"


def test_return_dict_without_scores(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS[:2])
    a, b = ab(stock_model, accel_model, input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
              pad_token_id=PAD_ID, return_dict_in_generate=True)
    assert isinstance(b, GenerateDecoderOnlyOutput)
    assert_same_tokens(a.sequences, b.sequences)
    assert b.scores is None and b.logits is None


# -- streamers -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 2])
def test_streamer_matches_stock(stock_model, accel_model, batch):
    ids, mask = left_pad(PROMPTS[:batch])
    width, n = ids.shape[1], 10
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=PAD_ID)
    extra = {}
    if batch > 1:  # one row ends early, so the stream carries pad for it
        eos, _ = pick_early_eos(stock_model.generate(**common), width)
        extra["eos_token_id"] = eos
    s_stock, s_ours = RecordingStreamer(), RecordingStreamer()
    a = stock_model.generate(**common, **extra, streamer=s_stock)
    b = accel_generate(accel_model, **common, **extra, streamer=s_ours)
    assert_same_tokens(a, b)
    assert s_ours.ends == 1 and s_stock.ends == 1
    assert len(s_ours.puts) == len(s_stock.puts), f"{len(s_ours.puts)} put() calls, stock made {len(s_stock.puts)}"
    for i, (x, y) in enumerate(zip(s_stock.puts, s_ours.puts, strict=True)):
        assert x.shape == y.shape and torch.equal(x, y), f"put #{i}: stock {x} got {y}"


# -- pipeline --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [1, 3])
def test_pipeline_text_generation(stock_model, accel_model, tokenizer, batch_size):
    texts = ["abcdefgh", "xyz", "Hello, world!"]
    kw = dict(max_new_tokens=8, do_sample=False, batch_size=batch_size)
    expected = pipeline("text-generation", model=stock_model, tokenizer=tokenizer)(texts, **kw)
    before = engine_steps(accel_model)
    got = pipeline("text-generation", model=accel_model, tokenizer=tokenizer)(texts, **kw)
    assert engine_steps(accel_model) > before, "the pipeline did not run on the engine"
    assert_engine_idle(accel_model)
    assert got == expected
    assert all(o[0]["generated_text"].startswith(t) for o, t in zip(got, texts, strict=True))


# -- restore ---------------------------------------------------------------------------------------------------------
def test_restore_then_accelerate_again(stock_model):
    m = fresh_copy(stock_model)
    cls = type(m)
    original = m.config._attn_implementation
    weights = {k: v.clone() for k, v in m.state_dict().items()}
    ids, mask = left_pad(PROMPTS)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD_ID)
    expected = stock_model.generate(**kw)

    assert accelerate_model(m) is m
    assert m.config._attn_implementation != original
    assert_same_tokens(expected, accel_generate(m, **kw))

    assert restore(m) is m
    assert "generate" not in vars(m) and "generate_batch" not in vars(m)
    assert m.generate.__func__ is cls.generate
    assert not hasattr(m, "_hf_accel_state")
    assert m.config._attn_implementation == original
    for name, module in m.named_modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            assert cfg._attn_implementation == original, f"{name} still uses {cfg._attn_implementation}"
    sd = m.state_dict()
    assert sd.keys() == weights.keys() and all(torch.equal(sd[k], weights[k]) for k in sd)
    assert_same_tokens(expected, m.generate(**kw))
    assert restore(m) is m  # restoring a stock model is a no-op

    accelerate_model(m)
    assert_same_tokens(expected, accel_generate(m, **kw))
    # accelerating an accelerated model re-applies the options on a fresh engine
    accelerate_model(m, max_num_seqs=2)
    assert engine_of(m).scheduler.max_num_seqs == 2
    assert_same_tokens(expected, accel_generate(m, **kw))
    restore(m)
    assert m.config._attn_implementation == original
    assert m.generate.__func__ is cls.generate


# -- sampling ----------------------------------------------------------------------------------------------------------
def _sample(model, seed, rows, **kw):
    ids, mask = left_pad(rows)
    torch.manual_seed(seed)
    return accel_generate(model, input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=12,
                          pad_token_id=PAD_ID, eos_token_id=None, **kw)


def test_seeded_sampling_reproducible(accel_model):
    a = _sample(accel_model, 1234, PROMPTS[:2])
    b = _sample(accel_model, 1234, PROMPTS[:2])
    c = _sample(accel_model, 4321, PROMPTS[:2])
    assert_same_tokens(a, b)
    assert not torch.equal(a, c), "different seeds gave identical samples"


def test_sampling_is_batch_invariant(accel_model):
    # the longest prompt comes first, so its row has no padding in either batch
    alone = _sample(accel_model, 77, PROMPTS[:1])
    batched = _sample(accel_model, 77, PROMPTS)
    assert torch.equal(alone[0], batched[0])


def test_top_k_1_sampling_equals_greedy(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, pad_token_id=PAD_ID)
    expected = stock_model.generate(**kw, do_sample=False)
    got = accel_generate(accel_model, **kw, do_sample=True, top_k=1, temperature=0.7)
    assert_same_tokens(expected, got)


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_sampling_first_step_scores_match_stock_warpers(stock_model, accel_model, penalty):
    """One sampled step with every knob on: the processed scores equal stock's (same -inf mask, same values)."""
    ids, mask = left_pad(PROMPTS)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=1, pad_token_id=PAD_ID, do_sample=True,
              temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=penalty,
              return_dict_in_generate=True, output_scores=True)
    torch.manual_seed(0)
    a = stock_model.generate(**kw)
    b = accel_generate(accel_model, **kw)
    torch.testing.assert_close(b.scores[0].float(), a.scores[0].float(), atol=ATOL, rtol=ATOL)
    tok = b.sequences[:, -1]
    assert torch.isfinite(b.scores[0][torch.arange(len(tok)), tok]).all(), "sampled a filtered-out token"


MIXED_PARAMS = [
    SamplingParams(do_sample=False),
    SamplingParams(do_sample=False, repetition_penalty=1.5),
    SamplingParams(do_sample=True, temperature=0.6, seed=11),
    SamplingParams(do_sample=True, top_p=0.8, seed=12),
    SamplingParams(do_sample=True, min_p=0.2, seed=13),
    SamplingParams(do_sample=True, top_k=5, temperature=1.5, seed=14),
    SamplingParams(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                   seed=15),
]


def _engine_requests(engine, n_new=8):
    return [Request(request_id=engine.new_request_id(), prompt_token_ids=list(PROMPTS[i % len(PROMPTS)]),
                    max_new_tokens=n_new, sampling=sp, want_scores=True, want_logits=True)
            for i, sp in enumerate(MIXED_PARAMS)]


def test_mixed_per_request_sampling_params_in_one_batch(stock_model, accel_model):
    eng = engine_of(accel_model)
    reqs = _engine_requests(eng)
    before = eng.stats.steps
    run_requests(accel_model, reqs)
    assert_engine_idle(accel_model)
    # all seven shared steps: one prefill step plus one decode step per further token
    assert eng.stats.steps - before == 8
    for req in reqs:
        sp = req.sampling
        assert len(req.output_token_ids) == 8 and req.is_finished
        procs = stock_processors(sp)
        for k, tok in enumerate(req.output_token_ids):
            row = torch.tensor([req.prompt_token_ids + req.output_token_ids[:k]])
            with torch.no_grad():
                ref_logits = stock_model(row).logits[0, -1].float()
            torch.testing.assert_close(req.raw_logits[k].float().cpu(), ref_logits, atol=ATOL, rtol=ATOL)
            expect = procs(row, ref_logits[None].clone())[0]
            got = req.scores[k].float().cpu()
            assert torch.equal(torch.isinf(got), torch.isinf(expect)), (
                f"{sp}: step {k}: kept {int(torch.isfinite(got).sum())} tokens, stock keeps "
                f"{int(torch.isfinite(expect).sum())}")
            torch.testing.assert_close(got, expect, atol=ATOL, rtol=ATOL)
            assert torch.isfinite(got[tok]), f"{sp}: step {k} sampled filtered token {tok}"
            if not sp.do_sample:
                assert tok == int(got.argmax()), f"{sp}: greedy step {k} is not the argmax"
    # each request alone (same seed) draws the same tokens as in the mixed batch
    alone = _engine_requests(eng)
    for req, solo in zip(reqs, alone, strict=True):
        run_requests(accel_model, [solo])
        assert solo.output_token_ids == req.output_token_ids, f"{req.sampling}: batch-dependent sampling"
    assert_engine_idle(accel_model)


def test_sampling_params_batch_via_generate(accel_model):
    """temperature/top_p/min_p/repetition_penalty together through generate(): runs, valid, reproducible."""
    ids, mask = left_pad(PROMPTS)
    kw = dict(temperature=0.9, top_p=0.85, min_p=0.05, repetition_penalty=1.2, top_k=40)
    a = _sample(accel_model, 5, PROMPTS, **kw)
    b = _sample(accel_model, 5, PROMPTS, **kw)
    assert_same_tokens(a, b)
    assert torch.equal(a[:, : ids.shape[1]], ids)
    assert ((a >= 0) & (a < 200)).all()


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_greedy_repetition_penalty_equals_stock(stock_model, accel_model, penalty):
    ids, mask = left_pad(PROMPTS)
    a, b = ab(stock_model, accel_model, input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
              pad_token_id=PAD_ID, repetition_penalty=penalty)
    assert_same_tokens(a, b)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_greedy_repetition_penalty_scores_equal_stock(stock_model, accel_model, penalty):
    ids, mask = left_pad(PROMPTS)
    a, b = ab(stock_model, accel_model, input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
              pad_token_id=PAD_ID, repetition_penalty=penalty, return_dict_in_generate=True, output_scores=True)
    assert_same_tokens(a.sequences, b.sequences)
    for k in range(len(a.scores)):
        torch.testing.assert_close(b.scores[k].float(), a.scores[k].float(), atol=ATOL, rtol=ATOL,
                                   msg=lambda m, k=k: f"scores[{k}]: {m}")


def test_repetition_penalty_does_not_penalize_left_padding(stock_model, accel_model):
    """Stock (transformers >= 5) skips the left padding when penalizing: the pad id keeps its logit."""
    ids, mask = left_pad(PROMPTS)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=PAD_ID,
              return_dict_in_generate=True, output_scores=True, output_logits=True)
    a, b = ab(stock_model, accel_model, **kw, repetition_penalty=2.0)
    padded_rows = [r for r in range(len(PROMPTS)) if (mask[r] == 0).any() and PAD_ID not in PROMPTS[r]]
    assert padded_rows
    for r in padded_rows:
        assert torch.equal(a.scores[0][r, PAD_ID], a.logits[0][r, PAD_ID])  # stock: untouched
        torch.testing.assert_close(b.scores[0][r, PAD_ID], a.scores[0][r, PAD_ID], atol=ATOL, rtol=ATOL,
                                   msg=lambda m, r=r: f"row {r}: pad token score {m}")


def test_repetition_penalty_pad_id_that_the_model_wants(stock_model, accel_model):
    """The pad id is the token a padded row generates first: stock keeps generating it (padding is not
    penalized), so penalizing the padding changes the tokens, not only the scores."""
    rows = PROMPTS[1:]
    ids, mask = left_pad(rows)
    width = ids.shape[1]
    first = int(stock_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                                     pad_token_id=PAD_ID)[0, width])
    assert first not in rows[0]
    ids, mask = left_pad(rows, pad=first)
    assert (mask[0] == 0).any()
    a, b = ab(stock_model, accel_model, input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
              pad_token_id=first, eos_token_id=None, repetition_penalty=5.0)
    assert int(a[0, width]) == first
    assert_same_tokens(a, b)


# -- lengths and stopping ----------------------------------------------------------------------------------------------
def test_min_new_tokens_and_eos_list(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS)
    width, n = ids.shape[1], 14
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=PAD_ID)
    ref = stock_model.generate(**common)
    eos1, row1 = pick_early_eos(ref, width)
    eos2, _ = pick_early_eos(ref[[r for r in range(len(PROMPTS)) if r != row1]], width, exclude={eos1})
    eos = [eos1, eos2]
    a, b = ab(stock_model, accel_model, **common, eos_token_id=eos)
    assert_same_tokens(a, b)
    fin = finish_steps(a, width, set(eos))
    assert min(fin) < n - 1, "no row ended early"
    # min_new_tokens past the first EOS: that EOS is suppressed, the row continues differently
    m = min(fin) + 2
    a, b = ab(stock_model, accel_model, **common, eos_token_id=eos, min_new_tokens=m)
    assert_same_tokens(a, b)
    assert min(finish_steps(a, width, set(eos))) >= m


def test_min_length_counts_prompt(stock_model, accel_model):
    common, width, eos = early_eos_call(stock_model, 12)
    a, b = ab(stock_model, accel_model, **common, eos_token_id=eos, min_length=width + 6)
    assert_same_tokens(a, b)


def test_min_new_tokens_wins_over_min_length(stock_model, accel_model):
    """Stock replaces min_length by min_new_tokens + prompt length whenever min_new_tokens is set."""
    common, width, eos = early_eos_call(stock_model, 12)
    a, b = ab(stock_model, accel_model, **common, eos_token_id=eos, min_new_tokens=1, min_length=width + 9)
    assert_same_tokens(a, b)
    assert min(finish_steps(a, width, {eos})) < 9  # min_length alone would have held the EOS back


def test_forced_eos_token_with_max_new_tokens(stock_model, accel_model):
    """ForcedEOS reads the resolved max_length (prompt + max_new_tokens) from the config."""
    ids, mask = left_pad(PROMPTS)
    a, b = ab(stock_model, accel_model, input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
              pad_token_id=PAD_ID, forced_eos_token_id=139)
    assert_same_tokens(a, b)
    assert (a[:, -1] == 139).all()


def test_eos_without_pad_token_pads_with_first_eos(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS)
    width = ids.shape[1]
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    eos, _ = pick_early_eos(stock_model.generate(**common, pad_token_id=PAD_ID), width)
    a, b = ab(stock_model, accel_model, **common, eos_token_id=[eos, 199])
    assert_same_tokens(a, b)


def test_max_length_instead_of_max_new_tokens(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS)
    a, b = ab(stock_model, accel_model, input_ids=ids, attention_mask=mask, max_length=ids.shape[1] + 7,
              do_sample=False, pad_token_id=PAD_ID)
    assert a.shape[1] == ids.shape[1] + 7
    assert_same_tokens(a, b)


def test_default_length_equals_stock(stock_model, accel_model):
    """Neither max_new_tokens nor max_length given: stock generates the default 20 *new* tokens."""
    ids = torch.tensor([[5, 6]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = ab(stock_model, accel_model, input_ids=ids, do_sample=False, eos_token_id=None)
    assert_same_tokens(a, b)


def test_num_return_sequences_with_sampling(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS[:2])
    width = ids.shape[1]
    out = _sample(accel_model, 3, PROMPTS[:2], num_return_sequences=3)
    assert out.shape[0] == 6
    assert torch.equal(out[:, :width], ids.repeat_interleave(3, dim=0))
    assert len({tuple(r) for r in out[:3, width:].tolist()}) > 1, "the 3 samples of one prompt are identical"
    assert_same_tokens(out, _sample(accel_model, 3, PROMPTS[:2], num_return_sequences=3))
    # deterministic sampling (top_k=1): every copy is the stock output
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, pad_token_id=PAD_ID, do_sample=True, top_k=1,
              num_return_sequences=2)
    a, b = ab(stock_model, accel_model, **kw)
    assert_same_tokens(a, b)


def test_stop_strings(stock_model, accel_model, tokenizer):
    ids, mask = left_pad(PROMPTS)
    width, n = ids.shape[1], 12
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=PAD_ID)
    ref = stock_model.generate(**common)
    # two consecutive generated characters of row 0 form the stop string
    stop = tokenizer.decode(ref[0, width + 3 : width + 5])
    assert len(stop) == 2
    a, b = ab(stock_model, accel_model, **common, stop_strings=[stop], tokenizer=tokenizer)
    assert_same_tokens(a, b)
    assert a.shape[1] < ref.shape[1] or (a[0, width + 5:] == PAD_ID).all(), "the stop string did not stop row 0"
    assert not torch.equal(a[0], ref[0])


def test_stop_strings_without_eos_in_a_batch_equal_stock(stock_model, accel_model, tokenizer):
    """With no EOS configured, stock keeps generating a row that a stop string ended (unpadded) until every row has
    stopped; that call takes the stock path with a warning, so the tokens are stock's exactly."""
    ids, mask = left_pad(PROMPTS)
    width, n = ids.shape[1], 12
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=PAD_ID,
                  eos_token_id=None)
    ref = stock_model.generate(**common)
    stop = tokenizer.decode(ref[0, width + 3 : width + 5])
    want = stock_model.generate(**common, stop_strings=[stop], tokenizer=tokenizer)
    with pytest.warns(UserWarning, match="no EOS token"):
        got = accel_model.generate(**common, stop_strings=[stop], tokenizer=tokenizer)
    assert_same_tokens(want, got)
    one = dict(common, input_ids=ids[:1], attention_mask=mask[:1])  # one row: nothing to keep generating for
    assert_same_tokens(*ab(stock_model, accel_model, **one, stop_strings=[stop], tokenizer=tokenizer))


class BanTokens(LogitsProcessor):
    def __init__(self, banned):
        self.banned = list(banned)

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.banned] = float("-inf")
        return scores


class NoImmediateRepeat(LogitsProcessor):
    """Row-dependent: bans each row's last token."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[torch.arange(scores.shape[0]), input_ids[:, -1]] = float("-inf")
        return scores


class StopOnToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_logits_processor_equals_stock(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS)
    width = ids.shape[1]
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD_ID)
    ref = stock_model.generate(**common)
    banned = sorted({int(ref[0, width + 1]), int(ref[1, width])})
    a = stock_model.generate(**common, logits_processor=LogitsProcessorList([BanTokens(banned), NoImmediateRepeat()]))
    b = accel_generate(accel_model, **common,
                       logits_processor=LogitsProcessorList([BanTokens(banned), NoImmediateRepeat()]))
    assert_same_tokens(a, b)
    assert not any(t in banned for t in b[:, width:].flatten().tolist())


def test_custom_logits_processor_with_min_new_tokens(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS)
    width = ids.shape[1]
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD_ID)
    eos, _ = pick_early_eos(stock_model.generate(**common), width)
    fin = finish_steps(stock_model.generate(**common, eos_token_id=eos), width, {eos})
    kw = dict(common, eos_token_id=eos, min_new_tokens=min(fin) + 2)
    a = stock_model.generate(**kw, logits_processor=LogitsProcessorList([BanTokens([199])]))
    b = accel_generate(accel_model, **kw, logits_processor=LogitsProcessorList([BanTokens([199])]))
    assert_same_tokens(a, b)


def test_custom_logits_processor_with_repetition_penalty(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD_ID,
              repetition_penalty=1.4)
    a = stock_model.generate(**kw, logits_processor=LogitsProcessorList([BanTokens([199])]))
    b = accel_generate(accel_model, **kw, logits_processor=LogitsProcessorList([BanTokens([199])]))
    assert_same_tokens(a, b)


def test_no_repeat_ngram_equals_stock(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS)
    a, b = ab(stock_model, accel_model, input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
              pad_token_id=PAD_ID, no_repeat_ngram_size=2)
    assert_same_tokens(a, b)


def test_bad_words_ids_equals_stock(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS)
    width = ids.shape[1]
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD_ID)
    ref = stock_model.generate(**common)
    a, b = ab(stock_model, accel_model, **common, bad_words_ids=[[int(ref[0, width])]])
    assert_same_tokens(a, b)


def test_custom_stopping_criteria_equals_stock(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS)
    width = ids.shape[1]
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD_ID)
    ref = stock_model.generate(**common)
    stop_tok, row = pick_early_eos(ref, width)
    a = stock_model.generate(**common, stopping_criteria=[StopOnToken(stop_tok)])
    b = accel_generate(accel_model, **common, stopping_criteria=[StopOnToken(stop_tok)])
    assert_same_tokens(a, b)
    assert (a[row, width:] == PAD_ID).any(), "the criterion did not stop its row"



# (name, the user's criterion, generate kwargs that make stock build one of the same class itself)
BUILTIN_CRITERIA = [
    ("EosTokenCriteria", lambda tok: EosTokenCriteria(147), dict(max_new_tokens=10, eos_token_id=32)),
    ("MaxLengthCriteria", lambda tok: MaxLengthCriteria(max_length=20), dict(max_new_tokens=4)),
    ("MaxTimeCriteria", lambda tok: MaxTimeCriteria(100.0), dict(max_new_tokens=6, max_time=0.0)),
    ("StopStringCriteria", lambda tok: StopStringCriteria(tok, ["~"]),
     dict(max_new_tokens=10, eos_token_id=EOS_ID, stop_strings=["S"])),
]


@pytest.mark.parametrize("case", BUILTIN_CRITERIA, ids=[c[0] for c in BUILTIN_CRITERIA])
def test_user_criterion_of_a_builtin_class_runs_stock(stock_model, accel_model, tokenizer, case):
    """Stock uses a user criterion of a class it builds itself instead of its own (a MaxLengthCriteria of 20 tokens
    lifts max_new_tokens=4); the engine would enforce both, so such a call runs stock, with a warning."""
    _, criterion, kwargs = case
    accelerate_model(accel_model)  # fresh engine state: nothing warned yet
    ids, mask = left_pad(PROMPTS)
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD_ID, tokenizer=tokenizer, **kwargs)
    expected = stock_model.generate(**kw, stopping_criteria=StoppingCriteriaList([criterion(tokenizer)]))
    before = engine_steps(accel_model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = accel_model.generate(**kw, stopping_criteria=StoppingCriteriaList([criterion(tokenizer)]))
    assert engine_steps(accel_model) == before
    assert [m for m in _hf_accel_warnings(caught) if "stopping criterion" in m], _hf_accel_warnings(caught)
    assert_same_tokens(expected, got)


def test_user_max_time_criterion_without_max_time_runs_on_the_engine(stock_model, accel_model):
    """A criterion of a built-in class that stock does not build for this call is one more criterion: the engine."""
    ids, mask = left_pad(PROMPTS)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID)
    a = stock_model.generate(**kw, stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(100.0)]))
    b = accel_generate(accel_model, **kw, stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(100.0)]))
    assert_same_tokens(a, b)


def test_stateful_processor_not_shared_between_returned_sequences(stock_model, accel_model):
    """One prompt, two returned sequences, a watermark that keeps per-row history: each sequence has its own
    processors (sharing one list advanced its state twice per step and changed the scores from the sixth step)."""
    from transformers import SynthIDTextWatermarkingConfig

    def call(model, run):
        torch.manual_seed(0)
        return run(model, input_ids=torch.tensor([PROMPTS[0]]), max_new_tokens=8, do_sample=True, top_k=1,
                   num_return_sequences=2, return_dict_in_generate=True, output_scores=True,
                   watermarking_config=SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123, 340, 443, 597, 160,
                                                                           57, 29], ngram_len=3))

    a = call(stock_model, lambda m, **kw: m.generate(**kw))
    b = call(accel_model, accel_generate)
    assert_same_tokens(a.sequences, b.sequences)
    assert len(a.scores) == len(b.scores)
    for step, (x, y) in enumerate(zip(a.scores, b.scores, strict=True)):
        assert torch.equal(torch.isinf(x), torch.isinf(y)), f"step {step}: masked tokens differ from stock"
        finite = torch.isfinite(x)
        torch.testing.assert_close(y[finite], x[finite], atol=ATOL, rtol=0)


# -- generate_batch --------------------------------------------------------------------------------------------------
def test_generate_batch_equals_stock_per_prompt(stock_model, accel_model):
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    before = engine_steps(accel_model)
    out = accel_model.generate_batch(PROMPTS, generation_config=gc)
    assert engine_steps(accel_model) > before
    assert_engine_idle(accel_model)
    assert isinstance(out, dict)
    assert list(out) == [f"req_{i}" for i in range(len(PROMPTS))]
    for i, prompt in enumerate(PROMPTS):
        res = out[f"req_{i}"]
        assert isinstance(res, GenerationOutput)
        assert res.request_id == f"req_{i}"
        assert res.prompt_ids == prompt
        assert res.is_finished() and res.error is None
        ref = stock_model.generate(torch.tensor([prompt]), generation_config=gc)
        assert res.generated_tokens == ref[0, len(prompt):].tolist(), f"req_{i}"
    assert accel_model.generate_batch([]) == {}


def test_generate_batch_max_new_tokens_kwarg(stock_model, accel_model):
    out = accel_model.generate_batch(PROMPTS[:2], generation_config=GenerationConfig(do_sample=False,
                                                                                     eos_token_id=None),
                                     max_new_tokens=5)
    for i, prompt in enumerate(PROMPTS[:2]):
        ref = stock_model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, eos_token_id=None)
        assert out[f"req_{i}"].generated_tokens == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("option", [dict(suppress_tokens=list(range(3, 120))),
                                    dict(bad_words_ids=[[t] for t in range(3, 120)]),
                                    dict(no_repeat_ngram_size=1), dict(forced_eos_token_id=EOS_ID),
                                    dict(min_new_tokens=6, suppress_tokens=[7])],
                         ids=["suppress", "bad_words", "no_repeat_ngram", "forced_eos", "min_new_tokens"])
def test_generate_batch_applies_the_configs_other_processors(stock_model, accel_model, option):
    """The config's processors beyond sampling (suppress_tokens, bad_words_ids, no_repeat_ngram_size) apply per
    prompt as generate() applies them; they were silently dropped (a hostile test, 2026-12-01)."""
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID, **option)
    out = accel_model.generate_batch(PROMPTS, generation_config=gc)
    assert_engine_idle(accel_model)
    for i, prompt in enumerate(PROMPTS):
        ref = stock_model.generate(torch.tensor([prompt]), generation_config=gc)
        assert out[f"req_{i}"].generated_tokens == ref[0, len(prompt):].tolist(), f"req_{i}"
    assert getattr(gc, "_eos_token_tensor", None) is None  # the caller's config is left as it was given


# -- stock path for unsupported modes -----------------------------------------------------------------------------
def _hf_accel_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "hf_accel" in str(w.message)]


def test_beam_search_takes_stock_path_with_one_warning(stock_model, accel_model):
    accelerate_model(accel_model)  # fresh engine state: nothing warned yet
    ids, mask = left_pad(PROMPTS[:2])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID,
              num_beams=2)
    expected = stock_model.generate(**kw)
    before = engine_steps(accel_model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = accel_model.generate(**kw)
    assert len(_hf_accel_warnings(caught)) == 1, _hf_accel_warnings(caught)
    assert engine_steps(accel_model) == before
    assert_same_tokens(expected, got)
    # the stock path ran with the original attention, and the engine still serves the next call
    assert accel_model.config._attn_implementation == ATTN_IMPLEMENTATION_NAME
    a, b = ab(stock_model, accel_model, input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
              pad_token_id=PAD_ID)
    assert_same_tokens(a, b)


def _right_padded_cases():
    """(name, generate kwargs) whose attention mask has a 0 after a 1 in some row."""
    ids, mask = left_pad(PROMPTS)
    right_ids = torch.full_like(ids, PAD_ID)
    right_mask = torch.zeros_like(mask)
    for r, row in enumerate(PROMPTS):  # the same prompts, padded on the right
        right_ids[r, : len(row)] = torch.tensor(row)
        right_mask[r, : len(row)] = 1
    gap_mask = mask.clone()
    gap_mask[0, -3] = 0  # a masked token inside row 0's prompt
    pad_last = ids.clone()
    pad_last[0, -1] = PAD_ID  # the pad id as row 0's last token, no mask given: stock infers the mask from it
    return [("right padding", dict(input_ids=right_ids, attention_mask=right_mask)),
            ("masked token inside a prompt", dict(input_ids=ids, attention_mask=gap_mask)),
            ("inferred mask, pad id last", dict(input_ids=pad_last)),
            ("right padding, batch of one", dict(input_ids=right_ids[1:2, :-1], attention_mask=right_mask[1:2, :-1]))]


@pytest.mark.parametrize("case", range(len(_right_padded_cases())), ids=[c[0] for c in _right_padded_cases()])
def test_right_padding_takes_stock_path_with_one_warning(stock_model, accel_model, case):
    """The engine would continue each row from its last real token; stock continues from the row's last position
    (a pad), so such calls run stock, with a warning, and return exactly stock's tokens."""
    accelerate_model(accel_model)  # fresh engine state: nothing warned yet
    kw = dict(_right_padded_cases()[case][1], max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID)
    expected = stock_model.generate(**kw)
    before = engine_steps(accel_model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = accel_model.generate(**kw)
    assert [m for m in _hf_accel_warnings(caught) if "padding" in m], _hf_accel_warnings(caught)
    assert engine_steps(accel_model) == before
    assert_same_tokens(expected, got)
    # left padding of the same prompts still runs on the engine
    ids, mask = left_pad(PROMPTS)
    a, b = ab(stock_model, accel_model, input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
              pad_token_id=PAD_ID)
    assert_same_tokens(a, b)


def test_numpy_eos_token_id_equals_stock(stock_model, accel_model):
    common, width, eos = early_eos_call(stock_model, 10)
    for given in (np.int64(eos), np.array([eos, 199]), [np.int32(eos)], torch.tensor(eos)):
        a, b = ab(stock_model, accel_model, **common, eos_token_id=given)
        assert_same_tokens(a, b)
        assert min(finish_steps(a, width, {eos})) < 9, "no row ended early"


def test_output_attentions_takes_stock_path_with_one_warning(stock_model, accel_model):
    accelerate_model(accel_model)
    ids, mask = left_pad(PROMPTS[:2])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD_ID,
              output_attentions=True, return_dict_in_generate=True)
    expected = stock_model.generate(**kw)
    before = engine_steps(accel_model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = accel_model.generate(**kw)
    assert len(_hf_accel_warnings(caught)) == 1, _hf_accel_warnings(caught)
    assert engine_steps(accel_model) == before
    assert_same_tokens(expected.sequences, got.sequences)
    assert len(got.attentions) == len(expected.attentions)
    for step_a, step_b in zip(expected.attentions, got.attentions, strict=True):
        for la, lb in zip(step_a, step_b, strict=True):
            if la is None:
                assert lb is None
            else:
                torch.testing.assert_close(lb, la)


# -- engine configuration does not change results -----------------------------------------------------------------
def test_preemption_and_chunked_prefill_keep_outputs(stock_model, accel_model):
    """A KV pool too small for the batch (preemption) and a tiny token budget (chunked prefill): same tokens."""
    small = accelerate_model(fresh_copy(stock_model), num_kv_blocks=6, max_num_batched_tokens=5, max_num_seqs=3,
                             block_size=16)
    rows = PROMPTS + [[9, 8, 7, 6, 5, 4, 3, 2]]
    ids, mask = left_pad(rows)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD_ID,
              eos_token_id=None)
    expected = stock_model.generate(**kw)
    got = accel_generate(small, **kw)
    assert_same_tokens(expected, got)
    assert engine_of(small).stats.preemptions > 0, "the small pool never preempted: the test lost its point"
    # seeded sampling draws the same tokens whatever the scheduling
    assert_same_tokens(_sample(accel_model, 99, rows), _sample(small, 99, rows))


def test_prefix_caching_off_equals_stock(stock_model):
    m = accelerate_model(fresh_copy(stock_model), enable_prefix_caching=False)
    rows = [PROMPTS[0] * 3, PROMPTS[0] * 3 + [4]]  # a shared 27-token prefix
    ids, mask = left_pad(rows)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID)
    expected = stock_model.generate(**kw)
    assert_same_tokens(expected, accel_generate(m, **kw))
    assert_same_tokens(expected, accel_generate(m, **kw))


def test_prefix_cache_hit_equals_stock(stock_model, accel_model):
    """The second call finds the first call's full prompt blocks in the prefix cache."""
    prefix = [(7 * i) % 190 + 3 for i in range(40)]
    rows = [prefix + [11, 12], prefix + [13]]
    ids, mask = left_pad(rows)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID)
    expected = stock_model.generate(**kw)
    assert_same_tokens(expected, accel_generate(accel_model, **kw))
    assert_same_tokens(expected, accel_generate(accel_model, **kw))


# -- found by A/B hunting against stock ----------------------------------------------------------------------------
def test_streamer_prompt_rows_with_num_return_sequences(stock_model, accel_model):
    ids, mask = left_pad(PROMPTS[:2])
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=True, num_return_sequences=2,
                  pad_token_id=PAD_ID)
    s_stock, s_ours = RecordingStreamer(), RecordingStreamer()
    stock_model.generate(**common, streamer=s_stock)
    accel_generate(accel_model, **common, streamer=s_ours)
    assert s_ours.puts[0].shape == s_stock.puts[0].shape == (4, ids.shape[1])
    assert torch.equal(s_ours.puts[0], s_stock.puts[0])


def test_generate_batch_names_forked_requests_like_stock(stock_model, accel_model):
    gc = GenerationConfig(max_new_tokens=4, do_sample=True, num_return_sequences=2, eos_token_id=EOS_ID,
                          pad_token_id=PAD_ID)
    prompts = [list(p) for p in PROMPTS]
    stock = stock_model.generate_batch(prompts, generation_config=gc, continuous_batching_config=small_stock_cb())
    ours = accel_model.generate_batch(prompts, generation_config=gc, continuous_batching_config=small_stock_cb())
    assert set(ours) == set(stock)
    for key, out in ours.items():
        assert out.prompt_ids == stock[key].prompt_ids  # every name maps to the same input as in stock
    assert_engine_idle(accel_model)


def test_negative_num_return_sequences_returns_one_like_stock(stock_model, accel_model):
    ids = torch.tensor([PROMPTS[0]])
    a, b = ab(stock_model, accel_model, input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD_ID,
              num_return_sequences=-1)
    assert_same_tokens(a, b)


@pytest.mark.parametrize("kwargs", [dict(dola_layers="high"), dict(force_words_ids=[[9]])])
def test_other_decoding_modes_take_the_stock_path(stock_model, accel_model, kwargs):
    """DoLa and constrained generation are not greedy search: never silently run them as greedy."""
    ids = torch.tensor([PROMPTS[0]])
    common = dict(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD_ID, **kwargs)
    try:
        want = stock_model.generate(**common)
    except Exception as exc:  # transformers may require remote code for these now: ours must raise the same
        with pytest.raises(type(exc)), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            accel_model.generate(**common)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = accel_model.generate(**common)
        assert_same_tokens(want, got)
    assert accel_model.config._attn_implementation == ATTN_IMPLEMENTATION_NAME


def test_stock_path_inside_stock_path(stock_model, accel_model):
    """Assisted decoding with the model as its own assistant: the inner stock call must not switch attention back."""
    ids = torch.tensor([PROMPTS[0]])
    common = dict(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID)
    want = stock_model.generate(**common)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = accel_model.generate(**common, assistant_model=accel_model)
    assert_same_tokens(want, got)
    assert accel_model.config._attn_implementation == ATTN_IMPLEMENTATION_NAME


# -- distributions that are not one, processors that change the shape ------------------------------------------------
class _Flood(LogitsProcessor):
    """Sets every score of a step to `value` (NaN, or -inf: nothing left to sample from)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self, input_ids, scores):
        return torch.full_like(scores, self.value)


@pytest.mark.parametrize("value", [float("nan"), float("-inf")], ids=["nan", "all-neg-inf"])
def test_sampling_from_no_distribution_raises_as_stock_does(stock_model, accel_model, value):
    """Stock's torch.multinomial raises on NaN / all -inf probabilities; the exponential race would quietly draw
    token 0 (a hostile test found it, 2026-12-01). The engine stays usable afterwards."""
    ids, mask = left_pad(PROMPTS)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=True,
              logits_processor=LogitsProcessorList([_Flood(value)]))
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        stock_model.generate(**kw)
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        accel_model.generate(**kw)
    assert_engine_idle(accel_model)
    greedy = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert_same_tokens(*ab(stock_model, accel_model, **greedy))


class _BatchState(LogitsProcessor):
    """Keeps a `[B, V]` state and adds it: called per row under hf_accel, it returns a `[B, V]` result."""

    def __init__(self, rows: int, vocab: int) -> None:
        self.bias = torch.zeros(rows, vocab)

    def __call__(self, input_ids, scores):
        return scores + self.bias.to(scores.device)


def test_processor_returning_another_shape_is_an_error_not_row_zero(accel_model):
    """Processors run once per row ([1, V] scores). One that returns [B, V] (batch state) used to be cut to its row 0
    for every row: now the call fails naming the shapes."""
    ids, mask = left_pad(PROMPTS)
    proc = _BatchState(ids.shape[0], accel_model.config.vocab_size)
    with pytest.raises(ValueError, match=r"returned scores of shape \(3, "):
        accel_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                             logits_processor=LogitsProcessorList([proc]))
    assert_engine_idle(accel_model)



def test_a_request_that_makes_nan_kv_does_not_reach_the_next_users_of_its_blocks():
    """A NaN in one request's KV (a NaN embedding row here; fp16 overflow in practice) stays that request's: the
    blocks it leaves are reused by later calls, whose masked slots must not turn 0 * NaN into NaN (the torch
    backend multiplied the whole block by the attention weights; found by a review, 2026-12-01)."""
    stock = make_llama(0)
    with torch.no_grad():
        stock.model.embed_tokens.weight[199] = float("nan")
    accel = accelerate_model(fresh_copy(stock))
    try:
        ids, mask = left_pad(PROMPTS)
        greedy = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
        ref = stock.generate(**greedy)
        bad = torch.tensor([[5, 6, 199, 7]])
        accel.generate(bad, attention_mask=torch.ones_like(bad), max_new_tokens=10, do_sample=False)
        k, v = engine_of(accel).kv_caches[0]
        assert v.isnan().any()  # the NaN request did leave NaN KV behind in its (now free) blocks
        for _ in range(2):
            assert torch.equal(accel.generate(**greedy), ref)
    finally:
        restore(accel)


def test_generate_under_the_callers_autocast_runs_stock(stock_model, accel_model):
    """Stock generate() runs the forward on the caller's thread, so `torch.autocast` around it recasts the matmuls
    (a float32 model computes in bf16). The engine steps on its own thread, where the caller's (thread-local)
    autocast does not reach: it computed in float32 and returned other logits and, at near-ties, other tokens. Such
    a call now takes the stock path, with a warning."""
    ids = torch.randint(3, 120, (2, 40), generator=torch.Generator().manual_seed(5))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
              output_logits=True, return_dict_in_generate=True, pad_token_id=PAD_ID)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = stock_model.generate(**kw)
    plain = stock_model.generate(**kw)
    assert not torch.equal(want.logits[0], plain.logits[0])  # autocast changes stock's numbers here
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(UserWarning, match="autocast"):
        got = accel_model.generate(**kw)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits, strict=True))
    again = accel_model.generate(**kw)  # without autocast: the engine, equal to stock without it
    assert torch.equal(again.sequences, plain.sequences)
