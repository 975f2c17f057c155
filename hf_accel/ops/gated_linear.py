"""`hf_accel::silu_mul_linear` and `hf_accel::add_rms_norm_silu_mul_linear`: a gated MLP's gate/up GEMM with the SiLU
gate in its epilogue.

A Llama-style MLP computes `down(silu(gate(x)) * up(x))`. With gate and up packed into one linear
(`compilation.linear_packing`), a decode step runs that linear, then one elementwise kernel for `silu(g) * u`, then
the down projection: at one to 64 rows the middle kernel moves a few kilobytes, yet it is one more launch and one
more wait between two GEMMs in every layer. The compile pass `compilation.gated_activation` hands the packed linear
and the activation after it (with the RMSNorm before it, when `compilation.norm_folding` already put the norm into
the linear) to these ops. At run time, for a row count and weight shape whose tuned gated decision is our kernel
(`ops.linear.tune_linears(gated=True)`), the small-M GEMM computes the gate and the up tile of each output column
block side by side and writes `silu(gate) * up` (`skinny_gemm.skinny_linear(gated=True)`; at one row with a
folded norm, the one-row kernel also normalizes its input). Everywhere else (more rows, no decision, CPU) it runs
what the graph ran before: the (norm and) linear, then the SiLU-and-mul as one kernel (torch's ops on CPU).

Numerics: every form rounds where the stock MLP rounds: the GEMM's output to the activations' dtype, SiLU in float32
rounded to it, then one product rounded once. Inductor's kernel, which this replaces, kept the SiLU in float32 up to
the product; the stock module does not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_accel.attention.context import split_k_counters
from hf_accel.ops.linear import gated_key_dtype, kernel_operands, run_linear, tuned_config
from hf_accel.ops.norm_linear import norm_unfused, one_row_norm_fits, run_norm_linear

# the Triton kernel modules (skinny_gemm, fused_kernels) import triton: they are imported where first used


def gated_config(x: torch.Tensor, weight: torch.Tensor):
    """The tuned gated GEMM config for this call (`x`'s rows, the gate/up weight's shape), or None (unfused)."""
    k = x.shape[-1]
    if not (kernel_operands(x, weight, None) and k and weight.shape[0] % 2 == 0):
        return None
    m = x.numel() // k
    if m == 0:
        return None
    return tuned_config(x.device, gated_key_dtype(x.dtype), weight.shape[0], weight.shape[1], False, m)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, use_pdl: bool) -> torch.Tensor:
    """`silu(gate) * up` rounded as the stock MLP: our one kernel on CUDA, torch's two ops elsewhere."""
    if gate.is_cuda:
        from hf_accel.ops import fused_kernels

        return fused_kernels.silu_and_mul(gate, up, use_pdl)
    return F.silu(gate) * up


def run_gated(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
              weight: torch.Tensor, use_pdl: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(`silu(y[..., :I]) * y[..., I:]`, h) for `y = F.linear(rms_norm(h), weight)` (`h = x (+ residual)`; no norm:
    `y = F.linear(x, weight)`, h None). `weight`: gate rows, then up rows (`[2I, K]`)."""
    inter = weight.shape[0] // 2
    cfg = gated_config(x, weight)
    if cfg is not None:
        from hf_accel.ops import skinny_gemm

        if norm_weight is not None and cfg.gemv and one_row_norm_fits(x, residual, norm_weight):
            return skinny_gemm.norm_linear_fused(x, residual, norm_weight, eps, weight, None, cfg, use_pdl,
                                                 counters=split_k_counters(), gated=True)
        h = None
        if norm_weight is not None:
            x, h = norm_unfused(x, residual, norm_weight, eps, use_pdl)
        y = skinny_gemm.skinny_linear(x, weight, None, cfg, use_pdl, counters=split_k_counters(), gated=True)
        return y, h if residual is not None else None
    if norm_weight is not None:
        both, h = run_norm_linear(x, residual, norm_weight, eps, weight, None, use_pdl)
    else:
        both, h = run_linear(x, weight, None, use_pdl), None
    return silu_and_mul(both[..., :inter], both[..., inter:], use_pdl), h if residual is not None else None


@torch.library.custom_op("hf_accel::silu_mul_linear", mutates_args=())
def silu_mul_linear(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, weight: torch.Tensor,
                    use_pdl: bool) -> torch.Tensor:
    """`silu(y[..., :I]) * y[..., I:]` for `y = F.linear(x', weight)`, `x'` = `llama_rms_norm(x, norm_weight, eps)`
    or, without `norm_weight`, `x` (see the module docstring)."""
    return run_gated(x, None, norm_weight, eps, weight, use_pdl)[0]


@silu_mul_linear.register_fake
def _(x, norm_weight, eps, weight, use_pdl):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


@torch.library.custom_op("hf_accel::add_rms_norm_silu_mul_linear", mutates_args=())
def add_rms_norm_silu_mul_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                 weight: torch.Tensor, use_pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(silu(y[..., :I]) * y[..., I:], h)` for `h = x + residual`, `y = F.linear(llama_rms_norm(h), weight)`."""
    return run_gated(x, residual, norm_weight, eps, weight, use_pdl)


@add_rms_norm_silu_mul_linear.register_fake
def _(x, residual, norm_weight, eps, weight, use_pdl):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2)), x.new_empty(x.shape)
