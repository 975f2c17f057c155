"""Qwen3's per-head q/k RMSNorm + RoPE at decode and prefill row counts: what Inductor's kernels cost, by the token
count of the first call (when Inductor autotunes each kernel once), against one hand-written Triton launch.

In the engine the model's forward is compiled once with a dynamic token count and first called at 16 tokens; every
later step (1-256 decode rows, up to 8,192 prefill tokens) reuses the configurations chosen then. The W3 profile
(session 23) had the q kernel at ~11 us per decode step of 256 rows, for ~2 MB of traffic. Each variant runs in a
fresh subprocess with its own Inductor cache, so its autotuning starts from nothing.

    python examples/bench_qk_rope.py [--tokens 1 64 256 8192] [--first 16 256 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl

from hf_accel.ops.pdl import launch_kwargs

H, HKV, D, EPS = 16, 8, 128, 1e-6


def formula(qkv, cos, sin, q_w, k_w):
    """Qwen3Attention's forward from the fused q/k/v projection's output to what hf_accel's attention op receives."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    t = qkv.shape[1]

    def norm(x, w):
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
        return w * xf.to(x.dtype)

    q = norm(qkv[..., : H * D].view(1, t, H, D), q_w).transpose(1, 2)
    k = norm(qkv[..., H * D: (H + HKV) * D].view(1, t, HKV, D), k_w).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1)


def time_graph(fn, reps: int = 20, samples: int = 7) -> float:
    """Median microseconds per call, `reps` calls captured in one CUDA graph (the GEMM tuner's own timing)."""
    from hf_accel.ops.linear import time_in_graph

    return time_in_graph(fn, reps, samples) * 1e6


def inputs(t: int):

    g = torch.Generator(device="cuda").manual_seed(t)
    qkv = torch.randn(1, t, (H + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16, generator=g)
    ang = torch.rand(1, t, D // 2, device="cuda", generator=g) * 6.28
    emb = torch.cat((ang, ang), dim=-1)
    return qkv, emb.cos().bfloat16(), emb.sin().bfloat16()


def child(first: int, tokens: list[int]) -> dict:
    """One variant: compile the formula (dynamic token count), first call at `first` tokens, then time each count."""

    from hf_accel.compilation.piecewise import inductor_settings
    from hf_accel.config import AccelConfig

    q_w = torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5
    k_w = torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5
    with inductor_settings(pdl=True, combo_kernels=AccelConfig().combo_kernels):  # as the engine compiles
        compiled = torch.compile(formula, dynamic=True, fullgraph=True)
        qkv, cos, sin = inputs(first)
        compiled(qkv, cos, sin, q_w, k_w)
    out = {}
    for t in tokens:
        qkv, cos, sin = inputs(t)
        ref_q, ref_k = formula(qkv, cos, sin, q_w, k_w)
        q, k = compiled(qkv, cos, sin, q_w, k_w)
        err = max((q.float() - ref_q.float()).abs().max().item(), (k.float() - ref_k.float()).abs().max().item())
        out[t] = {"us": time_graph(lambda qkv=qkv, cos=cos, sin=sin: compiled(qkv, cos, sin, q_w, k_w)),
                  "max_abs_err_vs_eager": err}
    # the configurations autotuning chose (Inductor keeps them beside each kernel's source)
    import glob

    out["best_configs"] = [open(f).read() for f in glob.glob(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"],
                                                                         "**", "*.best_config"), recursive=True)]
    return out


def triton_variant(tokens: list[int]) -> dict:
    """One launch per step for queries and keys (`launch_qk_norm_rope`, defined below when triton imports)."""

    def qk_norm_rope(query, key, cos, sin, q_weight, k_weight, eps, use_pdl=False):
        q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
        launch_qk_norm_rope(query, key, q_out, k_out, cos, sin, q_weight, k_weight, eps, use_pdl)
        return q_out, k_out

    q_w = torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5
    k_w = torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5
    out = {}
    for t in tokens:
        qkv, cos, sin = inputs(t)
        q_in = qkv[0, :, : H * D].view(t, H, D)
        k_in = qkv[0, :, H * D: (H + HKV) * D].view(t, HKV, D)
        ref_q, ref_k = formula(qkv, cos, sin, q_w, k_w)

        def call(q_in=q_in, k_in=k_in, cos=cos, sin=sin):
            return qk_norm_rope(q_in, k_in, cos[0], sin[0], q_w, k_w, EPS, use_pdl=True)

        q, k = call()
        err = max((q.float() - ref_q.float()).abs().max().item(), (k.float() - ref_k.float()).abs().max().item())
        out[t] = {"us": time_graph(call), "max_abs_err_vs_eager": err}
    return out


# ------------------------------------------------------------------------------------------- the one-launch kernel
# (the prologue kernel of the session-13 experiment, commit 51b060d; the arithmetic is the stock formula in float32,
# rounded once, as Inductor's fused kernels compute it)


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
def _norm_rope_heads(in_ptr, out_ptr, stride_h, stride_oh, w_ptr, cos, sin, eps, offs_d, d_ok,
                     NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HAS_NORM: tl.constexpr):
    """One token's heads (`in_ptr`, `out_ptr` at its row) normalised, rotated and stored."""
    heads = tl.arange(0, HEADS_PAD)
    ok = heads < NUM_HEADS
    x = _load_norm_rope(in_ptr, heads, ok, offs_d, d_ok, stride_h, w_ptr, cos, sin, eps, HEAD_DIM, HAS_NORM)
    tl.store(out_ptr + heads[:, None] * stride_oh + offs_d[None, :], x.to(out_ptr.dtype.element_ty),
             mask=ok[:, None] & d_ok[None, :])


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
    _norm_rope_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, stride_qh, stride_qoh, q_w_ptr, cos, sin, eps,
                     offs_d, d_ok, NUM_Q_HEADS, Q_HEADS_PAD, HEAD_DIM, HAS_NORM)
    _norm_rope_heads(k_ptr + t * stride_kt, k_out_ptr + t * stride_kot, stride_kh, stride_koh, k_w_ptr, cos, sin, eps,
                     offs_d, d_ok, NUM_KV_HEADS, KV_HEADS_PAD, HEAD_DIM, HAS_NORM)


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

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", nargs="*", type=int, default=[1, 64, 256, 8192])
    ap.add_argument("--first", nargs="*", type=int, default=[16, 256, 8192])
    ap.add_argument("--json")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.tokens)))
        return 0
    rows = {}
    for first in args.first:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            proc = subprocess.run([sys.executable, __file__, "--child", str(first), "--tokens",
                                   *map(str, args.tokens)], env=env, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                print(f"first call at {first}: failed\n{proc.stderr[-2000:]}")
                continue
            rows[f"inductor, first call at {first}"] = json.loads(proc.stdout.strip().splitlines()[-1])
    rows["triton, one launch"] = triton_variant(args.tokens)
    print(f"{'variant':32s}" + "".join(f"{t:>14d}" for t in args.tokens) + "   (us per call; tokens across)")
    for name, res in rows.items():
        print(f"{name:32s}" + "".join(f"{res[t]['us'] if t in res else res[str(t)]['us']:14.2f}"
                                      for t in args.tokens))
    for name, res in rows.items():
        for cfg in res.get("best_configs", []):
            print(f"{name}: {cfg[:200]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
