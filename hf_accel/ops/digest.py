"""A content digest of many GPU tensors in one kernel launch: the per-call weight check of the prefix cache.

Before a call reuses cached prefixes, the engine checks that the weights they were computed under are still the
model's (`engine.model_state.weights_digest`). With torch operations that meant gathering small tensors into 256 MiB
chunks (a copy) and two reductions per chunk: on an H200 about 5 ms per call for a 0.6B model and 55 ms for an 8B,
a few percent of a single-stream call. Here one launch reads the tensors where they lie (only a tensor that is not
contiguous, or not 16-byte aligned and a whole number of 16 bytes, is copied first).

The tensors' bytes (each zero-padded to a multiple of 16) are taken in order as one stream of int32 words, each
word `w` at stream position `p` (from 0) adding `w * a(p)` and `w * b(p)` to two int64 sums (wrapping: exact modulo
2^64), with `a(p) = (2p + 1) * A` and `b(p) = (h ^ (h >> 29)) | 1` where `h = p * B`, for odd 64-bit constants A and
B. What the sums guarantee:
- every weight is odd, hence invertible modulo 2^64, so changing any single word changes both sums;
- swapping two different words at positions i and j changes the first sum by `(w_i - w_j) * 2 (i - j) * A`, which
  is not 0 modulo 2^64 while the positions are less than 2^32 words (16 GiB, padding included, per GPU) apart, since
  a word difference has at most 31 factors of two;
- the first sum is linear in p, so it only sees two moments of the words (their sum and their position-weighted
  sum): an edit of many words that keeps both (scaling a whole float32 tensor by 2 can, at some offsets) is seen by
  the second sum alone, whose weights are not linear in p. It is a hash, not a proof, for such edits.
Like the torch path it replaces, it is not cryptographic: an edit crafted to cancel in both sums goes unseen;
ordinary edits (an optimizer step, scaling, a copy of other weights, a permutation, any single element) do not.

Each program reads one slice of up to `SLICE_WORDS` words of one tensor, located through a table of (address, words,
stream position) built on the host with numpy and kept on the device while the tensors stay where they are, and
writes its two partial sums; torch adds the partials (a wrapping int64 sum) and one device-to-host copy by the
caller brings the two numbers back.

This module imports triton at the top; callers import it lazily.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import torch
import triton
import triton.language as tl

from hf_accel.ops.triton_build import launcher, settle_cache_keys

SLICE_WORDS = 1 << 18  # int32 words per program (1 MiB): a 0.6B model is ~1,300 programs, an 8B ~16,000
_BLOCK = 2048  # words per loop step of a program
_ALIGN = 16  # bytes: every slice starts on a 16-byte boundary and is read with 128-bit loads
_COPY_BUDGET = 256 << 20  # bytes of copies (non-contiguous or unaligned tensors) alive at once; beyond, one more launch
_A = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constants, as signed int64
_B = 0xC2B2AE3D27D4EB4F - (1 << 64)

# device tables of the last layouts seen (device, addresses, words) -> int64 table: a model whose tensors stay where
# they are builds its table once
_tables: dict[tuple, torch.Tensor] = {}
_tables_lock = threading.Lock()
_MAX_TABLES = 8


@triton.jit
def _digest_kernel(table_ptr, out_ptr, A: tl.constexpr, B: tl.constexpr, BLOCK: tl.constexpr):
    """table: int64 [3, programs] (the slice's address, 16-byte aligned; its words; the stream position of its
    first word); out: int64 [2, programs]. Whole blocks are read with vector loads; only a slice's last partial
    block is masked. The position weights advance by a constant per block: one multiply per word and sum."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    words = tl.load(table_ptr + programs + pid)
    first = tl.load(table_ptr + 2 * programs + pid)
    src = tl.multiple_of(tl.load(table_ptr + pid).to(tl.pointer_type(tl.int32)), 16)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    step_a = lane * 2 * A  # a(p0 + lane) = a(p0) + 2 * lane * A
    step_b = lane * B  # h(p0 + lane) = h(p0) + lane * B
    sum_a = tl.zeros([BLOCK], dtype=tl.int64)
    sum_b = tl.zeros([BLOCK], dtype=tl.int64)
    full = words - words % BLOCK
    for start in range(0, full, BLOCK):
        w = tl.load(src + start + lane).to(tl.int64)
        p0 = first + start
        h = p0 * B + step_b
        sum_a += w * ((2 * p0 + 1) * A + step_a)
        sum_b += w * ((h ^ (h >> 29)) | 1)
    if full < words:
        w = tl.load(src + full + lane, mask=full + lane < words, other=0).to(tl.int64)
        p0 = first + full
        h = p0 * B + step_b
        sum_a += w * ((2 * p0 + 1) * A + step_a)
        sum_b += w * ((h ^ (h >> 29)) | 1)
    tl.store(out_ptr + pid, tl.sum(sum_a, axis=0))
    tl.store(out_ptr + programs + pid, tl.sum(sum_b, axis=0))


def _in_place(t: torch.Tensor) -> bool:
    """`t` can be read where it lies: contiguous, 16-byte aligned, a whole number of 16 bytes."""
    return t.is_contiguous() and t.data_ptr() % _ALIGN == 0 and t.nbytes % _ALIGN == 0


def _aligned_words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes in a fresh aligned buffer, zero-padded to a whole number of 16 bytes, as int32 words."""
    data = t.detach().contiguous()
    data = data.as_strided((data.numel(),), (1,)).view(torch.uint8)  # a one-element view may have any stride
    padded = torch.zeros(-(-data.numel() // _ALIGN) * _ALIGN, dtype=torch.uint8, device=data.device)
    padded[: data.numel()] = data
    return padded.view(torch.int32)


def _batches(tensors: list[torch.Tensor]) -> Iterator[tuple[list[int], list[int], list[torch.Tensor]]]:
    """The tensors as runs of words to read, (addresses, word counts, copies holding some of them), one batch per
    launch: all of them, unless the tensors that must be copied first (not contiguous, or not 16-byte aligned and a
    whole number of 16 bytes) pass `_COPY_BUDGET` together. A copy lives until its batch's launch is queued (the
    allocator reuses its memory only after that launch, in stream order)."""
    addresses: list[int] = []
    words: list[int] = []
    copies: list[torch.Tensor] = []
    copied = 0
    for t in tensors:
        if _in_place(t):
            addresses.append(t.data_ptr())
            words.append(t.nbytes // 4)
            continue
        if copies and copied + t.nbytes > _COPY_BUDGET:
            yield addresses, words, copies
            addresses, words, copies, copied = [], [], [], 0
        copy = _aligned_words(t)
        assert copy.data_ptr() % _ALIGN == 0, "the allocator returned an address the kernel's vector loads cannot read"
        copies.append(copy)
        copied += copy.nbytes
        addresses.append(copy.data_ptr())
        words.append(copy.numel())
    yield addresses, words, copies


def _table(addresses: list[int], words: list[int], position: int, device: torch.device) -> torch.Tensor:
    """The kernel's table for these runs of words, the first at stream `position` (module docstring)."""
    base = np.asarray(addresses, dtype=np.int64)
    n = np.asarray(words, dtype=np.int64)
    slices = -(-n // SLICE_WORDS)  # per run; 0 for an empty one
    first = position + np.cumsum(n) - n
    owner = np.repeat(np.arange(n.size), slices)
    start = (np.arange(int(slices.sum())) - np.repeat(np.cumsum(slices) - slices, slices)) * SLICE_WORDS
    rows = np.stack([base[owner] + 4 * start, np.minimum(SLICE_WORDS, n[owner] - start), first[owner] + start])
    return torch.from_numpy(rows).to(device)


def _remembered_table(addresses: list[int], words: list[int], device: torch.device) -> torch.Tensor:
    """`_table` from stream position 0, kept per (device, runs): a model whose tensors stay where they are builds
    its table once. Only for tensors read in place (a copy's address is new every call)."""
    key = (str(device), tuple(addresses), tuple(words))
    with _tables_lock:
        table = _tables.get(key)
    if table is None:
        table = _table(addresses, words, 0, device)
        with _tables_lock:
            if len(_tables) >= _MAX_TABLES:
                _tables.clear()
            _tables[key] = table
    return table


def digest_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The two int64 sums (module docstring) of the plain tensors `tensors`, all on one device, taken in order as
    one stream of words (each tensor's bytes zero-padded to a multiple of 16); an int64 tensor of 2 on that device.
    One kernel launch for all of them, or one per `_batches` batch when copies pass the budget."""
    assert SLICE_WORDS % (_ALIGN // 4) == 0, "slices must start on 16-byte boundaries"
    if not tensors:
        return torch.zeros(2, dtype=torch.int64)
    device = tensors[0].device
    total = torch.zeros(2, dtype=torch.int64, device=device)
    position = 0  # stream position of the batch's first word
    for addresses, words, copies in _batches(tensors):
        batch_words = sum(words)
        if batch_words:
            table = (_remembered_table(addresses, words, device) if position == 0 and not copies
                     else _table(addresses, words, position, device))
            programs = table.shape[1]
            out = torch.empty((2, programs), dtype=torch.int64, device=device)
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                launcher(_digest_kernel, (programs,))(table, out, A=_A, B=_B, BLOCK=_BLOCK)
            total += out.sum(dim=1)
        position += batch_words
    return total


def reference_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`digest_sums` in plain torch on the CPU (tests): the same two numbers, more memory and time."""
    words = (torch.cat([_aligned_words(t.cpu()) for t in tensors]).to(torch.int64) if tensors
             else torch.zeros(0, dtype=torch.int64))
    p = torch.arange(words.numel(), dtype=torch.int64)
    h = p * _B
    return torch.stack([(words * ((2 * p + 1) * _A)).sum(), (words * ((h ^ (h >> 29)) | 1)).sum()])


# keys that do not depend on which kernel a process launches first (ops/triton_build.py)
settle_cache_keys(globals())
