"""The engine loop: one thread per accelerated model steps the engine for every caller at once.

Threading design (what runs where):
- **Caller threads** (any number: a thread pool's workers, the main thread, an asyncio event loop) turn their call
  into requests, hand them to the loop as one `EngineCall` with `EngineLoop.submit`, and wait for it. A caller feeds
  its own streamer and progress bar on its own thread, from the tokens the loop hands it, so a slow or failing
  streamer stalls or ends that call alone.
- **The engine thread** (started by the first call that finds the loop idle, gone once no work is left, so an idle
  model holds no thread) owns the engine: it alone touches the scheduler, the block manager, the runner and the
  sampler. Between two steps it takes in the calls and aborts that arrived, decides whether the step may run one
  ahead of the host (only while every live call allows it), steps, and hands each call its new tokens. A call that
  arrives mid-run joins the running batch at the next step and leaves when its rows finish.
- **Callbacks that decide tokens** (transformers logits processors, stopping criteria, stop strings) run on the
  engine thread inside the step, as they must. One that raises (even KeyboardInterrupt) fails its own call, whose
  requests are aborted after the step; the other calls go on.
- **Signals** (Ctrl-C) reach the main thread only, so they land in a waiting caller, never in the middle of a step:
  that caller aborts its call (its blocks are freed before it re-raises) and the others go on.
- An error inside the step itself (the GPU, a bug) is not any one call's: every call in flight fails with it and the
  engine is reset (`LLMEngine.recover`), ready for the next call.
- **Rank 0 of a served tensor-parallel model** (`start_driving`, engine/tp_driver.py): the engine thread stays up
  until `stop_driving()`, hands every step's adds and aborts to the other ranks before the step, and sends an empty
  plan while idle; a step error there ends the process instead of a reset (the other ranks could not follow one).

No module-level mutable state: each model has its own loop, engine and forward context (the context is per thread,
and each model's steps run on that model's engine thread).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hf_accel.engine.request import Request
from hf_accel.engine.tp_driver import HEARTBEAT_S, unsupported_reason

if TYPE_CHECKING:
    from hf_accel.engine.engine import LLMEngine
    from hf_accel.engine.tp_driver import LeaderDriver

logger = logging.getLogger(__name__)

# (sequence index in the call, token id or None, finish reason or None): one entry per token read back, and one
# closing entry per sequence when it finishes ("stop", "length" or "abort")
CallEvent = tuple[int, int | None, str | None]
_RECHECK_S = 0.5  # a waiting caller looks at its call at least this often, even if no wake-up came


class EngineCall:
    """One caller's requests as the loop sees them, and how the caller hears back.

    The engine thread appends events (tokens, finishes) and calls `notify()` (if `wants_events`, after every step
    that touched the call; always once when the call is done). The caller takes the events with `take_events()`,
    from whatever thread it waits on. `notify` must be quick and must not raise: it only wakes the caller.
    """

    def __init__(self, requests: list[Request], wants_events: bool = False,
                 notify: Callable[[], None] | None = None) -> None:
        self.requests = requests
        self.wants_events = wants_events
        self.async_safe = all(r.is_async_safe for r in requests)
        self.error: BaseException | None = None
        self.done = threading.Event()  # set once every request has finished or the call failed
        self._events: list[CallEvent] = []
        self._events_lock = threading.Lock()
        self._notify = notify
        self._wake = threading.Event()  # the default waiter: wait_sync()
        self.num_finished = 0

    # -- engine thread ------------------------------------------------------------------------------------------
    def _push(self, event: CallEvent) -> None:
        if self.wants_events:
            with self._events_lock:
                self._events.append(event)

    def _signal(self) -> None:
        self._wake.set()
        if self._notify is not None:
            try:
                self._notify()
            except Exception:  # noqa: BLE001 - a closed event loop (its caller gone) must not stop the engine
                logger.debug("hf_accel: a call's notify() failed", exc_info=True)

    def _finish(self, error: BaseException | None = None) -> None:
        if self.done.is_set():
            return
        if error is not None and self.error is None:
            self.error = error
        self.done.set()
        self._signal()

    # -- caller --------------------------------------------------------------------------------------------------
    def take_events(self) -> list[CallEvent]:
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def wait_sync(self, on_events: Callable[[list[CallEvent]], None] | None = None,
                  heal: Callable[[EngineCall], None] | None = None) -> None:
        """Block the calling thread until the call is done, handing `on_events` each batch of events on this thread.

        Returns normally when the call succeeded; raises its error otherwise. Whatever is raised here (the call's
        error, an exception from `on_events`, a KeyboardInterrupt while waiting) leaves the call finished: the caller
        must have aborted it first (see `EngineLoop.run_sync`).
        """
        while True:
            if not self._wake.wait(_RECHECK_S) and heal is not None:  # woken per step; else look at the loop
                heal(self)
            self._wake.clear()
            finished = self.done.is_set()  # read before the events: a done call's events are all in already
            if on_events is not None:
                events = self.take_events()
                if events:
                    on_events(events)
            if finished:
                break
        if self.error is not None:
            raise self.error


_LIVE_LOOPS: weakref.WeakSet[EngineLoop] = weakref.WeakSet()


@atexit.register
def _stop_loops_at_exit() -> None:
    """At interpreter exit, abort every call still running and let each engine thread finish its step and leave.

    Why: the engine threads are daemon threads (a forgotten call must not keep a process alive), and a daemon
    thread still inside a torch op when the interpreter tears down aborts the process ("terminate called without
    an active exception", exit status 134): after an asyncio task was cancelled (its abort queued, the step still
    running), or with a stream left open at exit. Bounded: a step that does not end within a few seconds is left
    to the old behaviour rather than hanging the exit. Tensor-parallel leaders are left out: their ranks end together
    through the job (`tp_driver`)."""
    loops = [loop for loop in list(_LIVE_LOOPS) if loop.driver is None]  # a tensor-parallel leader: left as it is
    for loop in loops:
        loop.abort_all()
    for loop in loops:
        loop.wait_idle(timeout=5.0)


class EngineLoop:
    """Runs one engine for many callers (see the module docstring for who runs what)."""

    def __init__(self, engine: LLMEngine) -> None:
        _LIVE_LOOPS.add(self)
        self.engine = engine
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._incoming: list[EngineCall] = []
        # every call submitted and not yet over (under the lock): whatever fails, the loop finishes each of them
        self._known: dict[int, EngineCall] = {}
        self._aborts: list[tuple[EngineCall, Request | None, BaseException | None]] = []
        self._thread: threading.Thread | None = None
        # rank 0 of a served tensor-parallel model (`driver`, engine/tp_driver.py): its engine thread runs until
        # stop_driving(), handing each step's schedule to the other ranks; `_work` wakes it when idle
        self._work = threading.Event()
        # engine thread only
        self._calls: dict[int, EngineCall] = {}  # id(call) -> call
        self._owner: dict[int, tuple[EngineCall, int]] = {}  # id(request) -> (its call, its index there)
        self._unsafe_calls = 0  # live calls that need every token on the host before the next step is planned
        self.peak_calls = 0  # most calls live in one step so far
        self.shared_steps = 0  # steps run with more than one call live

    # -- any thread ----------------------------------------------------------------------------------------------
    def submit(self, call: EngineCall) -> None:
        """Queue a call; it joins the running batch at the next step. Raises (and queues nothing) when a request can
        never fit the KV cache or has an empty prompt."""
        for req in call.requests:
            self.engine.check_request(req)
        if self.driver is not None:
            reasons = [r for r in map(unsupported_reason, call.requests) if r is not None]
            if reasons:
                raise NotImplementedError(reasons[0])
        with self._lock:
            if self.driver is not None and self.driver.stopping:
                raise RuntimeError("hf_accel: the tensor-parallel engine is shutting down")
            self._known[id(call)] = call
            self._incoming.append(call)
            if self.driver is not None:
                self._work.set()
            try:
                self._ensure_thread()
            except BaseException:
                self._incoming.remove(call)
                del self._known[id(call)]
                raise

    def _ensure_thread(self) -> None:
        """Start the engine thread unless one is running (call with the lock held). A thread that died without
        clearing `_thread` (an error in its last lines) counts as gone; only the thread `_thread` names may step."""
        if not self._running():
            thread = threading.Thread(target=self._main, name="hf_accel-engine", daemon=True)
            thread.start()  # it waits for the lock before touching anything
            self._thread = thread

    def _running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def abort(self, call: EngineCall, request: Request | None = None, error: BaseException | None = None) -> None:
        """Cancel a whole call (request=None) or one of its requests, before the next step. A whole call ends with
        `error` (if given) once its requests are aborted and their KV blocks freed."""
        with self._lock:
            if not self._running():  # nothing runs: the call never started or is over
                self._known.pop(id(call), None)
                call._finish(error)
                return
            self._aborts.append((call, request, error))
            if self.driver is not None:
                self._work.set()

    def abort_all(self) -> None:
        """Cancel every call not yet over, as `abort(call)` does for one."""
        with self._lock:
            calls = list(self._known.values())
        for call in calls:
            if not call.done.is_set():
                self.abort(call)

    def run_sync(self, call: EngineCall, on_events: Callable[[list[CallEvent]], None] | None = None,
                 before: Callable[[], None] | None = None, *, submitted: bool = False) -> None:
        """Submit `call` (unless `submitted`) and wait for it on this thread (`before` runs once it is accepted: a
        streamer's prompt). Anything raised meanwhile (by `before` or `on_events`, a KeyboardInterrupt) aborts the
        call, waits until its blocks are freed, and re-raises."""
        if not submitted:
            self.submit(call)
        try:
            if before is not None:
                before()
            call.wait_sync(on_events, self._heal)
        except BaseException as exc:
            if not call.done.is_set():
                self.abort(call, error=exc)
                call.done.wait()
            raise

    def _heal(self, call: EngineCall) -> None:
        """A waiting caller's periodic look at the loop: if no engine thread runs while its call is not over (a
        thread that died in its last lines, before handing on the work that had just arrived), start one; if the
        loop lost track of the call altogether, fail it rather than wait forever."""
        with self._lock:
            if call.done.is_set() or self._running():
                return
            if id(call) in self._known:
                self._ensure_thread()
                return
        call._finish(RuntimeError("internal error: the engine loop lost this call"))

    @property
    def driver(self) -> LeaderDriver | None:
        """The engine's leader driver while rank 0 of a tensor-parallel model is served, else None."""
        return self.engine.driver

    def start_driving(self, driver: LeaderDriver) -> None:
        """Rank 0 of a served tensor-parallel model: from now on the engine thread runs until `stop_driving()` and
        hands every step's schedule to the other ranks (which run `tp_driver.follow`)."""
        with self._lock:
            if self._running() or self._known:
                raise RuntimeError("start_driving() needs an idle engine loop")
            self.engine.driver = driver
            self._ensure_thread()

    def stop_driving(self, timeout: float | None = None) -> bool:
        """Finish what runs, tell the other ranks to return, and let the engine thread exit; then this loop runs
        undriven again. True once that is done; False after `timeout` seconds (submits are refused meanwhile, and the
        thread still stops as soon as it can). The other ranks are told under the loop's lock, so a dead one holds
        this (and submit / abort) until the plan group notices."""
        with self._lock:
            if self.driver is None:
                return True
            self.driver.stopping = True
            self._work.set()
        if not self.wait_idle(timeout):
            return False
        with self._lock:
            self.engine.driver = None
        return True

    @property
    def on_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def is_idle(self) -> bool:
        with self._lock:
            return not self._running()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the engine thread has nothing left (no call, no step in flight). True if it is idle."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._running():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(0.05 if left is None else min(left, 0.05))  # also notices a thread that died
            return True

    # -- engine thread -------------------------------------------------------------------------------------------
    def _main(self) -> None:
        """The engine thread: step until no call and no step in flight is left, then exit."""
        try:
            if self.engine.device.type == "cuda":
                torch.cuda.set_device(self.engine.device)
            with torch.inference_mode():
                while self._iteration():
                    pass
        except BaseException as exc:  # noqa: BLE001 - never leave a caller waiting, whatever went wrong
            self._fail_everything(exc)
            if self.driver is not None:  # the other ranks cannot be kept in step: the job ends
                self.driver.fatal(exc)
        finally:
            self._exit()

    def _iteration(self) -> bool:
        """Take in what arrived, run one step, hand out its tokens. False when the loop may exit."""
        eng = self.engine
        with self._lock:
            if self._thread is not threading.current_thread():
                return False  # an orphan (its start was cut short): the thread `_thread` names does the work
            incoming, self._incoming = self._incoming, []
            aborts, self._aborts = self._aborts, []
            idle = not incoming and not aborts and not self._calls and not eng.is_busy
            driver = self.driver
            if idle and (driver is None or driver.stopping):
                if driver is not None:  # under the lock: no call can be admitted after the followers returned
                    driver.send_stop()
                self._thread = None  # under the lock: a submit from now on starts a new thread
                self._idle.notify_all()
                return False
            if driver is not None:
                self._work.clear()
        if idle:  # rank 0 driving, nothing to run: wait for work; meanwhile an empty plan keeps the others alive
            assert driver is not None
            if not self._work.wait(HEARTBEAT_S):
                driver.send(step=False)
            return True
        for call in incoming:  # admitted first: an abort of one sequence of a call that arrived in the same
            self._admit(call)  # iteration must find the call's requests, not end the whole call
        for call, request, error in aborts:
            self._abort(call, request, error)
        if not self._calls and not eng.is_busy:
            if driver is not None:
                driver.send(step=False)  # what changed (aborts, a failed admission) still reaches the others
            return True  # only aborts of calls already over: look again
        eng.allow_async = eng.cfg.async_scheduling and self._unsafe_calls == 0
        self.peak_calls = max(self.peak_calls, len(self._calls))
        self.shared_steps += len(self._calls) > 1
        if driver is not None:
            driver.send(step=True, allow_async=eng.allow_async)
        try:
            emitted = eng.step()
        except BaseException as exc:  # noqa: BLE001 - a step failure is every live call's: fail them, reset the engine
            if driver is not None:
                raise  # _main: every call fails, then the job ends (the other ranks cannot follow a reset)
            self._fail_calls(exc)
            eng.recover()
            return True
        # a callback's error first: its call fails even when the failing row was its last one to finish
        for req, exc in eng.take_hook_errors():
            owner = self._owner.get(id(req))
            if owner is not None:
                self._abort(owner[0], None, exc)
        self._dispatch(emitted)
        if not emitted and self._calls and not eng.is_busy:  # cannot happen: a live call's requests are in the engine
            self._fail_calls(RuntimeError("internal error: calls left with no request in the engine"))
        return True

    def _admit(self, call: EngineCall) -> None:
        if call.done.is_set():  # aborted before it started
            self._forget(call)
            return
        self._calls[id(call)] = call
        self._unsafe_calls += not call.async_safe
        try:
            for i, req in enumerate(call.requests):
                self._owner[id(req)] = (call, i)
                self.engine.add_request(req)
        except Exception as exc:  # noqa: BLE001 - checked by submit(); a failure here is this call's alone
            self._retire(call, exc)

    def _dispatch(self, emitted: list[tuple[Request, int]]) -> None:
        touched: dict[int, EngineCall] = {}
        finished: dict[int, tuple[EngineCall, int, Request]] = {}
        for req, tok in emitted:  # a request may appear twice (a step caught up, then its own): finishes go last
            owner = self._owner.get(id(req))
            if owner is None:
                continue
            call, i = owner
            if call.wants_events:
                call._push((i, tok, None))
            if req.is_finished:
                finished[id(req)] = (call, i, req)
            touched[id(call)] = call
        for call, i, req in finished.values():
            call._push((i, None, req.finish_reason))
            call.num_finished += 1
        for call in touched.values():
            if call.num_finished >= len(call.requests):
                self._retire(call, None)
            elif call.wants_events:
                call._signal()

    def _abort(self, call: EngineCall, request: Request | None, error: BaseException | None) -> None:
        if id(call) not in self._calls:
            call._finish(error)  # never admitted (or already over)
            self._forget(call)
            return
        targets = call.requests if request is None else [request]
        for req in targets:
            if not req.is_finished:
                self.engine.abort_request(req)
                call._push((self._owner[id(req)][1], None, "abort"))
                call.num_finished += 1
        if request is None or call.num_finished >= len(call.requests):
            self._retire(call, error)
        elif call.wants_events:
            call._signal()

    def _retire(self, call: EngineCall, error: BaseException | None) -> None:
        """The call is over (all its requests finished, or it failed): drop its requests, wake its caller, forget it.
        Until it is forgotten, a failure of the loop still finishes it."""
        if id(call) in self._calls:
            for req in call.requests:
                if not req.is_finished:  # a failed call: its other requests go too
                    self.engine.abort_request(req)
                self._owner.pop(id(req), None)
            self._unsafe_calls -= not call.async_safe
            del self._calls[id(call)]
        call._finish(error)
        self._forget(call)

    def _forget(self, call: EngineCall) -> None:
        with self._lock:
            self._known.pop(id(call), None)

    def _fail_calls(self, exc: BaseException) -> None:
        """A step failed: every admitted call fails with its error (the engine is reset by the caller)."""
        calls = list(self._calls.values())
        self._calls.clear()
        self._owner.clear()
        self._unsafe_calls = 0
        for call in calls:
            call._finish(exc)
            self._forget(call)

    def _fail_everything(self, exc: BaseException) -> None:
        """The loop itself failed: every call not yet over (admitted, queued, or caught in between) fails with
        `exc`, and the engine is reset for the next call."""
        with self._lock:
            calls = list(self._known.values())
            self._known.clear()
            self._incoming, self._aborts = [], []
        self._calls.clear()
        self._owner.clear()
        self._unsafe_calls = 0
        for call in calls:
            call._finish(exc)
        try:
            self.engine.recover()
        except BaseException:  # noqa: BLE001 - recovered again by the next call's loop
            logger.exception("hf_accel: the engine could not be reset after an error")

    def _exit(self) -> None:
        """Leave the thread; if work arrived meanwhile (after a failure), hand it to a new thread."""
        with self._lock:
            if self._thread is not threading.current_thread():
                return  # exited normally from _iteration, or an orphan
            self._thread = None
            if self._incoming or self._aborts:
                self._ensure_thread()
            self._idle.notify_all()
