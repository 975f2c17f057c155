"""Unified paged attention: prefill chunks, decodes and mixed batches in one launch.

Each program owns one KV head and a tile of `BLOCK_Q` consecutive query tokens of one sequence, with all the query
heads that share that KV head stacked as rows (`BLOCK_M = BLOCK_Q * GROUP_PAD`), so each K/V tile is read once for
the whole GQA group and both products are `tl.dot`s. The grid is `(num_tokens // BLOCK_Q + num_seqs + 1,
num_kv_heads)`: an upper bound on the query tiles of any batch with that many (padded) tokens and sequences, so it
depends on tensor shapes only (CUDA-graph safe); each program finds its sequence by binary search over
`query_start_loc` and exits early if it has no tile. Rows of graph-padded sequences (`seq_len == 0`) and rows past
the last sequence are written as zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.attention.kernels.common import TileConfig, attend_tile, dot_precision, find_seq
from hf_accel.ops.pdl import launch_kwargs
from hf_accel.ops.triton_build import launcher, settle_cache_keys


@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "window"])
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    scale, softcap, window, num_tokens, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # the query, the KV just written and the output all belong to earlier kernels of the step
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Last query tiles first: under causal masking they have the most keys, so the long programs start early and
    # the short ones fill the tail of the launch.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = find_seq(query_start_loc_ptr, pid, num_seqs, BLOCK_Q, True)
    is_real = seq < num_seqs
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.where(is_real, tl.load(query_start_loc_ptr + tl.minimum(seq + 1, num_seqs)), num_tokens)
    seq_len = tl.where(is_real, tl.load(seq_lens_ptr + tl.minimum(seq, num_seqs - 1)), 0)
    q_len = q_end - q_start
    q0 = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query token of this tile, within the sequence
    if q0 >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    tok = q0 + offs_m // GROUP_PAD
    group_idx = offs_m % GROUP_PAD
    head = kv_head * GROUP + group_idx
    row_valid = (tok < q_len) & (group_idx < GROUP)
    io_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = (q_start + tok).to(tl.int64)
    out_ptrs = out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if seq_len == 0:  # graph padding / rows past the last sequence: zeros, no KV read
        tl.store(out_ptrs, tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=out_ptr.dtype.element_ty), mask=io_mask)
        return

    q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=io_mask,
                other=0.0)
    context_len = seq_len - q_len
    q_pos = context_len + tok
    last_tok = tl.minimum(q0 + BLOCK_Q, q_len) - 1
    kv_end = context_len + last_tok + 1  # exclusive: the last row's own position is the farthest key
    # Keys in [full_lo, full_hi) are visible to every row of the tile: no masking there.
    full_hi = ((context_len + q0 + 1) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    bt_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    if USE_WINDOW:
        kv_start = (tl.maximum(context_len + q0 - window + 1, 0) // BLOCK_N) * BLOCK_N
        in_window_all = tl.maximum(context_len + last_tok - window + 1, 0)
        full_lo = tl.maximum(((in_window_all + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, kv_start)
        full_hi = tl.maximum(full_hi, full_lo)
        for start_n in range(kv_start, tl.minimum(full_lo, kv_end), BLOCK_N):
            acc, m_i, l_i = attend_tile(
                acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_ptr, start_n, kv_end, q_pos, row_valid, kv_head,
                scale, softcap, window, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, True, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION,
            )
    else:
        full_lo = 0

    for start_n in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_ptr, start_n, kv_end, q_pos, row_valid, kv_head,
            scale, softcap, window, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, False, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION,
        )
    for start_n in range(full_hi, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_ptr, start_n, kv_end, q_pos, row_valid, kv_head,
            scale, softcap, window, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, True, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION,
        )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def unified_tile_config(head_dim: int, group: int, max_query_len: int) -> TileConfig:
    """Tile shape for the unified kernel (Hopper-oriented; any choice is correct for any batch).

    Decode-like steps use the smallest MMA row count (16) so one program covers a GQA group of one token and
    streams KV; prefill uses large query tiles so each K/V tile is reused across many rows.
    """
    head_dim_pad = triton.next_power_of_2(head_dim)
    group_pad = triton.next_power_of_2(group)
    if max_query_len * group_pad <= 16:
        block_m = max(16, group_pad)
        return TileConfig(block_m, 64 if head_dim_pad <= 128 else 32, 4, 3 if head_dim_pad <= 128 else 2)
    if head_dim_pad <= 64:
        return TileConfig(max(128, group_pad), 64, 8, 3)
    if head_dim_pad <= 128:
        return TileConfig(max(128, group_pad), 64, 8, 2)
    return TileConfig(max(64, group_pad), 32, 8, 2)  # 256-wide accumulators: 8 warps keep them out of local memory


def unified_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, output: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, sliding_window: int, softcap: float, max_query_len: int,
                      config: TileConfig | None = None, use_pdl: bool = False) -> None:
    """Paged attention for packed query `[T, H, D]` into `output` `[T, H, D]` (every row written).

    `seq_lens.shape[0]` sequences (padded ones have length 0) own rows `query_start_loc[i]:query_start_loc[i+1]`;
    rows from `query_start_loc[num_seqs]` to `T` are zeroed. `max_query_len` only picks the tile shape.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0:
        return
    if num_seqs == 0:
        output.zero_()
        return
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert query.stride(-1) == 1 and output.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert query_start_loc.shape[0] >= num_seqs + 1 and block_tables.shape[0] >= num_seqs
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    cfg = config or unified_tile_config(head_dim, group, max_query_len)
    block_m = max(cfg.block_m, group_pad)
    block_q = block_m // group_pad
    grid = (num_tokens // block_q + num_seqs + 1, num_kv_heads)
    launcher(_unified_attention_kernel, grid, writes=(output,))(
        query, k_cache, v_cache, output, query_start_loc, seq_lens, block_tables,
        float(scale), float(softcap), int(sliding_window), num_tokens, num_seqs,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        USE_WINDOW=sliding_window > 0, USE_SOFTCAP=softcap > 0, DOT_PRECISION=dot_precision(query.dtype),
        USE_PDL=use_pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(use_pdl),
    )


# keys that do not depend on which kernel a process launches first (ops/triton_build.py)
settle_cache_keys(globals())
