"""`hf_accel::linear_add_rms_norm_linear`: a linear, the residual add after it, the RMSNorm and the linear after that.

Every decoder layer has two such chains: `o_proj -> + residual -> post-attention norm -> gate/up` and, from one layer
to the next, `down_proj -> + residual -> input norm -> q/k/v`. With `compilation.norm_folding` the norm and the add
are already part of the second linear's op; at one row that op normalizes inside the one-row GEMM, but at 2-64 rows
(W2's decode steps) it runs the add and the norm as a kernel of their own between the two GEMMs, because a GEMM
program cannot normalize a row it has not summed, and summing 64 whole rows in every program costs more than the
kernel. The compile pass `compilation.norm_folding.chain_residual_norms` hands the first linear to the op too, and
at run time, where both linears have a chain tile for the step's row count (a tensor-core tile of the small-M GEMM
that `ops.linear.tune_linears` timed in that place of a chain and found within `ops.linear.CHAIN_SLACK` of the
plain cuBLAS linear), the chain is two launches instead of three:

- the first GEMM's epilogue adds the residual to its rounded output, stores that sum `h` (the residual stream the
  layer continues with) and each column tile's float32 sums of squares of its rows of `h`
  (`skinny_gemm.linear_add_residual`);
- the second GEMM sums those partial sums per row in a fixed order, and normalizes each K tile of `h` as it reads it
  (`skinny_gemm.norm_partials_linear`; gated: the SiLU-and-mul in its epilogue as before).

Everywhere else (one row, a linear without a chain tile, CPU) it runs what the graph ran before: the linear, then
the folded norm's op (`ops.norm_linear` / `ops.gated_linear`).

Numerics: every form rounds where the stock modules round (the linear's output, the add, the normalized row, its
product with the norm weight); the chained form differs from the norm kernel it replaces only in the order of the
float32 sum of squares (per column tile, then across tiles), as the one-row fold does.
"""

from __future__ import annotations

import torch

from hf_accel.attention.context import split_k_counters
from hf_accel.ops.gated_linear import run_gated
from hf_accel.ops.linear import gated_key_dtype, kernel_operands, run_linear, tuned_config
from hf_accel.ops.norm_linear import run_norm_linear


def chain_configs(x: torch.Tensor, weight1: torch.Tensor, bias1: torch.Tensor | None, residual: torch.Tensor,
                  norm_weight: torch.Tensor, weight2: torch.Tensor, bias2: torch.Tensor | None, gated: bool,
                  counters: torch.Tensor | None):
    """(first config, second config) when this call runs as the two chained launches, else None."""
    k = x.shape[-1]
    if not k or not (kernel_operands(x, weight1, bias1) and kernel_operands(x, weight2, bias2)):
        return None
    from hf_accel.ops import skinny_gemm  # imports triton: only where a chain may run
    m = x.numel() // k
    n = weight1.shape[0]
    if m < 2 or residual.dtype != x.dtype or norm_weight.dtype != x.dtype or weight2.shape[1] != n:
        return None  # one row: the one-row GEMM normalizes its input itself (ops.norm_linear)
    cfg1 = tuned_config(x.device, x.dtype, n, k, bias1 is not None, m, chain="first")
    if cfg1 is None or not skinny_gemm.can_chain(cfg1, m, k, n, counters, residual=True):
        return None
    key = gated_key_dtype(x.dtype) if gated else x.dtype
    cfg2 = tuned_config(x.device, key, weight2.shape[0], n, bias2 is not None, m, chain="second")
    if cfg2 is None or not skinny_gemm.can_chain(cfg2, m, n, weight2.shape[0], counters, residual=False):
        return None
    return cfg1, cfg2


def run_chain(x: torch.Tensor, weight1: torch.Tensor, bias1: torch.Tensor | None, residual: torch.Tensor,
              norm_weight: torch.Tensor, eps: float, weight2: torch.Tensor, bias2: torch.Tensor | None, gated: bool,
              use_pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    counters = split_k_counters() if x.is_cuda else None
    cfgs = chain_configs(x, weight1, bias1, residual, norm_weight, weight2, bias2, gated, counters)
    if cfgs is not None:
        from hf_accel.ops import skinny_gemm

        h, ss = skinny_gemm.linear_add_residual(x, weight1, bias1, residual, cfgs[0], use_pdl, counters=counters)
        y = skinny_gemm.norm_partials_linear(h, ss, norm_weight, eps, weight2, bias2, cfgs[1], use_pdl,
                                             counters=counters, gated=gated)
        return y, h
    a = run_linear(x, weight1, bias1, use_pdl)
    if gated:
        return run_gated(a, residual, norm_weight, eps, weight2, use_pdl)
    return run_norm_linear(a, residual, norm_weight, eps, weight2, bias2, use_pdl)


@torch.library.custom_op("hf_accel::linear_add_rms_norm_linear", mutates_args=())
def linear_add_rms_norm_linear(x: torch.Tensor, weight1: torch.Tensor, bias1: torch.Tensor | None,
                               residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight2: torch.Tensor,
                               bias2: torch.Tensor | None, gated: bool,
                               use_pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(F.linear(llama_rms_norm(h, norm_weight, eps), weight2, bias2), h)` for `h = F.linear(x, weight1, bias1) +
    residual`; `gated`: the first output is `silu(y[..., :I]) * y[..., I:]` of that product (no bias2)."""
    return run_chain(x, weight1, bias1, residual, norm_weight, eps, weight2, bias2, gated, use_pdl)


@linear_add_rms_norm_linear.register_fake
def _(x, weight1, bias1, residual, norm_weight, eps, weight2, bias2, gated, use_pdl):
    out = weight2.shape[0] // 2 if gated else weight2.shape[0]
    return x.new_empty((*x.shape[:-1], out)), x.new_empty((*x.shape[:-1], weight1.shape[0]))
