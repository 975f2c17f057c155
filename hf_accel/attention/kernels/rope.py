"""Queries' and keys' per-head RMSNorm (Qwen3's `q_norm` / `k_norm`, optional) and rotary embedding, in the attention
op instead of in the model's graph.

Compiled, the model applies them in two Inductor kernels per layer (one for queries, one for keys) between the q/k/v
projection and the attention launch. When the attention module hands the raw projections to the attention op
(`hf_accel.attention.fused_rope`), the Triton backend's decode kernel applies both to the rows it reads and to the
new key it writes into the cache (`norm_rope`, called from `split_kv_decode`), and every other path runs
`qk_norm_rope` first: one launch for queries and keys, or the torch formula off CUDA.

The arithmetic is the stock modules' formula computed in float32 and rounded once to the input dtype, as Inductor's
fused kernels computed it before (eager transformers rounds after each op; the results differ from it in the last
bit of some elements, never more than a couple of ulps, and are closer to the float32 result). Off CUDA the op runs
the stock formula itself, op by op (`qk_norm_rope_reference`). `cos` / `sin` `[T, D]` are the model's own rotary tables
for the step's positions (the rotary module already ran in the graph), so every RoPE variant whose tables have the full
head dim (default, linear, dynamic, YaRN, llama3 scaling) is covered by the same code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.ops.pdl import launch_kwargs


@triton.jit
def norm_rope(x, x_rot, offs_d, w, w_rot, cos, sin, eps, out_like, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """Rows `x` `[R, DP]` of one token (float32 widened from the input dtype; padded columns zero) and `x_rot`, the
    same rows read at column `(d + D/2) % D` (`offs_d`: the column indices); `w`, `w_rot` the norm weight read likewise;
    `cos`, `sin` `[DP]` float32, the token's tables. Returns the rows normalised (HAS_NORM) and rotated, computed in
    float32 and rounded once, to `out_like`'s element type (a pointer of that dtype)."""
    sign = tl.where(offs_d < HEAD_DIM // 2, -1.0, 1.0)  # rotate_half: (-x2, x1)
    if HAS_NORM:
        r = tl.math.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)
        x = x * r[:, None] * w[None, :]
        x_rot = x_rot * r[:, None] * w_rot[None, :]
    return (x * cos[None, :] + x_rot * sign[None, :] * sin[None, :]).to(out_like.dtype.element_ty)


@triton.jit
def _load_norm_rope(ptr, heads, head_ok, offs_d, d_ok, stride_h, w_ptr, cos, sin, eps, HEAD_DIM: tl.constexpr,
                    HAS_NORM: tl.constexpr):
    """Rows `heads` of one token (`ptr` at its row) normalised and rotated (`norm_rope`)."""
    rot = (offs_d + HEAD_DIM // 2) % HEAD_DIM
    mask = head_ok[:, None] & d_ok[None, :]
    x = tl.load(ptr + heads[:, None] * stride_h + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_rot = tl.load(ptr + heads[:, None] * stride_h + rot[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        w = tl.load(w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        w_rot = tl.load(w_ptr + rot, mask=d_ok, other=0.0).to(tl.float32)
    else:
        w = cos
        w_rot = cos
    return norm_rope(x, x_rot, offs_d, w, w_rot, cos, sin, eps, ptr, HEAD_DIM, HAS_NORM)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_ct, stride_st,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HAS_NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per token: all its query heads, then all its key heads."""
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cos = tl.load(cos_ptr + t * stride_ct + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_st + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    qh = tl.arange(0, Q_HEADS_PAD)
    q_ok = qh < NUM_Q_HEADS
    q = _load_norm_rope(q_ptr + t * stride_qt, qh, q_ok, offs_d, d_ok, stride_qh, q_w_ptr, cos, sin, eps, HEAD_DIM,
                        HAS_NORM)
    tl.store(q_out_ptr + t * stride_qot + qh[:, None] * stride_qoh + offs_d[None, :], q.to(q_out_ptr.dtype.element_ty),
             mask=q_ok[:, None] & d_ok[None, :])
    kh = tl.arange(0, KV_HEADS_PAD)
    k_ok = kh < NUM_KV_HEADS
    k = _load_norm_rope(k_ptr + t * stride_kt, kh, k_ok, offs_d, d_ok, stride_kh, k_w_ptr, cos, sin, eps, HEAD_DIM,
                        HAS_NORM)
    tl.store(k_out_ptr + t * stride_kot + kh[:, None] * stride_koh + offs_d[None, :], k.to(k_out_ptr.dtype.element_ty),
             mask=k_ok[:, None] & d_ok[None, :])


def qk_norm_rope_reference(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The stock formula in torch ops (transformers' RMSNorm forward, then `apply_rotary_pos_emb`): query `[T, H, D]`,
    key `[T, Hkv, D]`, cos / sin `[T, D]`."""
    c, s = cos[:, None, :], sin[:, None, :]

    def one(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        if w is not None:
            xf = x.to(torch.float32)
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            x = w * xf.to(x.dtype)
        half = x.shape[-1] // 2
        return (x * c) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s)

    return one(query, q_weight), one(key, k_weight)


def qk_norm_rope(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 use_pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries `[T, H, D]` and keys `[T, Hkv, D]` (any row / head strides, D contiguous) normalised (given weights)
    and rotated into new contiguous tensors: one Triton launch on CUDA, `qk_norm_rope_reference` (the stock formula,
    op by op, bit for bit) elsewhere."""
    if not query.is_cuda:
        q, k = qk_norm_rope_reference(query, key, cos, sin, q_weight, k_weight, eps)
        return q.contiguous(), k.contiguous()
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    launch_qk_norm_rope(query, key, q_out, k_out, cos, sin, q_weight, k_weight, eps, use_pdl)
    return q_out, k_out


def launch_qk_norm_rope(query: torch.Tensor, key: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
                        k_weight: torch.Tensor | None, eps: float, use_pdl: bool = False) -> None:
    """The kernel of `qk_norm_rope` into given outputs (same shapes as the inputs, D contiguous)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    for t in (query, key, q_out, k_out, cos, sin):
        assert t.stride(-1) == 1, "rotary embedding: the head dim must be contiguous"
    assert head_dim % 2 == 0 and cos.shape[-1] == head_dim, "rotary tables must span the (even) head dim"
    if num_tokens == 0:
        return
    has_norm = q_weight is not None
    _qk_norm_rope_kernel[(num_tokens,)](
        query, key, q_out, k_out, cos, sin, q_weight if has_norm else cos, k_weight if has_norm else cos, float(eps),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), q_out.stride(0), q_out.stride(1),
        k_out.stride(0), k_out.stride(1), cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, Q_HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), HAS_NORM=has_norm, USE_PDL=use_pdl, num_warps=4,
        **launch_kwargs(use_pdl),
    )
