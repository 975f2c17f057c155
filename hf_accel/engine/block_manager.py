"""Paged KV block allocation with prefix caching.

Blocks are reference counted. A block that is full and computed gets a hash chained on its parent's hash and its
tokens, so two requests that share a prefix share its blocks. A block whose count drops to zero stays cached in an
LRU free list: it is reused as-is if its prefix comes back, and evicted (its hash forgotten) only when the
allocator needs a fresh block. Block 0 is the null block: never handed out, target of padded block-table entries.

Exceptions (a KeyboardInterrupt can land between any two bytecodes, an error anywhere in a step) are handled in two
layers:
- Every multi-step mutation is ordered so that an interruption can only *leak* (a block neither free nor recorded by
  a request, or a reference count too high), never hand a block to two owners, put a held block on the free list or
  leave a prefix-cache entry pointing at a block whose KV may be overwritten. A leak costs capacity; the others
  cost wrong answers. In particular a request drops its block list before the counts are decremented, a block's
  hash is evicted before the block leaves the free list, and `block_hash[b]` is set before `cached[h]`.
- `reconcile(live_requests)`, called by whoever caught the exception once the dead requests are dropped, rebuilds
  the reference counts and the free list from the block lists of the requests still alive, which repairs any such
  leak. It is idempotent, so an interruption of reconcile itself is repaired by calling it again.
`check_invariants(live_requests)` states what consistency means (the tests call it after injected faults).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable

from hf_accel.engine.request import Request


def hash_block(parent: bytes | None, tokens: list[int]) -> bytes:
    """A collision-resistant key for a full block given everything before it."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def unique_requests(requests: Iterable[Request]) -> list[Request]:
    """The requests, each once (a request may be listed twice while the scheduler moves it between queues)."""
    return list({id(r): r for r in requests}.values())


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # free blocks, least recently freed first; cached ones keep their hash until evicted
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------------------------
    def _prompt_hashes(self, req: Request) -> list[bytes]:
        """Hashes of the request's full blocks, excluding the block holding its last token (which must be
        recomputed to produce logits)."""
        tokens = req.all_token_ids
        full = (len(tokens) - 1) // self.block_size
        hashes, parent = [], None
        for i in range(full):
            parent = hash_block(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    def admit(self, req: Request) -> int:
        """Start a request with no blocks: take its cached prefix blocks. Returns the number of cached tokens."""
        assert not req.block_ids
        req.block_hashes = []
        if not self.enable_prefix_caching:
            return 0
        hits = []
        req.admitted_block_hashes = hashes = self._prompt_hashes(req)  # commit() reuses them
        for h in hashes:  # look up first (the hashing is the slow part), then take the blocks
            block = self.cached.get(h)
            if block is None:
                break
            hits.append((h, block))
        for h, block in hits:
            # off the free list (if there: a block leaked by an interruption is not), counted, then recorded:
            # interrupted in between, the block is over-counted (a leak reconcile() repairs), never free and held
            self.free.pop(block, None)
            self.ref_counts[block] += 1
            req.block_ids.append(block)
            req.block_hashes.append(h)
        return len(req.block_ids) * self.block_size

    def commit(self, req: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        # only blocks whose token values the host knows (a pending token is hashed once it is read back)
        known = min(req.num_computed_tokens, req.num_known_tokens)
        num_full = min(known // self.block_size, len(req.block_ids))
        if len(req.block_hashes) >= num_full:  # no block filled since the last commit (most steps)
            return
        admitted = req.admitted_block_hashes  # the same chain over the blocks full at admission: hashed then
        while len(req.block_hashes) < num_full:
            i = len(req.block_hashes)
            if i < len(admitted):
                h = admitted[i]
            else:
                parent = req.block_hashes[-1] if req.block_hashes else None
                h = hash_block(parent, req.known_token_ids(i * self.block_size, (i + 1) * self.block_size))
            block = req.block_ids[i]
            if h not in self.cached and self.block_hash[block] is None:
                # the block's own hash first: interrupted before the cache entry, the prefix is merely not found;
                # the other order could leave an entry that eviction (which starts from block_hash) never clears
                self.block_hash[block] = h
                self.cached[h] = block
            req.block_hashes.append(h)

    def forget_prefixes(self) -> None:
        """Drop every cached prefix (the KV it holds no longer matches the model, e.g. after a weight update)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks

    # -- allocation ---------------------------------------------------------------------------------------------
    def ensure(self, req: Request, num_tokens: int) -> bool:
        """Give `req` enough blocks for `num_tokens` tokens; False (and nothing changed) if there are too few.

        Per block, in an order whose every intermediate state is safe: the block's cached prefix (if any) is
        evicted while the block is still free (a free block without a hash is consistent), the block leaves the free
        list, gets its count, and only then is recorded in the request. Interrupted after it left the free list and
        before the request recorded it, the block is leaked, not shared; reconcile() gives it back. (Recording it in
        the request first would be worse: a held block still on the free list, handed out again by the next ensure
        unless something reconciles first.)"""
        need = self.blocks_needed(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        for _ in range(need):
            block = next(iter(self.free))  # least recently freed
            old = self.block_hash[block]
            if old is not None:  # evict: this cached prefix is gone
                if self.cached.get(old) == block:
                    del self.cached[old]
                self.block_hash[block] = None
            del self.free[block]
            self.ref_counts[block] = 1
            req.block_ids.append(block)
        return True

    def release(self, req: Request) -> None:
        """Drop the request's references. Tail blocks are freed first so they are evicted before shared heads.

        The request lets go of its block list before any count is decremented: interrupted halfway, the blocks not
        yet decremented are leaked (reconcile() repairs that), and a second release() of the same request cannot
        free them twice."""
        blocks = req.block_ids
        req.block_ids = []
        req.block_hashes = []
        for block in reversed(blocks):
            count = self.ref_counts[block]
            assert count > 0, f"block {block} freed twice"
            self.ref_counts[block] = count - 1
            if count == 1:
                if self.block_hash[block] is None:
                    self.free[block] = None
                    self.free.move_to_end(block, last=False)  # uncached blocks are reused first
                else:
                    self.free[block] = None

    # -- consistency --------------------------------------------------------------------------------------------
    def reconcile(self, live_requests: Iterable[Request]) -> int:
        """Make the block state agree with the requests still alive, after an exception anywhere.

        Reference counts are recomputed from the live requests' block lists; every block none of them holds (block
        0 aside) goes back on the free list: blocks already free keep their LRU order, recovered ones are added as
        release() would add them (uncached first in line, cached last). Prefix-cache entries are kept when the
        entry and the block's hash agree: such a block was registered after its KV was computed and a block is only
        written while held and unhashed, so its KV is intact. An entry or hash without its counterpart (an
        interrupted commit or eviction) is dropped. Live requests must be in a consistent state themselves; the
        requests of the failed call must already be dropped (their blocks are simply not counted).

        Idempotent, and harmless when nothing leaked. Returns the number of blocks that were neither free nor held
        by a live request (leaked) and are free again."""
        live = unique_requests(live_requests)
        counts = [0] * self.num_blocks
        for req in live:
            for block in req.block_ids:
                counts[block] += 1
        block_hash: list[bytes | None] = [None] * self.num_blocks
        cached: dict[bytes, int] = {}
        for h, block in self.cached.items():
            if 0 < block < self.num_blocks and self.block_hash[block] == h:
                cached[h] = block
                block_hash[block] = h
        free: OrderedDict[int, None] = OrderedDict(
            (b, None) for b in self.free if 0 < b < self.num_blocks and counts[b] == 0)
        recovered = [b for b in range(1, self.num_blocks) if counts[b] == 0 and b not in free]
        for block in recovered:
            if block_hash[block] is None:
                free[block] = None
                free.move_to_end(block, last=False)
            else:
                free[block] = None
        # every field computed above; each assignment is atomic and a partial update is repaired by calling again
        self.ref_counts = counts
        self.block_hash = block_hash
        self.cached = cached
        self.free = free
        return len(recovered)

    def check_invariants(self, live_requests: Iterable[Request]) -> None:
        """Raise AssertionError unless the block state is consistent with `live_requests` (every request that may
        hold blocks): free, held and the null block partition the cache; each count is the number of live requests
        holding the block; the prefix cache and the blocks' hashes agree; no request holds a block twice."""

        def check(cond: bool, msg: str) -> None:
            if not cond:  # not `assert`: this must hold under python -O too
                raise AssertionError(msg)

        live = unique_requests(live_requests)
        holders = [0] * self.num_blocks
        for req in live:
            check(len(set(req.block_ids)) == len(req.block_ids),
                  f"request {req.request_id} holds a block twice: {req.block_ids}")
            for block in req.block_ids:
                check(0 < block < self.num_blocks, f"request {req.request_id} holds block {block}")
                holders[block] += 1
        check(0 not in self.free, "the null block is on the free list")
        check(len(self.ref_counts) == self.num_blocks and self.ref_counts[0] == 0, "the null block is counted")
        owned = {b for b in range(1, self.num_blocks) if holders[b]}
        free = set(self.free)
        check(len(free) == len(self.free), "a block is on the free list twice")
        check(all(0 < b < self.num_blocks for b in free), f"free list holds foreign blocks {sorted(free)}")
        check(not (free & owned), f"blocks both free and held: {sorted(free & owned)}")
        lost = set(range(1, self.num_blocks)) - free - owned
        check(not lost, f"blocks neither free nor held by a live request (leaked): {sorted(lost)}")
        for b in range(1, self.num_blocks):
            check(self.ref_counts[b] == holders[b],
                  f"block {b}: ref count {self.ref_counts[b]}, held by {holders[b]} live requests")
        for h, b in self.cached.items():
            check(0 < b < self.num_blocks and self.block_hash[b] == h,
                  f"prefix-cache entry for block {b} disagrees with the block's hash")
        for b in range(self.num_blocks):
            h = self.block_hash[b]
            check(h is None or self.cached.get(h) == b, f"block {b} has a hash the prefix cache does not map to it")
