"""Many callers, one engine: concurrent generate()/generate_batch()/pipeline calls and the async entry points share
one running batch, each getting exactly what it would get alone, and a failing call ends alone.

Every test checks that calls really overlapped (`EngineLoop.shared_steps`), so a regression to one-call-at-a-time
would fail them, and that the engine is idle with every KV block free afterwards.
"""

from __future__ import annotations

import _thread
import asyncio
import copy
import signal
import threading
import time
import warnings

import pytest
import torch
from conftest import EOS_ID, PAD_ID, PROMPTS, assert_engine_idle, engine_of, left_pad, make_llama
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList, pipeline

from hf_accel import GenerationDelta, accelerate_model, restore

GREEDY = dict(do_sample=False, pad_token_id=PAD_ID)


def rows_for(k: int) -> list[list[int]]:
    """A batch of 1-3 rows of different lengths, different per k."""
    n = 1 + k % 3
    return [[(7 * k + 13 * j + i) % 190 + 5 for i in range(3 + (k + j) % 9)] for j in range(n)]


class SlowStreamer:
    """Records every put() and sleeps a little, so calls stay alive long enough to overlap."""

    def __init__(self, delay: float = 0.002) -> None:
        self.puts: list[torch.Tensor] = []
        self.ended = False
        self.delay = delay

    def put(self, value) -> None:
        self.puts.append(value.clone())
        time.sleep(self.delay)

    def end(self) -> None:
        self.ended = True


class Barrier:
    """Start threads together; re-raise the first error of any of them."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n)
        self.errors: list[BaseException] = []

    def run(self, targets) -> None:
        def wrap(fn):
            def go():
                try:
                    self.barrier.wait(30)
                    fn()
                except BaseException as exc:  # noqa: BLE001 - reported below
                    self.errors.append(exc)
            return go

        threads = [threading.Thread(target=wrap(fn)) for fn in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not any(t.is_alive() for t in threads), "a thread hung"
        if self.errors:
            raise self.errors[0]


@pytest.fixture(scope="module")
def pair():
    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock))
    return stock, accel


def test_many_threads_of_mixed_calls_each_equal_stock(pair):
    """24 threads at once: greedy batches of 1-3 left-padded rows with different lengths, EOS on and off, a
    repetition penalty (stepped synchronously beside asynchronous calls), scores, streamers, custom processors and
    stopping criteria, generate_batch: every call equals stock's own answer, every streamer saw exactly its rows."""
    stock, accel = pair
    loop = accel._hf_accel_state.loop
    shared_before = loop.shared_steps

    class BanToken(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, 77] = -float("inf")
            return scores

    class StopAfter(StoppingCriteria):
        def __init__(self, length: int) -> None:
            self.length = length

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)

    def case(k: int):
        ids, mask = left_pad(rows_for(k))
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6 + k % 11, **GREEDY,
                  eos_token_id=EOS_ID if k % 2 else None)
        mode = k % 6
        if mode == 1:
            kw["repetition_penalty"] = 1.3
        elif mode == 2:
            kw.update(output_scores=True, return_dict_in_generate=True)
        elif mode == 3:
            kw["logits_processor"] = LogitsProcessorList([BanToken()])
        elif mode == 4:
            kw["stopping_criteria"] = StoppingCriteriaList([StopAfter(ids.shape[1] + 4)])
            kw["eos_token_id"] = EOS_ID
        return mode, kw

    def check(k: int) -> None:
        mode, kw = case(k)
        want = stock.generate(**kw)
        streamer = SlowStreamer() if mode in (0, 5) else None
        got = accel.generate(**kw, streamer=streamer)
        if mode == 2:
            assert torch.equal(got.sequences, want.sequences), k
            assert len(got.scores) == len(want.scores)
            for a, b in zip(got.scores, want.scores):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        else:
            assert torch.equal(got, want), f"call {k}:\n{got}\nstock:\n{want}"
        if streamer is not None:  # the prompt, then one [B] tensor per step of *this* call
            assert streamer.ended
            assert torch.equal(streamer.puts[0], kw["input_ids"])
            steps = torch.stack(streamer.puts[1:], dim=1)
            assert torch.equal(steps, want[:, kw["input_ids"].shape[1]:]), f"streamer of call {k}"

    def batch_call(k: int) -> None:
        prompts = rows_for(k)
        gc = copy.deepcopy(stock.generation_config)
        gc.update(max_new_tokens=5 + k % 4, do_sample=False, eos_token_id=None, pad_token_id=PAD_ID)
        got = accel.generate_batch(prompts, generation_config=gc)
        for i, p in enumerate(prompts):
            want = stock.generate(input_ids=torch.tensor([p]), max_new_tokens=gc.max_new_tokens, **GREEDY,
                                  eos_token_id=None)
            assert got[f"req_{i}"].generated_tokens == want[0, len(p):].tolist(), f"generate_batch {k} row {i}"

    def worker(t: int):
        def run():
            for r in range(3):
                k = 3 * t + r
                (batch_call if k % 7 == 6 else check)(k)
        return run

    Barrier(24).run([worker(t) for t in range(24)])
    assert loop.shared_steps > shared_before, "no step ran with two calls in it: the calls did not share a batch"
    assert loop.peak_calls >= 4
    assert_engine_idle(accel)


def test_two_models_in_many_threads_are_independent():
    """Two accelerated models with different weights, six threads each at once: each model's calls equal its own
    stock model's (the forward context belongs to each model's engine thread)."""
    stocks = [make_llama(0), make_llama(5)]
    accels = [accelerate_model(copy.deepcopy(m)) for m in stocks]
    rows = [PROMPTS[i % 3][: 3 + i % 6] for i in range(6)]
    want = {(m, i): stocks[m].generate(input_ids=torch.tensor([r]), max_new_tokens=8, **GREEDY)
            for m in range(2) for i, r in enumerate(rows)}

    def worker(m: int, i: int):
        def run():
            for _ in range(3):
                got = accels[m].generate(input_ids=torch.tensor([rows[i]]), max_new_tokens=8, **GREEDY)
                assert torch.equal(got, want[(m, i)]), (m, i)
        return run

    Barrier(12).run([worker(m, i) for m in range(2) for i in range(6)])
    for a in accels:
        assert a._hf_accel_state.loop.shared_steps > 0
        assert_engine_idle(a)


class Boom(Exception):
    pass


@pytest.mark.parametrize("where", ["streamer", "logits_processor", "stopping_criteria"])
@pytest.mark.parametrize("exc_type", [Boom, KeyboardInterrupt])
def test_a_failing_callback_ends_its_call_alone(pair, where, exc_type):
    """One call's streamer (caller's thread), logits processor or stopping criterion (engine thread) raises midway,
    even a KeyboardInterrupt: that call raises it, its blocks are freed, and the calls running beside it finish with
    stock's tokens."""
    stock, accel = pair
    loop = accel._hf_accel_state.loop
    shared_before = loop.shared_steps

    ticks = [0]

    def tick() -> None:
        time.sleep(0.003)
        ticks[0] += 1
        if ticks[0] == 4:
            raise exc_type("callback failed")

    class FailingStreamer:
        def put(self, value):
            tick()

        def end(self):
            pass

    class FailingProcessor(LogitsProcessor):
        def __call__(self, input_ids, scores):
            tick()
            return scores

    class FailingCriterion(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            tick()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids, mask = left_pad(rows_for(2))
    bad_kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, **GREEDY, eos_token_id=None)
    if where == "streamer":
        bad_kw["streamer"] = FailingStreamer()
    elif where == "logits_processor":
        bad_kw["logits_processor"] = LogitsProcessorList([FailingProcessor()])
    else:  # with an EOS id: the engine serves stopping criteria on a batch (without one, stock does)
        bad_kw["stopping_criteria"] = StoppingCriteriaList([FailingCriterion()])
        bad_kw["eos_token_id"] = EOS_ID
    started = threading.Event()
    raised: list[BaseException] = []

    def bad_call():
        started.set()
        try:
            accel.generate(**bad_kw)
        except BaseException as exc:  # noqa: BLE001 - checked below
            raised.append(exc)

    def good_call(k: int):
        def run():
            assert started.wait(30)
            ids, mask = left_pad(rows_for(k))
            kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, **GREEDY, eos_token_id=None,
                      streamer=SlowStreamer())
            assert torch.equal(accel.generate(**kw), stock.generate(**{**kw, "streamer": None})), k
        return run

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no call may take the stock path
        Barrier(4).run([bad_call] + [good_call(k) for k in (3, 4, 5)])
    assert len(raised) == 1 and isinstance(raised[0], exc_type), raised
    assert loop.shared_steps > shared_before
    assert_engine_idle(accel)
    assert torch.equal(accel.generate(**{**bad_kw, "streamer": None, "logits_processor": None,
                                         "stopping_criteria": None}),
                       stock.generate(**{**bad_kw, "streamer": None, "logits_processor": None,
                                         "stopping_criteria": None}))


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler for the test: a process started with SIGINT ignored (a job a non-interactive
    shell put in the background) keeps it ignored, and `_thread.interrupt_main` then does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_while_waiting_aborts_that_call_alone(pair, python_sigint):
    """A real KeyboardInterrupt (interrupt_main) reaches the main thread while it waits for its call: the call is
    aborted and its blocks freed before the exception comes out; a call of another thread finishes correctly."""
    stock, accel = pair
    ids, mask = left_pad(rows_for(7))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, **GREEDY, eos_token_id=None)
    other: dict = {}

    def other_call():
        other["out"] = accel.generate(**kw, streamer=SlowStreamer(0.004))

    class Interrupting:
        puts = 0

        def put(self, value):
            self.puts += 1
            time.sleep(0.004)
            if self.puts == 5:
                threading.Thread(target=_thread.interrupt_main).start()

        def end(self):
            pass

    t = threading.Thread(target=other_call)
    t.start()
    with pytest.raises(KeyboardInterrupt):
        accel.generate(**kw, streamer=Interrupting())
        time.sleep(5)  # not reached when the interrupt lands inside generate()
    t.join(60)
    assert torch.equal(other["out"], stock.generate(**kw))
    assert_engine_idle(accel)


def test_generate_from_an_engine_thread_callback_runs_stock(pair):
    """A logits processor (engine thread) that calls generate() on the same model: that inner call runs stock
    transformers with a warning instead of deadlocking the engine; both calls are right."""
    stock, accel = pair
    inner_kw = dict(input_ids=torch.tensor([[9, 9, 9]]), max_new_tokens=3, **GREEDY)
    inner: list[torch.Tensor] = []

    class Nesting(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not inner:
                inner.append(accel.generate(**inner_kw))
            return scores

    kw = dict(input_ids=torch.tensor([PROMPTS[0]]), max_new_tokens=6, **GREEDY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = accel.generate(**kw, logits_processor=LogitsProcessorList([Nesting()]))
    assert torch.equal(got, stock.generate(**kw))
    assert torch.equal(inner[0], stock.generate(**inner_kw))
    assert any("engine step" in str(w.message) for w in caught)
    assert_engine_idle(accel)


def test_pipelines_in_threads(pair, tokenizer):
    stock, accel = pair
    texts = ["hello there", "abc", "the quick brown fox", "z"]
    pipe_s = pipeline("text-generation", model=stock, tokenizer=tokenizer)
    pipe_a = pipeline("text-generation", model=accel, tokenizer=tokenizer)
    kw = dict(max_new_tokens=7, do_sample=False, pad_token_id=PAD_ID)
    want = {t: pipe_s(t, **kw)[0]["generated_text"] for t in texts}

    def worker(t: str):
        return lambda: [assert_equal(pipe_a(t, **kw)[0]["generated_text"], want[t]) for _ in range(2)]

    Barrier(len(texts)).run([worker(t) for t in texts])
    assert_engine_idle(accel)


def assert_equal(a, b) -> None:
    assert a == b, (a, b)


# -- the async entry points ---------------------------------------------------------------------------------------
def test_agenerate_concurrent_calls_equal_stock(pair):
    stock, accel = pair
    cases = []
    for k in range(10):
        ids, mask = left_pad(rows_for(k))
        cases.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=5 + k, **GREEDY,
                          eos_token_id=EOS_ID if k % 2 else None))
    loop = accel._hf_accel_state.loop
    shared_before = loop.shared_steps

    async def main():
        return await asyncio.gather(*(accel.agenerate(**kw) for kw in cases))

    got = asyncio.run(main())
    for kw, out in zip(cases, got):
        assert torch.equal(out, stock.generate(**kw))
    assert loop.shared_steps > shared_before
    assert_engine_idle(accel)


def test_agenerate_seeded_sampling_is_reproducible_whatever_runs_beside(pair):
    """The same seed gives the same draws alone and amid other calls (counter-based noise: no batch dependence);
    another seed gives other draws."""
    _, accel = pair
    kw = dict(input_ids=torch.tensor([PROMPTS[0]]), max_new_tokens=12, do_sample=True, top_k=0, temperature=1.5,
              num_return_sequences=3, pad_token_id=PAD_ID, eos_token_id=None)

    async def alone(seed):
        return await accel.agenerate(**kw, seed=seed)

    async def crowded(seed):
        others = [accel.agenerate(input_ids=torch.tensor([PROMPTS[k % 3]]), max_new_tokens=10 + k, do_sample=True,
                                  seed=100 + k, pad_token_id=PAD_ID) for k in range(6)]
        outs = await asyncio.gather(accel.agenerate(**kw, seed=seed), *others)
        return outs[0]

    a = asyncio.run(alone(7))
    b = asyncio.run(crowded(7))
    c = asyncio.run(alone(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert len({tuple(r) for r in a.tolist()}) > 1, "the three sequences drew the same tokens"
    assert_engine_idle(accel)


def test_agenerate_stream_deltas_abort_and_cancel(pair):
    stock, accel = pair
    ids, mask = left_pad(rows_for(4))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=9, **GREEDY, eos_token_id=None)
    want = stock.generate(**kw)[:, ids.shape[1]:].tolist()
    bm = engine_of(accel).block_manager

    async def full():
        seqs: dict[int, list[int]] = {}
        reasons = {}
        async for d in accel.agenerate_stream(**kw):
            assert isinstance(d, GenerationDelta)
            seqs.setdefault(d.sequence, []).extend(d.token_ids)
            if d.finish_reason:
                reasons[d.sequence] = d.finish_reason
        return seqs, reasons

    seqs, reasons = asyncio.run(full())
    assert [seqs[i] for i in range(len(want))] == want
    assert set(reasons.values()) == {"length"}

    long_kw = dict(input_ids=torch.tensor([PROMPTS[1]]), max_new_tokens=60, **GREEDY, eos_token_id=None,
                   num_return_sequences=1)

    async def abort_one_then_break():
        stream = accel.agenerate_stream(**{**kw, "max_new_tokens": 60})
        seen: dict[int, list[int]] = {}
        reasons = {}
        async for d in stream:
            seen.setdefault(d.sequence, []).extend(d.token_ids)
            if d.finish_reason:
                reasons[d.sequence] = d.finish_reason
            if len(seen.get(0, [])) >= 3 and 0 not in reasons:
                stream.abort(0)
            if 0 in reasons and len(seen.get(1, [])) >= 8:
                break  # leaving early aborts the rest
        return reasons

    reasons = asyncio.run(abort_one_then_break())
    assert reasons[0] == "abort"
    assert_engine_idle(accel)

    async def abort_one_at_once():  # before the engine loop took the call in: still only that sequence
        stream = accel.agenerate_stream(**{**kw, "max_new_tokens": 20})
        stream.abort(1)
        reasons = {}
        async for d in stream:
            if d.finish_reason:
                reasons[d.sequence] = d.finish_reason
        return reasons

    for _ in range(3):  # the abort lands before or after admission, whichever the loop thread makes of it
        reasons = asyncio.run(abort_one_at_once())
        assert reasons[1] == "abort" and all(r == "length" for i, r in reasons.items() if i != 1), reasons
    assert_engine_idle(accel)
    assert bm.num_free_blocks == bm.num_usable_blocks

    async def cancel_task():
        started = asyncio.Event()

        async def consume():
            async for _ in accel.agenerate_stream(**long_kw):
                started.set()
                await asyncio.sleep(0.05)  # a slow consumer: the stream is still open when the task is cancelled
        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_task())
    assert_engine_idle(accel)
    with pytest.raises(ValueError):
        accel.agenerate_stream(input_ids=torch.tensor([PROMPTS[0]]), max_new_tokens=1000, **GREEDY)


def test_restore_waits_for_async_streams_and_threads(pair):
    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock))
    kw = dict(input_ids=torch.tensor([PROMPTS[0]]), max_new_tokens=25, **GREEDY, eos_token_id=None)
    out: dict = {}

    def threaded():
        out["thread"] = accel.generate(**kw, streamer=SlowStreamer(0.01))

    t = threading.Thread(target=threaded)
    t.start()
    time.sleep(0.05)
    restore(accel)  # waits for the thread's call
    t.join(30)
    assert torch.equal(out["thread"], stock.generate(**kw))
    assert "_hf_accel_state" not in accel.__dict__ and not hasattr(accel, "agenerate")


def test_demo_concurrent_mode_runs_and_matches_stock(capsys):
    from hf_accel.cli import main

    assert main(["demo", "--concurrent", "3", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "all threads at once" in out and "match stock: True" in out


@pytest.mark.parametrize("where", ["logits_processor", "stopping_criteria"])
def test_a_callback_failing_on_the_last_step_still_fails_its_call(pair, where):
    """The callback raises while its row is the call's last one to finish (review finding): the call raises it, it
    does not return the rows cut short or sampled from unprocessed logits."""
    _, accel = pair
    kw = dict(input_ids=torch.tensor([PROMPTS[0]]), max_new_tokens=6, **GREEDY, eos_token_id=None)
    last = kw["input_ids"].shape[1] + kw["max_new_tokens"] - 1

    class LastStepProcessor(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == last:
                raise Boom("processor failed on the last step")
            return scores

    class LastStepCriterion(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.shape[1] >= last:
                raise Boom("criterion failed on the last step")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    extra = ({"logits_processor": LogitsProcessorList([LastStepProcessor()])} if where == "logits_processor"
             else {"stopping_criteria": StoppingCriteriaList([LastStepCriterion()])})
    with pytest.raises(Boom):
        accel.generate(**kw, **extra)
    assert_engine_idle(accel)


def test_restore_on_the_event_loop_with_open_async_calls_raises_instead_of_hanging():
    accel = accelerate_model(make_llama(0))
    kw = dict(input_ids=torch.tensor([PROMPTS[0]]), max_new_tokens=20, **GREEDY, eos_token_id=None)

    async def main():
        task = asyncio.create_task(accel.agenerate(**kw))
        await asyncio.sleep(0)  # the call is admitted
        with pytest.raises(RuntimeError, match="event loop"):
            restore(accel)
        await task
        restore(accel)  # nothing open on this loop any more

    asyncio.run(main())
    assert "_hf_accel_state" not in accel.__dict__


def test_break_out_of_a_stream_aborts_it_while_the_stream_is_still_referenced(pair):
    """`break` leaves `async for` without closing a plain async iterator: the call kept running (and holding KV
    blocks, and blocking restore()) until the stream object itself was collected. The stream now iterates through
    an async generator, which asyncio closes as soon as the loop drops it."""
    _, accel = pair
    long_kw = dict(input_ids=torch.tensor([PROMPTS[1], PROMPTS[1][::-1]]), max_new_tokens=200, **GREEDY,
                   eos_token_id=None)
    loop = accel._hf_accel_state.loop
    bm = engine_of(accel).block_manager

    async def break_and_keep():
        stream = accel.agenerate_stream(**long_kw)
        async for _ in stream:
            break
        for _ in range(500):  # the stream stays referenced all along
            if loop.is_idle():
                break
            await asyncio.sleep(0.01)
        idle = loop.is_idle()
        reasons = [r.finish_reason for r in stream._call.requests]
        del stream
        return idle, reasons

    idle, reasons = asyncio.run(break_and_keep())
    assert idle and reasons == ["abort", "abort"], reasons  # not "length": aborted, not run to the end
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_interpreter_exit_aborts_running_calls_and_lets_engine_threads_leave(pair):
    """The engine threads are daemon threads; one still inside a torch op at interpreter exit aborts the process
    (exit status 134), as after a cancelled agenerate() task whose step was still running. An exit handler now
    aborts what runs and waits for each engine thread to leave."""
    from hf_accel.engine.loop import _stop_loops_at_exit

    _, accel = pair
    loop = accel._hf_accel_state.loop
    long_kw = dict(input_ids=torch.tensor([PROMPTS[1]]), max_new_tokens=200, **GREEDY, eos_token_id=None)

    async def open_stream_then_exit_handler():
        stream = accel.agenerate_stream(**long_kw)
        first = await stream.__anext__()
        assert first.token_ids
        await asyncio.to_thread(_stop_loops_at_exit)  # what atexit runs
        assert loop.is_idle()
        rest = [d async for d in stream]
        return rest

    rest = asyncio.run(open_stream_then_exit_handler())
    assert rest and rest[-1].finish_reason == "abort"


def test_re_accelerate_keeps_the_methods_for_calls_arriving_meanwhile(pair):
    """A re-accelerate with other options used to remove generate/agenerate while the new engine was built: calls
    arriving meanwhile found stock generate() or no agenerate at all (AttributeError). They now wait for it."""
    from hf_accel.api import _accelerated_generate

    stock, _ = pair
    model = accelerate_model(copy.deepcopy(stock))
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            d = model.__dict__
            seen.append("agenerate" in d and getattr(d.get("generate"), "__func__", None) is _accelerated_generate)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for blocks in (64, 96, 128):
            accelerate_model(model, num_kv_blocks=blocks)
    finally:
        stop.set()
        watcher.join()
        restore(model)
    assert seen and all(seen)
    assert "agenerate" not in model.__dict__ and "generate" not in model.__dict__
