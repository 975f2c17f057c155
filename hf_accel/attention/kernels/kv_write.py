"""Triton kernel that scatters a step's new K/V rows into the paged KV cache.

One program copies one token's heads for K and V (a `[BLOCK_H, HEAD_DIM_PAD]` tile each). Slots `< 0` are padding
(CUDA-graph rows, tokens that must not be cached) and are skipped inside the kernel, so the launch grid depends on
the tensor shape only and the same launch is valid for every replay of a captured graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.ops.pdl import launch_kwargs
from hf_accel.ops.triton_build import launcher, settle_cache_keys


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, USE_PDL: tl.constexpr,
):
    tok = tl.program_id(0)
    if USE_PDL:  # everything below reads or writes what earlier kernels of the step touch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    tok64 = tok.to(tl.int64)

    k = tl.load(key_ptr + tok64 * stride_kt + heads[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + tok64 * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=mask)
    store_at_slot(k_cache_ptr, k, slot, heads[:, None] * stride_kch + offs_d[None, :], stride_kcb, stride_kcs, mask,
                  BLOCK_SIZE)
    store_at_slot(v_cache_ptr, v, slot, heads[:, None] * stride_vch + offs_d[None, :], stride_vcb, stride_vcs, mask,
                  BLOCK_SIZE)


@triton.jit
def store_at_slot(cache_ptr, rows, slot, head_offsets, stride_block, stride_slot, mask, BLOCK_SIZE: tl.constexpr):
    """Store `rows` (one token's heads, at `head_offsets` within a slot) at flat slot `slot` of a paged cache, cast
    to the cache's dtype; the split-KV decode kernel writes its step's new K/V through this too."""
    block = slot // BLOCK_SIZE
    at = slot % BLOCK_SIZE
    tl.store(cache_ptr + block * stride_block + at * stride_slot + head_offsets,
             rows.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, use_pdl: bool = False) -> None:
    """Write `key`/`value` `[T, Hkv, D]` into `k_cache`/`v_cache` `[num_blocks, block_size, Hkv, D]`.

    Row `t` goes to flat slot `slot_mapping[t]`; rows with a negative slot are skipped. Only the first `T` entries
    of `slot_mapping` are read.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "key/value must be contiguous in the head dim"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "KV cache must be contiguous in the head dim"
    assert slot_mapping.shape[0] >= num_tokens
    head_dim_pad = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(num_kv_heads), 2048 // head_dim_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    launcher(_write_kv_kernel, grid)(
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_H=block_h,
        BLOCK_SIZE=k_cache.shape[1], USE_PDL=use_pdl, num_warps=4, **launch_kwargs(use_pdl),
    )


# keys that do not depend on which kernel a process launches first (ops/triton_build.py)
settle_cache_keys(globals())
