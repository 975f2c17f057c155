"""The RMSNorm-into-linear fold: the compile pass (compilation.norm_folding), its ops (ops.norm_linear), the add +
norm kernel (`fused_kernels.add_rms_norm`) and the one-row GEMM that normalizes its own input
(`skinny_gemm.norm_linear_fused`).

On CPU the kernels run in the Triton interpreter and the pass runs on Dynamo-traced tiny models, whose folded ops
then take their CPU path (torch's ops, rounding as the stock module): the folded forward must give the same bits as
the unfolded one. On a GPU the `gpu`-marked tests add bf16 at real decode shapes, the op's choice of the fused kernel,
and PDL inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from conftest import graph_replays_with_and_without_pdl, tiny_pass_model
from triton_mode import DEVICE, ON_GPU, load_kernel_modules

triton = pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

import hf_accel.ops.norm_linear  # noqa: E402, F401  (registers the ops)
from hf_accel.compilation.linear_packing import merge_packed_linears, pack_sibling_linears  # noqa: E402
from hf_accel.compilation.norm_folding import fold_norms_into_linears  # noqa: E402
from hf_accel.compilation.small_m_linear import route_small_m_linears  # noqa: E402
from hf_accel.ops import linear as linear_op  # noqa: E402
from hf_accel.ops import pdl  # noqa: E402

(G,) = load_kernel_modules(["hf_accel.ops.skinny_gemm"], "_skinny_gemm_kernel")
(K,) = load_kernel_modules(["hf_accel.ops.fused_kernels"], "_rms_norm_kernel")
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (compiled Triton kernels)")
EPS = 1e-6


def stock_norm(k: int, dtype: torch.dtype, seed: int = 0) -> LlamaRMSNorm:
    gen = torch.Generator().manual_seed(seed)
    module = LlamaRMSNorm(k, eps=EPS)
    with torch.no_grad():
        module.weight.copy_(1.0 + 0.5 * torch.randn(k, generator=gen))
    return module.to(DEVICE, dtype)


def rnd(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


def _tol(dtype: torch.dtype, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item() + 1e-6
    return {torch.float32: 2e-3, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype] * scale


# ------------------------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "k", "block_n", "block_k", "split", "bias", "add"), [
    (40, 96, 4, 32, 1, False, True),      # N not a multiple of the rows per program
    (70, 200, 8, 64, 1, True, True),      # masked K tail, bias
    (33, 64, 16, 32, 2, True, False),     # split K, reduced in the launch; no residual add
    (24, 5000, 2, 1024, 1, False, True),  # a row wider than MAX_NORM_BLOCK: the squares summed in two chunks
])
def test_one_row_kernel_normalizes_its_input(dtype, n, k, block_n, block_k, split, bias, add):
    """`norm_linear_fused` is `F.linear(LlamaRMSNorm(x + r), W, b)`, and stores `x + r` exactly."""
    x, r = rnd(1, k, dtype=dtype, seed=1), rnd(1, k, dtype=dtype, seed=2)
    w = rnd(n, k, dtype=dtype, seed=3) * 0.1
    b = rnd(n, dtype=dtype, seed=4) if bias else None
    norm = stock_norm(k, dtype)
    counters = torch.zeros(triton.cdiv(n, block_n), dtype=torch.int32, device=DEVICE)
    cfg = G.SkinnyConfig(1, block_n, block_k, split, 4, 2, gemv=True)
    with torch.no_grad():
        h_ref = x + r if add else x
        normed = norm(h_ref)
        y, h = G.norm_linear_fused(x, r if add else None, norm.weight, EPS, w, b, cfg, counters=counters)
    ref = F.linear(normed.float(), w.float(), b.float() if b is not None else None)
    assert y.shape == (1, n) and y.dtype == dtype
    assert (y.float() - ref).abs().max().item() <= _tol(dtype, ref)
    # the same GEMM on the stock module's output: equal up to the order of the sum of squares
    plain = G.skinny_linear(normed, w, b, cfg)
    assert (y.float() - plain.float()).abs().max().item() <= _tol(dtype, ref) / 4
    if add:
        assert torch.equal(h, h_ref)
    else:
        assert h is None
    assert not counters.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 48), (1, 64), (2, 3, 80)])
def test_add_rms_norm_kernel(dtype, shape):
    a, b = rnd(*shape, dtype=dtype, seed=5), rnd(*shape, dtype=dtype, seed=6)
    norm = stock_norm(shape[-1], dtype)
    with torch.no_grad():
        out, h = K.add_rms_norm(a, b, norm.weight, EPS)
        ref_h = a + b
        ref = norm(ref_h)
    assert torch.equal(h, ref_h)
    torch.testing.assert_close(out, ref, rtol=2e-3 if dtype == torch.float16 else 1e-5,
                               atol=2e-3 if dtype == torch.float16 else 1e-5)
    with torch.no_grad():
        out_plain, same = K.add_rms_norm(a, None, norm.weight, EPS)
    assert same is a
    torch.testing.assert_close(out_plain, norm(a), rtol=2e-3, atol=2e-3)


def test_add_rms_norm_rows_wider_than_one_block(monkeypatch):
    """The two-pass loop reads the sum back from `h` (shrunk block so it runs on a tiny row)."""
    monkeypatch.setattr(K, "MAX_NORM_BLOCK", 32)
    a, b = rnd(3, 80, dtype=torch.float16, seed=7), rnd(3, 80, dtype=torch.float16, seed=8)
    norm = stock_norm(80, torch.float16)
    with torch.no_grad():
        out, h = K.add_rms_norm(a, b, norm.weight, EPS)
        assert torch.equal(h, a + b)
        torch.testing.assert_close(out, norm(a + b), rtol=2e-3, atol=2e-3)


# -------------------------------------------------------------------------------------------------------- the ops
def test_ops_on_cpu_are_the_stock_formula():
    """Off CUDA (and wherever the fused kernel is not chosen) the ops compute the add, the stock norm and
    hf_accel::linear: the same bits as the unfused graph."""
    k, n = 48, 24
    a, b = torch.randn(1, 3, k).to(torch.bfloat16), torch.randn(1, 3, k).to(torch.bfloat16)
    w, bias = torch.randn(n, k).to(torch.bfloat16), torch.randn(n).to(torch.bfloat16)
    norm = LlamaRMSNorm(k, eps=EPS).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k) + 0.5)
        y, h = torch.ops.hf_accel.add_rms_norm_linear(a, b, norm.weight, EPS, w, bias, False)
        assert torch.equal(h, a + b)
        assert torch.equal(y, F.linear(norm(a + b), w, bias))
        y2 = torch.ops.hf_accel.rms_norm_linear(a, norm.weight, EPS, w, None, True)
        assert torch.equal(y2, F.linear(norm(a), w))


# -------------------------------------------------------------------------------------------------------- the pass
_model = tiny_pass_model


def _compiled_output(model, ids, fold: bool, counts: dict, any_width: bool = False):
    def backend(gm, example_inputs):
        merge_packed_linears(gm, example_inputs)
        route_small_m_linears(gm, use_pdl=False, allow_cpu=True)
        counts["folded"] = fold_norms_into_linears(gm, any_width) if fold else 0
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        counts["add_ops"] = targets.count(torch.ops.hf_accel.add_rms_norm_linear.default)
        counts["plain_ops"] = targets.count(torch.ops.hf_accel.rms_norm_linear.default)
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            return torch.compile(model, backend=backend)(ids, logits_to_keep=ids.shape[1]).logits
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_pass_folds_both_norms_of_every_layer(family):
    """With q/k/v and gate/up packed, each layer's two norms feed one linear each: both fold, the first layer's
    input norm without an add (its input is the embedding), every other with its residual add. The final norm
    (the logits' row selection comes between it and the lm_head) and Qwen3's q/k norms stay. The folded forward
    gives the same bits as the unfolded one."""
    model = _model(family)
    pack_sibling_linears(model)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 200, (1, 9))
    counts: dict = {}
    plain = _compiled_output(model, ids, False, counts)
    folded = _compiled_output(model, ids, True, counts)
    assert counts == {"folded": 2 * layers, "add_ops": 2 * layers - 1, "plain_ops": 1}
    assert torch.equal(folded, plain)
    with torch.no_grad():
        eager = model(ids).logits
    torch.testing.assert_close(folded, eager, rtol=0, atol=0)


def test_pass_leaves_rows_wider_than_the_limit(monkeypatch):
    """Rows wider than MAX_FOLD_K keep Inductor's norm kernels (the fused form lost there on the H200), unless a
    residual chain asks for every width (`any_width`): then they fold, with the same bits."""
    import hf_accel.compilation.norm_folding as folding

    monkeypatch.setattr(folding, "MAX_FOLD_K", 32)  # the tiny models' rows have 64 columns
    model = _model("llama", layers=2)
    pack_sibling_linears(model)
    ids = torch.randint(3, 200, (1, 5))
    counts: dict = {}
    plain = _compiled_output(model, ids, True, counts)
    assert counts["folded"] == 0
    wide = _compiled_output(model, ids, True, counts, any_width=True)
    assert counts["folded"] == 4 and torch.equal(wide, plain)


def test_one_row_fold_only_up_to_its_width(monkeypatch):
    """The op normalizes inside the one-row GEMM only for rows of at most MAX_ONE_ROW_NORM_K columns (a wider row
    that folded for a chain runs its norm as a kernel of its own at one row), and only for a one-row decision."""
    import hf_accel.ops.norm_linear as norm_op
    from hf_accel.ops.skinny_gemm import SkinnyConfig

    decision = {"cfg": SkinnyConfig(1, 8, 32, 1, 4, 2, gemv=True)}
    monkeypatch.setattr(norm_op, "kernel_operands", lambda x, w, b: True)
    monkeypatch.setattr(norm_op, "tuned_config", lambda dev, dtype, n, k, bias, m: decision["cfg"])
    g = torch.ones(64)
    w = torch.randn(16, 64)
    assert norm_op._fused_config(torch.randn(1, 64), None, g, w, None) == decision["cfg"]
    assert norm_op._fused_config(torch.randn(2, 64), None, g, w, None) is None  # two rows
    monkeypatch.setattr(norm_op, "MAX_ONE_ROW_NORM_K", 32)
    assert norm_op._fused_config(torch.randn(1, 64), None, g, w, None) is None
    monkeypatch.setattr(norm_op, "MAX_ONE_ROW_NORM_K", 64)
    assert norm_op._fused_config(torch.randn(1, 64), None, g, w, None) == decision["cfg"]
    decision["cfg"] = SkinnyConfig(16, 8, 32, 1, 4, 2)  # a tensor-core tile cannot normalize
    assert norm_op._fused_config(torch.randn(1, 64), None, g, w, None) is None


def test_pass_leaves_a_norm_feeding_several_linears():
    """Unpacked q/k/v (three linears on one normed row) and gate/up: nothing folds."""
    model = _model("llama", layers=2)
    counts: dict = {}
    _compiled_output(model, torch.randint(3, 200, (1, 5)), True, counts)
    assert counts["folded"] == 0


class _Block(nn.Module):
    def __init__(self, norm: nn.Module, k: int = 32, n: int = 16) -> None:
        super().__init__()
        self.norm = norm
        self.lin = nn.Linear(k, n, bias=True)

    def forward(self, a, b):
        h = a + b
        early = h * 2  # a use of the add's result before the linear
        return self.lin(self.norm(h)), early


def _fold_block(block: nn.Module, a, b) -> tuple[int, list, tuple, tuple]:
    seen: dict = {}

    def backend(gm, example_inputs):
        route_small_m_linears(gm, use_pdl=False, allow_cpu=True)
        seen["folded"] = fold_norms_into_linears(gm)
        seen["targets"] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            out = torch.compile(block, backend=backend)(a, b)
            ref = block(a, b)
    finally:
        torch._dynamo.reset()
    return seen["folded"], seen["targets"], out, ref


def test_pass_keeps_an_add_used_before_the_linear():
    """The add's result is used before the linear: the norm still folds, the add stays where it was."""
    block = _Block(LlamaRMSNorm(32, eps=EPS)).to(torch.bfloat16).eval()
    a, b = torch.randn(1, 2, 32).to(torch.bfloat16), torch.randn(1, 2, 32).to(torch.bfloat16)
    folded, targets, out, ref = _fold_block(block, a, b)
    assert folded == 1
    assert torch.ops.hf_accel.rms_norm_linear.default in targets
    assert torch.ops.hf_accel.add_rms_norm_linear.default not in targets
    for o, r in zip(out, ref, strict=True):
        assert torch.equal(o, r)


class _Mutating(nn.Module):
    """A write between the norm (or the add) and its linear: to an addend, or to the norm's input."""

    def __init__(self, what: str, k: int = 32, n: int = 16) -> None:
        super().__init__()
        self.what = what
        self.norm = LlamaRMSNorm(k, eps=EPS)
        self.lin = nn.Linear(k, n, bias=False)

    def forward(self, a, b):
        h = a + b
        normed = self.norm(h)
        if self.what == "addend":
            a.add_(5)
        else:
            h.add_(1)
        return self.lin(normed), h


@pytest.mark.parametrize("what", ["addend", "norm_input"])
def test_pass_does_not_move_the_norm_past_a_write(what):
    """The folded op runs at the linear's place: with an in-place write in between, nothing folds (found by review:
    the result was the norm of the written value)."""
    block = _Mutating(what).to(torch.bfloat16).eval()
    a, b = torch.randn(1, 2, 32).to(torch.bfloat16), torch.randn(1, 2, 32).to(torch.bfloat16)
    folded, _, out, ref = _fold_block(block, a.clone(), b.clone())
    with torch.no_grad():
        ref = block(a.clone(), b.clone())
    assert folded == 0
    for o, r in zip(out, ref, strict=True):
        assert torch.equal(o, r)


class _Transposed(nn.Module):
    def __init__(self, k: int = 32, n: int = 16) -> None:
        super().__init__()
        self.norm = LlamaRMSNorm(k, eps=EPS)
        self.lin = nn.Linear(k, n, bias=False)

    def forward(self, a, b):
        h = a.transpose(0, 1) + b.transpose(0, 1)
        return self.lin(self.norm(h)), h


def test_pass_keeps_the_add_of_strided_addends():
    """Addends that are transposed views: `a + b` keeps their layout, the op's second output is contiguous, so the
    add stays outside and only the norm folds."""
    block = _Transposed().to(torch.bfloat16).eval()
    a, b = torch.randn(2, 3, 32).to(torch.bfloat16), torch.randn(2, 3, 32).to(torch.bfloat16)
    folded, targets, out, ref = _fold_block(block, a, b)
    assert folded == 1 and torch.ops.hf_accel.add_rms_norm_linear.default not in targets
    for o, r in zip(out, ref, strict=True):
        assert torch.equal(o, r)


def test_pass_leaves_gemma_style_norms():
    """`(1 + weight)` norms compute something else: not matched."""
    block = _Block(GemmaRMSNorm(32, eps=EPS)).to(torch.bfloat16).eval()
    a, b = torch.randn(1, 2, 32).to(torch.bfloat16), torch.randn(1, 2, 32).to(torch.bfloat16)
    folded, targets, out, ref = _fold_block(block, a, b)
    assert folded == 0
    for o, r in zip(out, ref, strict=True):
        assert torch.equal(o, r)


# ------------------------------------------------------------------------------------------------------------- GPU
def _decide_one_row(n: int, k: int, cfg) -> None:
    key = linear_op._key(torch.device(DEVICE), torch.bfloat16, n, k, False, 1)
    linear_op._decisions[key] = cfg


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(3072, 2048), (16384, 2048), (6144, 1024), (128256, 2048)])
def test_gpu_op_runs_the_norm_inside_the_one_row_gemm(n, k, monkeypatch):
    """At one row with a one-row decision the op is the fused kernel (no norm kernel: checked by counting
    launches of the add + norm kernel), equal to the unfused op up to the sum-of-squares order; at 5 rows the
    unfused path runs, as before."""
    cfg = G.SkinnyConfig(1, 8, 512, 1, 4, 4, gemv=True)
    _decide_one_row(n, k, cfg)
    try:
        a, b = rnd(1, k, dtype=torch.bfloat16, seed=1), rnd(1, k, dtype=torch.bfloat16, seed=2)
        w = rnd(n, k, dtype=torch.bfloat16, seed=3) * 0.05
        norm = stock_norm(k, torch.bfloat16)
        calls = []
        real = K.add_rms_norm
        monkeypatch.setattr(K, "add_rms_norm", lambda *args, **kw: calls.append(1) or real(*args, **kw))
        with torch.no_grad():
            y, h = torch.ops.hf_accel.add_rms_norm_linear(a, b, norm.weight, EPS, w, None, pdl.supported(DEVICE))
            normed = norm(a + b)
            plain = G.skinny_linear(normed, w, None, cfg)
        assert calls == []
        assert torch.equal(h, a + b)
        ref = F.linear(normed.float(), w.float())
        assert (y.float() - ref).abs().max().item() <= _tol(torch.bfloat16, ref)
        assert (y == plain).float().mean().item() > 0.95
        a5, b5 = rnd(5, k, dtype=torch.bfloat16, seed=4), rnd(5, k, dtype=torch.bfloat16, seed=5)
        with torch.no_grad():
            y5, h5 = torch.ops.hf_accel.add_rms_norm_linear(a5, b5, norm.weight, EPS, w, None, False)
            ref5 = F.linear(norm(a5 + b5).float(), w.float())
        assert calls == [1] and torch.equal(h5, a5 + b5)
        assert (y5.float() - ref5).abs().max().item() <= _tol(torch.bfloat16, ref5)
    finally:
        linear_op.clear_decisions()


@gpu
@pytest.mark.gpu
def test_gpu_fused_chain_in_a_graph_with_and_without_pdl():
    """A layer's worth of dependent launches (GEMM -> add + norm + GEMM -> GEMM -> add + norm + GEMM) captured in
    a CUDA graph gives the same bits with PDL as without, replay after replay."""
    if not pdl.supported(DEVICE):
        pytest.skip("PDL needs sm90+ and a triton that exposes it")
    k, n1, n2 = 2048, 3072, 2048
    cfg = G.SkinnyConfig(1, 8, 512, 1, 4, 4, gemv=True)
    w_o = rnd(k, n2, dtype=torch.bfloat16, seed=9) * 0.03
    w_qkv = rnd(n1, k, dtype=torch.bfloat16, seed=10) * 0.03
    w_down = rnd(k, n1, dtype=torch.bfloat16, seed=11) * 0.03
    w_up = rnd(n1, k, dtype=torch.bfloat16, seed=12) * 0.03
    g1, g2 = stock_norm(k, torch.bfloat16, 1).weight.detach(), stock_norm(k, torch.bfloat16, 2).weight.detach()
    x0 = rnd(1, n2, dtype=torch.bfloat16, seed=13)
    r0 = rnd(1, k, dtype=torch.bfloat16, seed=14)

    def chain(use_pdl: bool):
        o = G.skinny_linear(x0, w_o, None, cfg, use_pdl)
        qkv, h1 = G.norm_linear_fused(o, r0, g1, EPS, w_qkv, None, cfg, use_pdl)
        d = G.skinny_linear(qkv, w_down, None, cfg, use_pdl)
        up, h2 = G.norm_linear_fused(d, h1, g2, EPS, w_up, None, cfg, use_pdl)
        return up, h2

    outs = graph_replays_with_and_without_pdl(chain)
    for plain, overlapped in zip(outs[False], outs[True], strict=True):
        assert torch.equal(plain, overlapped)
