"""Fault injection: an exception (a Ctrl-C, an error) at any point of the scheduler, the block manager or the engine's
step loop must not lose a KV block or corrupt the prefix cache.

`FaultInjector` is a `sys.settrace` / `threading.settrace` tracer (the engine steps on its own thread) that counts the
'line' events of the frames it watches (block_manager.py, scheduler.py, LLMEngine.step/_launch/_read_back and the
engine loop of engine/loop.py) and raises at the k-th one; Python then drops the tracer, so exactly one fault is
injected, in the middle of whatever that line was doing. A sweep runs the same workload for
k = 1, 1 + stride, ... until a run ends before its k-th event (every point covered). The workload goes through the
public API (generate() on an accelerated tiny Llama) and hits the prefix cache (a shared prefix longer than a block),
preempts (a 5-block cache for four requests) and chunks prefills (16-token budget). After every fault the exception
must come out unchanged, the engine must be idle with every block free and consistent, and a request that needs the
whole cache must still run and give stock transformers' tokens (cached prefixes kept across the fault included).

The BlockManager-level tests check reconcile()/check_invariants() directly, and that every intermediate state of
ensure/admit/release/commit errs towards a leak (repairable), never towards a block that is both free and held.
"""

from __future__ import annotations

import copy
import linecache
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from conftest import PAD_ID, compute_all, engine_of, left_pad, make_request

import hf_accel.engine.block_manager as block_manager_module
import hf_accel.engine.engine as engine_module
import hf_accel.engine.loop as loop_module
import hf_accel.engine.scheduler as scheduler_module
from hf_accel import accelerate_model
from hf_accel.config import AccelConfig
from hf_accel.engine.block_manager import BlockManager
from hf_accel.engine.request import Request
from hf_accel.engine.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 6  # 5 usable: the workload below does not fit at once (preemption)
BUDGET = 16  # max_num_batched_tokens: every prompt is prefilled in chunks

BM_FILE = block_manager_module.__file__
SCHED_FILE = scheduler_module.__file__
ENGINE_FILE = engine_module.__file__
ENGINE_FUNCS = frozenset({"step", "_launch", "_read_back", "recover", "abort_request"})
LOOP_FILE = loop_module.__file__

PREFIX = [(i * 7) % 190 + 5 for i in range(20)]  # shared by every prompt: more than one full block
WORKLOAD_ROWS = [PREFIX + [50, 51, 52, 53, 54], PREFIX + [60, 61], PREFIX + [70, 71, 72, 73, 74, 75, 76, 77],
                 PREFIX[:18] + [9]]
WORKLOAD_NEW = 8
# prompt + new tokens = every usable block: fails if a single block leaked; shares PREFIX, so it also reads KV of
# prefix-cache entries that survived a fault
FULL_NEW = 6
FULL_ROW = PREFIX + [(i * 11) % 190 + 5 for i in range((NUM_KV_BLOCKS - 1) * BLOCK_SIZE - FULL_NEW - len(PREFIX))]


def _gen_kwargs(rows, max_new):
    ids, mask = left_pad(rows)
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=PAD_ID,
                eos_token_id=None)


WORKLOAD = _gen_kwargs(WORKLOAD_ROWS, WORKLOAD_NEW)
FULL = _gen_kwargs([FULL_ROW], FULL_NEW)


class InjectedFault(RuntimeError):
    """The RuntimeError variant (an error inside the engine rather than a Ctrl-C)."""


def _is_tracer_only_point(frame) -> bool:
    """Lines where only a tracer can raise, never a program error or a signal (CPython checks for those at calls and
    jumps, not here), and where CPython 3.11 does not unwind a raise through an enclosing `with` (its lock stays held):
    a `with` line, which is reported again on the way out, between the block and `__exit__`; and the no-op lines that
    open a `try` block. A fault there is an artefact of tracing, so such events are not fault points."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return line.startswith("with ") or line == "try:"


class FaultInjector:
    """Raise `exc_type` at the `at`-th 'line' event (1-based) of the watched frames of class `which`:
    "block_manager" (block_manager.py), "scheduler" (scheduler.py), "engine" (the engine's run/step loop) or
    "all"."""

    def __init__(self, exc_type: type[BaseException], at: int, which: str) -> None:
        self.exc_type, self.at, self.which = exc_type, at, which
        self.count = 0
        self.hit: tuple[str, str, int] | None = None  # (file, function, line) where the fault was raised
        self.exc: BaseException | None = None
        self._previous = None
        self._lock = threading.Lock()

    def _watched(self, code) -> bool:
        f = code.co_filename
        kinds = {"block_manager": f == BM_FILE, "scheduler": f == SCHED_FILE,
                 "engine": (f == ENGINE_FILE and code.co_name in ENGINE_FUNCS) or f == LOOP_FILE}
        return any(kinds.values()) if self.which == "all" else kinds[self.which]

    def _global(self, frame, event, arg):
        return self._local if self._watched(frame.f_code) else None

    def _local(self, frame, event, arg):
        if event == "line" and self.hit is None and not _is_tracer_only_point(frame):
            with self._lock:  # the caller's thread and the engine thread both run watched code
                self.count += 1
                fire = self.count == self.at
            if fire:
                code = frame.f_code
                self.hit = (os.path.basename(code.co_filename), code.co_name, frame.f_lineno)
                self.exc = self.exc_type(f"injected at event {self.at}: {self.hit}")
                raise self.exc  # Python unsets the tracer when it raises: one fault per run
        return self._local

    def __enter__(self) -> FaultInjector:
        self._previous = sys.gettrace()
        sys.settrace(self._global)
        threading.settrace(self._global)  # the engine thread starts inside the call
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self._previous)
        threading.settrace(None)


@dataclass
class SweepStats:
    points: int = 0  # faults injected (runs interrupted)
    leaky_faults: int = 0  # faults after which reconcile() found leaked blocks to give back
    recovered_blocks: int = 0
    after_call: int = 0  # faults on the engine thread after the call had returned its (correct) answer
    events: int = 0  # watched events in the uninterrupted run
    where: Counter = field(default_factory=Counter)  # faults per (file, function)
    seconds: float = 0.0


def _spy_reconcile(bm: BlockManager, stats: SweepStats):
    """Wrap the instance's reconcile() to count what it recovers (the engine calls it after every abort)."""
    original = bm.reconcile

    def spy(live):
        n = original(live)
        if n:
            stats.leaky_faults += 1
            stats.recovered_blocks += n
        return n

    bm.reconcile = spy


def check_recovered(model, want_full: torch.Tensor, stats: SweepStats) -> None:
    """After a fault: nothing queued or in flight, every block free and consistent, the whole cache usable."""
    assert model._hf_accel_state.loop.wait_idle(30), "the engine loop is stuck after a fault"
    eng = engine_of(model)
    bm = eng.block_manager
    assert not eng.scheduler.waiting and not eng.scheduler.running
    assert eng._inflight is None
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks - 1 and not any(bm.ref_counts)
    got = model.generate(**FULL)
    assert torch.equal(got, want_full), f"whole-cache request after a fault:\n{got}\nstock:\n{want_full}"
    bm.check_invariants([])


def sweep(model, want: torch.Tensor, want_full: torch.Tensor, exc_type: type[BaseException], which: str,
          stride: int, max_points: int = 100_000) -> SweepStats:
    """Inject one fault at watched event k = 1, 1 + stride, ... until a run completes before reaching k."""
    stats = SweepStats()
    eng = engine_of(model)
    _spy_reconcile(eng.block_manager, stats)
    t0 = time.perf_counter()
    k = 1
    while True:
        assert stats.points < max_points, "the workload never completes"
        raised = out = None
        with FaultInjector(exc_type, k, which) as inj:
            try:
                out = model.generate(**WORKLOAD)
            except BaseException as exc:  # noqa: B036 - the injected KeyboardInterrupt is the point
                raised = exc
        if inj.hit is None:  # ran to the end without reaching event k
            assert raised is None, f"uninjected run raised {raised!r}"
            assert torch.equal(out, want), f"uninjected workload:\n{out}\nstock:\n{want}"
            stats.events = inj.count
            break
        if raised is None:  # the fault hit the engine thread after the call was over: the call's answer stands
            assert torch.equal(out, want), f"fault {inj.exc!r} after the call:\n{out}\nstock:\n{want}"
            stats.after_call += 1
        else:
            assert raised is inj.exc, f"fault {inj.exc!r} came out as {raised!r}"
        stats.points += 1
        stats.where[inj.hit[:2]] += 1
        check_recovered(model, want_full, stats)
        k += stride
    stats.seconds = time.perf_counter() - t0
    return stats


# -- fixtures --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def references(stock_model):
    return stock_model.generate(**WORKLOAD), stock_model.generate(**FULL)


def _accelerated(stock_model, async_scheduling: bool):
    return accelerate_model(copy.deepcopy(stock_model), num_kv_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE,
                            max_num_batched_tokens=BUDGET, config=AccelConfig(async_scheduling=async_scheduling))


def test_workload_exercises_prefix_hits_preemption_and_chunked_prefill(stock_model, references):
    model = _accelerated(stock_model, async_scheduling=True)
    eng = engine_of(model)
    assert eng.cfg.max_num_batched_tokens < min(len(r) for r in WORKLOAD_ROWS), "no chunked prefill"
    assert torch.equal(model.generate(**WORKLOAD), references[0])
    assert eng.stats.preemptions > 0, "the workload does not preempt"
    assert eng.scheduler.prefix_hit_tokens > BLOCK_SIZE, "the workload does not hit the prefix cache"
    assert eng.stats.async_steps > 0
    assert torch.equal(model.generate(**FULL), references[1])
    eng.block_manager.check_invariants([])


# (exception, watched frames, stride, asynchronous scheduling): every event of the block manager, the rest strided
SWEEPS = [
    pytest.param(KeyboardInterrupt, "block_manager", 1, True, id="ctrl_c-block_manager-every_event-async"),
    pytest.param(KeyboardInterrupt, "scheduler", 1, True, id="ctrl_c-scheduler-every_event-async"),
    pytest.param(KeyboardInterrupt, "engine", 3, True, id="ctrl_c-engine-stride3-async"),
    pytest.param(InjectedFault, "all", 7, False, id="error-all-stride7-sync"),
]


@pytest.mark.parametrize("exc_type, which, stride, async_scheduling", SWEEPS)
def test_fault_at_every_point_leaks_nothing(stock_model, references, exc_type, which, stride, async_scheduling):
    model = _accelerated(stock_model, async_scheduling)
    stats = sweep(model, *references, exc_type, which, stride)
    top = ", ".join(f"{f}:{fn} {n}" for (f, fn), n in stats.where.most_common(8))
    print(f"\n{exc_type.__name__} in {which} (stride {stride}, async={async_scheduling}): {stats.points} faults "
          f"injected over {stats.events} watched events in {stats.seconds:.1f} s; {stats.leaky_faults} left leaked "
          f"blocks ({stats.recovered_blocks} blocks) that reconcile() gave back; {stats.after_call} landed after the "
          f"call had returned. Where: {top}")
    assert stats.points >= stats.events // stride, "the sweep stopped early"
    assert stats.points > 50


# -- BlockManager / Scheduler directly -------------------------------------------------------------------------------
def test_check_invariants_catches_each_kind_of_damage():
    bs = 2
    bm = BlockManager(8, bs)
    a, b = make_request(1, [3, 4, 5, 6, 7]), make_request(2, [3, 4, 5, 6, 8])
    compute_all(bm, a)
    assert bm.admit(b) == 2 * bs  # shares a's two full blocks
    bm.check_invariants([a, b])
    with pytest.raises(AssertionError, match="ref count"):
        bm.check_invariants([a])  # b's references are not accounted for

    def damaged(mutate):
        x = copy.deepcopy(bm)
        ra, rb = copy.deepcopy(a), copy.deepcopy(b)
        mutate(x, ra, rb)
        return x, [ra, rb]

    cases = {
        "leaked": lambda x, ra, rb: x.free.popitem(last=False),
        "both free and held": lambda x, ra, rb: x.free.__setitem__(ra.block_ids[-1], None),
        "null block": lambda x, ra, rb: x.free.__setitem__(0, None),
        "holds a block twice": lambda x, ra, rb: ra.block_ids.append(ra.block_ids[0]),
        "ref count": lambda x, ra, rb: x.ref_counts.__setitem__(ra.block_ids[0], 1),
        "disagrees with the block's hash": lambda x, ra, rb: x.cached.__setitem__(b"h" * 16, ra.block_ids[-1]),
        "does not map to it": lambda x, ra, rb: x.block_hash.__setitem__(ra.block_ids[-1], b"h" * 16),
    }
    for match, mutate in cases.items():
        x, live = damaged(mutate)
        with pytest.raises(AssertionError, match=match):
            x.check_invariants(live)


def test_reconcile_recovers_a_block_popped_and_not_recorded():
    """The window of issue 12: a block off the free list, the request not holding it yet."""
    bm = BlockManager(6, 4)
    a = make_request(1, range(3, 12))
    assert bm.ensure(a, 4)
    bm.free.popitem(last=False)  # what an interruption inside ensure() used to leave
    with pytest.raises(AssertionError, match="leaked"):
        bm.check_invariants([a])
    assert bm.reconcile([a]) == 1
    bm.check_invariants([a])
    assert bm.ensure(a, 20), "the whole cache is usable again"
    assert bm.reconcile([a]) == 0  # idempotent: nothing else to recover
    bm.release(a)
    bm.check_invariants([])
    assert bm.num_free_blocks == 5


def test_reconcile_keeps_consistent_prefixes_and_drops_half_made_ones():
    bs = 2
    bm = BlockManager(10, bs)
    a, dead = make_request(1, [3, 4, 5, 6, 7]), make_request(2, [9, 9, 8, 8, 7])
    compute_all(bm, a)
    compute_all(bm, dead)
    keep, drop_entry, drop_hash = a.block_ids[0], dead.block_ids[0], dead.block_ids[1]
    del bm.cached[bm.block_hash[drop_entry]]  # an eviction cut short: hash left on the block, entry gone
    bm.block_hash[drop_hash] = None  # a commit cut short the other way: entry without the block's hash
    live_b = make_request(3, [3, 4, 5, 6, 1])
    assert bm.admit(live_b) == 2 * bs
    free_before = list(bm.free)
    # `dead` is dropped by the failed call without a release: its blocks are counted but held by no live request
    assert bm.reconcile([a, live_b, live_b]) == len(dead.block_ids)  # duplicates count once
    bm.check_invariants([a, live_b])
    assert bm.ref_counts[keep] == 2 and bm.block_hash[keep] is not None
    assert bm.block_hash[drop_entry] is None and bm.block_hash[drop_hash] is None
    assert list(bm.free)[len(dead.block_ids):] == free_before, "already-free blocks keep their LRU order"
    assert set(list(bm.free)[: len(dead.block_ids)]) == set(dead.block_ids), "uncached recovered blocks first"
    bm.release(a)
    bm.release(live_b)
    hit = make_request(4, [3, 4, 5, 6, 2])
    assert bm.admit(hit) == 2 * bs, "the consistent prefix survived"
    assert bm.admit(make_request(5, [9, 9, 8, 8, 7])) == 0
    bm.release(hit)
    bm.check_invariants([])


def _cached_two_block_prefix() -> tuple[int, BlockManager, Scheduler]:
    """A block manager (8 blocks of 4) whose prefix cache holds two full blocks of tokens 3.., all blocks free."""
    bs = 4
    bm = BlockManager(8, bs)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    warm = make_request(1, range(3, 3 + 2 * bs + 1))
    compute_all(bm, warm)
    bm.release(warm)
    return bs, bm, sched


def test_abort_all_releases_waiting_requests_holding_prefix_blocks():
    bs, bm, sched = _cached_two_block_prefix()
    waiting = make_request(2, range(3, 3 + 2 * bs + 3))
    sched.add(waiting)
    # admission cut short after admit() took the cached prefix blocks (the exception's window in schedule())
    waiting.num_computed_tokens = bm.admit(waiting)
    assert len(waiting.block_ids) == 2 and waiting in sched.waiting
    running = make_request(3, [50, 51, 52])
    sched.add(running)
    sched.waiting.remove(running)
    sched.running.append(running)
    assert bm.ensure(running, 3)
    sched.abort_all()
    assert not sched.has_work
    for req in (waiting, running):
        assert req.block_ids == [] and req.block_hashes == [] and req.num_computed_tokens == 0
    bm.check_invariants([])
    assert bm.num_free_blocks == 7
    assert bm.admit(make_request(4, range(3, 3 + 2 * bs + 1))) == 2 * bs, "the cached prefix survived the abort"


def test_admission_cut_short_starts_over():
    """A queued request left holding admit()'s prefix blocks with a stale computed count (an exception between the
    two, the request kept alive) is admitted afresh: its blocks given back and taken again, nothing recomputed into
    shared blocks."""
    bs, bm, sched = _cached_two_block_prefix()
    req = make_request(2, range(3, 3 + 2 * bs + 3))
    sched.add(req)
    bm.admit(req)  # num_computed_tokens not set: still 0
    step = sched.schedule()
    assert step.requests == [req] and step.num_tokens == [3], "the cached prefix is not recomputed"
    assert req.num_computed_tokens == 2 * bs
    bm.check_invariants(sched.live_requests())


def test_release_is_never_a_double_free():
    bm = BlockManager(6, 4)
    a = make_request(1, range(3, 12))
    assert bm.ensure(a, 9)
    bm.release(a)
    bm.release(a)  # the request let go of its list: a second release is a no-op
    bm.check_invariants([])
    a.block_ids = [1]
    with pytest.raises(AssertionError, match="freed twice"):
        bm.release(a)
    bm.check_invariants([])


def _check_safe(bm: BlockManager, live: list[Request]) -> None:
    """What must hold at *every* point, before any reconcile(): a leak is allowed, sharing by accident is not."""
    holders = Counter(b for r in live for b in r.block_ids)
    for b, n in holders.items():
        assert b not in bm.free, f"block {b} is held and free"
        assert bm.ref_counts[b] >= n, f"block {b} under-counted"
    for h, b in bm.cached.items():
        assert bm.block_hash[b] == h, f"prefix-cache entry for block {b} that eviction would not clear"


def _ops_scenario(bm: BlockManager, live: list[Request]):
    """A sequence touching every path of the block manager: allocation with eviction, prefix hits, commit,
    release of shared and unshared blocks. Yields after each operation so a fault can land in any of them."""
    bs = bm.block_size
    a = make_request(1, range(3, 3 + 3 * bs + 1))
    live.append(a)
    compute_all(bm, a)  # ensure + commit: 3 full blocks cached
    yield
    b = make_request(2, range(3, 3 + 3 * bs + 2))
    live.append(b)
    b.num_computed_tokens = bm.admit(b)  # prefix hits
    yield
    assert bm.ensure(b, b.num_tokens)
    b.num_computed_tokens = b.num_tokens
    bm.commit(b)
    yield
    bm.release(a)
    yield
    c = make_request(3, [90] * (bm.num_usable_blocks - len(b.block_ids)) * bs)
    live.append(c)
    assert bm.ensure(c, c.num_tokens)  # takes every free block: evicts cached ones
    yield
    bm.release(b)
    bm.release(c)


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, InjectedFault])
def test_block_manager_fault_at_every_line_is_safe_then_reconciled(exc_type):
    """Every line event of every BlockManager call in the scenario, one fault each. Right after the fault the state
    may have leaked but must be safe; reconcile() with the requests alive then makes it exact, and the remaining
    operations (on a fresh scenario) still work."""
    k, points = 1, 0
    while True:
        bm = BlockManager(8, 2)
        live: list[Request] = []
        with FaultInjector(exc_type, k, "block_manager") as inj:
            try:
                for _ in _ops_scenario(bm, live):
                    pass
            except BaseException as exc:  # noqa: B036
                assert exc is inj.exc
        if inj.hit is None:
            break
        points += 1
        _check_safe(bm, live)
        bm.reconcile(live)
        bm.check_invariants(live)
        for req in live:
            bm.release(req)
        bm.check_invariants([])
        assert bm.num_free_blocks == bm.num_usable_blocks, f"fault at {inj.hit}"
        k += 1
    assert points > 100
