"""Building blocks shared by the paged attention kernels: sequence lookup, softcap, one online-softmax KV tile.

Conventions (see hf_accel/attention/metadata.py): KV cache `[num_blocks, block_size, num_kv_heads, head_dim]`,
block tables map a sequence's logical block to a physical one, scores are kept in the log2 domain (scaled by
log2(e)) so the softmax uses `exp2`, which is a single hardware instruction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hf_accel.ops.triton_build import settle_cache_keys

LOG2E = tl.constexpr(1.4426950408889634)


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of an attention kernel: rows per program (query tokens x padded group heads), keys per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs would silently use TF32 on Ampere+; ask for exact products so fp32 matches the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def find_seq(query_start_loc_ptr, target, num_seqs, BLOCK_Q: tl.constexpr, ADD_INDEX: tl.constexpr):
    """Largest `i` in `[0, num_seqs]` with `key(i) <= target`, `key(i) = query_start_loc[i] // BLOCK_Q (+ i)`.

    With `ADD_INDEX` the key is the first query-tile index of sequence `i` in a grid that gives every sequence
    `cdiv(query_len, BLOCK_Q)` tiles: keys strictly increase, so the answer is the sequence that owns tile `target`
    (`num_seqs` is the virtual sequence holding rows past the last real one). Without it, the owner of token
    `target`. Done inside the kernel so the grid never depends on per-step lengths (CUDA graphs).
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        key = tl.load(query_start_loc_ptr + mid) // BLOCK_Q
        if ADD_INDEX:
            key += mid
        ok = key <= target
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def tanh(x):
    """tanh from exp2 (no libdevice needed, so it runs in the interpreter too); saturates cleanly to +-1."""
    e = tl.exp2(x * (2.0 * LOG2E))
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def attend_tile(
    acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, start_n, kv_end, q_pos, row_valid, kv_head,
    scale, softcap, window,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys `[start_n, start_n + BLOCK_N)` of one sequence and one KV head.

    `q` is `[BLOCK_M, HEAD_DIM_PAD]`, `q_pos` its rows' positions. With `MASKED` off, the caller guarantees every
    key of the tile exists and is visible to every row (interior tiles): no mask math, no load predicates.
    Keys are gathered through the block table, so a tile may span several pages.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    if MASKED:
        kv_ok = offs_n < kv_end
        page = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
    else:
        page = tl.load(block_table_ptr + offs_n // BLOCK_SIZE).to(tl.int64)
    slot_row = offs_n % BLOCK_SIZE
    k_ptrs = k_cache_ptr + page[:, None] * stride_kb + slot_row[:, None] * stride_ks + kv_head * stride_kh
    v_ptrs = v_cache_ptr + page[:, None] * stride_vb + slot_row[:, None] * stride_vs + kv_head * stride_vh
    k_ptrs += offs_d[None, :]
    v_ptrs += offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
    elif HEAD_DIM == HEAD_DIM_PAD:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)

    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    if USE_SOFTCAP:
        s = softcap * tanh(s * (scale / softcap)) * LOG2E
    else:
        s = s * (scale * LOG2E)
    if MASKED:
        visible = row_valid[:, None] & (offs_n[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        if USE_WINDOW:
            visible = visible & ((q_pos[:, None] - offs_n[None, :]) < window)
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: keep p = alpha = 0
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)

    if MASKED:
        v = tl.load(v_ptrs, mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
    elif HEAD_DIM == HEAD_DIM_PAD:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    v = v.to(q.dtype)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# keys that do not depend on which kernel a process launches first (ops/triton_build.py)
settle_cache_keys(globals())
