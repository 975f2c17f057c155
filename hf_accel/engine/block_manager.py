"""Paged KV block allocation with prefix caching.

Blocks are reference counted. A block that is full and computed gets a hash chained on its parent's hash and its
tokens, so two requests that share a prefix share its blocks. A block whose count drops to zero stays cached in an
LRU free list: it is reused as-is if its prefix comes back, and evicted (its hash forgotten) only when the
allocator needs a fresh block. Block 0 is the null block: never handed out, target of padded block-table entries.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from hf_accel.engine.request import Request


def hash_block(parent: bytes | None, tokens: list[int]) -> bytes:
    """A collision-resistant key for a full block given everything before it."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


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
        for h in self._prompt_hashes(req):
            block = self.cached.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free[block]
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
        while len(req.block_hashes) < num_full:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else None
            tokens = [req.token_at(j) for j in range(i * self.block_size, (i + 1) * self.block_size)]
            h = hash_block(parent, tokens)
            req.block_hashes.append(h)
            block = req.block_ids[i]
            if h not in self.cached and self.block_hash[block] is None:
                self.cached[h] = block
                self.block_hash[block] = h

    def forget_prefixes(self) -> None:
        """Drop every cached prefix (the KV it holds no longer matches the model, e.g. after a weight update)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks

    # -- allocation ---------------------------------------------------------------------------------------------
    def ensure(self, req: Request, num_tokens: int) -> bool:
        """Give `req` enough blocks for `num_tokens` tokens; False (and nothing changed) if there are too few."""
        need = self.blocks_needed(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        for _ in range(need):
            block, _ = self.free.popitem(last=False)
            old = self.block_hash[block]
            if old is not None:  # evict: this cached prefix is gone
                if self.cached.get(old) == block:
                    del self.cached[old]
                self.block_hash[block] = None
            self.ref_counts[block] = 1
            req.block_ids.append(block)
        return True

    def release(self, req: Request) -> None:
        """Drop the request's references. Tail blocks are freed first so they are evicted before shared heads."""
        for block in reversed(req.block_ids):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is None:
                    self.free[block] = None
                    self.free.move_to_end(block, last=False)  # uncached blocks are reused first
                else:
                    self.free[block] = None
        req.block_ids = []
        req.block_hashes = []
