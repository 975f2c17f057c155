"""Q/K norm and RoPE inside the attention op (hf_accel.attention.fused_rope, attention/kernels/rope.py).

Kernel tests run compiled on a GPU or in the Triton interpreter on CPU (tests/triton_mode.py): the prologue kernel
against the stock formula, and the decode kernel rotating its own query rows and new keys against the same step with
both applied beforehand (outputs and the KV written). Model tests run the tiny Llama / Qwen3 on CPU through the
engine (torch backend: the op applies the stock formula itself) and check the patched forwards are installed, used,
exact against stock, and gone again after restore; and that every case the fused path does not cover falls back to
the class forward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from triton_mode import DEVICE, ON_GPU, load_kernel_modules

triton = pytest.importorskip("triton")

import transformers  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb  # noqa: E402

load_kernel_modules([f"hf_accel.attention.kernels.{n}" for n in ("rope", "kv_write", "common", "unified_attention",
                                                                    "split_kv_decode")], "_qk_norm_rope_kernel")

from test_triton_kernels import make_backend, make_step  # noqa: E402

from hf_accel import AccelConfig, accelerate_model, restore  # noqa: E402
from hf_accel.attention.kernels import rope as R  # noqa: E402


def rotary_tables(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions[:, None].float().cpu() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(positions.device), emb.sin().to(dtype).to(positions.device)


def stock(q, k, cos, sin, q_norm=None, k_norm=None):
    """transformers' own modules: [T, H, D] in, [T, H, D] out."""
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    sq, sk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    return sq[0].transpose(0, 1), sk[0].transpose(0, 1)


def norms(head_dim: int, dtype: torch.dtype, device=DEVICE, seed: int = 3):
    torch.manual_seed(seed)
    q_norm, k_norm = Qwen3RMSNorm(head_dim, eps=1e-6), Qwen3RMSNorm(head_dim, eps=1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(head_dim))
        k_norm.weight.copy_(torch.randn(head_dim))
    return q_norm.to(device, dtype), k_norm.to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_norm", [False, True])
def test_reference_is_the_stock_formula(dtype, with_norm):
    """Bit for bit on CPU: the formula the op applies where no kernel runs is transformers' own."""
    torch.manual_seed(0)
    q, k = torch.randn(7, 4, 32, dtype=dtype) * 3, torch.randn(7, 2, 32, dtype=dtype) * 3
    cos, sin = rotary_tables(torch.arange(7) + 11, 32, dtype)
    qn, kn = norms(32, dtype, "cpu") if with_norm else (None, None)
    with torch.no_grad():
        want = stock(q, k, cos, sin, qn, kn)
        got = R.qk_norm_rope_reference(q, k, cos, sin, qn.weight if qn else None, kn.weight if kn else None, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# float32 compares closely in the interpreter; its bf16 casts truncate, so bf16 is judged on a GPU only
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (6, 2, 48), (8, 8, 128)])
def test_prologue_kernel_matches_stock(dtype, with_norm, heads, kv_heads, head_dim):
    """One launch for queries and keys, from strided views of a packed q/k/v output, head counts and head dims that
    are not powers of two included. The kernel computes in float32 and rounds once (as Inductor's fused kernels did),
    stock rounds after every op: within a couple of ulps of the stock modules, in half precision most elements
    exactly."""
    torch.manual_seed(1)
    t = 5
    packed = torch.randn(t, (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype) * 2
    q = packed[:, : heads * head_dim].view(t, heads, head_dim)
    k = packed[:, heads * head_dim: (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    cos, sin = rotary_tables(torch.arange(t, device=DEVICE) * 7, head_dim, dtype)
    qn, kn = norms(head_dim, dtype) if with_norm else (None, None)
    q_out, k_out = torch.empty(q.shape, dtype=dtype, device=DEVICE), torch.empty(k.shape, dtype=dtype, device=DEVICE)
    R.launch_qk_norm_rope(q, k, q_out, k_out, cos, sin, qn.weight if qn else None, kn.weight if kn else None, 1e-6)
    with torch.no_grad():
        want_q, want_k = stock(q, k, cos, sin, qn, kn)
    ulps = 4 if dtype == torch.float32 else 2  # stock rounds after each op, the kernel once at the end
    for got, want in ((q_out, want_q), (k_out, want_k)):
        ulp = torch.finfo(dtype).eps * want.float().abs().clamp(min=1.0)
        assert ((got.float() - want.float()).abs() <= ulps * ulp).all()
        if dtype != torch.float32:
            assert (got == want).float().mean() > 0.5


def _rope_args(step, dtype, with_norm):
    head_dim = step.query.shape[-1]
    positions = step.meta.seq_lens[: step.meta.num_seqs].long() - 1
    pos = torch.zeros(step.query.shape[0], dtype=torch.long, device=DEVICE)
    pos[: step.meta.num_seqs] = positions  # decode: one row per sequence
    cos, sin = rotary_tables(pos, head_dim, dtype)
    qn, kn = norms(head_dim, dtype) if with_norm else (None, None)
    return (cos, sin, qn.weight.detach() if qn else None, kn.weight.detach() if kn else None, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("splits,fused", [(1, True), (4, True), (4, False), (0, True)])
def test_decode_launch_rotates_its_own_rows(dtype, with_norm, splits, fused):
    """The layer with raw q/k and `rope` gives the output and the KV cache of the same layer run on q/k rotated
    beforehand by the prologue kernel: fused-merge split launches rotate in-kernel; the unsplit launch, the unfused
    split and the unified kernel (splits 0) take the prologue first."""
    step = make_step([1] * 4, [0, 15, 40, 77], dtype=dtype, seed=5)
    rope = _rope_args(step, dtype, with_norm)
    q_rot, k_rot = torch.empty_like(step.query), torch.empty_like(step.key)
    R.launch_qk_norm_rope(step.query, step.key, q_rot, k_rot, *rope)  # the prologue kernel: the same float32 math
    scale = step.query.shape[-1] ** -0.5
    results = []
    for raw in (True, False):
        be = make_backend(step, num_kv_splits=splits, decode_block_n=16, fused_split_reductions=fused)
        kc, vc = step.k_cache.clone(), step.v_cache.clone()
        be.prepare(step.meta)
        out = torch.full_like(step.query, float("nan"))
        if raw:
            be.write_kv_and_forward(step.query, step.key, step.value, kc, vc, step.meta, out, scale, 0, 0.0,
                                    rope=rope)
        else:
            be.write_kv_and_forward(q_rot.contiguous(), k_rot.contiguous(), step.value, kc, vc, step.meta, out,
                                    scale, 0, 0.0)
        results.append((out, kc, vc))
    (out_a, kc_a, vc_a), (out_b, kc_b, vc_b) = results
    n = step.meta.num_tokens
    tol = 2e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out_a[:n], out_b[:n], atol=tol, rtol=tol)
    written = ~torch.isnan(kc_b)
    assert torch.equal(written, ~torch.isnan(kc_a))
    torch.testing.assert_close(kc_a[written], kc_b[written], atol=tol, rtol=tol)
    assert torch.equal(vc_a.nan_to_num(7.0), vc_b.nan_to_num(7.0))


# -- the patched attention forwards on the tiny models (CPU, torch backend) --------------------------------------

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=200, max_position_embeddings=256)


def tiny(family: str, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    config = (transformers.LlamaConfig(**COMMON) if family == "llama"
              else transformers.Qwen3Config(**COMMON, head_dim=16))
    model = transformers.AutoModelForCausalLM.from_config(config).eval().to(dtype)
    if family == "qwen3":
        with torch.no_grad():  # norms that are not ones, so that skipping one would show
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    return model


def patched(model) -> list:
    return [m for m in model.modules() if "forward" in m.__dict__ and hasattr(m, "q_proj")]


def generate(model, ids, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          pad_token_id=0, **kw)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_forward_is_used_and_exact(family, dtype, monkeypatch):
    """Installed on every attention module, used for every layer of every step; greedy output is stock's in float32,
    and in bf16 (where the engine's attention and stock sdpa may already part on near-ties of random weights) the
    same as the engine's with the stock forwards: on CPU the op applies the stock formula to the same values."""
    model = tiny(family, dtype)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(4))
    if dtype == torch.float32:
        want = generate(model, ids)
    else:
        accelerate_model(model, attention_backend="torch", compile=False, config=AccelConfig(fused_rope=False))
        want = generate(model, ids)
        restore(model)
    calls = []
    original = R.qk_norm_rope_reference
    monkeypatch.setattr(R, "qk_norm_rope_reference", lambda *a: calls.append(a[4] is not None) or original(*a))
    accelerate_model(model, attention_backend="torch", compile=False)
    assert len(patched(model)) == 2
    assert torch.equal(generate(model, ids), want)
    assert calls and all(c == (family == "qwen3") for c in calls)
    restore(model)
    assert patched(model) == []


def test_switch_off_and_copies():
    """`fused_rope=False` installs nothing. A deep copy of an accelerated model (an RL loop's reference model) runs
    stock forwards; accelerated itself, its own settings decide, also `fused_rope=False`."""
    model = tiny("qwen3")
    accelerate_model(model, attention_backend="torch", compile=False, config=AccelConfig(fused_rope=False))
    assert patched(model) == []
    restore(model)
    accelerate_model(model, attention_backend="torch", compile=False)
    assert len(patched(model)) == 2
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(6))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, model(ids).logits)
    accelerate_model(twin, attention_backend="torch", compile=False, config=AccelConfig(fused_rope=False))
    assert patched(twin) == []
    assert torch.equal(generate(twin, ids), generate(model, ids))
    restore(twin)
    restore(model)


class ScaledNorm(Qwen3RMSNorm):
    """A norm of the user's own: not a checked class, so the fused path must not stand in for it."""

    def forward(self, hidden_states):
        return super().forward(hidden_states) * 2


@pytest.mark.parametrize("case", ["plain_forward", "own_norm_class"])
def test_falls_back_to_the_class_forward(case, monkeypatch):
    """Outside an engine step, or where a norm is not a class the fused path was checked against: the class
    forward runs (the op gets no rope for that layer) and results are stock's."""
    base = tiny("qwen3")
    if case == "own_norm_class":
        attn = base.model.layers[0].self_attn
        own = ScaledNorm(16, eps=1e-6)
        own.load_state_dict(attn.q_norm.state_dict())
        attn.q_norm = own
    model = copy.deepcopy(base)
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(5))
    calls = []
    original = R.qk_norm_rope_reference
    monkeypatch.setattr(R, "qk_norm_rope_reference", lambda *a: calls.append(1) or original(*a))
    accelerate_model(model, attention_backend="torch", compile=False)
    if case == "plain_forward":
        with torch.no_grad():
            assert torch.equal(model(ids).logits, base(ids).logits)
        assert calls == []
    else:
        assert torch.equal(generate(model, ids), generate(base, ids))
        assert len(calls) == 12  # layer 1 only, once per step (the prompt, then 11 decode steps)
    restore(model)
