"""`hf_accel::rms_norm_linear` and `hf_accel::add_rms_norm_linear`: a decoder layer's RMSNorm and the linear after it.

In a decode step at batch 1, the residual add and the RMSNorm before the q/k/v and gate/up projections are one
Inductor kernel each: a launch, a wait for the GEMM before it, a row read and a row written, about 1.5 us on the H200
for 4 KB of work, twice per layer. The compile pass `compilation.norm_folding` hands such a pair (the norm's input,
or the two addends of the add before it, the norm's weight and epsilon, and the linear) to these ops instead. At run
time, with one row of at most `MAX_ONE_ROW_NORM_K` columns and a weight shape whose tuned M = 1 decision is the
one-row GEMM kernel, the op is that kernel normalizing its own input (`skinny_gemm.norm_linear_fused`): the norm
kernel is gone. Everywhere else (more rows, a wider row, another decision, CPU) it runs the add and the norm as one
kernel (`fused_kernels.add_rms_norm` on CUDA, torch's ops on CPU), as Inductor did, then what `hf_accel::linear`
runs.

Numerics: each form rounds where the eager LlamaRMSNorm rounds (the sum to the activations' dtype, the normalized row
to it, then the product with the weight), so the GEMM reads the bits the stock module would give it, up to the order
of the float32 sum of squares (and a multiply by 1/K for the mean). Inductor's own norm kernel, which this replaces,
keeps the normalized row in float32 up to the product with the weight (it does not emulate that cast), so with the
fold on, steps of any size round as eager does rather than with Inductor's extra precision.
"""

from __future__ import annotations

import torch

from hf_accel.attention.context import split_k_counters
from hf_accel.ops.linear import kernel_operands, run_linear, tuned_config

# the Triton kernel modules (skinny_gemm, fused_kernels) import triton: they are imported where first used

# widest row (hidden size) the one-row GEMM normalizes itself. Every program of that kernel reads the whole row
# (twice: for its sum of squares, then tile by tile) where the unfolded GEMM reads it once, and that cost grows with
# the row: on the H200, W1 rose from 1,024 to 1,086 tok/s with the fold at qwen3-0.6b's 1,024 columns and from 989 to
# 1,015 at llama-3.2-1b's 2,048 (same lease), but fell from 233 to 228 at llama-3.1-8b's 4,096 (another lease).
# Wider rows take the unfused path (`compilation.norm_folding` folds them only for a residual chain)
MAX_ONE_ROW_NORM_K = 2048


def one_row_norm_fits(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor) -> bool:
    """Whether a one-row GEMM can normalize this input itself: one row of at most `MAX_ONE_ROW_NORM_K` columns, the
    norm's weight and the residual in the input's dtype (plain and gated linears alike)."""
    k = x.shape[-1]
    return (0 < k <= MAX_ONE_ROW_NORM_K and x.numel() == k and norm_weight.dtype == x.dtype
            and (residual is None or residual.dtype == x.dtype))


def _fused_config(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None):
    """The one-row GEMM config that runs this call with the norm inside it, or None (the unfused path)."""
    if not (kernel_operands(x, weight, bias) and one_row_norm_fits(x, residual, norm_weight)):
        return None
    cfg = tuned_config(x.device, x.dtype, weight.shape[0], weight.shape[1], bias is not None, 1)
    return cfg if cfg is not None and cfg.gemv else None


def norm_unfused(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  use_pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, h): the add and the norm as the graph had them, one kernel on CUDA."""
    if x.is_cuda and (residual is None or residual.dtype == x.dtype) and norm_weight.dtype == x.dtype:
        from hf_accel.ops import fused_kernels

        return fused_kernels.add_rms_norm(x, residual, norm_weight, eps, use_pdl)
    h = (x + residual).contiguous() if residual is not None else x  # contiguous, as the op's fake says
    h32 = h.to(torch.float32)
    normed = norm_weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return normed, h


def run_norm_linear(x, residual, norm_weight, eps, weight, bias, use_pdl) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = _fused_config(x, residual, norm_weight, weight, bias)
    if cfg is not None:
        from hf_accel.ops import skinny_gemm

        y, h = skinny_gemm.norm_linear_fused(x, residual, norm_weight, eps, weight, bias, cfg, use_pdl,
                                             counters=split_k_counters())
        return y, (h if h is not None else x)
    normed, h = norm_unfused(x, residual, norm_weight, eps, use_pdl)
    return run_linear(normed, weight, bias, use_pdl), h


@torch.library.custom_op("hf_accel::rms_norm_linear", mutates_args=())
def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None, use_pdl: bool) -> torch.Tensor:
    """`F.linear(llama_rms_norm(x, norm_weight, eps), weight, bias)` (see the module docstring)."""
    return run_norm_linear(x, None, norm_weight, eps, weight, bias, use_pdl)[0]


@rms_norm_linear.register_fake
def _(x, norm_weight, eps, weight, bias, use_pdl):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("hf_accel::add_rms_norm_linear", mutates_args=())
def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None,
                        use_pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(F.linear(llama_rms_norm(h, norm_weight, eps), weight, bias), h)` for `h = x + residual`."""
    return run_norm_linear(x, residual, norm_weight, eps, weight, bias, use_pdl)


@add_rms_norm_linear.register_fake
def _(x, residual, norm_weight, eps, weight, bias, use_pdl):
    return x.new_empty((*x.shape[:-1], weight.shape[0])), x.new_empty(x.shape)
