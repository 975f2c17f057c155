"""The asyncio side of a call: awaiting an engine call, and streaming its tokens, from an event loop.

The engine thread never touches the event loop's objects: it only schedules a wake-up on the loop
(`call_soon_threadsafe`), at most one pending per call, and the loop's side takes the call's events itself. So a
server with hundreds of streams costs the engine thread one cheap call per stream per step, and a burst of steps
while the loop is busy costs one wake-up, not one per step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from hf_accel.engine.loop import CallEvent, EngineCall, EngineLoop

RECHECK_S = 0.5  # an awaiting caller looks at its call at least this often


@dataclass
class GenerationDelta:
    """New tokens of one sequence since its previous delta. `sequence` is the row of `generate()`'s output
    (`row * num_return_sequences + k`). The last delta of a sequence has `finish_reason`: "stop" (an EOS token or a
    stopping criterion), "length" (`max_new_tokens`) or "abort" (cancelled); its `token_ids` may be empty."""

    sequence: int
    token_ids: list[int]
    finish_reason: str | None = None


class AsyncWaker:
    """Wakes one asyncio waiter from the engine thread: one `call_soon_threadsafe` at a time, however many steps."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self._scheduled = False
        self._lock = threading.Lock()

    def __call__(self) -> None:  # engine thread
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._set)

    def _set(self) -> None:  # event loop
        with self._lock:
            self._scheduled = False
        self.event.set()

    async def wait(self) -> None:
        """Until woken, or a recheck interval passed (a lost wake-up costs that, never a hang)."""
        try:
            await asyncio.wait_for(self.event.wait(), RECHECK_S)
        except asyncio.TimeoutError:
            pass
        self.event.clear()


async def run_async(loop: EngineLoop, call: EngineCall, waker: AsyncWaker,
                    on_events: Callable[[list[CallEvent]], None] | None = None) -> None:
    """Await a submitted call on the event loop, handing `on_events` its events there. Cancellation (or an error from
    `on_events`) aborts the call; its blocks are freed by the engine thread before the next step."""
    try:
        while True:
            await waker.wait()
            finished = call.done.is_set()
            if on_events is not None:
                events = call.take_events()
                if events:
                    on_events(events)
            if finished:
                break
    except BaseException as exc:
        if not call.done.is_set():
            loop.abort(call, error=exc if not isinstance(exc, asyncio.CancelledError) else None)
        raise
    if call.error is not None:
        raise call.error


class GenerationStream:
    """An async iterator of `GenerationDelta`s for one call (see `agenerate_stream`).

    `abort(sequence)` cancels one sequence (None: all); leaving the `async for` early, cancelling the task or
    `aclose()` aborts what is left, and the engine frees the KV blocks before its next step. A stream dropped without
    being closed is aborted when it is garbage collected.
    """

    def __init__(self, loop: EngineLoop, call: EngineCall, waker: AsyncWaker,
                 on_close: Callable[[], None] | None = None) -> None:
        self._loop = loop
        self._call = call
        self._waker = waker
        self._on_close = on_close
        self._finished: set[int] = set()
        self._closed = False
        self._pending: list[GenerationDelta] = []

    @property
    def num_sequences(self) -> int:
        return len(self._call.requests)

    def abort(self, sequence: int | None = None) -> None:
        if self._call.done.is_set():
            return
        req = None if sequence is None else self._call.requests[sequence]
        self._loop.abort(self._call, request=req)

    def __aiter__(self) -> AsyncIterator[GenerationDelta]:
        """The deltas as an async generator. Why not `self`: `async for` never closes a plain async iterator it
        leaves early (a `break`, a `return`), so the call kept running until the stream itself was garbage
        collected; asyncio closes a dropped async generator at once, and closing it aborts what is left."""
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[GenerationDelta]:
        try:
            while True:
                try:
                    delta = await self.__anext__()
                except StopAsyncIteration:
                    return
                yield delta
        finally:  # no await here: this may run as the generator is finalized
            self._abandon()

    async def __anext__(self) -> GenerationDelta:
        while not self._pending:
            if self._closed or len(self._finished) == self.num_sequences:
                self._close()
                raise StopAsyncIteration
            try:
                await self._next_batch()
            except BaseException:
                await self.aclose()
                raise
        return self._pending.pop(0)

    async def _next_batch(self) -> None:
        await self._waker.wait()
        done = self._call.done.is_set()  # before the events: a done call's events are all in
        tokens: dict[int, list[int]] = {}
        reasons: dict[int, str] = {}
        for i, tok, reason in self._call.take_events():
            if tok is not None:
                tokens.setdefault(i, []).append(tok)
            if reason is not None:
                reasons[i] = reason
                tokens.setdefault(i, [])
        self._pending.extend(GenerationDelta(i, toks, reasons.get(i)) for i, toks in tokens.items())
        self._finished.update(reasons)
        if done and self._call.error is not None:
            raise self._call.error
        if done:  # sequences the call ended without a finish event of their own (the call was aborted as a whole)
            for i in range(self.num_sequences):
                if i not in self._finished:
                    self._pending.append(GenerationDelta(i, [], "abort"))
                    self._finished.add(i)

    async def aclose(self) -> None:
        if not self._call.done.is_set():
            self._loop.abort(self._call)
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._on_close is not None:
            self._on_close()

    def __del__(self) -> None:
        """A stream dropped unclosed is aborted and closed from a short-lived thread: the garbage collector may run
        this on any thread, holding any lock (the engine loop's, the model's), which must not be taken here."""
        if not self._closed:
            threading.Thread(target=self._abandon, name="hf_accel-stream-close", daemon=True).start()

    def _abandon(self) -> None:
        if not self._call.done.is_set():
            self._loop.abort(self._call)
        self._close()


class StockGenerationStream:
    """The same interface for a call that runs stock generate() (in a worker thread): every sequence's tokens arrive
    at once when it returns, cut after the first EOS; `abort` drops a sequence's output."""

    def __init__(self, run: Callable[[], torch.Tensor], prompt_len: int, eos: set[int], num_sequences: int) -> None:
        self._run = run
        self._prompt_len = prompt_len
        self._eos = eos
        self.num_sequences = num_sequences
        self._aborted: set[int] = set()
        self._pending: list[GenerationDelta] | None = None

    def abort(self, sequence: int | None = None) -> None:
        self._aborted.update(range(self.num_sequences) if sequence is None else [sequence])

    def __aiter__(self) -> StockGenerationStream:
        return self

    async def __anext__(self) -> GenerationDelta:
        if self._pending is None:
            sequences = await asyncio.to_thread(self._run)
            self._pending = []
            for i, row in enumerate(sequences[:, self._prompt_len :].tolist()):
                cut = next((k for k, t in enumerate(row) if t in self._eos), None)
                delta = GenerationDelta(i, row, "length") if cut is None else GenerationDelta(i, row[: cut + 1], "stop")
                self._pending.append(GenerationDelta(i, [], "abort") if i in self._aborted else delta)
        if not self._pending:
            raise StopAsyncIteration
        return self._pending.pop(0)

    async def aclose(self) -> None:
        self.abort()
