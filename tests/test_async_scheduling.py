"""Asynchronous scheduling, A/B on CPU: steps launched before the host reads the previous step's tokens must give
exactly the tokens of stock transformers and of the synchronous engine, through early EOS, preemption, chunked
prefill with a budget smaller than the batch, max_new_tokens=1, seeded sampling and stop strings.

On CPU the "device" is the host, so these tests check the bookkeeping (pending tokens fed from the previous step's
sampled tensor, a finished request computed once more and its token dropped, deferred prefix-cache commits); the GPU
A/B suite checks the same paths with real streams.
"""

from __future__ import annotations

import pytest
import torch
from conftest import EOS_ID, PAD_ID, PROMPTS, assert_engine_idle, engine_of, fresh_copy, left_pad

from hf_accel import accelerate_model
from hf_accel.config import AccelConfig

pytestmark = pytest.mark.usefixtures("single_thread")


def _engine_run(model, **kw):
    eng = engine_of(model)
    steps, async_steps = eng.stats.steps, eng.stats.async_steps
    out = model.generate(**kw)
    assert eng.stats.steps > steps, "the call did not run on the hf_accel engine"
    assert_engine_idle(model)
    return out, eng.stats.async_steps - async_steps


@pytest.fixture(scope="module")
def async_pair(stock_model):
    """(asynchronous, synchronous) accelerated copies with a small KV cache and token budget."""
    a = accelerate_model(fresh_copy(stock_model), num_kv_blocks=12, max_num_batched_tokens=16)
    s = accelerate_model(fresh_copy(stock_model), num_kv_blocks=12, max_num_batched_tokens=16,
                         config=AccelConfig(async_scheduling=False))
    return a, s


ROWS = [PROMPTS[0], PROMPTS[1], PROMPTS[2], [7, 8, 9, 10, 11]]


@pytest.mark.parametrize("max_new", [1, 2, 9, 20])
def test_greedy_equals_stock_and_sync(stock_model, async_pair, max_new):
    ids, mask = left_pad(ROWS)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=PAD_ID,
              eos_token_id=None)
    want = stock_model.generate(**kw)
    got_async, n_async = _engine_run(async_pair[0], **kw)
    got_sync, n_sync = _engine_run(async_pair[1], **kw)
    assert torch.equal(got_async, want), f"async\n{got_async}\nstock\n{want}"
    assert torch.equal(got_sync, want)
    assert n_sync == 0
    if max_new > 1:
        assert n_async > 0, "no step ran ahead of the host"


def test_early_eos_drops_the_extra_token(stock_model, async_pair):
    """Rows that end on EOS at different steps: the step computed after a row's EOS must not leak a token."""
    ids, mask = left_pad(ROWS)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=PAD_ID)
    free = stock_model.generate(**kw, eos_token_id=None)
    gen = free[:, ids.shape[1]:]
    eos = int(gen[0, 3])  # ends row 0 at step 3 (or earlier), other rows wherever they meet it
    want = stock_model.generate(**kw, eos_token_id=eos)
    assert want.shape[1] < free.shape[1] or (gen == eos).sum() > 0
    got, n_async = _engine_run(async_pair[0], **kw, eos_token_id=eos)
    assert torch.equal(got, want), f"async\n{got}\nstock\n{want}"
    assert n_async > 0


def test_preemption_under_async(stock_model):
    """A cache that holds about one sequence: constant preemption while tokens are still on the device."""
    m = accelerate_model(fresh_copy(stock_model), num_kv_blocks=4, max_num_batched_tokens=8)
    ids, mask = left_pad(ROWS)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD_ID,
              eos_token_id=None)
    want = stock_model.generate(**kw)
    got, n_async = _engine_run(m, **kw)
    assert torch.equal(got, want)
    assert engine_of(m).stats.preemptions > 0, "the workload did not preempt"
    assert n_async > 0


def test_seeded_sampling_same_tokens_async_and_sync(async_pair):
    ids, mask = left_pad(ROWS)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=True, top_k=20, temperature=0.8,
              pad_token_id=PAD_ID, eos_token_id=None)
    torch.manual_seed(5)
    a, n_async = _engine_run(async_pair[0], **kw)
    torch.manual_seed(5)
    s, _ = _engine_run(async_pair[1], **kw)
    assert torch.equal(a, s)
    assert n_async > 0


def test_host_dependent_sampling_runs_synchronously(stock_model, async_pair):
    """Repetition penalty and output_scores need every token on the host: those calls do not run ahead."""
    ids, mask = left_pad(ROWS[:2])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD_ID,
              eos_token_id=None, repetition_penalty=1.3)
    want = stock_model.generate(**kw)
    got, n_async = _engine_run(async_pair[0], **kw)
    assert torch.equal(got, want)
    assert n_async == 0
    out, n_async = _engine_run(async_pair[0], **{**kw, "repetition_penalty": 1.0}, output_scores=True,
                               return_dict_in_generate=True)
    assert n_async == 0 and len(out.scores) == 8


def test_stop_strings_under_async(stock_model, async_pair, tokenizer):
    ids, mask = left_pad(ROWS[:2])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=PAD_ID,
              eos_token_id=EOS_ID)
    free = stock_model.generate(**kw)
    text = tokenizer.decode(free[0, ids.shape[1]:].tolist())
    stop = text[4:6]
    want = stock_model.generate(**kw, stop_strings=[stop], tokenizer=tokenizer)
    got, n_async = _engine_run(async_pair[0], **kw, stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(got, want), f"async\n{got}\nstock\n{want}"
    assert n_async > 0


@pytest.mark.parametrize("outer_penalty", [1.0, 1.3])
def test_generate_called_from_inside_a_running_call(stock_model, async_pair, outer_penalty):
    """A streamer that calls generate() on the same model mid-call: the running call's step in flight is read back,
    both calls finish with stock's tokens (the outer one with or without a host-side penalty), the engine is idle."""
    ids, mask = left_pad(ROWS[:2])
    outer_kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=PAD_ID,
                    eos_token_id=None, repetition_penalty=outer_penalty)
    inner_kw = dict(input_ids=torch.tensor([[9, 9, 9]]), max_new_tokens=3, do_sample=False, pad_token_id=PAD_ID,
                    eos_token_id=None)
    want_outer, want_inner = stock_model.generate(**outer_kw), stock_model.generate(**inner_kw)
    model = async_pair[0]
    inner = []

    class NestingStreamer:
        puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 3:
                inner.append(model.generate(**inner_kw))

        def end(self):
            pass

    got = model.generate(**outer_kw, streamer=NestingStreamer())
    assert torch.equal(got, want_outer)
    assert inner and torch.equal(inner[0], want_inner)
    assert_engine_idle(model)
