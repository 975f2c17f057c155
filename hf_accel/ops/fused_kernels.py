"""Triton kernels for RMSNorm and SiLU-and-mul, rounding where the stock transformers modules round.

One program handles one row of the norm (the whole row stays in registers when it fits one block, otherwise two
passes over it), and one `[row, column block]` tile of SiLU-and-mul. Launch grids depend on tensor shapes only, so a
launch recorded in a CUDA graph stays valid for every replay.

This module imports triton at the top; `hf_accel.ops.fused` imports it lazily, so a test can set TRITON_INTERPRET=1
before triton is imported and the kernels then run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.ops.pdl import launch_kwargs
from hf_accel.ops.triton_build import launcher, settle_cache_keys

MAX_NORM_BLOCK = 8192  # widest row kept in registers at once; wider rows loop over chunks of this many columns
MAX_ACT_BLOCK = 1024  # columns of SiLU-and-mul per program


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, r_ptr, h_ptr, stride_x, stride_out, stride_r, stride_h, inv_n, eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr, GEMMA: tl.constexpr, HAS_ADD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """HAS_ADD: the row normalized is `x + r`, rounded to x's dtype (a tensor add), and stored to `h` too."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    offs = tl.arange(0, BLOCK_N)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if NUM_CHUNKS == 1:
        mask = offs < N
        x = _norm_input(x_row, r_ptr + row * stride_r, h_ptr + row * stride_h, offs, mask, HAS_ADD)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) * inv_n + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = x * rstd
        if GEMMA:  # (norm(x.float()) * (1 + w.float())).type_as(x)
            out = y * (1.0 + w)
        else:  # w * norm(x.float()).to(x.dtype), in the promoted dtype
            out = w * y.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_row + offs, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK_N + offs
            x = _norm_input(x_row, r_ptr + row * stride_r, h_ptr + row * stride_h, cols, cols < N, HAS_ADD)
            acc += x * x
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) * inv_n + eps)
        if HAS_ADD:
            tl.debug_barrier()  # the first pass's stores of h, read back below
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK_N + offs
            mask = cols < N
            if HAS_ADD:  # the sum as stored in the first pass
                x = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = x * rstd
            if GEMMA:
                out = y * (1.0 + w)
            else:
                out = w * y.to(x_ptr.dtype.element_ty).to(tl.float32)
            tl.store(out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_input(x_row, r_row, h_row, cols, mask, HAS_ADD: tl.constexpr):
    """The row's values at `cols` in float32: x, or `x + r` rounded to x's dtype and stored to h."""
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    if HAS_ADD:
        x = (x.to(tl.float32) + tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)).to(x_row.dtype.element_ty)
        tl.store(h_row + cols, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(
    gate_ptr, up_ptr, out_ptr, stride_g, stride_u, stride_out,
    COLS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < COLS
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # nn.SiLU: computed in fp32, rounded to the gate's dtype; then `* up`: one fp32 product, rounded once
    s = (g / (1.0 + tl.exp(-g))).to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as a 2-D `[rows, cols]` tensor with unit column stride (a view where possible, else a copy)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    t2 = t.reshape(-1, t.shape[-1])  # a view unless the leading dims cannot be flattened to one row stride
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma_style: bool) -> torch.Tensor:
    """RMSNorm of `x` `[..., N]` over its last dim with `weight` `[N]`, as transformers computes it.

    Llama style (`LlamaRMSNorm` and copies): `weight * norm(x.float()).to(x.dtype)`, result dtype promoted from
    `weight` and `x`. Gemma style (`GemmaRMSNorm`, Gemma2/3): `(norm(x.float()) * (1 + weight.float())).to(x.dtype)`.
    """
    return _rms_norm(x, None, weight, eps, gemma_style, False)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 use_pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(h), h)` for `h = x + residual` (a tensor add, rounded to x's dtype; `h` is `x` without a
    residual), Llama style, in one launch: the kernel Inductor makes of a decoder layer's residual add and the norm
    after it, for where that pair runs outside Inductor (`ops.norm_linear`). `use_pdl`: launched with programmatic
    dependent launch."""
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype), "x and residual differ"
    return _rms_norm(x, residual, weight, eps, False, use_pdl)


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, gemma_style: bool,
              use_pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    assert weight.dim() == 1 and weight.shape[0] == n, f"weight {tuple(weight.shape)} does not match N={n}"
    out_dtype = x.dtype if gemma_style else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    h = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    if out.numel() == 0:
        return out, h
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    h2 = h.view(-1, n) if residual is not None else x2
    out2 = out.view(-1, n)
    weight = weight.contiguous()
    block_n = min(triton.next_power_of_2(n), MAX_NORM_BLOCK)
    num_warps = 4 if block_n <= 1024 else 8 if block_n <= 4096 else 16
    launcher(_rms_norm_kernel, (x2.shape[0],), writes=(out, h) if residual is not None else (out,))(
        x2, weight, out2, r2, h2, x2.stride(0), out2.stride(0), r2.stride(0), h2.stride(0), 1.0 / n, float(eps),
        N=n, BLOCK_N=block_n, NUM_CHUNKS=triton.cdiv(n, block_n), GEMMA=gemma_style, HAS_ADD=residual is not None,
        USE_PDL=use_pdl, num_warps=num_warps, **launch_kwargs(use_pdl),
    )
    return out, h


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, use_pdl: bool = False) -> torch.Tensor:
    """`silu(gate) * up` for `gate`/`up` `[..., I]` with nn.SiLU's and the product's rounding points.

    `gate` and `up` may be column slices of one wider tensor (row stride != I); their last dim must be the columns.
    The result is a new contiguous tensor in the promoted dtype of the two. `use_pdl`: launched with programmatic
    dependent launch (it waits for its predecessor before its loads).
    """
    assert gate.shape == up.shape, f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ"
    assert gate.device == up.device
    cols = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if out.numel() == 0:
        return out
    g2, u2 = _rows(gate), _rows(up)
    out2 = out.view(-1, cols)
    block = min(triton.next_power_of_2(cols), MAX_ACT_BLOCK)
    grid = (g2.shape[0], triton.cdiv(cols, block))
    launcher(_silu_and_mul_kernel, grid, writes=(out,))(
        g2, u2, out2, g2.stride(0), u2.stride(0), out2.stride(0),
        COLS=cols, BLOCK=block, USE_PDL=use_pdl, num_warps=4, **launch_kwargs(use_pdl),
    )
    return out


# keys that do not depend on which kernel a process launches first (ops/triton_build.py)
settle_cache_keys(globals())
