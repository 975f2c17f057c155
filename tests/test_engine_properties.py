"""Property tests of the block manager and scheduler, driven without a model.

A fake runner plays the engine's step(): it schedules, "computes" the scheduled tokens by writing them into a model of
the paged KV cache (block -> slot -> token), advances `num_computed_tokens`, commits full blocks to the prefix cache,
and samples a deterministic token for every request whose last token was computed, finishing it at max_new_tokens.
After every step the allocator and scheduler invariants are checked; at the end every request must hold exactly the
expected tokens and every block must be back in the free pool.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from conftest import compute_all, make_request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_accel.engine.block_manager import BlockManager, hash_block
from hf_accel.engine.request import PENDING_TOKEN, Request, RequestStatus
from hf_accel.engine.runner import HostBlockTable
from hf_accel.engine.scheduler import Scheduler

ALPHABET = (3, 4, 5, 6)  # few distinct tokens: unrelated requests often share identical full blocks


def expected_token(req: Request, k: int) -> int:
    """The k-th output token of `req`: a function of (prompt, output group, k) or of (request id, k)."""
    group = req._group  # type: ignore[attr-defined]
    key = (tuple(req.prompt_token_ids), group, k) if group else (req.request_id, k)
    return ALPHABET[zlib.crc32(repr(key).encode()) % len(ALPHABET)]


class KVModel:
    """What the paged KV cache would hold: the token whose K/V was written at each (block, slot)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.slots = [[None] * block_size for _ in range(num_blocks)]
        self.block_size = block_size

    def write(self, bm: BlockManager, req: Request, start: int, n: int) -> None:
        bs = self.block_size
        for p in range(start, start + n):
            block = req.block_ids[p // bs]
            assert block != 0, "KV written into the null block"
            assert bm.ref_counts[block] == 1, (
                f"request {req.request_id} writes position {p} into block {block} shared by "
                f"{bm.ref_counts[block]} requests")
            self.slots[block][p % bs] = true_token(req, p)

    def check_computed(self, req: Request) -> None:
        """Every position the request counts as computed holds that request's token."""
        bs = self.block_size
        for p in range(req.num_computed_tokens):
            block = req.block_ids[p // bs]
            got = self.slots[block][p % bs]
            assert got == true_token(req, p), (
                f"request {req.request_id} position {p} (block {block}) holds {got}, expected {true_token(req, p)}")


def check_invariants(bm: BlockManager, sched: Scheduler, live: list[Request]) -> None:
    holders: dict[int, list[tuple[Request, int]]] = {}
    for req in live:
        assert len(set(req.block_ids)) == len(req.block_ids), f"request {req.request_id} holds a block twice"
        for i, b in enumerate(req.block_ids):
            assert 0 < b < bm.num_blocks, f"block {b} handed out"
            holders.setdefault(b, []).append((req, i))
        if req.status == RequestStatus.WAITING:
            assert req.block_ids == [], f"waiting request {req.request_id} still holds blocks {req.block_ids}"
        chain = None  # its hash chain is the one of its own tokens, block by block (whoever computed which link)
        for i, h in enumerate(req.block_hashes):
            chain = hash_block(chain, req.all_token_ids[i * bm.block_size : (i + 1) * bm.block_size])
            assert h == chain, f"request {req.request_id}: block {i}'s hash is not its tokens' chain"
    assert 0 not in bm.free and bm.ref_counts[0] == 0, "the null block entered circulation"
    for b in range(1, bm.num_blocks):
        count = bm.ref_counts[b]
        assert count >= 0, f"block {b} has ref count {count}"
        assert count == len(holders.get(b, [])), f"block {b}: ref count {count}, held by {len(holders.get(b, []))}"
        assert (b in bm.free) == (count == 0), f"block {b}: ref count {count} but free={b in bm.free}"
    for b, hs in holders.items():
        if len(hs) > 1:  # sharing is only allowed for a cached full block, at the same position, same hash
            h = bm.block_hash[b]
            assert h is not None, f"uncached block {b} shared by {[r.request_id for r, _ in hs]}"
            positions = {i for _, i in hs}
            assert len(positions) == 1, f"block {b} shared at different positions {positions}"
            for req, i in hs:
                assert i < len(req.block_hashes) and req.block_hashes[i] == h, (
                    f"block {b} shared by request {req.request_id} without the matching hash")
    for h, b in bm.cached.items():
        assert bm.block_hash[b] == h, f"cache entry for block {b} disagrees with the block's hash"
    assert bm.num_free_blocks == len(bm.free) <= bm.num_blocks - 1
    assert len(sched.running) <= sched.max_num_seqs
    running_ids = [id(r) for r in sched.running]
    assert len(running_ids) == len(set(running_ids)), "a request is running twice"
    assert not ({id(r) for r in sched.waiting} & set(running_ids)), "a request is both waiting and running"


def check_block_table(table, reqs: list[Request]) -> None:
    """The runner's kept block table (only what changed is written each step) equals one built from scratch: every
    request's blocks in its row, zeros after them, as wide as the longest list."""
    width = max((len(r.block_ids) for r in reqs), default=0)
    assert table.shape == (len(reqs), width)
    for i, req in enumerate(reqs):
        want = req.block_ids + [0] * (width - len(req.block_ids))
        assert table[i].tolist() == want, f"row {i} (request {req.request_id}): {table[i].tolist()} != {want}"


def true_token(req: Request, p: int) -> int:
    """The token at position p, also while the host has not read it back (a pending token)."""
    tok = req.token_at(p)
    return tok if tok != PENDING_TOKEN else expected_token(req, p - req.num_prompt_tokens)


def read_back(bm: BlockManager, sched: Scheduler, launched: list[tuple[Request, int]]) -> None:
    """What LLMEngine._read_back() does with a launched step's tokens."""
    for req, tok in launched:
        req.num_pending_tokens -= 1
        if req.is_finished:
            continue  # computed once more after its last token: dropped
        req.output_token_ids.append(tok)
        if req.num_computed_tokens >= req.num_known_tokens:
            bm.commit(req)
        if len(req.output_token_ids) >= req.max_new_tokens:
            sched.finish(req, "length")


def drive(bm: BlockManager, sched: Scheduler, arrivals: list[tuple[int, Request]], max_steps: int = 5000,
          lag: bool = False):
    """Run the scheduler loop to completion with the fake runner; returns the per-step (tokens, seqs) trace.

    `lag=True` plays asynchronous scheduling: a step is planned and launched before the previous step's tokens
    are read back (they are pending, fed from the device), as LLMEngine does."""
    kv = KVModel(bm.num_blocks, bm.block_size)
    pending = sorted(arrivals, key=lambda a: a[0])
    live: list[Request] = []
    step_no = 0
    preemptions = 0
    inflight: list[tuple[Request, int]] | None = None
    host_table = HostBlockTable(sched.max_num_seqs, bm.num_blocks)  # what the runner packs, checked every step
    while pending or sched.has_work or inflight is not None:
        assert step_no < max_steps, "the scheduler does not converge"
        while pending and pending[0][0] <= step_no:
            req = pending.pop(0)[1]
            sched.add(req)
            live.append(req)
        step_no += 1
        if not sched.has_work and inflight is None:
            continue
        step = sched.schedule()
        preemptions += len(step.preempted)
        assert step.requests or inflight is not None, "scheduler made no progress although every request fits"
        assert len(step.requests) == len(step.num_tokens)
        assert len({id(r) for r in step.requests}) == len(step.requests), "a request scheduled twice in one step"
        assert step.total_tokens <= sched.max_num_batched_tokens
        assert len(step.requests) <= sched.max_num_seqs
        for victim in step.preempted:
            assert victim not in step.requests
            assert victim.block_ids == [] and victim.num_computed_tokens == 0
            assert victim.status == RequestStatus.WAITING
        check_invariants(bm, sched, [r for r in live if not r.is_finished])
        check_block_table(host_table.build(step.requests), step.requests)
        for req, n in zip(step.requests, step.num_tokens, strict=True):
            assert req.status == RequestStatus.RUNNING and req in sched.running
            assert n >= 1 and req.num_computed_tokens + n <= req.num_tokens
            assert req.num_generated <= req.max_new_tokens, "a request computed past its last token"
            assert len(req.block_ids) * bm.block_size >= req.num_computed_tokens + n, "too few blocks for the step"
            kv.check_computed(req)  # prefix-cache hits and kept blocks hold this request's tokens
        # the fake forward: write K/V, then what LLMEngine._launch() does
        sampled = [r for r, n in zip(step.requests, step.num_tokens, strict=True)
                   if r.num_computed_tokens + n == r.num_tokens]
        for req, n in zip(step.requests, step.num_tokens, strict=True):
            kv.write(bm, req, req.num_computed_tokens, n)
            req.num_computed_tokens += n
            if not req.num_pending_tokens:
                bm.commit(req)
        launched = []
        for req in sampled:
            launched.append((req, expected_token(req, req.num_generated)))
            req.num_pending_tokens += 1
        if lag:
            if inflight is not None:
                read_back(bm, sched, inflight)
            inflight = launched if step.requests else None
        else:
            read_back(bm, sched, launched)
        check_invariants(bm, sched, [r for r in live if not r.is_finished])
    return live, preemptions


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    prefixes = draw(st.lists(st.lists(st.sampled_from(ALPHABET), min_size=2, max_size=24), min_size=1, max_size=2))
    n = draw(st.integers(1, 8))
    specs = []
    for _ in range(n):
        base = draw(st.sampled_from(prefixes))
        cut = draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))  # mostly the whole shared prefix
        suffix = draw(st.lists(st.sampled_from(ALPHABET + (7, 8, 9)), min_size=0 if cut else 1, max_size=10))
        prompt = base[:cut] + suffix
        specs.append(dict(prompt=prompt, max_new=draw(st.integers(1, 12)), group=draw(st.integers(0, 2)),
                          arrival=draw(st.integers(0, 8))))
    need = max(-(-(len(s["prompt"]) + s["max_new"]) // block_size) for s in specs)
    num_blocks = need + 1 + draw(st.one_of(st.integers(0, 2), st.integers(0, 12)))  # often too few: preemption
    return dict(block_size=block_size, num_blocks=num_blocks, specs=specs,
                max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.integers(1, 48)),
                prefix_caching=draw(st.booleans()))


def _requests(specs) -> list[tuple[int, Request]]:
    out = []
    for i, s in enumerate(specs):
        req = Request(request_id=i + 1, prompt_token_ids=list(s["prompt"]), max_new_tokens=s["max_new"])
        req._group = s["group"]  # type: ignore[attr-defined]
        out.append((s["arrival"], req))
    return out


def check_workload(w, lag: bool = False) -> None:
    bm = BlockManager(w["num_blocks"], w["block_size"], enable_prefix_caching=w["prefix_caching"])
    sched = Scheduler(bm, w["max_num_seqs"], w["max_num_batched_tokens"])
    arrivals = _requests(w["specs"])
    live, _ = drive(bm, sched, arrivals, lag=lag)
    assert len(live) == len(arrivals)
    for req in live:
        assert req.is_finished and req.finish_reason == "length"
        want = [expected_token(req, k) for k in range(req.max_new_tokens)]
        assert req.output_token_ids == want, f"request {req.request_id}: lost or duplicated tokens"
        assert req.block_ids == []
    assert not sched.running and not sched.waiting
    assert bm.num_free_blocks == bm.num_blocks - 1
    assert all(c == 0 for c in bm.ref_counts)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_scheduler_loop_properties(w):
    check_workload(w)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_scheduler_loop_properties_async(w):
    """The same properties when each step is planned before the previous step's tokens are read back."""
    check_workload(w, lag=True)


@st.composite
def shared_prefix_waves(draw):
    """Requests over one long common prefix, arriving in waves: later waves hit the prefix cache."""
    block_size = draw(st.sampled_from([1, 2, 4]))
    prefix = draw(st.lists(st.sampled_from(ALPHABET), min_size=block_size + 1, max_size=40))
    specs = []
    for wave in range(draw(st.integers(2, 4))):
        for _ in range(draw(st.integers(1, 3))):
            suffix = draw(st.lists(st.sampled_from((7, 8, 9)), min_size=0, max_size=5))
            specs.append(dict(prompt=prefix + suffix, max_new=draw(st.integers(1, 8)), group=draw(st.integers(0, 1)),
                              arrival=wave * draw(st.integers(1, 12))))
    need = max(-(-(len(s["prompt"]) + s["max_new"]) // block_size) for s in specs)
    return dict(block_size=block_size, num_blocks=need + 1 + draw(st.integers(0, 3 * need)), specs=specs,
                max_num_seqs=draw(st.integers(1, 8)), max_num_batched_tokens=draw(st.integers(4, 64)),
                prefix_caching=True)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_prefix_waves(), st.booleans())
def test_prefix_cache_waves_properties(w, lag):
    check_workload(w, lag)


@settings(max_examples=50, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4]), prompt_len=st.integers(1, 30), max_new=st.integers(1, 10),
       copies=st.integers(2, 5), caching=st.booleans(), lag=st.booleans())
def test_identical_requests_under_minimal_pool(block_size, prompt_len, max_new, copies, caching, lag):
    """Identical prompts in a pool that holds exactly one of them: constant preemption, still exact results."""
    prompt = [ALPHABET[i % len(ALPHABET)] for i in range(prompt_len)]
    need = -(-(prompt_len + max_new) // block_size)
    bm = BlockManager(need + 1, block_size, enable_prefix_caching=caching)
    sched = Scheduler(bm, max_num_seqs=copies, max_num_batched_tokens=64)
    arrivals = _requests([dict(prompt=prompt, max_new=max_new, group=1, arrival=0)] * copies)
    live, _ = drive(bm, sched, arrivals, lag=lag)
    for req in live:
        assert req.output_token_ids == [expected_token(req, k) for k in range(max_new)]
    assert bm.num_free_blocks == bm.num_blocks - 1


@pytest.mark.parametrize("lag", [False, True])
def test_preemption_really_happens(lag):
    """A fixed workload that must preempt (guards the property test against never exercising preemption)."""
    bm = BlockManager(7, 2, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    specs = [dict(prompt=[3 + i, 4, 5, 6], max_new=6, group=0, arrival=0) for i in range(4)]
    live, preemptions = drive(bm, sched, _requests(specs), lag=lag)
    assert preemptions > 0
    assert any(r.num_preemptions for r in live)
    for req in live:
        assert req.output_token_ids == [expected_token(req, k) for k in range(6)]
    assert bm.num_free_blocks == bm.num_blocks - 1


def test_scheduler_refuses_request_larger_than_pool():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    with pytest.raises(ValueError):
        sched.add(Request(request_id=1, prompt_token_ids=[3] * 10, max_new_tokens=3))  # 13 tokens: 4 blocks > 3
    sched.add(Request(request_id=2, prompt_token_ids=[3] * 9, max_new_tokens=3))  # 12 tokens: 3 blocks
    assert len(sched.waiting) == 1


# -- BlockManager directly -------------------------------------------------------------------------------------------
def test_block_zero_never_handed_out_and_failed_ensure_changes_nothing():
    bm = BlockManager(6, 4)
    a = make_request(1, range(3, 23))  # 20 tokens: all 5 usable blocks
    assert bm.ensure(a, 20)
    assert sorted(a.block_ids) == [1, 2, 3, 4, 5]
    assert bm.num_free_blocks == 0
    b = make_request(2, [3])
    assert not bm.ensure(b, 1)
    assert b.block_ids == [] and bm.num_free_blocks == 0
    assert not bm.ensure(a, 21)  # one more block than exists
    assert len(a.block_ids) == 5
    bm.release(a)
    assert bm.num_free_blocks == 5 and 0 not in bm.free
    a.block_ids = [1]
    with pytest.raises(AssertionError, match="freed twice"):
        bm.release(a)  # double free is detected


def test_prefix_hit_reuses_blocks_and_skips_the_last_token_block():
    bs = 4
    bm = BlockManager(16, bs)
    tokens = list(range(3, 3 + 2 * bs + 1))  # two full blocks + 1
    a = make_request(1, tokens)
    assert bm.admit(a) == 0
    compute_all(bm, a)
    assert len(a.block_hashes) == 2
    first_blocks = a.block_ids[:2]
    bm.release(a)
    assert bm.num_free_blocks == 15
    b = make_request(2, tokens)
    assert bm.admit(b) == 2 * bs
    assert b.block_ids == first_blocks
    assert bm.ref_counts[first_blocks[0]] == 1 and first_blocks[0] not in bm.free
    # exactly two full blocks: the block holding the last token is recomputed, so only one is a hit
    c = make_request(3, tokens[: 2 * bs])
    assert bm.admit(c) == bs
    assert c.block_ids == first_blocks[:1]
    assert bm.ref_counts[first_blocks[0]] == 2
    bm.release(b)
    bm.release(c)
    assert bm.num_free_blocks == 15 and all(x == 0 for x in bm.ref_counts)


def test_prefix_cache_chain_depends_on_everything_before():
    bs = 2
    bm = BlockManager(16, bs)
    a = make_request(1, [3, 4, 5, 6, 7])
    compute_all(bm, a)
    b = make_request(2, [9, 9, 5, 6, 7])  # same second block, different first: no hit at all
    assert bm.admit(b) == 0
    assert hash_block(None, [3, 4]) != hash_block(None, [9, 9])
    assert hash_block(hash_block(None, [3, 4]), [5, 6]) != hash_block(hash_block(None, [9, 9]), [5, 6])


def test_prefix_caching_off():
    bm = BlockManager(16, 2, enable_prefix_caching=False)
    a = make_request(1, [3, 4, 5, 6, 7])
    compute_all(bm, a)
    assert not bm.cached and all(h is None for h in bm.block_hash)
    bm.release(a)
    assert bm.admit(make_request(2, [3, 4, 5, 6, 7])) == 0


def test_uncached_blocks_reused_before_cached_ones_and_eviction_forgets_hash():
    bs = 2
    bm = BlockManager(5, bs)  # 4 usable
    a = make_request(1, [3, 4, 5])  # one full block (cached after commit) + a partial one
    compute_all(bm, a)
    cached_block, partial_block = a.block_ids
    assert bm.block_hash[cached_block] is not None and bm.block_hash[partial_block] is None
    bm.release(a)
    b = make_request(2, [8])
    assert bm.ensure(b, 1)
    assert b.block_ids == [partial_block], "an uncached free block must be reused before a cached one"
    hit = make_request(3, [3, 4, 5])
    assert bm.admit(hit) == bs and hit.block_ids == [cached_block]  # still cached
    bm.release(hit)
    bm.release(b)
    c = make_request(4, list(range(3, 11)))
    assert bm.ensure(c, 8)  # every usable block: the cached one is evicted
    assert bm.block_hash[cached_block] is None and not bm.cached
    bm.release(c)
    assert bm.admit(make_request(5, [3, 4, 5])) == 0


def test_host_block_table_rejects_a_position_past_a_rows_blocks():
    """A wider row pads the others with zeros; a position past a row's own blocks must raise, not map to block 0."""
    a, b = make_request(1, [5] * 40), make_request(2, [5] * 10)
    a.block_ids, b.block_ids = [3, 4, 5], [7]
    table = HostBlockTable(4, 8)
    assert table.build([a, b]).tolist() == [[3, 4, 5], [7, 0, 0]]
    table.covers(np.array([47, 15]), 16)  # the last slot of each row's blocks
    with pytest.raises(RuntimeError, match="row 1 .* past its 1 KV blocks"):
        table.covers(np.array([40, 16]), 16)
