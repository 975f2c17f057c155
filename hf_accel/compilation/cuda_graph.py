"""CUDA graph capture and replay: the shared machinery and the full-graph runner.

Full graphs serve uniform decode batches: one capture of the whole forward (attention included) per padded batch
size, replayed with a single launch. The captured callable must read its inputs from persistent buffers (same
addresses at every replay) and the runner fills those buffers before `replay()`; nothing is copied here.

Memory: every graph of a process draws from one shared pool (`torch.cuda.graph_pool_handle()`). Outputs are kept
as *weak* references (tensors that alias the pool without owning it), so after a capture the pool memory is free
for the next capture; sizes are captured largest first and share the same bytes. The price is the usual one for
graph replay: an output is valid only until the next replay of any graph of the pool, so consume (or copy) the
logits of a step before running the next one.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_map

logger = logging.getLogger(__name__)


def pad_to_capture_size(n: int, sizes: Iterable[int]) -> int | None:
    """The smallest capture size >= n, or None when n is above the largest (then no graph serves it)."""
    ordered = sorted(sizes)
    i = bisect.bisect_left(ordered, n)
    return ordered[i] if i < len(ordered) else None


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor aliasing `t`'s memory without keeping it alive (lets the graph pool reuse it)."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty((), dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.size(), t.stride())


def weak_ref_tree(value: Any) -> Any:
    return tree_map(lambda x: weak_ref_tensor(x) if isinstance(x, torch.Tensor) else x, value)


_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
    """One side stream per device for every capture of the process (capturing on the legacy default stream is
    illegal); per device because entering a stream's context also makes its device current."""
    device = torch.cuda.current_device()
    if device not in _capture_streams:
        _capture_streams[device] = torch.cuda.Stream(device)
    return _capture_streams[device]


def capture_graph(fn: Callable[[], Any], pool: Any) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture `fn()` into a new graph drawing from `pool`; returns (graph, fn's output).

    `torch.cuda.graph(...)` would also run gc.collect() and empty_cache() on every capture, which costs seconds
    over the hundreds of piecewise captures of a model; capture_begin/capture_end do only the capture.
    A capture that fails raises fn's (or capture_end's) error with the allocator and RNG put back in order
    (`end_failed_capture`); capture later graphs into a new pool handle, not `pool`, whose reference count the
    failure may have brought to zero (torch then refuses to capture into it again until it is freed).
    """
    graph = torch.cuda.CUDAGraph()
    if pool is None:  # a handle of our own: after a failed capture the pool must be named to release it
        pool = torch.cuda.graph_pool_handle()
    stream = capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    ended = False
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                out = fn()
                ended = True  # from here on, a failure is capture_end's own (an op the capture refused silently)
                graph.capture_end()
            except BaseException:  # clean up, but report fn's (or capture_end's) error
                end_failed_capture(graph, pool, stream, ended=ended)
                raise
    finally:
        torch.cuda.current_stream().wait_stream(stream)
    return graph, out


def end_failed_capture(graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream, *,
                       ended: bool = False) -> None:
    """Close a capture that failed and put the allocator and the CUDA RNG back as a clean capture_end would.

    When the stream refused an op (a host sync, say), torch's capture_end (2.11) raises at cudaStreamEndCapture
    before its own bookkeeping, which leaves two things behind: the caching allocator still believes a capture is
    under way (it then defers every free of a block used on another stream, forever: a later engine found 122 GiB
    it could not get back, 2026-12-01) and holds the reference to the graph's pool that capture_begin took; and the
    device's default generator stays marked as capturing, so every later random op there (the user's
    torch.randint, a sampled token) raises "Offset increment outside graph capture". Here the allocator is told
    the capture is over and the pool reference is returned, and one throwaway capture of a trivial op, on a stream
    of its own, runs the generator's prologue and epilogue again, clearing the flag on the same generator state
    (graphs captured before keep advancing it; seeds and offsets are untouched). What this cannot reach: the
    pinned host allocator's own capture bookkeeping, which has no Python binding.

    `pool`: the handle capture_begin was given (torch names no pool of a failed capture). `stream`: the capturing
    stream. `ended`: capture_end was already called and raised. Never raises: the caller reports the capture's
    own error, and a cleanup step that fails is logged instead."""
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        if not ended:
            try:
                graph.capture_end()
                return  # fn raised but the capture itself was still valid: torch closed it cleanly
            except Exception:  # the capture was invalidated; fn's error (raised by the caller) is the one to report
                pass
        try:
            if torch.cuda.is_current_stream_capturing():  # the capture never ended: nothing below is safe
                logger.warning("hf_accel: a failed CUDA graph capture could not be ended; later captures on this "
                               "stream will fail")
                return
            device = stream.device.index if stream.device.index is not None else torch.cuda.current_device()
            try:
                torch._C._cuda_endAllocateToPool(device, pool)
            except RuntimeError:  # capture_end got past the allocator's bookkeeping before it failed
                pass
            else:
                torch._C._cuda_releasePool(device, pool)  # reset() returns it only for a capture that ended
            rearm_stream = torch.cuda.Stream(stream.device)
            rearm_stream.wait_stream(stream)
            with torch.cuda.stream(rearm_stream):
                scratch = torch.zeros(1, device=stream.device)
                rearm = torch.cuda.CUDAGraph()
                rearm.capture_begin()
                try:
                    scratch.add_(1)
                finally:
                    rearm.capture_end()
            stream.wait_stream(rearm_stream)
            del rearm
        except Exception as exc:  # noqa: BLE001 - never mask the capture's own error
            logger.warning("hf_accel: cleaning up after a failed CUDA graph capture failed too (%s: %s); random "
                           "ops or memory on this device may misbehave", type(exc).__name__, exc)


def warmup_representatives(keys: Iterable[Hashable],
                           warmup_key: Callable[[Hashable], Hashable] | None) -> list[Hashable]:
    """The first key of each warm-up class, in order: the keys `capture_with_warmups` warms up (retries aside)."""
    seen: set[Hashable] = set()
    out = []
    for key in keys:
        cls = warmup_key(key) if warmup_key is not None else ("key", key)
        if cls not in seen:
            seen.add(cls)
            out.append(key)
    return out


def capture_with_warmups(keys: Iterable[Hashable], warmup_key: Callable[[Hashable], Hashable] | None,
                         warm_up: Callable[[Hashable], Any], capture: Callable[[Hashable], Any],
                         on_retry: Callable[[], Any], what: str) -> None:
    """Capture every key in order (largest first), warming up only the first key of each warm-up class.

    A warm-up runs the key once outside any capture (first-launch autotuning, lazy kernel builds and workspaces must
    not happen inside one) and costs a whole forward. `warmup_key(key)` names the class of keys that run the same
    kernels with the same specializations (None: every key its own class). A key captured without a warm-up of its
    own that fails is warmed up and captured again (`on_retry()` counts it); a second failure raises. `capture` must
    leave no partial state behind when it raises. `what` names the graphs in the log line of a retry."""
    keys = list(keys)
    first_of_class = set(warmup_representatives(keys, warmup_key))
    for key in keys:
        if key in first_of_class:
            warm_up(key)
            capture(key)
            continue
        try:
            capture(key)
        except Exception as exc:  # something of this key still initialises lazily: warm it up, try again
            logger.info("hf_accel: %s capture of %s without its own warm-up failed (%s: %s); warming it up and "
                        "capturing again", what, key, type(exc).__name__,
                        str(exc).splitlines()[0][:200] if str(exc) else "")
            on_retry()
            warm_up(key)
            capture(key)


class CaptureMemory:
    """Measures what a capture phase costs on the device (allocated and reserved bytes)."""

    def __init__(self) -> None:
        self.on_cuda = torch.cuda.is_available()
        self.allocated0 = torch.cuda.memory_allocated() if self.on_cuda else 0
        self.reserved0 = torch.cuda.memory_reserved() if self.on_cuda else 0

    def delta(self) -> tuple[int, int]:
        if not self.on_cuda:
            return 0, 0
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - self.allocated0, torch.cuda.memory_reserved() - self.reserved0


class FullCUDAGraphRunner:
    """Captures a whole forward once per key (e.g. padded decode batch size) and replays it.

    Generic on purpose: `run_fn(key)` is any callable that reads persistent buffers (the runner fills them for the
    key's padded shape, sets the forward context, and calls the model). Keys are usually ints (batch sizes); any
    hashable works (e.g. `(num_tokens, uniform_decode)`); `sort_key` orders captures largest first.
    """

    def __init__(self, pool: Any = None, num_warmups: int = 1) -> None:
        self.pool = pool
        self.num_warmups = num_warmups
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.capture_seconds = 0.0
        self.warmup_seconds = 0.0  # of capture_seconds: the warm-up forwards before captures
        self.warmups = 0  # keys warmed up (the first of each warm-up class, and any retried)
        self.retries = 0  # keys whose capture without a warm-up of their own failed and was redone
        self.pool_bytes = 0  # reserved-memory growth over all captures

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    @property
    def captured_keys(self) -> list[Hashable]:
        return list(self._graphs)

    def capture(self, keys: Iterable[Hashable], run_fn: Callable[[Hashable], Any],
                prepare_fn: Callable[[Hashable], Any] | None = None,
                sort_key: Callable[[Hashable], Any] | None = None,
                warmup_key: Callable[[Hashable], Hashable] | None = None) -> None:
        """Warm up and capture `run_fn(key)` for every key not captured yet, largest first (memory reuse).

        `prepare_fn(key)`, if given, runs before each warm-up and before the capture, outside the graph: fill the
        persistent buffers with a dummy batch of that shape, set the forward context, `backend.prepare(meta)`.
        `warmup_key(key)`: keys of one class share the `num_warmups` warm-up runs of its first
        (`capture_with_warmups`); None warms up every key.
        """
        if not torch.cuda.is_available():
            raise RuntimeError("FullCUDAGraphRunner.capture needs CUDA")
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        todo = sorted((k for k in set(keys) if k not in self._graphs), key=sort_key, reverse=True)
        if not todo:
            return
        mem = CaptureMemory()
        t0 = time.perf_counter()
        capture_with_warmups(todo, warmup_key, lambda k: self._warm_up(k, run_fn, prepare_fn),
                             lambda k: self._capture_one(k, run_fn, prepare_fn), self._count_retry, "full CUDA graph")
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        allocated, reserved = mem.delta()
        self.capture_seconds += elapsed
        self.pool_bytes += reserved
        logger.info("captured %d full CUDA graph(s) in %.2f s, %d warm-ups (device memory: %+.1f MiB allocated, "
                    "%+.1f MiB reserved)", len(todo), elapsed, self.warmups, allocated / 2**20, reserved / 2**20)

    def _count_retry(self) -> None:
        self.retries += 1

    def _warm_up(self, key: Hashable, run_fn: Callable[[Hashable], Any],
                 prepare_fn: Callable[[Hashable], Any] | None) -> None:
        t0 = time.perf_counter()
        for _ in range(self.num_warmups):
            if prepare_fn is not None:
                prepare_fn(key)
            run_fn(key)  # lazy init, autotuning, workspaces: all outside the capture
        self.warmups += 1
        self.warmup_seconds += time.perf_counter() - t0

    def _capture_one(self, key: Hashable, run_fn: Callable[[Hashable], Any],
                     prepare_fn: Callable[[Hashable], Any] | None) -> None:
        if prepare_fn is not None:
            prepare_fn(key)
        torch.cuda.synchronize()
        try:
            graph, out = capture_graph(lambda: run_fn(key), self.pool)
        except BaseException:
            self.pool = torch.cuda.graph_pool_handle()  # never capture into a failed capture's pool again
            raise
        graph.replay()  # capture only records; replay so the buffers hold a real result
        self._graphs[key] = (graph, weak_ref_tree(out))

    def replay(self, key: Hashable) -> Any:
        """Replay the graph of `key`; returns the captured output (valid until the next replay of the pool)."""
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def reset(self) -> None:
        self._graphs.clear()
