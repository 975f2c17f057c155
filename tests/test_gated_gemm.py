"""The gated gate/up GEMM: the kernels' SiLU epilogue (`skinny_gemm.skinny_linear(gated=True)`), its ops
(`ops.gated_linear`), the compile pass (`compilation.gated_activation`) and its tuning (`ops.linear`).

On CPU the kernels run in the Triton interpreter and the pass runs on Dynamo-traced tiny models, whose new ops then
take their CPU path (torch's ops, rounding as the stock MLP): the rewritten forward must give the same bits as the
stock one. On a GPU the `gpu`-marked tests add bf16 at real decode shapes, the tuner, and PDL inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from conftest import LaunchRecorder, graph_replays_with_and_without_pdl, stand_in_tuner_gpu, tiny_pass_model
from triton_mode import DEVICE, ON_GPU, load_kernel_modules

triton = pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

import hf_accel.ops.gated_linear as gated_op  # noqa: E402
import hf_accel.ops.norm_linear as norm_op  # noqa: E402
from hf_accel.compilation.gated_activation import fuse_silu_mul_into_linears  # noqa: E402
from hf_accel.compilation.linear_packing import merge_packed_linears, pack_sibling_linears  # noqa: E402
from hf_accel.compilation.norm_folding import fold_norms_into_linears  # noqa: E402
from hf_accel.compilation.small_m_linear import route_small_m_linears  # noqa: E402
from hf_accel.ops import linear as linear_op  # noqa: E402
from hf_accel.ops import pdl  # noqa: E402

G, K = load_kernel_modules(["hf_accel.ops.skinny_gemm", "hf_accel.ops.fused_kernels"], "_skinny_gemm_kernel")
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (compiled Triton kernels)")
EPS = 1e-6


def rnd(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


def stock_activation(y: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a packed gate/up output, as the stock MLP rounds it (eager torch, on CPU)."""
    inter = y.shape[-1] // 2
    y = y.cpu()
    return F.silu(y[..., :inter]) * y[..., inter:]


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The gated product in float32 (no intermediate rounding)."""
    inter = w.shape[0] // 2
    y = F.linear(x.float(), w.float())
    return (F.silu(y[:, :inter]) * y[:, inter:]).cpu()


def _tol(dtype: torch.dtype, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item() + 1e-6
    return {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype] * scale


# ------------------------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "inter", "k", "block_m", "block_n", "block_k", "split", "gemv"), [
    (1, 40, 96, 16, 16, 32, 1, False),    # I not a multiple of the tile: the up rows start mid-tile
    (3, 70, 200, 16, 32, 64, 2, False),   # uneven K split, masked K tail
    (20, 64, 128, 32, 32, 32, 1, False),
    (64, 50, 300, 64, 16, 64, 3, False),  # a split count that does not divide K
    (1, 40, 96, 1, 4, 32, 1, True),       # the one-row kernel
    (1, 33, 200, 1, 8, 64, 2, True),      # one-row, split K, masked K tail
    (1, 24, 512, 1, 2, 128, 1, True),     # one-row, four K tiles each loaded before the previous one is used
])
@pytest.mark.parametrize("fused", [False, True])
def test_gated_kernel_is_silu_of_gate_times_up(dtype, m, inter, k, block_m, block_n, block_k, split, gemv, fused):
    """`silu(x @ gate^T) * (x @ up^T)` for a weight of gate rows then up rows, split-K reduced by the reduce kernel
    or in the launch (the counters are zeros again after it, and both give the same bits)."""
    x = rnd(m, k, dtype=dtype, seed=m + k)
    w = rnd(2 * inter, k, dtype=dtype, seed=inter, scale=0.3)
    cfg = G.SkinnyConfig(block_m, block_n, block_k, split, 4, 2, gemv=gemv)
    counters = torch.zeros(triton.cdiv(inter, block_n), dtype=torch.int32, device=DEVICE) if fused else None
    y = G.skinny_linear(x, w, None, cfg, counters=counters, gated=True)
    ref = reference(x, w)
    assert y.shape == (m, inter) and y.dtype == dtype
    assert (y.float().cpu() - ref).abs().max().item() <= _tol(dtype, ref)
    assert counters is None or not counters.any()
    if fused and split > 1:
        assert torch.equal(y, G.skinny_linear(x, w, None, cfg, gated=True))
    # where the gate rounds: the same as the plain GEMM's output through the stock activation, up to the last bit
    # of the product's order (the plain launch tiles 2I rows, the gated one I rows twice)
    stock = stock_activation(G.skinny_linear(x, w, None, cfg))
    assert (y.float().cpu() - stock.float()).abs().max().item() <= _tol(dtype, ref)


def test_gated_launch_refuses_what_it_cannot_compute():
    cfg = G.SkinnyConfig(16, 16, 32, 1)
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(AssertionError, match="odd"):
        G.skinny_linear(x, torch.randn(7, 32, device=DEVICE), None, cfg, gated=True)
    with pytest.raises(AssertionError, match="bias"):
        G.skinny_linear(x, torch.randn(8, 32, device=DEVICE), torch.randn(8, device=DEVICE), cfg, gated=True)


@pytest.mark.parametrize(("inter", "k", "block_n", "block_k", "split", "add"), [
    (40, 96, 4, 32, 1, True),
    (33, 64, 16, 32, 2, False),   # split K, reduced in the launch; no residual add
    (24, 5000, 2, 1024, 1, True),  # a row wider than MAX_NORM_BLOCK
])
def test_gated_one_row_kernel_normalizes_its_input(inter, k, block_n, block_k, split, add):
    """The one-row kernel with the norm folded in and the gate in its epilogue: the norm's bits (h = a + b stored
    once), then the gated product, as the unfused norm followed by the gated GEMM."""
    dtype = torch.float16
    a, b = rnd(1, k, dtype=dtype, seed=1), rnd(1, k, dtype=dtype, seed=2)
    norm = LlamaRMSNorm(k, eps=EPS).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(rnd(k, dtype=dtype, seed=3, scale=0.5) + 1.0)
    w = rnd(2 * inter, k, dtype=dtype, seed=4, scale=0.05)
    cfg = G.SkinnyConfig(1, block_n, block_k, split, 4, 2, gemv=True)
    counters = torch.zeros(triton.cdiv(inter, block_n), dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        y, h = G.norm_linear_fused(a, b if add else None, norm.weight, EPS, w, None, cfg, counters=counters,
                                   gated=True)
        normed = norm(a + b if add else a)
    assert (h is not None) == add and (not add or torch.equal(h, a + b))
    ref = reference(normed, w)
    assert y.shape == (1, inter)
    assert (y.float().cpu() - ref).abs().max().item() <= _tol(dtype, ref)
    assert not counters.any()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("m", "split", "gemv"), [(1, 1, False), (5, 2, False), (64, 8, False), (1, 1, True),
                                                  (1, 3, True)])
def test_gated_built_ahead_launches_are_the_real_ones(monkeypatch, m, split, gemv, fused):
    """`build_skinny_linear(gated=True)` (n: the weight's rows) asks Triton for the kernels, grids and
    specializations `skinny_linear(gated=True)` launches: what the tuner builds ahead is what it times."""
    n, k = 96, 320
    cfg = G.SkinnyConfig(1 if gemv else 16 if m <= 16 else 64, 16, 64, split, 4, 2, gemv=gemv)
    real, built = [], []
    for calls in (real, built):
        monkeypatch.setattr(G, "_skinny_gemm_kernel", LaunchRecorder(calls, "gemm"))
        monkeypatch.setattr(G, "_gemv_kernel", LaunchRecorder(calls, "gemv"))
        monkeypatch.setattr(G, "_split_reduce_kernel", LaunchRecorder(calls, "reduce"))
        if calls is real:
            G.skinny_linear(torch.randn(m, k, dtype=torch.float16), torch.randn(n, k, dtype=torch.float16), None,
                            cfg, counters=torch.zeros(8, dtype=torch.int32) if fused else None, gated=True)
        else:
            G.build_skinny_linear(m, n, k, torch.float16, torch.float16, False, False, cfg, fused_splits=fused,
                                  gated=True)
    assert real and built == real
    assert all(dict(c[3])["GATED"] for c in real)
    assert real[0][1][0] == triton.cdiv(n // 2, cfg.block_n)  # column tiles of the I outputs


# ------------------------------------------------------------------------------------------------------------ ops
def _mlp_inputs(dtype=torch.bfloat16, rows: int = 3, k: int = 48, inter: int = 24):
    a, b = torch.randn(1, rows, k).to(dtype), torch.randn(1, rows, k).to(dtype)
    w = (0.2 * torch.randn(2 * inter, k)).to(dtype)
    norm = LlamaRMSNorm(k, eps=EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k) + 0.5)
    return a, b, w, norm


def test_ops_on_cpu_are_the_stock_formula():
    """Off CUDA (and wherever the gated kernel is not chosen) the ops compute what the graph did before the pass:
    the (norm and) linear, then SiLU and the product, each rounded as eager torch rounds it."""
    linear_op.clear_decisions()
    a, b, w, norm = _mlp_inputs()
    with torch.no_grad():
        y = torch.ops.hf_accel.silu_mul_linear(a, None, 0.0, w, False)
        assert torch.equal(y, stock_activation(F.linear(a, w)))
        y = torch.ops.hf_accel.silu_mul_linear(a, norm.weight, EPS, w, True)
        assert torch.equal(y, stock_activation(F.linear(norm(a), w)))
        y, h = torch.ops.hf_accel.add_rms_norm_silu_mul_linear(a, b, norm.weight, EPS, w, False)
        assert torch.equal(h, a + b)
        assert torch.equal(y, stock_activation(F.linear(norm(a + b), w)))


@pytest.mark.parametrize(("rows", "wide"), [(1, False), (1, True), (5, False), (40, False), (65, False)])
def test_op_follows_the_gated_decision(monkeypatch, rows, wide):
    """With a gated decision for the row count's bucket the op runs the gated kernel (with the norm inside it at
    one row when the decision is the one-row kernel and the row is at most MAX_ONE_ROW_NORM_K wide; `wide`: it is
    not, the norm runs before the kernel); without one (or above the largest bucket) the linear, then the
    SiLU-and-mul. The kernels run in the interpreter here (the CUDA check is lifted); results agree either way."""
    dtype = torch.float16 if not ON_GPU else torch.bfloat16
    k, inter = 64, 32
    if wide:
        monkeypatch.setattr(norm_op, "MAX_ONE_ROW_NORM_K", k // 2)  # the limit both ops check (one_row_norm_fits)
    monkeypatch.setattr(gated_op, "kernel_operands", lambda x, w, b: True)
    monkeypatch.setattr(linear_op, "device_index", lambda device: 0)
    calls = []
    real_linear, real_fused = G.skinny_linear, G.norm_linear_fused
    monkeypatch.setattr(G, "skinny_linear", lambda *a, **kw: calls.append(("gemm", kw.get("gated"))) or
                        real_linear(*a, **kw))
    monkeypatch.setattr(G, "norm_linear_fused", lambda *a, **kw: calls.append(("fused", kw.get("gated"))) or
                        real_fused(*a, **kw))
    linear_op.clear_decisions()
    key_dtype = linear_op.gated_key_dtype(dtype)
    decided = {1: G.SkinnyConfig(1, 8, 32, 1, 4, 2, gemv=True), 16: G.SkinnyConfig(16, 16, 32, 2, 4, 2),
               64: G.SkinnyConfig(64, 16, 32, 1, 4, 2)}
    for bucket, cfg in decided.items():
        linear_op._decisions[linear_op._key(DEVICE, key_dtype, 2 * inter, k, False, bucket)] = cfg
    try:
        a, b = rnd(rows, k, dtype=dtype, seed=1), rnd(rows, k, dtype=dtype, seed=2)
        w = rnd(2 * inter, k, dtype=dtype, seed=3, scale=0.2)
        g = (rnd(k, dtype=dtype, seed=4, scale=0.3) + 1.0)
        with torch.no_grad():
            y, h = gated_op.run_gated(a, b, g, EPS, w, False)
        assert torch.equal(h, a + b)
        if rows == 1 and not wide:
            assert calls == [("fused", True)]
        elif rows <= 64:
            assert calls == [("gemm", True)]
        else:  # above the largest bucket: the plain op (cuBLAS / torch), no gated launch
            assert ("gemm", True) not in calls and ("fused", True) not in calls
        h32 = (a + b).float()
        normed = g * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
        ref = reference(normed, w)
        assert (y.float().cpu() - ref).abs().max().item() <= _tol(dtype, ref)
    finally:
        linear_op.clear_decisions()


# -------------------------------------------------------------------------------------------------------- the pass
_model = tiny_pass_model


def _compiled_logits(model, ids, fold: bool, gated: bool, seen: dict):
    def backend(gm, example_inputs):
        merge_packed_linears(gm, example_inputs)
        route_small_m_linears(gm, use_pdl=False, allow_cpu=True)
        if fold:
            fold_norms_into_linears(gm)
        seen["shapes"] = fuse_silu_mul_into_linears(gm) if gated else []
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        seen["plain"] = targets.count(torch.ops.hf_accel.silu_mul_linear.default)
        seen["add"] = targets.count(torch.ops.hf_accel.add_rms_norm_silu_mul_linear.default)
        seen["silu"] = targets.count(F.silu)
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            return torch.compile(model, backend=backend)(ids, logits_to_keep=ids.shape[1]).logits
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_pass_fuses_every_layers_activation(family, fold):
    """With gate/up packed, every layer's MLP activation joins its gate/up linear: with the norms folded, as the
    add + norm form (the residual add's result still feeds the layer's last add); without, as the plain form. The
    rewritten forward gives the stock forward's bits."""
    model = _model(family)
    pack_sibling_linears(model)
    layers, cfg = model.config.num_hidden_layers, model.config
    ids = torch.randint(3, 200, (1, 9))
    seen: dict = {}
    out = _compiled_logits(model, ids, fold, True, seen)
    assert seen["shapes"] == [(2 * cfg.intermediate_size, cfg.hidden_size, False)] * layers
    assert (seen["plain"], seen["add"], seen["silu"]) == ((0, layers, 0) if fold else (layers, 0, 0))
    with torch.no_grad():
        eager = model(ids).logits
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


def test_pass_leaves_unpacked_gate_and_up():
    """Gate and up as two linears (not packed): there is no one product to gate, nothing changes."""
    model = _model("llama", layers=2)
    seen: dict = {}
    _compiled_logits(model, torch.randint(3, 200, (1, 5)), True, True, seen)
    assert seen["shapes"] == [] and seen["silu"] == 2


def _traced(fn, *inputs) -> dict:
    """Run the pass on Dynamo's graph of `fn`; what it replaced, and whether the result kept its value."""
    seen: dict = {}

    def backend(gm, example_inputs):
        seen["shapes"] = fuse_silu_mul_into_linears(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            seen["equal"] = torch.equal(torch.compile(fn, backend=backend)(*inputs), fn(*inputs))
    finally:
        torch._dynamo.reset()
    return seen


def test_pass_matches_only_silu_of_the_first_half_times_the_second():
    lin = torch.ops.hf_accel.linear.default
    x, w = torch.randn(3, 16).to(torch.bfloat16), torch.randn(32, 16).to(torch.bfloat16)
    bias = torch.randn(32).to(torch.bfloat16)

    def gated(x, w):
        y = lin(x, w, None, False)
        return F.silu(torch.narrow(y, -1, 0, 16)) * torch.narrow(y, -1, 16, 16)

    def up_first(x, w):  # silu(up) * gate: another function
        y = lin(x, w, None, False)
        return torch.narrow(y, -1, 0, 16) * F.silu(torch.narrow(y, -1, 16, 16))

    def commuted(x, w):  # up * silu(gate): the same product
        y = lin(x, w, None, False)
        return torch.narrow(y, -1, 16, 16) * F.silu(torch.narrow(y, -1, 0, 16))

    def gelu(x, w):
        y = lin(x, w, None, False)
        return F.gelu(torch.narrow(y, -1, 0, 16)) * torch.narrow(y, -1, 16, 16)

    def gate_read_twice(x, w):
        y = lin(x, w, None, False)
        g = torch.narrow(y, -1, 0, 16)
        return F.silu(g) * torch.narrow(y, -1, 16, 16) + g

    def with_bias(x, w):
        y = lin(x, w, bias, False)
        return F.silu(torch.narrow(y, -1, 0, 16)) * torch.narrow(y, -1, 16, 16)

    def output_read_too(x, w):
        y = lin(x, w, None, False)
        return F.silu(torch.narrow(y, -1, 0, 16)) * torch.narrow(y, -1, 16, 16) + y.sum()

    for fn, fused in ((gated, True), (commuted, True), (up_first, False), (gelu, False), (gate_read_twice, False),
                      (with_bias, False), (output_read_too, False)):
        seen = _traced(fn, x, w)
        assert seen["shapes"] == ([(32, 16, False)] if fused else []), fn.__name__
        assert seen["equal"], fn.__name__


# ----------------------------------------------------------------------------------------------------------- tuning
def test_gated_decisions_are_kept_apart_from_the_plain_ones(monkeypatch, tmp_path):
    """The tuner's bookkeeping for gated shapes (timing faked, no GPU here): `_tune_one` is told the shape is gated,
    decisions sit under the gated key (in memory and on disk), and the plain linear of the same shape is untouched."""
    cuda = stand_in_tuner_gpu(monkeypatch)
    timed = []
    won = G.SkinnyConfig(64, 16, 128, 1)

    def fake_tune(n, k, has_bias, bucket, dtype, device, use_pdl, scratch, int8=False, gated=False):
        timed.append((n, k, bucket, gated))
        return (won if bucket == 64 else None), 2e-6, 1e-6

    monkeypatch.setattr(linear_op, "_tune_one", fake_tune)
    linear_op.clear_decisions()
    try:
        report = linear_op.tune_linears([(64, 32, False)], torch.bfloat16, cuda, use_pdl=False, cache_dir=tmp_path,
                                        gated=True)
        assert timed == [(64, 32, b, True) for b in linear_op.M_BUCKETS]
        assert (report["ours"], report["linear + silu_mul"]) == (1, 2)
        gk = linear_op.gated_key_dtype(torch.bfloat16)
        assert linear_op.tuned_config(cuda, gk, 64, 32, False, 40) == won
        assert linear_op.tuned_config(cuda, torch.bfloat16, 64, 32, False, 40) is None  # the plain linear: untuned
        assert linear_op.decisions_for([(64, 32, False)], cuda, gk)["64x32@m1"] == "linear + silu_mul"
        stored = (tmp_path / linear_op.TUNE_FILE).read_text()
        assert "silu_mul" in stored
        linear_op.clear_decisions()  # a new process reads the gated decision back, times nothing
        timed.clear()
        again = linear_op.tune_linears([(64, 32, False)], torch.bfloat16, cuda, use_pdl=False, cache_dir=tmp_path,
                                       gated=True)
        assert not timed and again["from_cache"] == 3
        assert linear_op.tuned_config(cuda, gk, 64, 32, False, 64) == won
        with pytest.raises(ValueError, match="gated"):
            linear_op.tune_linears([(64, 32, False)], torch.bfloat16, cuda, use_pdl=False, int8=True, gated=True)
    finally:
        linear_op.clear_decisions()


# ------------------------------------------------------------------------------------------------------------- GPU
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("use_pdl", [False, True])
def test_gpu_gated_candidates_at_decode_shapes(use_pdl):
    """Every gated candidate the tuner may pick, at the bench models' gate/up shapes and decode row counts, in bf16."""
    if use_pdl and not pdl.supported(DEVICE):
        pytest.skip("PDL needs sm90+ and a triton that exposes it")
    counters = torch.zeros(1 << 12, dtype=torch.int32, device=DEVICE)
    for n, k in ((6144, 1024), (16384, 2048)):
        w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.05
        for m in (1, 7, 16, 64):
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            ref = reference(x, w)
            bucket = linear_op.m_bucket(m)
            for cfg in linear_op._candidates_for(bucket, k, False):
                y = G.skinny_linear(x, w, None, cfg, use_pdl, counters=counters, gated=True)
                assert (y.float().cpu() - ref).abs().max().item() <= _tol(torch.bfloat16, ref), (n, k, m, cfg)
                assert not counters.any()


@gpu
@pytest.mark.gpu
def test_gpu_tuner_decides_gated_shapes_and_the_op_follows(tmp_path):
    shapes = [(6144, 1024, False)]
    use_pdl = pdl.supported(DEVICE)
    linear_op.clear_decisions()
    try:
        linear_op.tune_linears(shapes, torch.bfloat16, DEVICE, use_pdl=use_pdl, cache_dir=tmp_path)
        report = linear_op.tune_linears(shapes, torch.bfloat16, DEVICE, use_pdl=use_pdl, cache_dir=tmp_path,
                                        gated=True)
        assert report["tuned"] == len(linear_op.M_BUCKETS)
        decisions = linear_op.decisions_for(shapes, DEVICE, linear_op.gated_key_dtype(torch.bfloat16))
        assert len(decisions) == len(linear_op.M_BUCKETS)
        w = torch.randn(6144, 1024, device=DEVICE, dtype=torch.bfloat16) * 0.05
        for m in (1, 16, 64, 100):
            x = torch.randn(m, 1024, device=DEVICE, dtype=torch.bfloat16)
            y = torch.ops.hf_accel.silu_mul_linear(x, None, 0.0, w, use_pdl)
            ref = reference(x, w)
            assert y.shape == (m, 3072)
            assert (y.float().cpu() - ref).abs().max().item() <= _tol(torch.bfloat16, ref), m
    finally:
        linear_op.clear_decisions()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("gemv", [False, True])
def test_gpu_gated_chain_in_a_graph_with_and_without_pdl(gemv):
    """A layer's MLP (gated gate/up GEMM -> down GEMM -> the next gated GEMM reading its output) captured in a CUDA
    graph gives the same bits with PDL as without, replay after replay."""
    if not pdl.supported(DEVICE):
        pytest.skip("PDL needs sm90+ and a triton that exposes it")
    k, inter = 1024, 3072
    m = 1 if gemv else 64
    cfg = G.SkinnyConfig(1, 8, 512, 1, 4, 4, gemv=True) if gemv else G.SkinnyConfig(64, 32, 128, 2, 4, 4)
    down_cfg = G.SkinnyConfig(1, 8, 512, 1, 4, 4, gemv=True) if gemv else G.SkinnyConfig(64, 32, 128, 4, 4, 4)
    w_gu = rnd(2 * inter, k, dtype=torch.bfloat16, seed=1, scale=0.03)
    w_down = rnd(k, inter, dtype=torch.bfloat16, seed=2, scale=0.03)
    x0 = rnd(m, k, dtype=torch.bfloat16, seed=3)
    counters = torch.zeros(1 << 12, dtype=torch.int32, device=DEVICE)

    def chain(use_pdl: bool):
        act = G.skinny_linear(x0, w_gu, None, cfg, use_pdl, counters=counters, gated=True)
        d = G.skinny_linear(act, w_down, None, down_cfg, use_pdl, counters=counters)
        return act, G.skinny_linear(d, w_gu, None, cfg, use_pdl, counters=counters, gated=True)

    outs = graph_replays_with_and_without_pdl(chain)
    for plain, overlapped in zip(outs[False], outs[True], strict=True):
        assert torch.equal(plain, overlapped)



def test_gated_candidates_at_one_row_are_one_row_kernels():
    """At one row the gated candidates are the one-row kernel's only (the kernel that can carry the norm before
    it); at more rows, the whole tensor-core set."""
    every = linear_op._candidates_for(1, 1024, False)
    assert any(c.gemv for c in every) and any(not c.gemv for c in every)
    one_row = linear_op._gated_candidates(1, 1024)
    assert one_row == [c for c in every if c.gemv]
    for bucket in (16, 64):
        assert linear_op._gated_candidates(bucket, 1024) == linear_op._candidates_for(bucket, 1024, False)


def test_gated_one_row_bucket_without_one_row_candidates_keeps_the_baseline(monkeypatch):
    """With the one-row kernel switched off there is no gated candidate at one row: that bucket keeps the baseline
    (no crash, and the other buckets are still tuned)."""
    monkeypatch.setattr(linear_op, "ONE_ROW_GEMM", False)
    assert linear_op._gated_candidates(1, 1024) == []
    cfg, _, _ = linear_op._tune_one(64, 1024, False, 1, torch.bfloat16, torch.device("cpu"), False, 1 << 20,
                                    gated=True)
    assert cfg is None
