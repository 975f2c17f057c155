"""Small-M GEMM for decode linears: `y = x @ W^T (+ b)` with few rows, streaming W once at full bandwidth.

A decode step multiplies a handful of rows (one per sequence) by every weight matrix, so each linear is a pass over
its weights and nothing else: the time it takes is the weight bytes over the bandwidth the kernel reaches, plus its
launch. cuBLAS picks tiles built for large M there, reaching a third to a half of the copy bandwidth at M = 1-64 on
an H200 for these shapes. This kernel gives each program a `[BLOCK_N, K / SPLIT_K]` slice of W: enough programs to
fill every SM (splitting K when N alone is too narrow), each one streaming its rows of W with the few activation rows
beside it, products on the tensor cores (`tl.dot` with M padded to 16). With split-K, each split writes a float32
partial; they are summed in a fixed order (deterministic), the bias added and the result cast either by a second
kernel or, given `counters` (an int32 buffer of zeros with one entry per column tile, owned by the caller), inside the
same launch: each split takes a ticket from its column tile's counter after storing its partial, and the one that
draws the last ticket sums the tile's partials and sets the counter back to zero. Both ways add the same partials in
the same order, so they give the same bits; the fused one saves a launch per split-K linear (a decode step at
batch 1 has one or two per layer).

A decode step at batch 1 has one row, which `tl.dot` pads to 16: the tensor-core kernel then needs wide, long tiles,
so few programs each walk a chain of dependent K tiles, and a 4-12 MB linear takes 4-6 us where its bytes alone take
1-3. The one-row kernel (`SkinnyConfig(gemv=True)`, block_m 1) skips the tensor cores: each program holds 2-16 rows
of W, multiplies them by x element-wise in float32 and sums each row once after its K loop, so many small programs
have their loads in flight at once. On the H200 it made every layer's four linears of qwen3-0.6b at M = 1 take
377 us in one graph against 616 us (`examples/bench_skinny_gemm.py`). The tuner times it beside the tensor-core tiles
for the M = 1 bucket (`ops/linear.py`, `HF_ACCEL_ONE_ROW_GEMM=0` leaves it out).

Launched with PDL where supported (see `hf_accel.ops.pdl`): it waits for its predecessor before reading `x` and
before any store, and lets its successor launch right after that wait (`HF_ACCEL_GEMM_TRIGGER=late`: after its
K loop), so the successor's launch and its pre-wait weight loads overlap this kernel's whole loop. The one-row kernel
loads its first tile of W before the wait: no kernel of a step writes a weight.

The one-row kernel can also apply a Llama-style RMSNorm (and the residual add before it) to its input itself
(`norm_linear_fused`, for `ops.norm_linear`): each program sums the squares of the whole row, then normalizes each
tile of x as its K loop reads it; program 0 stores the add's result for the rest of the layer.

This module imports triton at the top; callers import it lazily.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hf_accel.ops.pdl import GEMM_EARLY_TRIGGER as EARLY_TRIGGER
from hf_accel.ops.pdl import launch_kwargs
from hf_accel.ops.triton_build import launcher, settle_cache_keys

MAX_M = 64  # rows this kernel is meant for; above it cuBLAS's large-M tiles win
MAX_NORM_BLOCK = 4096  # columns of the row a normalizing one-row GEMM sums at a time (`_row_rstd`)
# column tiles of a chain's first linear whose partial sums of squares the second one reads in one block
# (`norm_partials_linear`): hidden / block_n. The block is [tiles, BLOCK_M] float32 in registers before its sum.
# Compiled for sm_90a (examples/kernel_registers.py, Triton 3.9), the second launch of a 64-row 32-column tile needs
# 135 registers for 64 or 128 tiles and 185 for 256 (251 against 227 for a 64-column tile). An 8B's o_proj and
# down_proj (4,096 columns) chain with tiles of 32 columns or wider
MAX_SS_TILES = 128


@dataclass(frozen=True)
class SkinnyConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    # one row without tensor cores (`_gemv_kernel`): block_m must be 1
    gemv: bool = False


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, part_ptr, counters_ptr, M, N, K, K_PER_SPLIT,
    stride_xm, stride_wn, stride_ym,
    r_ptr, ss_out_ptr, g_ptr, ss_in_ptr, n_ss_tiles, inv_k, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, USE_PDL: tl.constexpr,
    FUSED_SPLITS: tl.constexpr, EARLY_TRIGGER: tl.constexpr, GATED: tl.constexpr,
    RESIDUAL: tl.constexpr, NORM: tl.constexpr, SS_TILES: tl.constexpr,
):
    """FUSED_SPLITS: 0 = no fused reduction (one split, or the reduce kernel follows), else the split count.
    EARLY_TRIGGER: let the successor launch right after the wait instead of after the K loop.
    GATED: W has 2N rows, gate then up; the output is `silu(x @ W[:N]^T) * (x @ W[N:]^T)` (`_store_output`).
    RESIDUAL: the output is `h = y + r` (the residual add after the linear), and each column tile also stores its
    rows' float32 sums of squares of h to `ss_out[pid_n, :M]` (`linear_add_residual`).
    NORM: the input is `h` of such a launch, normalized here: `rstd` of each row from the `n_ss_tiles` partial sums
    at `ss_in` (summed in a fixed order), then each K tile of x becomes `g * (h * rstd).to(dtype)` rounded to the
    dtype, LlamaRMSNorm's rounding (`norm_partials_linear`)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k0 = pid_k * K_PER_SPLIT
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :]
    u_ptrs = w_ptrs + N.to(tl.int64) * stride_wn  # GATED: the up rows, N below the gate rows (int64 offset)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    if NORM:  # (rstd exists only here; every use of it is under NORM too)
        offs_t = tl.arange(0, SS_TILES)
        ss = tl.load(ss_in_ptr + offs_t[:, None] * M + offs_m[None, :],
                     mask=(offs_t[:, None] < n_ss_tiles) & m_ok[None, :], other=0.0)
        rstd = tl.math.rsqrt(tl.sum(ss, axis=0) * inv_k + eps)
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        if EVEN_K:
            w_mask = n_ok[:, None]
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            if NORM:
                x = _normalize_tile(x, rstd, tl.load(g_ptr + k0 + k + offs_k))
        else:
            k_ok = (k0 + k + offs_k) < tl.minimum(K, k0 + K_PER_SPLIT)
            w_mask = n_ok[:, None] & k_ok[None, :]
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                x = _normalize_tile(x, rstd, tl.load(g_ptr + k0 + k + offs_k, mask=k_ok, other=0.0))
        w = tl.load(w_ptrs, mask=w_mask, other=0)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)  # int8 weights widen in registers; a no-op for bf16 / fp16
        if GATED:
            acc_u = tl.dot(x, tl.trans(tl.load(u_ptrs, mask=w_mask, other=0).to(x.dtype)), acc_u)
            u_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    mask = m_ok[:, None] & n_ok[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    # split 0's partial of this tile; a gated launch keeps gate and up partials side by side (rows of 2N)
    part_row = 2 * N if GATED else N
    part0_ptrs = part_ptr + offs_m[:, None].to(tl.int64) * part_row + offs_n[None, :]
    r_ptrs = r_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]  # RESIDUAL: r has y's layout
    _finish(acc, acc_u, y_ptrs, part0_ptrs, M * part_row, N, pid_k, counters_ptr + pid_n, b_ptr, s_ptr, offs_n,
            n_ok, mask, r_ptrs, ss_out_ptr + pid_n * M + offs_m, m_ok, IS_SPLIT, HAS_BIAS, HAS_SCALE, FUSED_SPLITS,
            GATED, RESIDUAL)


@triton.jit
def _normalize_tile(x, rstd, g):
    """`g * (h * rstd).to(dtype)` rounded to the dtype, for a `[rows, K tile]` tile `x` of h (LlamaRMSNorm)."""
    dtype = x.dtype
    y = (x.to(tl.float32) * rstd[:, None]).to(dtype)
    return (g.to(tl.float32)[None, :] * y.to(tl.float32)).to(dtype)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, part_ptr, counters_ptr, N, K, K_PER_SPLIT, stride_wn,
    r_ptr, g_ptr, h_ptr, inv_k, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr, USE_PDL: tl.constexpr, FUSED_SPLITS: tl.constexpr, EARLY_TRIGGER: tl.constexpr,
    NORM: tl.constexpr, HAS_ADD: tl.constexpr, NORM_BLOCK: tl.constexpr, GATED: tl.constexpr,
):
    """One row (M = 1) without tensor cores: each program multiplies a `[BLOCK_N, K / SPLIT_K]` slice of W by x
    element-wise in float32 and sums each row once, after the K loop. `tl.dot` pads M to 16, so at M = 1 the GEMM
    kernel needs tiles wide in N and long in K to keep the tensor cores fed, which leaves few programs with long
    dependent K loops; here a program can hold a few rows, and many programs each have their loads in flight at
    once. W's next K tile is loaded before the current one is used, and its first before the PDL wait: no kernel of
    the step writes a weight, so that load may overlap the previous kernel (whose successor launches right after
    that kernel's own wait; x and every store come after the wait).

    NORM: the input is `rms_norm(x (+ r))` with weight `g` (Llama style, `norm_linear_fused`): every program first
    sums the squares of the whole row (`NORM_BLOCK` columns at a time; program 0 also stores `x + r` to `h_ptr`
    under HAS_ADD), then its K loop normalizes each tile of x as it reads it, rounding where the stock module
    rounds, so the GEMM sees the bits the norm kernel it replaces would have written.

    GATED: as the GEMM kernel's (W has 2N rows, gate then up; the output is `silu(gate) * up`)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k0 = pid_k * K_PER_SPLIT
    k_end = tl.minimum(K, k0 + K_PER_SPLIT)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]
    # EVEN_K (every split whole tiles of K): no mask along K, so the loads stay 16-byte vectors
    u_ptrs = w_ptrs + N.to(tl.int64) * stride_wn  # GATED: the up rows, N below the gate rows (int64 offset)
    w = _gemv_tile(w_ptrs, n_ok[:, None], (k0 + offs_k)[None, :], k_end, EVEN_K)
    wu = w
    if GATED:
        wu = _gemv_tile(u_ptrs, n_ok[:, None], (k0 + offs_k)[None, :], k_end, EVEN_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    rstd = 1.0
    if NORM:
        rstd = _row_rstd(x_ptr, r_ptr, h_ptr, K, inv_k, eps, pid_n + pid_k, HAS_ADD, NORM_BLOCK)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(BLOCK_K, K_PER_SPLIT, BLOCK_K):  # W's tile k is loaded before tile k - 1 is used
        w_next = _gemv_tile(w_ptrs + k, n_ok[:, None], (k0 + k + offs_k)[None, :], k_end, EVEN_K)
        x = _gemv_input(x_ptr, r_ptr, g_ptr, k0 + k - BLOCK_K + offs_k, k_end, rstd, EVEN_K, NORM, HAS_ADD)
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
        if GATED:
            wu_next = _gemv_tile(u_ptrs + k, n_ok[:, None], (k0 + k + offs_k)[None, :], k_end, EVEN_K)
            acc_u += wu.to(tl.float32) * x[None, :]
            wu = wu_next
    last = (K_PER_SPLIT - 1) // BLOCK_K * BLOCK_K
    x = _gemv_input(x_ptr, r_ptr, g_ptr, k0 + last + offs_k, k_end, rstd, EVEN_K, NORM, HAS_ADD)
    acc += w.to(tl.float32) * x[None, :]
    if GATED:
        acc_u += wu.to(tl.float32) * x[None, :]
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.reshape(tl.sum(acc, axis=1), [1, BLOCK_N])  # the output row, shaped as the GEMM's epilogue sees a tile
    row_u = tl.reshape(tl.sum(acc_u, axis=1), [1, BLOCK_N])
    part_row = 2 * N if GATED else N
    _finish(row, row_u, y_ptr + offs_n[None, :], part_ptr + offs_n[None, :], part_row, N, pid_k, counters_ptr + pid_n,
            b_ptr, s_ptr, offs_n, n_ok, n_ok[None, :], y_ptr, y_ptr, n_ok, IS_SPLIT, HAS_BIAS, HAS_SCALE,
            FUSED_SPLITS, GATED, False)


@triton.jit
def _row_rstd(x_ptr, r_ptr, h_ptr, K, inv_k, eps, program, HAS_ADD: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """`rsqrt(mean(h^2) + eps)` of the row `h = x (+ r)` (the sum rounded to x's dtype first, as a tensor add
    rounds); the first program (`program` 0) also stores `h` to `h_ptr`."""
    offs = tl.arange(0, NORM_BLOCK)
    h_end = tl.where(program == 0, K, 0)  # the columns this program stores: all, or none
    squares = tl.zeros([NORM_BLOCK], dtype=tl.float32)
    for c in range(0, K, NORM_BLOCK):
        cols = c + offs
        ok = cols < K
        h = tl.load(x_ptr + cols, mask=ok, other=0.0)
        if HAS_ADD:
            h = (h.to(tl.float32) + tl.load(r_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(h_ptr + cols, h, mask=cols < h_end)
        h = h.to(tl.float32)
        squares += h * h
    return tl.math.rsqrt(tl.sum(squares, axis=0) * inv_k + eps)


@triton.jit
def _gemv_input(x_ptr, r_ptr, g_ptr, k_offs, k_end, rstd, EVEN_K: tl.constexpr, NORM: tl.constexpr,
                HAS_ADD: tl.constexpr):
    """The K tile of the GEMV's input at `k_offs`, in float32 (zeros at or past `k_end` without EVEN_K): x itself,
    or with NORM `g * (h * rstd).to(dtype)` rounded to the dtype, `h = x (+ r)`: LlamaRMSNorm's formula."""
    x = _gemv_tile(x_ptr + k_offs, True, k_offs, k_end, EVEN_K)
    if NORM:
        dtype = x_ptr.dtype.element_ty
        if HAS_ADD:
            x = (x.to(tl.float32) + _gemv_tile(r_ptr + k_offs, True, k_offs, k_end, EVEN_K).to(tl.float32)).to(dtype)
        y = (x.to(tl.float32) * rstd).to(dtype)
        g = _gemv_tile(g_ptr + k_offs, True, k_offs, k_end, EVEN_K)
        x = (g.to(tl.float32) * y.to(tl.float32)).to(dtype)
    return x.to(tl.float32)


@triton.jit
def _gemv_tile(ptrs, row_ok, k_offs, k_end, EVEN_K: tl.constexpr):
    """A tile of W (or x) at `ptrs`; without EVEN_K, columns at or past `k_end` read as zeros."""
    if EVEN_K:
        return tl.load(ptrs, mask=row_ok, other=0)
    return tl.load(ptrs, mask=row_ok & (k_offs < k_end), other=0)


@triton.jit
def _finish(acc, acc_u, y_ptrs, part0_ptrs, split_stride, up_offset, pid_k, counter, b_ptr, s_ptr, offs_n, n_ok,
            mask, r_ptrs, ss_ptrs, rows_ok, IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
            FUSED_SPLITS: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr):
    """After the K loop of either kernel: the output tile (one split), or this split's float32 partial at
    `part0_ptrs + pid_k * split_stride` (GATED: the up partial `up_offset` columns after it) and, with
    FUSED_SPLITS, the reduction by the split that takes the last ticket from this column tile's `counter`.
    `r_ptrs`, `ss_ptrs`, `rows_ok`: the residual tile, its rows' sums of squares, for RESIDUAL (`_store_output`)."""
    if not IS_SPLIT:
        _store_output(acc, acc_u, y_ptrs, b_ptr, s_ptr, offs_n, n_ok, mask, r_ptrs, ss_ptrs, rows_ok, HAS_BIAS,
                      HAS_SCALE, GATED, RESIDUAL)
    else:
        split_stride = pid_k.to(tl.int64) * 0 + split_stride  # int64, even where triton made it a constant (M=N=1)
        tl.store(part0_ptrs + pid_k * split_stride, acc, mask=mask)
        if GATED:
            tl.store(part0_ptrs + pid_k * split_stride + up_offset, acc_u, mask=mask)
        if FUSED_SPLITS > 0:
            # every thread's partial is stored before one thread takes the ticket (release); the last split's
            # ticket (acquire) then sees all of them. Its loads bypass L1 (.cg), which holds nothing stale of them
            tl.debug_barrier()
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == FUSED_SPLITS - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch
                total = tl.zeros_like(acc)
                total_u = tl.zeros_like(acc)
                for s in tl.static_range(FUSED_SPLITS):  # fixed order, as the reduce kernel
                    total += tl.load(part0_ptrs + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
                    if GATED:
                        total_u += tl.load(part0_ptrs + s * split_stride + up_offset, mask=mask, other=0.0,
                                           cache_modifier=".cg")
                _store_output(total, total_u, y_ptrs, b_ptr, s_ptr, offs_n, n_ok, mask, r_ptrs, ss_ptrs, rows_ok,
                              HAS_BIAS, HAS_SCALE, GATED, RESIDUAL)


@triton.jit
def _store_output(acc, acc_u, y_ptrs, b_ptr, s_ptr, offs_n, n_ok, mask, r_ptrs, ss_ptrs, rows_ok,
                  HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr):
    """The epilogue of every path (GEMM, fused split-K, reduce kernel): an int8 weight's per-output-row scale, then
    the bias, then the cast to the output dtype. GATED (no scale, no bias): `silu(gate) * up` from the gate and up
    sums, rounded where the stock MLP rounds: each product to the output dtype (as the GEMM's output is), SiLU in
    float32 rounded to it (nn.SiLU), then one float32 product rounded once (`fused_kernels.silu_and_mul`).
    RESIDUAL (not GATED): the tile stored is `h = out + r`, rounded to the dtype (a tensor add after the linear's
    rounded output), read from `r_ptrs`, and each row's float32 sum of squares of the tile's h goes to `ss_ptrs`
    (rows in `rows_ok`)."""
    dtype = y_ptrs.dtype.element_ty
    if GATED:
        g = acc.to(dtype).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        acc = silu * acc_u.to(dtype).to(tl.float32)
    else:
        if HAS_SCALE:
            acc *= tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if RESIDUAL:
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        h = (acc.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(y_ptrs, h, mask=mask)
        hf = tl.where(mask, h.to(tl.float32), 0.0)
        tl.store(ss_ptrs, tl.sum(hf * hf, axis=1), mask=rows_ok)
    else:
        tl.store(y_ptrs, acc.to(dtype), mask=mask)


@triton.jit
def _split_reduce_kernel(part_ptr, b_ptr, s_ptr, y_ptr, M, N, stride_ym, SPLIT_K, BLOCK: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, USE_PDL: tl.constexpr,
                         GATED: tl.constexpr):
    row = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    part_row = 2 * N if GATED else N  # a gated launch's partial rows: gate sums, then up sums
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([1, BLOCK], dtype=tl.float32)  # one output row, as the GEMM's epilogue sees a tile
    acc_u = tl.zeros([1, BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):  # fixed order: the same bits on every run
        ptrs = part_ptr + (s * M + row).to(tl.int64) * part_row + offs[None, :]
        acc += tl.load(ptrs, mask=ok[None, :], other=0.0)
        if GATED:
            acc_u += tl.load(ptrs + N, mask=ok[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _store_output(acc, acc_u, y_ptr + row.to(tl.int64) * stride_ym + offs[None, :], b_ptr, s_ptr, offs, ok,
                  ok[None, :], y_ptr, y_ptr, ok, HAS_BIAS, HAS_SCALE, GATED, False)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig,
                  use_pdl: bool = False, out: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                  gated: bool = False) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for `x` of at most `config.block_m` rows (leading dims flattened).

    `scale` (one value per output row, contiguous): `weight` is int8 and the product is `(x @ weight^T) * scale`,
    accumulated in float32 and scaled once before the bias and the cast (int8 weight-only quantization).
    `counters` (int32 zeros on x's device, left as zeros): a split-K launch sums its partials in the same launch
    when there is a counter per column tile (module docstring); None, or too few: the reduce kernel does.
    `gated`: `weight` is a gated MLP's gate rows then its up rows (`[2I, K]`, no bias, no scale) and the result is
    `silu(x @ gate^T) * (x @ up^T)`, `[..., I]`: the activation in the GEMM's epilogue (`ops.gated_linear`)."""
    k = x.shape[-1]
    n = _out_columns(weight, bias, scale, gated)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    assert m <= config.block_m, f"skinny_linear: {m} rows do not fit block_m={config.block_m}"
    assert not config.gemv or config.block_m == 1, "a GEMV config is for one row (block_m=1)"
    assert weight.stride(-1) == 1 and weight.shape[1] == k
    if bias is not None and bias.stride(0) != 1:  # the kernels read the bias as contiguous
        bias = bias.contiguous()
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    k_per_split, split = _split(k, config)
    part = torch.empty((split, m, 2 * n if gated else n), dtype=torch.float32, device=x.device) if split > 1 else y
    if counters is not None and counters.numel() < triton.cdiv(n, config.block_n):
        counters = None
    _launch(x2, weight, bias, scale, y, part, counters, m, n, k, k_per_split, split,
            (x2.stride(0), weight.stride(0), y.stride(0)), config, use_pdl, warmup=False, gated=gated)
    return y.view(*x.shape[:-1], n)


def _out_columns(weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None, gated: bool) -> int:
    """The output's columns: the weight's rows, or half of them for a gated launch (gate rows, then up rows)."""
    if not gated:
        return weight.shape[0]
    assert bias is None and scale is None, "a gated launch has no bias and no int8 scale"
    assert weight.shape[0] % 2 == 0, f"a gated weight has gate and up rows: {weight.shape[0]} rows is odd"
    return weight.shape[0] // 2


@dataclass
class NormArgs:
    """The RMSNorm a one-row GEMM applies to its input (`norm_linear_fused`): `weight` and `eps` of the norm, and
    with `residual`, the input is `x + residual`, which the launch also stores to `h`."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    h: torch.Tensor | None = None


def norm_linear_fused(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig, use_pdl: bool = False,
                      counters: torch.Tensor | None = None,
                      gated: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`F.linear(rms_norm(h), weight, bias)` for one row `h = x (+ residual)`, in one launch of the one-row kernel
    (`config.gemv`): returns the product and, given `residual`, `h` (else None).

    The norm is LlamaRMSNorm's: `norm_weight * (h.float() * rsqrt(mean(h.float()^2) + eps)).to(dtype)`, each
    step rounded as the stock module rounds it; `norm_weight` has x's dtype. It replaces the norm kernel (with the
    residual add, the one Inductor makes of the add and the norm) that would run between the previous kernel and
    this GEMM: `compilation.norm_folding` puts it in the traced forward. `gated`: as `skinny_linear`'s."""
    k = x.shape[-1]
    n = _out_columns(weight, bias, None, gated)
    assert config.gemv and x.numel() == k, "norm_linear_fused is the one-row kernel's: one row, a GEMV config"
    assert norm_weight.shape == (k,) and norm_weight.dtype == x.dtype and weight.shape[1] == k
    x1 = x.reshape(k).contiguous()
    r1 = residual.reshape(k).contiguous() if residual is not None else None
    h = torch.empty_like(x1) if r1 is not None else None
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    k_per_split, split = _split(k, config)
    part = torch.empty((split, 1, 2 * n if gated else n), dtype=torch.float32, device=x.device) if split > 1 else y
    if counters is not None and counters.numel() < triton.cdiv(n, config.block_n):
        counters = None
    _launch(x1, weight, bias, None, y, part, counters, 1, n, k, k_per_split, split, (k, weight.stride(0), n),
            config, use_pdl, warmup=False, norm=NormArgs(norm_weight.contiguous(), eps, r1, h), gated=gated)
    out = y.view(*x.shape[:-1], n)
    return out, (h.view(x.shape) if h is not None else None)


@dataclass(frozen=True)
class ChainArgs:
    """The GEMM kernel's part in a linear -> residual add -> RMSNorm -> linear chain (`ops.residual_chain`).
    The first linear: `residual` (added to its output, which becomes h) and `ss_out` (float32 `[column tiles, M]`: each
    column tile's sums of squares of its h rows). The second: `ss_in` (the first's `ss_out`, `ss_tiles` rows),
    `norm_weight` and `eps` of the norm its input goes through. Pointer fields may be dtypes when building ahead."""

    residual: torch.Tensor | torch.dtype | None = None
    ss_out: torch.Tensor | torch.dtype | None = None
    ss_in: torch.Tensor | torch.dtype | None = None
    ss_tiles: int = 1
    norm_weight: torch.Tensor | torch.dtype | None = None
    eps: float = 0.0


_NO_CHAIN = ChainArgs()


def can_chain(config: SkinnyConfig, m: int, k: int, n: int, counters: torch.Tensor | None,
              residual: bool) -> bool:
    """Whether `m` rows of a `[n, k]` weight can run in a chained launch of `config`: a tensor-core tile holding the
    rows; for the first linear's residual epilogue (`residual`), at most MAX_SS_TILES column tiles, in the GEMM kernel
    itself: one K split, or a counter per column tile (the splits reduced in the same launch)."""
    if config.gemv or not 0 < m <= config.block_m:
        return False
    if not residual:
        return True
    tiles = triton.cdiv(n, config.block_n)
    return tiles <= MAX_SS_TILES and (_split(k, config)[1] == 1 or (counters is not None and counters.numel() >= tiles))


def linear_add_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                        config: SkinnyConfig, use_pdl: bool = False,
                        counters: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(h, ss)`: `h = F.linear(x, weight, bias) + residual`, each rounded as the two torch ops round, in one launch of
    the GEMM kernel, with `ss` (float32 `[column tiles, rows]`) each column tile's sums of squares of its rows of h,
    for `norm_partials_linear` to normalize h without a pass of its own. Needs a tensor-core config
    (`ops.residual_chain.chain_configs`); split-K needs `counters` (the reduction in the same launch)."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    assert can_chain(config, m, k, n, counters, residual=True), "linear_add_residual: not a chainable launch"
    k_per_split, split = _split(k, config)
    assert residual.shape == (*x.shape[:-1], n) and residual.dtype == x.dtype and weight.shape[1] == k
    r2 = residual.reshape(m, n).contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    h = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n, config.block_n)
    ss = torch.empty((tiles, m), dtype=torch.float32, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else h
    _launch(x2, weight, bias, None, h, part, counters, m, n, k, k_per_split, split,
            (x2.stride(0), weight.stride(0), h.stride(0)), config, use_pdl, warmup=False,
            chain=ChainArgs(residual=r2, ss_out=ss))
    return h.view(*x.shape[:-1], n), ss


def norm_partials_linear(h: torch.Tensor, ss: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig, use_pdl: bool = False,
                         counters: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """`F.linear(llama_rms_norm(h), weight, bias)` (`gated`: `silu(gate) * up` of it, as `skinny_linear`'s) in one
    launch of the GEMM kernel, the norm's sums of squares taken from `ss` (`linear_add_residual`'s) and summed in a
    fixed order: each K tile of h is normalized as the stock module rounds it before it enters the product."""
    k = h.shape[-1]
    n = _out_columns(weight, bias, None, gated)
    h2 = h.reshape(-1, k)
    m = h2.shape[0]
    assert h2.stride(-1) == 1 and h2.stride(0) == k, "norm_partials_linear: h must be contiguous rows"
    assert ss.dtype == torch.float32 and ss.dim() == 2 and ss.shape[1] == m and ss.is_contiguous()
    assert norm_weight.shape == (k,) and norm_weight.dtype == h.dtype and weight.shape[1] == k
    assert can_chain(config, m, k, n, counters, residual=False), "norm_partials_linear: not a chainable launch"
    k_per_split, split = _split(k, config)
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    y = torch.empty((m, n), dtype=h.dtype, device=h.device)
    part = torch.empty((split, m, 2 * n if gated else n), dtype=torch.float32, device=h.device) if split > 1 else y
    if counters is not None and counters.numel() < triton.cdiv(n, config.block_n):
        counters = None
    _launch(h2, weight, bias, None, y, part, counters, m, n, k, k_per_split, split, (k, weight.stride(0), n), config,
            use_pdl, warmup=False, gated=gated,
            chain=ChainArgs(ss_in=ss, ss_tiles=ss.shape[0], norm_weight=norm_weight.contiguous(), eps=eps))
    return y.view(*h.shape[:-1], n)


def build_skinny_linear(m: int, n: int, k: int, dtype: torch.dtype, weight_dtype: torch.dtype, has_bias: bool,
                        has_scale: bool, config: SkinnyConfig, use_pdl: bool = False,
                        fused_splits: bool = True, gated: bool = False) -> list:
    """Compile (without running) the kernels `skinny_linear` launches for `m` rows of a contiguous `dtype` input
    and a contiguous [n, k] weight (`fused_splits`: given counters): Triton's `warmup`, with dtypes standing in for
    the tensors (only their dtypes and alignment enter a kernel's specialization). Returns what each `warmup`
    returned (under Triton's async compile mode, futures), so `ops.triton_build.build_in_parallel` can build many
    configurations at once. `gated`: `n` is the weight's rows (gate and up), as for `skinny_linear(gated=True)`."""
    k_per_split, split = _split(k, config)
    out_n = n // 2 if gated else n
    return _launch(dtype, weight_dtype, dtype if has_bias else None, dtype if has_scale else None, dtype,
                   torch.float32 if split > 1 else dtype, torch.int32 if fused_splits else None, m, out_n, k,
                   k_per_split, split, (k, k, out_n), config, use_pdl, warmup=True, gated=gated)


def _split(k: int, config: SkinnyConfig) -> tuple[int, int]:
    """(K per split, splits) of a launch: `config.split_k` rounded to whole `block_k` tiles, never an empty split."""
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    return k_per_split, triton.cdiv(k, k_per_split)


def _launch(x, weight, bias, scale, y, part, counters, m: int, n: int, k: int, k_per_split: int, split: int,
            strides: tuple[int, int, int], config: SkinnyConfig, use_pdl: bool, warmup: bool,
            norm: NormArgs | None = None, gated: bool = False, chain: ChainArgs | None = None) -> list:
    """Launch (or, with `warmup`, only compile) the GEMM and, when K is split and no `counters` are given, the
    reduction; one code path for both, so what is built ahead is what runs. The pointer arguments are tensors, or
    dtypes when `warmup` (an absent bias, scale or counters is None). `norm`: the one-row kernel normalizes its
    input first (`norm_linear_fused`). `gated`: `n` is the output's columns, half the weight's rows (gate, then
    up), and the epilogue applies the SiLU gate. `chain`: the GEMM kernel's residual epilogue or its normalizing
    prologue (`linear_add_residual`, `norm_partials_linear`). Returns what each launch returned."""
    has_bias, has_scale = bias is not None, scale is not None
    fused = split > 1 and counters is not None
    in_gemm = split == 1 or fused  # the GEMM kernel itself writes the output (bias and scale there)
    stride_xm, stride_wn, stride_ym = strides
    grid = (triton.cdiv(n, config.block_n), split)
    common = dict(
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=k % k_per_split == 0, IS_SPLIT=split > 1,
        HAS_BIAS=has_bias and in_gemm, HAS_SCALE=has_scale and in_gemm, USE_PDL=use_pdl,
        FUSED_SPLITS=split if fused else 0, EARLY_TRIGGER=EARLY_TRIGGER, GATED=gated, num_warps=config.num_warps,
        num_stages=config.num_stages, **launch_kwargs(use_pdl),
    )
    pointers = (x, weight, bias if has_bias else weight, scale if has_scale else weight, y, part,
                counters if fused else part)
    if config.gemv:
        residual = norm.residual if norm is not None else None
        if norm is None:  # r, g, h: unused pointers (x stands in), 1 / K, eps
            norm_pointers = (x, x, x, 1.0, 0.0)
        elif residual is None:
            norm_pointers = (x, norm.weight, x, 1.0 / k, float(norm.eps))
        else:
            norm_pointers = (residual, norm.weight, norm.h, 1.0 / k, float(norm.eps))
        writes = (y, norm.h) if residual is not None else (y,)
        gemv = launcher(_gemv_kernel, grid, warmup, writes=writes)
        built = [gemv(*pointers, n, k, k_per_split, stride_wn, *norm_pointers, NORM=norm is not None,
                      HAS_ADD=residual is not None,
                      # a constant without a norm: K stays a runtime argument of the plain kernel (one build for all K)
                      NORM_BLOCK=min(triton.next_power_of_2(k), MAX_NORM_BLOCK) if norm is not None else 16,
                      **common)]
    else:
        assert norm is None, "only the one-row kernel normalizes its input"
        c = chain if chain is not None else _NO_CHAIN
        chain_pointers = (*(p if p is not None else weight for p in (c.residual, c.ss_out, c.norm_weight, c.ss_in)),
                          c.ss_tiles, 1.0 / k, float(c.eps))
        writes = (y, c.ss_out) if c.ss_out is not None else (y,)
        gemm = launcher(_skinny_gemm_kernel, grid, warmup, writes=writes)
        built = [gemm(*pointers, m, n, k, k_per_split, stride_xm, stride_wn, stride_ym, *chain_pointers,
                      BLOCK_M=config.block_m, RESIDUAL=c.residual is not None, NORM=c.ss_in is not None,
                      SS_TILES=triton.next_power_of_2(max(c.ss_tiles, 1)), **common)]
    if split > 1 and not fused:
        block = min(1024, triton.next_power_of_2(n))
        grid = (triton.cdiv(n, block), m)
        reduce = launcher(_split_reduce_kernel, grid, warmup)
        built.append(reduce(
            part, bias if has_bias else weight, scale if has_scale else weight, y, m, n, stride_ym, SPLIT_K=split,
            BLOCK=block, HAS_BIAS=has_bias, HAS_SCALE=has_scale, USE_PDL=use_pdl, GATED=gated, num_warps=4,
            **launch_kwargs(use_pdl),
        ))
    return built


# keys that do not depend on which kernel a process launches first (ops/triton_build.py)
settle_cache_keys(globals())
