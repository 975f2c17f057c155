"""Split-KV ("flash-decoding") attention for uniform decode steps (one query token per sequence).

A small decode batch gives the unified kernel only `num_seqs * num_kv_heads` programs, far fewer than the GPU has
SMs, each streaming a whole (possibly 32k-token) KV history. Here every sequence's KV range is cut into
`num_splits` pieces handled by separate programs, each writing a normalised partial output and its log-sum-exp to
preallocated scratch; a second kernel merges the pieces. `num_splits` is a launch constant picked from the batch
shape (never from this step's lengths), and each program derives its key range from `seq_lens` on the device, so
a captured CUDA graph stays valid for any lengths; splits that get no keys write an empty partial (lse = -inf).

With `counters` (an int32 buffer of one zero per (sequence, KV head), owned by the caller) the merge runs inside the
same launch: each split that holds keys writes its partial, then takes a ticket from its (sequence, KV head)
counter; the program that draws the last ticket merges the partials of that group of query heads and sets the counter
back to zero for the next launch. At batch 1 this saves the merge kernel's launch on every layer; splits that get no
keys (most of them at short contexts, where the split count is set for the longest) exit at once. The merge combines
the same partials by the same formula as the merge kernel, but takes a GQA group's heads in one tile and the splits
in chunks (`_merge_group`) where the merge kernel takes one head per program, so the two add the splits' float32
terms in another order: the results agree to float32 rounding, not always to the bit (the GEMM's fused split-K
reduction, one sum per element in split order, does keep the bits).

With `num_splits == 1` there is nothing to merge: one program per (sequence, KV head) walks all of that pair's keys
and writes its output row directly. Wide decode batches run this way: against the unified kernel, each program
finds its sequence by its index instead of a binary search over the batch (a chain of dependent loads before the
first key), and needs no scratch. With a fused merge, a split whose sequence's keys fit one tile does the same.

Given also the step's new keys and values (`new_kv`), a fused or unsplit launch writes them into the cache itself:
the split that holds a sequence's last position stores that token's K/V row for its KV head, then waits for its own
threads (a block barrier) before it reads the tile that holds it. No other program reads that position, so the
separate KV write kernel of the step is saved too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.attention.kernels.common import TileConfig, attend_tile, dot_precision, find_seq
from hf_accel.attention.kernels.kv_write import store_at_slot, write_kv
from hf_accel.ops.pdl import launch_kwargs
from hf_accel.ops.triton_build import launcher, settle_cache_keys

MAX_SPLITS = 64
# Split only while the plain grid would leave the GPU under-filled, and aim for about this many programs per SM.
SPLIT_BELOW_PROGRAMS_PER_SM = 2
TARGET_PROGRAMS_PER_SM = 4


@triton.jit(do_not_specialize=["window", "num_splits"])
def _split_kv_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, seq_lens_ptr,
    block_tables_ptr, out_ptr, counters_ptr, new_k_ptr, new_v_ptr, slot_mapping_ptr, seq_order_ptr,
    scale, softcap, window, num_splits,
    stride_qt, stride_qh, stride_nkt, stride_nkh, stride_nvt, stride_nvh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_po_seq, stride_po_split, stride_po_head, stride_pl_seq, stride_pl_split, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_KV_HEADS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    FUSED_MERGE: tl.constexpr, WRITE_KV: tl.constexpr, IS_SPLIT: tl.constexpr, GROUP_PAD: tl.constexpr,
    MERGE_SPLITS: tl.constexpr, ORDERED: tl.constexpr,
):
    """IS_SPLIT off: one program per (sequence, KV head) over all its keys, writing the output row itself (rows are
    sequences). On: `num_splits` programs per pair; where only one of them gets keys (a context of one tile) and the
    merge is fused, it too writes the output row directly. ORDERED (unsplit only): a 1-D grid, program `p` takes KV
    head `p % NUM_KV_HEADS` of sequence `seq_order[p // NUM_KV_HEADS]`."""
    pid = tl.program_id(0)
    if ORDERED:
        kv_head = pid % NUM_KV_HEADS
        order_index = pid // NUM_KV_HEADS
    else:
        kv_head = tl.program_id(1)
        order_index = pid
    split = tl.program_id(2)
    # the query, the KV just written and the scratch the last merge read belong to earlier kernels: the PDL wait comes
    # before them. The step's metadata read here (launch order, lengths, query offsets) is no kernel's output
    # (ops/pdl.py), so its chain of dependent loads runs before the wait, overlapping the kernel before this one (an
    # A/B against reading it after the wait found no difference on an H100, session 35; this order is kept)
    if ORDERED:
        seq = tl.load(seq_order_ptr + order_index)
    else:
        seq = order_index
    seq_len = tl.load(seq_lens_ptr + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    head = kv_head * GROUP + offs_m
    row_valid = offs_m < GROUP
    d_ok = offs_d < HEAD_DIM
    row = (q_start + q_len - 1).to(tl.int64)
    if (seq_len == 0) | (q_len == 0):  # graph padding: zeros in its row (written by the merge kernel when unfused)
        if FUSED_MERGE or not IS_SPLIT:
            if (split == 0) & (q_len > 0):
                tl.store(out_ptr + row * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                         tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=out_ptr.dtype.element_ty),
                         mask=row_valid[:, None] & d_ok[None, :])
        return
    q = tl.load(q_ptr + row * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_ok[None, :], other=0.0)
    pos = seq_len - 1
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + pos

    if USE_WINDOW:
        kv_start = (tl.maximum(pos - window + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        kv_start = 0
    num_tiles = (seq_len - kv_start + BLOCK_N - 1) // BLOCK_N
    # `direct`: one program holds all of this pair's keys and writes the output row itself (no partial, no ticket)
    if IS_SPLIT:
        tiles_per_split = (num_tiles + num_splits - 1) // num_splits
        used_splits = (num_tiles + tiles_per_split - 1) // tiles_per_split  # the splits that get keys
        if FUSED_MERGE:
            if split >= used_splits:  # no keys: nothing to merge (the unfused merge reads its empty partial)
                return
            direct = used_splits == 1
        else:
            direct = used_splits < 0  # never: the merge kernel reads every split's partial
    else:
        tiles_per_split = num_tiles
        used_splits = 1
        direct = True
    if WRITE_KV:  # only when rows are sequences (fused merge, or no split): this row is the token at `pos`
        if split == used_splits - 1:  # the split whose range ends at pos
            slot = tl.load(slot_mapping_ptr + row)
            if slot >= 0:
                k_row = tl.load(new_k_ptr + row * stride_nkt + kv_head * stride_nkh + offs_d, mask=d_ok)
                v_row = tl.load(new_v_ptr + row * stride_nvt + kv_head * stride_nvh + offs_d, mask=d_ok)
                store_at_slot(k_cache_ptr, k_row, slot, kv_head * stride_kh + offs_d, stride_kb, stride_ks, d_ok,
                              BLOCK_SIZE)
                store_at_slot(v_cache_ptr, v_row, slot, kv_head * stride_vh + offs_d, stride_vb, stride_vs, d_ok,
                              BLOCK_SIZE)
            tl.debug_barrier()  # the block's stores are visible to its own loads of that tile below
    lo = kv_start + split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    bt_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_ptr, start_n, seq_len, q_pos, row_valid, kv_head,
            scale, softcap, window, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, True, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION,
        )

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if direct:
        tl.store(out_ptr + row * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_ok[None, :])
        return
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))  # log2 domain
    base_o = part_out_ptr + seq.to(tl.int64) * stride_po_seq + split * stride_po_split
    tl.store(base_o + head[:, None] * stride_po_head + offs_d[None, :], out,
             mask=row_valid[:, None] & d_ok[None, :])
    base_l = part_lse_ptr + seq.to(tl.int64) * stride_pl_seq + split * stride_pl_split
    tl.store(base_l + head, lse, mask=row_valid)

    if FUSED_MERGE:
        # every thread's partial is stored before one thread takes the ticket (release); the last program's ticket
        # (acquire) then sees all of them. Its loads bypass L1 (.cg), which holds nothing stale of them
        tl.debug_barrier()
        counter = counters_ptr + seq * NUM_KV_HEADS + kv_head
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == used_splits - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch
            seq64 = seq.to(tl.int64)
            _merge_group(part_out_ptr + seq64 * stride_po_seq, part_lse_ptr + seq64 * stride_pl_seq,
                         out_ptr + row * stride_ot, kv_head * GROUP, used_splits, stride_po_split, stride_po_head,
                         stride_pl_split, stride_oh, GROUP, GROUP_PAD, HEAD_DIM, HEAD_DIM_PAD, SPLITS_PAD,
                         MERGE_SPLITS)


@triton.jit
def _merge_group(part_out_ptr, part_lse_ptr, out_row_ptr, head0, used_splits, stride_po_split, stride_po_head,
                 stride_pl_split, stride_oh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, MERGE_SPLITS: tl.constexpr):
    """The fused merge: the output rows of one GQA group (query heads `head0 ..`) from their splits' partials, all
    heads at once. One load of every split's lse gives each head's max and denominator; the partial outputs then come
    in chunks of MERGE_SPLITS splits x GROUP heads, one load each (a single chunk at W1's contexts), and the rows
    are stored together at the end. Merging head by head instead cost one dependent round trip to L2 per head: with
    Llama's four query heads per KV head, about 4 us of an 8.5 us launch at batch 1 on the H200. Loads bypass L1
    (.cg), which holds nothing stale of the partials."""
    offs_g = tl.arange(0, GROUP_PAD)  # GROUP padded to a power of two (not an MMA: no 16-row minimum)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    g_ok = offs_g < GROUP
    heads = head0 + offs_g
    offs_s = tl.arange(0, SPLITS_PAD)
    lse = tl.load(part_lse_ptr + offs_s[:, None] * stride_pl_split + heads[None, :],
                  mask=(offs_s < used_splits)[:, None] & g_ok[None, :], other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a head whose splits are all empty weighs them 0
    den = tl.sum(tl.exp2(lse - m[None, :]), 0)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    offs_c = tl.arange(0, MERGE_SPLITS)
    for s0 in range(0, used_splits, MERGE_SPLITS):
        s = s0 + offs_c
        s_ok = s < used_splits
        lse_c = tl.load(part_lse_ptr + s[:, None] * stride_pl_split + heads[None, :],
                        mask=s_ok[:, None] & g_ok[None, :], other=float("-inf"), cache_modifier=".cg")
        w = tl.exp2(lse_c - m[None, :])
        o = tl.load(part_out_ptr + s[:, None, None] * stride_po_split + heads[None, :, None] * stride_po_head
                    + offs_d[None, None, :], mask=s_ok[:, None, None] & g_ok[None, :, None] & d_ok[None, None, :],
                    other=0.0, cache_modifier=".cg")
        acc += tl.sum(o * w[:, :, None], 0)
    res = acc / tl.where(den == 0.0, 1.0, den)[:, None]
    tl.store(out_row_ptr + heads[:, None] * stride_oh + offs_d[None, :], res.to(out_row_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_partials(lse, part_out_ptr, offs_s, offs_d, s_ok, d_ok, stride_po_split):
    """One head's output from its splits' partials: outputs weighted by exp2(lse), normalised (log2 domain)."""
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0
    o = tl.load(part_out_ptr + offs_s[:, None] * stride_po_split + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
    den = tl.sum(w, 0)
    return tl.sum(o * w[:, None], 0) / tl.where(den == 0.0, 1.0, den)


@triton.jit(do_not_specialize=["num_seqs"])
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, seq_lens_ptr, num_seqs,
    stride_ot, stride_oh, stride_po_seq, stride_po_split, stride_po_head, stride_pl_seq, stride_pl_split,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    seq = find_seq(query_start_loc_ptr, tok, num_seqs, 1, False)
    is_real = seq < num_seqs
    seq_len = tl.where(is_real, tl.load(seq_lens_ptr + tl.minimum(seq, num_seqs - 1)), 0)
    num_parts = tl.where(seq_len > 0, NUM_SPLITS, 0)  # padded rows read no partials and come out as zeros

    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    s_ok = offs_s < num_parts
    seq64 = seq.to(tl.int64)
    lse = tl.load(part_lse_ptr + seq64 * stride_pl_seq + offs_s * stride_pl_split + head, mask=s_ok,
                  other=float("-inf"))
    res = _merge_partials(lse, part_out_ptr + seq64 * stride_po_seq + head * stride_po_head, offs_s, offs_d, s_ok,
                          d_ok, stride_po_split)
    out_ptrs = out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=d_ok)


def merge_chunk(num_splits: int, group: int, head_dim_pad: int) -> int:
    """Splits per load of the fused merge (`_merge_group`): a power of two, at most the padded split count, such that
    the [splits, group, head dim] float32 tile (padded sizes) holds at most 4,096 values, about 32 registers a thread
    at 4 warps, plus as many for its pointers. One split where a single group row is larger than that (MQA models'
    64-128 heads per KV head): that tile is then the group's, as the per-head merge before it was."""
    cap = max(1, 4096 // (triton.next_power_of_2(group) * head_dim_pad))
    return min(triton.next_power_of_2(num_splits), 1 << (cap.bit_length() - 1))


def decode_tile_config(head_dim: int, group: int) -> TileConfig:
    """One program = one (sequence, KV head, split): the GQA group as rows (padded to the 16-row MMA minimum)."""
    head_dim_pad = triton.next_power_of_2(head_dim)
    block_m = max(16, triton.next_power_of_2(group))
    if head_dim_pad <= 128:
        return TileConfig(block_m, 64, 4, 3)
    return TileConfig(block_m, 32, 4, 2)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_kv_len: int, block_n: int, num_sms: int) -> int:
    """Splits per sequence for a decode batch of this shape; 1 means "no split" (the decode kernel with one program
    per sequence and KV head, or, where the backend's `decode_kernel` is off, the unified kernel).

    Depends only on the padded batch size and capacity (`max_kv_len` = max_blocks_per_seq * block_size), so the
    choice made when a CUDA graph is captured holds for every replay.
    """
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= SPLIT_BELOW_PROGRAMS_PER_SM * num_sms:
        return 1
    max_tiles = max(1, triton.cdiv(max_kv_len, block_n))
    splits = max(1, min(MAX_SPLITS, triton.cdiv(TARGET_PROGRAMS_PER_SM * num_sms, programs), max_tiles))
    return 1 << (splits.bit_length() - 1)  # a power of two: few distinct merge-kernel compilations


def split_kv_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, output: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, sliding_window: int, softcap: float, num_splits: int,
                    part_out: torch.Tensor, part_lse: torch.Tensor, config: TileConfig | None = None,
                    use_pdl: bool = False, counters: torch.Tensor | None = None,
                    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    seq_order: torch.Tensor | None = None) -> None:
    """Decode attention (each sequence's last query row against its KV) with KV split `num_splits` ways.

    `part_out` (float32, >= `num_seqs * num_splits * H * D` elements) and `part_lse` (float32, >= `num_seqs *
    num_splits * H`) are scratch owned by the caller. Every row of `output` is written; rows that belong to no
    sequence with KV are zeros. Only valid when every sequence has at most one query token.

    `num_splits == 1`: one program per (sequence, KV head) writes its output row directly; needs one query row per
    sequence (`query.shape[0] == seq_lens.shape[0]`, as decode steps and their graphs have) and no scratch.

    `counters` (int32 zeros, owned by the caller and left as zeros): merge in the same launch (module docstring).
    Used when every row of `query` belongs to one sequence (rows == sequences, as in decode steps and their graphs)
    and there is a counter per (sequence, KV head); otherwise the merge kernel runs, which also zeroes rows that
    belong to no sequence.

    `new_kv` = (key, value `[T, Hkv, D]` contiguous in D, slot_mapping): the step's new rows, to be written into the
    cache first (rows with a negative slot are skipped): by a fused or unsplit launch itself (module docstring), else
    by the KV write kernel before the attention.

    `seq_order` (int32, a permutation of `range(num_seqs)` in its first `num_seqs` entries; unsplit launches only):
    the order in which sequences' programs are launched, longest first where the caller sorted them. The GPU starts
    programs in launch order, so with contexts of mixed lengths the longest ones no longer run alone at the end of
    the launch (a wide decode batch runs several waves of programs). Which program takes which sequence changes
    nothing else: each writes its own sequence's row.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    single = num_splits == 1
    assert not single or num_tokens == num_seqs, "the unsplit decode kernel needs one query row per sequence"
    # fused: every row of the query one sequence's token, a ticket counter for each (sequence, KV head)
    fused = (not single and counters is not None and num_tokens == num_seqs
             and counters.numel() >= num_seqs * num_kv_heads)
    if new_kv is not None and not (fused or single):
        write_kv(*new_kv[:2], k_cache, v_cache, new_kv[2], use_pdl)
    if num_tokens == 0:
        return
    if num_seqs == 0:
        output.zero_()
        return
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert query.stride(-1) == 1 and output.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert query_start_loc.shape[0] >= num_seqs + 1 and block_tables.shape[0] >= num_seqs
    group = num_heads // num_kv_heads
    cfg = config or decode_tile_config(head_dim, group)
    block_m = max(cfg.block_m, triton.next_power_of_2(group))
    rows = num_seqs * num_splits
    if single:  # no partials: the scratch arguments are never read (any float32 tensors of the right rank)
        po = part_out.view(-1)[:1].view(1, 1, 1, 1)
        pl = part_lse.view(-1)[:1].view(1, 1, 1)
    else:
        assert part_out.numel() >= rows * num_heads * head_dim and part_lse.numel() >= rows * num_heads, \
            "split-KV scratch too small for this batch"
        po = part_out.view(-1)[: rows * num_heads * head_dim].view(num_seqs, num_splits, num_heads, head_dim)
        pl = part_lse.view(-1)[: rows * num_heads].view(num_seqs, num_splits, num_heads)
    head_dim_pad = triton.next_power_of_2(head_dim)
    assert counters is None or counters.dtype == torch.int32, "split-KV merge counters must be int32"
    write = (fused or single) and new_kv is not None
    new_k, new_v, slots = new_kv if write else (query, query, seq_lens)
    if write:
        assert new_k.stride(-1) == 1 and new_v.stride(-1) == 1 and slots.shape[0] >= num_tokens
    ordered = single and seq_order is not None
    if ordered:
        assert seq_order.dtype == torch.int32 and seq_order.numel() >= num_seqs, "seq_order: int32, one per sequence"
    grid = (num_seqs * num_kv_heads, 1, 1) if ordered else (num_seqs, num_kv_heads, num_splits)

    launcher(_split_kv_decode_kernel, grid, writes=(output,))(
        query, k_cache, v_cache, po, pl, query_start_loc, seq_lens, block_tables, output,
        counters if fused else pl, new_k, new_v, slots, seq_order if ordered else seq_lens,
        float(scale), float(softcap), int(sliding_window), num_splits,
        query.stride(0), query.stride(1), new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1), output.stride(0), output.stride(1),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=cfg.block_n, NUM_KV_HEADS=num_kv_heads,
        SPLITS_PAD=triton.next_power_of_2(num_splits), GROUP_PAD=triton.next_power_of_2(group),
        MERGE_SPLITS=merge_chunk(num_splits, group, head_dim_pad),
        USE_WINDOW=sliding_window > 0, USE_SOFTCAP=softcap > 0, DOT_PRECISION=dot_precision(query.dtype),
        USE_PDL=use_pdl, FUSED_MERGE=fused, WRITE_KV=write, IS_SPLIT=not single, ORDERED=ordered,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **launch_kwargs(use_pdl),
    )
    if fused or single:
        return
    launcher(_merge_splits_kernel, (num_tokens, num_heads))(
        output, po, pl, query_start_loc, seq_lens, num_seqs,
        output.stride(0), output.stride(1), po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, USE_PDL=use_pdl, num_warps=4 if head_dim_pad * num_splits >= 4096 else 2,
        **launch_kwargs(use_pdl),
    )


# keys that do not depend on which kernel a process launches first (ops/triton_build.py)
settle_cache_keys(globals())
