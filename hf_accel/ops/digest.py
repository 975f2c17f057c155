"""A content digest of many GPU tensors in one kernel launch: the per-call weight check of the prefix cache.

Before a call reuses cached prefixes, the engine checks that the weights they were computed under are still the
model's (`engine.model_state.weights_digest`). With torch operations that meant gathering small tensors into 256 MiB
chunks (a copy) and two reductions per chunk: about 15 ms per call for a 0.6B model on an H200 and 63 ms for an 8B,
a few percent of a single-stream call. Here one launch reads every tensor in place at memory speed.

The tensors' bytes (each zero-padded to a multiple of 16) are taken in order as one stream of int32 words, each
word `w` at stream position `p` (from 0) adding `w * a(p)` and `w * b(p)` to two int64 sums (wrapping: exact modulo
2^64), with `a(p) = (2p + 1) * A` and `b(p) = (h ^ (h >> 29)) | 1` where `h = p * B`, for odd 64-bit constants A and
B. Every such weight is odd, hence invertible modulo 2^64, so changing any single word changes both sums. Swapping
two different words at positions i and j changes the first sum by `(w_i - w_j) * 2 (i - j) * A`, which is not 0
modulo 2^64 while the positions are less than 2^32 words (16 GiB) apart, since a word difference has at most 31
factors of two. Like the torch path it replaces, it is not a cryptographic hash: an edit crafted to cancel in both
sums goes unseen; ordinary edits (an optimizer step, scaling, a copy of other weights, a permutation, any single
element) do not.

Each program reads one slice of up to `SLICE_WORDS` words of one tensor, located through a table of (address, words,
stream position) built on the host, and writes its two partial sums; torch adds the partials (a wrapping int64 sum)
and one device-to-host copy brings the two numbers back.

This module imports triton at the top; callers import it lazily.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

SLICE_WORDS = 1 << 18  # int32 words per program (1 MiB): a 0.6B model is ~1,300 programs, an 8B ~16,000
_BLOCK = 2048  # words per loop step of a program
_ALIGN = 16  # bytes: every tensor is read from a 16-byte boundary as a whole number of 16 bytes (vector loads)
_A = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constants, as signed int64
_B = 0xC2B2AE3D27D4EB4F - (1 << 64)


@triton.jit
def _digest_kernel(anchor_ptr, table_ptr, out_ptr, A: tl.constexpr, B: tl.constexpr, BLOCK: tl.constexpr):
    """table: int64 [3, programs] (where the slice starts, in int32 words from `anchor_ptr`; its words; the stream
    position of its first word); out: int64 [2, programs]. Slices start 16 bytes apart from the anchor (a multiple
    of 4 words, said to the compiler), so whole blocks are read with vector loads; only a slice's last partial block
    is masked. The position weights advance by a constant per block: one multiply per word and sum."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    words = tl.load(table_ptr + programs + pid)
    first = tl.load(table_ptr + 2 * programs + pid)
    src = anchor_ptr + tl.multiple_of(tl.load(table_ptr + pid), 4)
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
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    padded = torch.zeros(-(-data.numel() // _ALIGN) * _ALIGN, dtype=torch.uint8, device=data.device)
    padded[: data.numel()] = data
    return padded.view(torch.int32)


def digest_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The two int64 sums (module docstring) of the plain tensors `tensors`, all on one device, taken in order as
    one stream of words (each tensor's bytes zero-padded to a multiple of 16); an int64 tensor of 2 on that device.
    One kernel launch for all of them; a tensor is copied only when it is not contiguous and 16-byte aligned."""
    if not tensors:
        return torch.zeros(2, dtype=torch.int64)
    device = tensors[0].device
    keep, addresses, counts, firsts = [], [], [], []
    position = 0
    for t in tensors:
        if _in_place(t):
            base, n = t.data_ptr(), t.nbytes // 4
        else:
            words = _aligned_words(t)
            keep.append(words)  # alive until the kernel has been queued (the allocator reuses it only after)
            base, n = words.data_ptr(), words.numel()
        for start in range(0, n, SLICE_WORDS):
            addresses.append(base + 4 * start)
            counts.append(min(SLICE_WORDS, n - start))
            firsts.append(position + start)
        position += n
    if not addresses:
        return torch.zeros(2, dtype=torch.int64, device=device)
    out = torch.empty((2, len(addresses)), dtype=torch.int64, device=device)
    anchor = out.view(torch.int32)  # a 16-byte aligned address every slice is a whole number of words away from
    starts = [(a - anchor.data_ptr()) // 4 for a in addresses]
    table = torch.tensor([starts, counts, firsts], dtype=torch.int64).to(device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _digest_kernel[(len(addresses),)](anchor, table, out, A=_A, B=_B, BLOCK=_BLOCK)
    return out.sum(dim=1)


def reference_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`digest_sums` in plain torch on the CPU (tests): the same two numbers, more memory and time."""
    words = (torch.cat([_aligned_words(t.cpu()) for t in tensors]).to(torch.int64) if tensors
             else torch.zeros(0, dtype=torch.int64))
    p = torch.arange(words.numel(), dtype=torch.int64)
    h = p * _B
    return torch.stack([(words * ((2 * p + 1) * _A)).sum(), (words * ((h ^ (h >> 29)) | 1)).sum()])
