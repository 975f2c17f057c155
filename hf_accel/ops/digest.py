"""A content digest of many GPU tensors in one kernel launch: the per-call weight check of the prefix cache.

Before a call reuses cached prefixes, the engine checks that the weights they were computed under are still the
model's (`engine.model_state.weights_digest`). With torch operations that meant gathering small tensors into 256 MiB
chunks (a copy) and two reductions per chunk: about 15 ms per call for a 0.6B model on an H200 and 63 ms for an 8B,
a few percent of a single-stream call. Here one launch reads every tensor in place at memory speed.

The tensors' bytes are taken in order as one stream of int32 words, each word `w` at stream position `p` (from 0)
adding `w * a(p)` and `w * b(p)` to two int64 sums (wrapping: exact modulo 2^64), with `a(p) = (2p + 1) * A` and
`b(p) = ((p ^ (p >> 17)) * B) | 1` for odd 64-bit constants A and B. Every such weight is odd, hence invertible
modulo 2^64, so changing any single word changes both sums. Swapping two different words at positions i and j
changes the first sum by `(w_i - w_j) * 2 (i - j) * A`, which is not 0 modulo 2^64 while the positions are less
than 2^32 words (16 GiB) apart, since a word difference has at most 31 factors of two. Like the torch path it
replaces, it is not a cryptographic hash: an edit crafted to cancel in both sums goes unseen; ordinary edits (an
optimizer step, scaling, a copy of other weights, a permutation, any single element) do not.

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
_A = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constants, as signed int64
_B = 0xC2B2AE3D27D4EB4F - (1 << 64)


@triton.jit
def _digest_kernel(table_ptr, out_ptr, A: tl.constexpr, B: tl.constexpr, BLOCK: tl.constexpr):
    """table: int64 [3, programs] (address, words, stream position of the first word); out: int64 [2, programs]."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    words = tl.load(table_ptr + programs + pid)
    first = tl.load(table_ptr + 2 * programs + pid)
    src = tl.load(table_ptr + pid).to(tl.pointer_type(tl.int32))
    sum_a = tl.zeros([BLOCK], dtype=tl.int64)
    sum_b = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, words, BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        w = tl.load(src + offs, mask=offs < words, other=0).to(tl.int64)
        p = first + offs
        sum_a += w * ((2 * p + 1) * A)
        sum_b += w * (((p ^ (p >> 17)) * B) | 1)
    tl.store(out_ptr + pid, tl.sum(sum_a, axis=0))
    tl.store(out_ptr + programs + pid, tl.sum(sum_b, axis=0))


def _words(data: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view as int32 words: in place when aligned and a whole number of words, else an aligned copy
    padded with zero bytes (a tensor of an odd number of bf16 values, a bool mask)."""
    if data.numel() % 4 == 0 and data.data_ptr() % 4 == 0:
        return data.view(torch.int32)
    padded = torch.zeros(-(-data.numel() // 4) * 4, dtype=torch.uint8, device=data.device)
    padded[: data.numel()] = data
    return padded.view(torch.int32)


def digest_sums(byte_views: list[torch.Tensor]) -> torch.Tensor:
    """The two int64 sums (module docstring) of the flat uint8 tensors `byte_views`, all on one device, taken in
    order as one stream of words; an int64 tensor of 2 on that device. One kernel launch for all of them."""
    if not byte_views:
        return torch.zeros(2, dtype=torch.int64)
    device = byte_views[0].device
    keep, addresses, counts, firsts = [], [], [], []
    position = 0
    for data in byte_views:
        words = _words(data)
        keep.append(words)  # alive until the kernel has read it (a padded copy has no other owner)
        n, base = words.numel(), words.data_ptr()
        for start in range(0, n, SLICE_WORDS):
            addresses.append(base + 4 * start)
            counts.append(min(SLICE_WORDS, n - start))
            firsts.append(position + start)
        position += n
    if not addresses:
        return torch.zeros(2, dtype=torch.int64, device=device)
    table = torch.tensor([addresses, counts, firsts], dtype=torch.int64).to(device)
    out = torch.empty((2, len(addresses)), dtype=torch.int64, device=device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _digest_kernel[(len(addresses),)](table, out, A=_A, B=_B, BLOCK=_BLOCK)
    return out.sum(dim=1)  # the copies in `keep` may go now: the allocator reuses them only after the kernel


def reference_sums(byte_views: list[torch.Tensor]) -> torch.Tensor:
    """`digest_sums` in plain torch on any device (tests): the same two numbers, more memory and time."""
    words = torch.cat([_words(d.cpu()) for d in byte_views]).to(torch.int64) if byte_views else torch.zeros(0)
    p = torch.arange(words.numel(), dtype=torch.int64)
    return torch.stack([(words * ((2 * p + 1) * _A)).sum(), (words * (((p ^ (p >> 17)) * _B) | 1)).sum()])

