"""The small-M GEMM (hf_accel.ops.skinny_gemm), its op (hf_accel::linear), the routing pass, and PDL.

On CPU the kernel runs in the Triton interpreter (fp32 / fp16); on a GPU the same tests run compiled, and the
`gpu`-marked ones add bf16 at real decode shapes, PDL inside CUDA graphs (a chain of dependent GEMMs must give the
same bits with and without PDL) and the warm-up tuner.
"""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE, ON_GPU, load_kernel_modules

triton = pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
from conftest import LaunchRecorder, stand_in_tuner_gpu  # noqa: E402

from hf_accel.compilation.small_m_linear import route_small_m_linears  # noqa: E402
from hf_accel.ops import linear as linear_op  # noqa: E402
from hf_accel.ops import pdl  # noqa: E402

(G,) = load_kernel_modules(["hf_accel.ops.skinny_gemm"], "_skinny_gemm_kernel")
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (compiled Triton kernels)")


def _tol(dtype: torch.dtype, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item() + 1e-6
    return {torch.float32: 2e-3, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "n", "k", "block_m", "block_n", "block_k", "split", "bias"), [
    (1, 40, 96, 16, 16, 32, 1, False),     # N not a multiple of the tile, K a multiple
    (3, 70, 200, 16, 32, 64, 2, True),     # uneven K split, bias after the split reduce
    (16, 33, 64, 16, 16, 32, 4, True),     # more splits than K tiles per split would like
    (20, 64, 128, 32, 32, 32, 1, False),
    (64, 50, 300, 64, 16, 64, 3, True),    # a split count that does not divide K
    (5, 48, 64, 16, 16, 32, 8, False),     # splits beyond K's tiles: the empty ones are dropped
])
def test_kernel_matches_linear(dtype, m, n, k, block_m, block_n, block_k, split, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    y = G.skinny_linear(x, w, b, G.SkinnyConfig(block_m, block_n, block_k, split, 4, 2))
    ref = F.linear(x.float(), w.float(), b.float() if b is not None else None)
    assert y.shape == (m, n) and y.dtype == dtype
    assert (y.float() - ref).abs().max().item() <= _tol(dtype, ref)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "k", "block_n", "block_k", "split", "bias"), [
    (40, 96, 4, 32, 1, False),     # N not a multiple of the rows per program, K of the tile
    (70, 200, 8, 64, 2, True),     # uneven K split: masked K tail, bias after the reduction
    (33, 64, 16, 32, 4, True),
    (50, 300, 4, 64, 3, True),     # a split count that does not divide K
    (48, 64, 8, 32, 8, False),     # splits beyond K's tiles: the empty ones are dropped
    (1, 64, 4, 32, 2, False),      # a one-column output (triton makes N a constant)
    (64, 1024, 8, 1024, 1, False), # one K tile: no loop iteration, only the tile loaded before the PDL wait
    (24, 512, 2, 128, 1, True),    # four K tiles, each loaded before the previous one is used
])
def test_one_row_kernel_matches_linear(dtype, n, k, block_n, block_k, split, bias, fused):
    """The one-row (GEMV) kernel: one input row, any N and K, split-K reduced by the reduce kernel or in the launch
    (then the counters are zeros again after it)."""
    g = torch.Generator().manual_seed(n * 7 + k)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    counters = torch.zeros(triton.cdiv(n, block_n), dtype=torch.int32, device=DEVICE) if fused else None
    cfg = G.SkinnyConfig(1, block_n, block_k, split, 4, 2, gemv=True)
    y = G.skinny_linear(x, w, b, cfg, counters=counters)
    ref = F.linear(x.float(), w.float(), b.float() if b is not None else None)
    assert y.shape == (1, n) and y.dtype == dtype
    assert (y.float() - ref).abs().max().item() <= _tol(dtype, ref)
    assert counters is None or not counters.any()
    if split > 1 and fused:  # the fused reduction adds the same partials in the same order as the reduce kernel
        assert torch.equal(y, G.skinny_linear(x, w, b, cfg))


def test_one_row_kernel_takes_one_row_only():
    cfg = G.SkinnyConfig(1, 8, 64, 1, gemv=True)
    with pytest.raises(AssertionError):
        G.skinny_linear(torch.randn(2, 64, device=DEVICE), torch.randn(8, 64, device=DEVICE), None, cfg)
    with pytest.raises(AssertionError, match="one row"):  # a GEMV config must say block_m=1
        G.skinny_linear(torch.randn(1, 64, device=DEVICE), torch.randn(8, 64, device=DEVICE), None,
                        G.SkinnyConfig(16, 8, 64, 1, gemv=True))


def test_one_row_candidates_only_at_one_row_and_behind_their_switch(monkeypatch):
    """The tuner times the one-row kernel for the M = 1 bucket of bf16 / fp16 weights only; HF_ACCEL_ONE_ROW_GEMM=0
    (ONE_ROW_GEMM) leaves it out, and the stored key says which candidate set a decision came from."""
    one = linear_op._candidates(1)
    assert any(c.gemv for c in one) and all(c.block_m == 1 for c in one if c.gemv)
    assert not any(c.gemv for b in linear_op.M_BUCKETS[1:] for c in linear_op._candidates(b))
    assert not any(c.gemv for c in linear_op._candidates(1, int8=True))
    monkeypatch.setattr(linear_op.torch.cuda, "get_device_name", lambda index: "GPU")
    monkeypatch.setattr(linear_op, "device_index", lambda device: 0)
    cuda = torch.device("cuda")

    def keys() -> list[str]:
        return [linear_op._stored_key(cuda, dtype, 8, 8, False, b, True)
                for dtype in (torch.bfloat16, linear_op.int8_key_dtype(torch.bfloat16)) for b in linear_op.M_BUCKETS]

    on = keys()
    monkeypatch.setattr(linear_op, "ONE_ROW_GEMM", False)
    assert not any(c.gemv for c in linear_op._candidates(1))
    off = keys()
    # only the bf16 M = 1 key names the switch: the other buckets' and int8's decisions do not depend on it
    assert [a != b for a, b in zip(on, off, strict=True)] == [True] + [False] * (len(on) - 1)


def test_linears_with_computed_weights_run_without_pdl():
    """The routing pass gives a linear PDL only where its weight is a parameter or a view of one (the one-row kernel
    reads weights before its PDL wait); a weight the forward computes could be stored by the kernel just before."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 8, dtype=torch.float16))

        def forward(self, x):
            packed = torch.as_strided(self.w, (8, 8), (8, 1))  # as merge_packed_linears views a packed block
            return F.linear(x, self.w), F.linear(x, packed), F.linear(x, self.w[:8]), F.linear(x, self.w * 0.5)

    flags: list = []

    def backend(gm, example_inputs):
        route_small_m_linears(gm, use_pdl=True, allow_cpu=True)
        flags.extend(n.args[3] for n in gm.graph.nodes if n.target is torch.ops.hf_accel.linear.default)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(Net(), backend=backend, fullgraph=True)(torch.randn(2, 8, dtype=torch.float16))
    torch._dynamo.reset()
    assert flags == [True, True, True, False]


@pytest.mark.parametrize(("m", "n", "k", "block_m", "block_n", "block_k", "split", "bias"), [
    (1, 40, 96, 16, 16, 32, 1, False),
    (3, 70, 200, 16, 32, 64, 2, True),     # the scale applied after the split reduce, before the bias
    (20, 64, 128, 32, 32, 32, 1, True),
    (64, 50, 300, 64, 16, 64, 3, False),
])
def test_int8_weight_kernel_matches_the_dequantized_linear(m, n, k, block_m, block_n, block_k, split, bias):
    """int8 weights with one scale per output row (torchao int8 weight-only): widened in registers, scaled once."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    dtype = torch.float16
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(DEVICE)
    s = (torch.rand(n, generator=g) * 0.02 + 0.001).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    y = G.skinny_linear(x, q, b, G.SkinnyConfig(block_m, block_n, block_k, split, 4, 2), scale=s)
    ref = F.linear(x.float(), q.float() * s.float()[:, None], b.float() if b is not None else None)
    assert y.shape == (m, n) and y.dtype == dtype
    assert (y.float() - ref).abs().max().item() <= _tol(dtype, ref)


def test_int8_candidates_fit_their_bucket_and_the_op_follows_a_decision(monkeypatch):
    """Tuned int8 tiles hold the bucket's rows; the op takes a stored decision for its (shape, bucket) and the
    tile rule otherwise (the kernel itself needs CUDA; here the choice is checked)."""
    from hf_accel.ops import quantized_linear

    for bucket in linear_op.M_BUCKETS:
        cands = linear_op._candidates(bucket, int8=True)
        assert cands and all(c.block_m >= bucket for c in cands)
        assert {c.block_k for c in cands} != {c.block_k for c in linear_op._candidates(bucket)}  # longer K tiles
    monkeypatch.setattr(linear_op, "device_index", lambda device: 0)
    monkeypatch.setattr(quantized_linear, "default_config", lambda m, n, k, device: ("rule", m))
    linear_op.clear_decisions()
    tuned = G.SkinnyConfig(16, 64, 512, 2, 4, 4)
    key_dtype = linear_op.int8_key_dtype(torch.bfloat16)
    linear_op._decisions[linear_op._key(torch.device("cpu"), key_dtype, 48, 64, False, 16)] = tuned
    try:
        x = torch.randn(5, 64, dtype=torch.bfloat16)
        assert quantized_linear._tile_config(x, 5, 48, 64, False) is tuned  # 5 rows: bucket 16
        assert quantized_linear._tile_config(x, 1, 48, 64, False) == ("rule", 1)  # bucket 1: not tuned
        assert quantized_linear._tile_config(x, 5, 48, 64, True) == ("rule", 5)  # with a bias: another shape
        assert quantized_linear._tile_config(x.half(), 5, 48, 64, False) == ("rule", 5)  # fp16: another key
        wide = G.SkinnyConfig(64, 64, 128, 1, 4, 4)
        linear_op._decisions[linear_op._key(torch.device("cpu"), key_dtype, 48, 64, False, 64)] = wide
        assert quantized_linear._tile_config(x, 40, 48, 64, False) is wide
        assert quantized_linear._tile_config(x, 20, 48, 64, False) == ("rule", 20)  # 17-32 rows: the rule's tile
    finally:
        linear_op.clear_decisions()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("m", "split", "gemv"), [(1, 1, False), (5, 2, False), (16, 4, False), (64, 8, False),
                                                  (1, 1, True), (1, 3, True)])
def test_built_ahead_launches_are_the_real_ones(monkeypatch, m, split, gemv, bias, int8, fused):
    """`build_skinny_linear` (compile only, dtypes for tensors) asks Triton for exactly the kernels, grids and
    specializations `skinny_linear` launches for a contiguous input of `m` rows, with the split-K reduction fused
    (counters given) or not: what the tuner builds ahead is what it then times."""
    n, k = 96, 320  # K not a multiple of every split: uneven splits and the EVEN_K specialization both occur
    cfg = G.SkinnyConfig(1 if gemv else 16 if m <= 16 else 64, 32, 64, split, 4, 2, gemv=gemv)
    real, built = [], []
    monkeypatch.setattr(G, "_skinny_gemm_kernel", LaunchRecorder(real, "gemm"))
    monkeypatch.setattr(G, "_gemv_kernel", LaunchRecorder(real, "gemv"))
    monkeypatch.setattr(G, "_split_reduce_kernel", LaunchRecorder(real, "reduce"))
    x = torch.randn(m, k, dtype=torch.float16)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8) if int8 else torch.randn(n, k, dtype=torch.float16)
    G.skinny_linear(x, w, torch.randn(n, dtype=torch.float16) if bias else None, cfg, use_pdl=False,
                    scale=torch.rand(n, dtype=torch.float16) if int8 else None,
                    counters=torch.zeros(8, dtype=torch.int32) if fused else None)
    monkeypatch.setattr(G, "_skinny_gemm_kernel", LaunchRecorder(built, "gemm"))
    monkeypatch.setattr(G, "_gemv_kernel", LaunchRecorder(built, "gemv"))
    monkeypatch.setattr(G, "_split_reduce_kernel", LaunchRecorder(built, "reduce"))
    G.build_skinny_linear(m, n, k, torch.float16, w.dtype, bias, int8, cfg, use_pdl=False, fused_splits=fused)
    assert real and built == real
    split_k = G._split(k, cfg)[1]
    main = "gemv" if gemv else "gemm"
    assert [c[0] for c in real] == ([main, "reduce"] if split_k > 1 and not fused else [main])
    assert dict(real[0][3])["FUSED_SPLITS"] == (split_k if fused and split_k > 1 else 0)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize(("m", "n", "split", "bias"), [(1, 40, 2, False), (3, 70, 4, True), (16, 33, 3, True)])
def test_fused_split_reduction_gives_the_reduce_kernels_bits(m, n, split, bias, int8):
    """Summing the split-K partials in the GEMM's last program (counters given) adds the same partials in the same
    order as the reduce kernel: the same bits, scale and bias included; the counters are zeros after every call, so
    call after call agrees; too few counters for the column tiles falls back to the reduce kernel."""
    g = torch.Generator().manual_seed(m * 100 + n)
    dtype, k = torch.float16, 200
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(DEVICE) if int8
         else torch.randn(n, k, generator=g).to(DEVICE, dtype))
    s = (torch.rand(n, generator=g) * 0.02 + 0.001).to(DEVICE, dtype) if int8 else None
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    cfg = G.SkinnyConfig(16, 16, 32, split, 4, 2)
    want = G.skinny_linear(x, w, b, cfg, scale=s)
    counters = torch.zeros(triton.cdiv(n, 16), dtype=torch.int32, device=DEVICE)
    for _ in range(3):
        assert torch.equal(G.skinny_linear(x, w, b, cfg, scale=s, counters=counters), want)
        assert not counters.any(), "every counter must be back at zero after the launch"
    few = torch.full((triton.cdiv(n, 16) - 1,), 5, dtype=torch.int32, device=DEVICE)
    assert torch.equal(G.skinny_linear(x, w, b, cfg, scale=s, counters=few), want)
    assert (few == 5).all(), "too few counters: the reduce kernel runs and the counters are not touched"


def test_split_k_counters_are_this_threads_steps_own():
    """The GEMM ops take their split-K ticket counters from this thread's engine step only: nested steps see their
    own buffer, another thread sees none (two models stepping in two threads never share counters), and outside a
    step there are none, so the two-kernel path runs."""
    import threading

    from hf_accel.attention.context import ForwardContext, forward_context, split_k_counters

    a, b = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    seen: dict = {}
    assert split_k_counters() is None
    with forward_context(ForwardContext(None, None, [], split_k_counters=a)):
        assert split_k_counters() is a
        other = threading.Thread(target=lambda: seen.update(other=split_k_counters()))
        other.start()
        other.join()
        with forward_context(ForwardContext(None, None, [], split_k_counters=b)):
            assert split_k_counters() is b
        assert split_k_counters() is a
    assert "other" in seen and seen["other"] is None
    assert split_k_counters() is None


def test_tuner_times_only_what_is_not_decided_and_builds_it_first(monkeypatch, tmp_path):
    """The tuner's bookkeeping (timing and builds faked, no GPU here): decisions come from memory, then from the
    stored file, and only the rest is built ahead (once, all together) and timed; counts add up either way."""
    built, timed = [], []
    cuda = stand_in_tuner_gpu(monkeypatch, lambda todo: built.append(list(todo)))

    def fake_tune(n, k, has_bias, bucket, *args):
        timed.append((n, k, has_bias, bucket))
        return (G.SkinnyConfig(16, 32, 64, 2) if bucket == 1 else None), 2e-6, 1e-6

    monkeypatch.setattr(linear_op, "_tune_one", fake_tune)
    linear_op.clear_decisions()
    try:
        first = linear_op.tune_linears([(64, 128, False)], torch.float16, cuda, use_pdl=False, cache_dir=tmp_path)
        assert timed == built[0] == [(64, 128, False, b) for b in linear_op.M_BUCKETS]
        assert (first["tuned"], first["from_cache"], first["ours"], first["cublas"]) == (3, 0, 1, 2)
        linear_op.clear_decisions()  # a new process: the first shape from the file, the second one timed
        timed.clear()
        built.clear()
        second = linear_op.tune_linears([(64, 128, False), (32, 64, True)], torch.float16, cuda, use_pdl=False,
                                        cache_dir=tmp_path)
        assert timed == built[0] == [(32, 64, True, b) for b in linear_op.M_BUCKETS]
        assert (second["tuned"], second["from_cache"], second["ours"], second["cublas"]) == (3, 3, 2, 4)
        timed.clear()
        built.clear()
        third = linear_op.tune_linears([(32, 64, True), (64, 128, False)], torch.float16, cuda, use_pdl=False)
        assert not timed and not built and (third["tuned"], third["ours"], third["cublas"]) == (0, 2, 4)
        assert linear_op.tuned_config(cuda, torch.float16, 64, 128, False, 1) == G.SkinnyConfig(16, 32, 64, 2)
        assert linear_op.tuned_config(cuda, torch.float16, 64, 128, False, 40) is None
    finally:
        linear_op.clear_decisions()


def test_kernel_keeps_leading_dims_and_strided_rows():
    x = torch.randn(1, 3, 2 * 64, device=DEVICE)[..., :64]  # rows with a stride of 128
    w = torch.randn(24, 64, device=DEVICE)
    y = G.skinny_linear(x, w, None, G.SkinnyConfig(16, 16, 32, 2, 4, 2))
    assert y.shape == (1, 3, 24)
    ref = F.linear(x.double(), w.double()).float()  # float32 products on a GPU's tensor cores are TF32: judged
    torch.testing.assert_close(y, ref, rtol=0, atol=_tol(torch.float32, ref))  # as test_kernel_matches_linear


def test_strided_bias_is_read_correctly():
    x = torch.randn(3, 64, device=DEVICE)
    w = torch.randn(40, 64, device=DEVICE)
    b = torch.randn(80, device=DEVICE)[::2]  # a view with stride 2
    for split in (1, 2):
        y = G.skinny_linear(x, w, b, G.SkinnyConfig(16, 16, 32, split, 4, 2))
        ref = F.linear(x.double(), w.double(), b.double()).float()
        torch.testing.assert_close(y, ref, rtol=0, atol=_tol(torch.float32, ref))


def test_too_many_rows_is_refused():
    with pytest.raises(AssertionError, match="rows"):
        G.skinny_linear(torch.randn(17, 32, device=DEVICE), torch.randn(8, 32, device=DEVICE), None,
                        G.SkinnyConfig(16, 16, 32, 1))


def test_op_is_f_linear_when_untuned_or_on_cpu():
    linear_op.clear_decisions()
    x, w, b = torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(5)
    torch.testing.assert_close(torch.ops.hf_accel.linear(x, w, b, False), F.linear(x, w, b), rtol=0, atol=0)
    torch.testing.assert_close(torch.ops.hf_accel.linear(x, w, None, True), F.linear(x, w), rtol=0, atol=0)


def test_routing_pass_on_a_traced_model():
    """Every plain linear of a Dynamo-traced tiny Llama becomes hf_accel::linear; outputs stay equal."""
    from conftest import make_llama

    model = make_llama().to(torch.float16).eval()  # routed dtypes are bf16 / fp16
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    routed: list = []

    def backend(gm, example_inputs):
        routed.extend(route_small_m_linears(gm, use_pdl=False, allow_cpu=True))
        names = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        assert not any("linear" in nm and "hf_accel" not in nm for nm in names), names
        return gm.forward

    with torch.no_grad():
        ref = model(ids).logits
        torch._dynamo.reset()
        out = torch.compile(model, backend=backend, fullgraph=False)(ids).logits
    torch._dynamo.reset()
    cfg = model.config
    layers = cfg.num_hidden_layers
    assert len(routed) == 7 * layers + 1  # q, k, v, o, gate, up, down per layer + lm_head
    assert (cfg.vocab_size, cfg.hidden_size, False) in routed
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_routing_pass_leaves_fp32_and_cpu_alone():
    from conftest import make_llama

    model = make_llama().eval()  # float32
    routed: list = []

    def backend(gm, example_inputs):
        routed.extend(route_small_m_linears(gm, use_pdl=False, allow_cpu=True))
        routed.extend(route_small_m_linears(gm, use_pdl=False))  # CPU without allow_cpu: nothing either
        return gm.forward

    with torch.no_grad():
        torch._dynamo.reset()
        torch.compile(model, backend=backend)(torch.randint(0, 100, (1, 5)))
    torch._dynamo.reset()
    assert routed == []


def test_pdl_switch_is_off_without_a_gpu():
    if not ON_GPU:
        assert not pdl.supported("cpu")
        assert pdl.launch_kwargs(False) == {}
    assert pdl.launch_kwargs(True) == {"launch_pdl": True}


# ------------------------------------------------------------------------------------------------------------- GPU
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("use_pdl", [False, True])
def test_bf16_decode_shapes(use_pdl):
    if use_pdl and not pdl.supported(DEVICE):
        pytest.skip("PDL needs sm90+ and a triton that exposes it")
    for n, k in ((4096, 1024), (1024, 2048), (1024, 3072), (3072, 2048)):
        for m in (1, 7, 16, 64):
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.05
            ref = F.linear(x.float(), w.float())
            for cfg in linear_op._candidates(1 if m == 1 else (16 if m <= 16 else 64)):
                y = G.skinny_linear(x, w, None, cfg, use_pdl)
                assert (y.float() - ref).abs().max().item() <= _tol(torch.bfloat16, ref), (n, k, m, cfg)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("use_pdl", [False, True])
def test_int8_weight_op_on_decode_shapes(use_pdl):
    """hf_accel::int8_weight_linear on the llama-3.1-8b decode shapes: the small-M kernel (its own tile choice) at
    1-64 rows, torchao's arithmetic above; both against the float32 dequantized product."""
    from hf_accel.ops.quantized_linear import int8_weight_linear

    if use_pdl and not pdl.supported(DEVICE):
        pytest.skip("PDL needs sm90+ and a triton that exposes it")
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        q = torch.randint(-127, 128, (n, k), device=DEVICE, dtype=torch.int8)
        s = torch.rand(n, device=DEVICE, dtype=torch.bfloat16) * 0.002 + 1e-4
        for m in (1, 5, 16, 33, 64, 65, 300):
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            ref = F.linear(x.float(), q.float() * s.float()[:, None])
            y = int8_weight_linear(x, q, s, None, use_pdl)
            assert (y.float() - ref).abs().max().item() <= _tol(torch.bfloat16, ref), (n, k, m)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_pdl_chain_in_a_cuda_graph_keeps_every_dependency(fused, gemv):
    """Forty dependent GEMMs (each reads the previous output, split-K ones included, back to back on one set of
    ticket counters when `fused`) replayed from a graph: the same bits with PDL as without, and as run eagerly with
    the reduce kernel; the counters are zeros after every replay. `gemv`: one row through the one-row kernel, which
    loads weights before its PDL wait."""
    if not pdl.supported(DEVICE):
        pytest.skip("PDL needs sm90+ and a triton that exposes it")
    torch.manual_seed(0)
    h = 1024
    ws = [torch.randn(h, h, device=DEVICE, dtype=torch.bfloat16) / 32 for _ in range(40)]
    cfgs = [G.SkinnyConfig(1, 8, 256, 1 + 3 * (i % 2), 4, 4, gemv=True) if gemv
            else G.SkinnyConfig(16, 32, 256, 1 + 3 * (i % 2), 4, 4) for i in range(40)]
    x0 = torch.randn(1 if gemv else 4, h, device=DEVICE, dtype=torch.bfloat16)
    counters = torch.zeros(h // 8, dtype=torch.int32, device=DEVICE) if fused else None

    def chain(use_pdl: bool, counters: torch.Tensor | None) -> torch.Tensor:
        y = x0
        for w, c in zip(ws, cfgs, strict=True):
            # a non-PDL kernel between, too
            y = torch.tanh(G.skinny_linear(y, w, None, c, use_pdl, counters=counters))
            y = G.skinny_linear(y, w, None, c, use_pdl, counters=counters)
        return y

    eager = chain(False, None)
    outs = {}
    for use_pdl in (False, True):
        g = torch.cuda.CUDAGraph()
        chain(use_pdl, counters)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            out = chain(use_pdl, counters)
        for _ in range(3):
            g.replay()
            torch.cuda.synchronize()
            assert counters is None or not counters.any()
        outs[use_pdl] = out.clone()
    assert torch.equal(outs[False], eager) and torch.equal(outs[True], eager)


@gpu
@pytest.mark.gpu
def test_tuner_decides_and_the_op_follows(tmp_path):
    linear_op.clear_decisions()
    shapes = [(1024, 2048, False), (4096, 1024, True)]
    report = linear_op.tune_linears(shapes, torch.bfloat16, DEVICE, use_pdl=pdl.supported(DEVICE),
                                    cache_dir=tmp_path, scratch_bytes=32 << 20)
    assert report["tuned"] == len(shapes) * len(linear_op.M_BUCKETS)
    assert (tmp_path / linear_op.TUNE_FILE).is_file()
    for n, k, has_bias in shapes:
        for m in (1, 5, 16, 40, 64, 65):
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.05
            b = torch.randn(n, device=DEVICE, dtype=torch.bfloat16) if has_bias else None
            ref = F.linear(x.float(), w.float(), b.float() if b is not None else None)
            y = torch.ops.hf_accel.linear(x, w, b, False)
            assert (y.float() - ref).abs().max().item() <= _tol(torch.bfloat16, ref)
    # a second process would read the file: drop the memory and re-tune from it
    linear_op.clear_decisions()
    again = linear_op.tune_linears(shapes, torch.bfloat16, DEVICE, use_pdl=pdl.supported(DEVICE),
                                   cache_dir=tmp_path)
    assert again["tuned"] == 0 and again["from_cache"] == len(shapes) * len(linear_op.M_BUCKETS)
    linear_op.clear_decisions()


@gpu
@pytest.mark.gpu
def test_int8_tuner_decides_and_the_op_follows(tmp_path):
    """int8 weights: the tuner times the tile rule against the candidates per shape and bucket, remembers the
    decisions on disk, and hf_accel::int8_weight_linear runs them (results still the dequantized product)."""
    from hf_accel.ops.quantized_linear import int8_weight_linear

    linear_op.clear_decisions()
    shapes = [(1024, 2048, False), (4096, 1024, True)]
    report = linear_op.tune_linears(shapes, torch.bfloat16, DEVICE, use_pdl=pdl.supported(DEVICE), int8=True,
                                    cache_dir=tmp_path, scratch_bytes=32 << 20)
    assert report["tuned"] == len(shapes) * len(linear_op.M_BUCKETS)
    decisions = linear_op.decisions_for(shapes, DEVICE, linear_op.int8_key_dtype(torch.bfloat16))
    assert len(decisions) == len(shapes) * len(linear_op.M_BUCKETS)
    assert not linear_op.decisions_for(shapes, DEVICE, torch.bfloat16)  # bf16 decisions are separate
    for n, k, has_bias in shapes:
        q = torch.randint(-127, 128, (n, k), device=DEVICE, dtype=torch.int8)
        s = torch.rand(n, device=DEVICE, dtype=torch.bfloat16) * 0.002 + 1e-4
        b = torch.randn(n, device=DEVICE, dtype=torch.bfloat16) if has_bias else None
        for m in (1, 5, 16, 40, 64, 65):
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            ref = F.linear(x.float(), q.float() * s.float()[:, None], b.float() if b is not None else None)
            y = int8_weight_linear(x, q, s, b, False)
            assert (y.float() - ref).abs().max().item() <= _tol(torch.bfloat16, ref), (n, k, m)
    linear_op.clear_decisions()
    again = linear_op.tune_linears(shapes, torch.bfloat16, DEVICE, use_pdl=pdl.supported(DEVICE), int8=True,
                                   cache_dir=tmp_path)
    assert again["tuned"] == 0 and again["from_cache"] == len(shapes) * len(linear_op.M_BUCKETS)
    linear_op.clear_decisions()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
def test_candidates_built_ahead_are_the_kernels_the_tuner_runs(int8):
    """`build_candidates` compiles, in a thread pool, exactly the specializations `_tune_one` then launches: after
    it, timing every candidate of a shape and bucket adds nothing to the kernels' compile caches."""
    from hf_accel.ops.triton_build import build_in_parallel

    dev = torch.cuda.current_device()

    def compiled() -> int:
        return sum(len(kernel.device_caches[dev][0]) for kernel in (G._skinny_gemm_kernel, G._gemv_kernel,
                                                                        G._split_reduce_kernel))

    todo = [(768, 1536, True, 1), (1536, 768, False, 16), (640, 1536, False, 64)]  # shapes no other test compiles
    before = compiled()
    report = linear_op.build_candidates(todo, torch.bfloat16, pdl.supported(DEVICE), int8, DEVICE)
    assert report["workers"] >= 2 and report["kernels"] > 0, report
    # what an earlier test compiled is found, not built again: counted in the report, not new in the caches
    assert 0 < compiled() - before <= report["kernels"]
    after_build = compiled()
    for n, k, has_bias, bucket in todo:
        linear_op._tune_one(n, k, has_bias, bucket, torch.bfloat16, DEVICE, pdl.supported(DEVICE), 8 << 20, int8)
    assert compiled() == after_build  # nothing new was compiled on the critical path
    assert build_in_parallel([], workers=4)["kernels"] == 0
