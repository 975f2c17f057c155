"""`hf_accel::int8_weight_linear`: a linear whose weight is int8 with one scale per output row (torchao int8
weight-only), as one opaque op for torch.compile.

Decode steps (at most `skinny_gemm.MAX_M` rows, CUDA) run the small-M GEMM on the int8 weight itself: one byte per
weight streamed, widened in registers, float32 accumulation, the scale applied once. Every other call computes what
torchao's own `Int8Tensor` linear computes, in the same order (`(x @ W.to(x.dtype)^T) * scale`), so prefill and
CPU runs give torchao's numbers. See `patches.quantization.int8_weight_only_parts` for why the op exists.
"""

from __future__ import annotations

import functools

import torch

from hf_accel.attention.context import split_k_counters
from hf_accel.ops.linear import device_index, int8_key_dtype, tuned_config

_skinny = None  # hf_accel.ops.skinny_gemm, imported on first CUDA use (it imports triton at the top)


def default_config(m: int, n: int, k: int, device: torch.device):
    """The tile rule used where nothing was tuned (and the tuner's baseline): M padded to the tensor-core minimum, K
    tiles of 256 int8 bytes (128 for 64 rows, to fit shared memory), and K split until there are about two programs
    per SM."""
    return _rule(16 if m <= 16 else (32 if m <= 32 else 64), n, k, device_index(device))


@functools.cache
def _rule(block_m: int, n: int, k: int, device_index: int):
    """`default_config` per (row tile, shape, GPU): computed once, since uncaptured steps ask on every call."""
    from hf_accel.ops.skinny_gemm import SkinnyConfig

    block_k = 256 if block_m <= 32 else 128
    block_n = 64
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    n_programs = -(-n // block_n)
    split = 1
    while n_programs * split < 2 * sms and k // (block_k * split * 2) >= 2:
        split *= 2
    return SkinnyConfig(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split,
                        num_warps=4, num_stages=4 if block_m <= 32 else 3)


def reference_int8_weight_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                                 bias: torch.Tensor | None) -> torch.Tensor:
    """torchao's int8 weight-only linear (per-row / per-tensor scale), step for step."""
    m = torch.mm(x.reshape(-1, x.shape[-1]), qdata.t().to(x.dtype))
    y = (m * scale.to(m.dtype).flatten()).reshape(*x.shape[:-1], qdata.shape[0])
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


@torch.library.custom_op("hf_accel::int8_weight_linear", mutates_args=())
def int8_weight_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                       use_pdl: bool) -> torch.Tensor:
    """`x @ (qdata * scale)^T (+ bias)` for an int8 `qdata` [N, K] and a scale per row of it (or one in all)."""
    global _skinny
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    n, k = qdata.shape
    if (x.is_cuda and 0 < m and x.dtype in (torch.bfloat16, torch.float16) and qdata.stride(-1) == 1
            and (bias is None or bias.dtype == x.dtype)):
        if _skinny is None:
            from hf_accel.ops import skinny_gemm as _skinny
        if m <= _skinny.MAX_M:
            s = scale.reshape(-1)
            s = (s.expand(n) if s.numel() == 1 else s).contiguous()
            return _skinny.skinny_linear(x, qdata, bias, _tile_config(x, m, n, k, bias is not None), use_pdl,
                                         scale=s, counters=split_k_counters())
    return reference_int8_weight_linear(x, qdata, scale, bias)


def _tile_config(x: torch.Tensor, m: int, n: int, k: int, has_bias: bool):
    """The tuned tile shape for this weight shape and row bucket (`linear.tune_linears(..., int8=True)`, run at
    warm-up when the small-M GEMM is on), else the tile rule. 17-32 rows keep the rule: no 32-row bucket is tuned,
    and the rule's 32-row tile beats the 64-row bucket's there."""
    cfg = None if 16 < m <= 32 else tuned_config(x.device, int8_key_dtype(x.dtype), n, k, has_bias, m)
    return cfg if cfg is not None else default_config(m, n, k, x.device)


@int8_weight_linear.register_fake
def _(x, qdata, scale, bias, use_pdl):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))
