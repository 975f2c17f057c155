"""Fused RMSNorm / SiLU-and-mul (hf_accel.ops) against the stock transformers modules.

Without a GPU the kernels run on CPU tensors in the Triton interpreter (TRITON_INTERPRET=1, set below before triton
is imported), the way tests/test_triton_kernels.py runs the attention kernels. On a CUDA machine the same tests run
compiled on the GPU, and the `gpu`-marked test adds bf16 at a real hidden size.

The interpreter casts fp32 to bf16 by truncation where the GPU rounds to nearest even, so bf16 results on CPU are
compared with a tolerance of a couple of bf16 steps; fp16 (numpy rounds to nearest) checks the rounding points: the
fused results must equal stock almost everywhere, not just be close.
"""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE, ON_GPU, load_kernel_modules

triton = pytest.importorskip("triton")

import ast  # noqa: E402
import inspect  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

from hf_accel.compilation.linear_packing import pack_sibling_linears, unpack_sibling_linears  # noqa: E402
from hf_accel.ops import fused  # noqa: E402

(K,) = load_kernel_modules(["hf_accel.ops.fused_kernels"], "_rms_norm_kernel")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (compiled Triton kernels)")


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to float reduction order: tight in fp32, near-exact in fp16 (and bf16 on GPU)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.numel() == 0:
        return
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    if ref.dtype == torch.bfloat16 and not ON_GPU:  # interpreter truncates to bf16: up to a step or two below
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
        return
    step = 2e-3 if ref.dtype == torch.float16 else 1.6e-2
    torch.testing.assert_close(out, ref, rtol=step, atol=step)
    assert (out == ref).float().mean().item() > 0.98, "rounding points differ from the stock module"


def make_norm(cls: type, n: int, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    module = cls(n, eps=1e-6)
    with torch.no_grad():  # llama style weights around 1, gemma style around 0 (the kernel adds the 1)
        base = 0.0 if cls in (GemmaRMSNorm, Gemma2RMSNorm) else 1.0
        module.weight.copy_(base + 0.5 * torch.randn(n, generator=gen))
    return module.to(DEVICE, dtype)


def rnd(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


# -- rms_norm ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen3RMSNorm, Gemma2RMSNorm])
@pytest.mark.parametrize("shape", [(5, 48), (2, 3, 80), (0, 48), (1, 64)])
def test_rms_norm_matches_module(cls, dtype, shape):
    module = make_norm(cls, shape[-1], dtype)
    x = rnd(*shape, dtype=dtype)
    gemma = fused.FUSABLE_NORMS[cls.__name__] == "gemma"
    eps = module.eps if gemma else module.variance_epsilon
    with torch.no_grad():
        assert_matches(K.rms_norm(x, module.weight, eps, gemma), module(x))


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Gemma2RMSNorm])
def test_rms_norm_mixed_dtypes(cls):
    """fp32 weights on fp16 activations: Llama style promotes the result to fp32, Gemma style keeps x's dtype."""
    module = make_norm(cls, 80, torch.float32)
    x = rnd(4, 80, dtype=torch.float16)
    gemma = cls is Gemma2RMSNorm
    with torch.no_grad():
        ref = module(x)
        out = K.rms_norm(x, module.weight, 1e-6, gemma)
    assert ref.dtype == (torch.float16 if gemma else torch.float32)
    assert_matches(out, ref)


@pytest.mark.parametrize("layout", ["row_slice", "transposed"])
def test_rms_norm_strided_input(layout):
    """Rows that are slices of wider rows (row stride != N) and leading dims that cannot be flattened."""
    module = make_norm(LlamaRMSNorm, 48, torch.float16)
    if layout == "row_slice":
        x = rnd(2, 3, 64, dtype=torch.float16)[..., 8:56]
    else:
        x = rnd(3, 2, 48, dtype=torch.float16).transpose(0, 1)
    assert not x.is_contiguous()
    with torch.no_grad():
        assert_matches(K.rms_norm(x, module.weight, 1e-6, False), module(x))


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Gemma2RMSNorm])
def test_rms_norm_rows_wider_than_one_block(cls, monkeypatch):
    """Rows wider than MAX_NORM_BLOCK take the two-pass loop (shrunk here so it runs on a tiny row)."""
    monkeypatch.setattr(K, "MAX_NORM_BLOCK", 32)
    module = make_norm(cls, 80, torch.float16)  # 3 chunks of 32, the last one partial
    x = rnd(3, 80, dtype=torch.float16)
    with torch.no_grad():
        assert_matches(K.rms_norm(x, module.weight, 1e-6, cls is Gemma2RMSNorm), module(x))


# -- silu_and_mul ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "column_slices", "leading_dims", "empty"])
def test_silu_and_mul(dtype, layout):
    if layout == "contiguous":
        gate, up = rnd(7, 96, dtype=dtype, seed=1), rnd(7, 96, dtype=dtype, seed=2)
    elif layout == "column_slices":  # the one-GEMM path: both halves of one [M, 2I] product
        both = rnd(7, 2 * 100, dtype=dtype, seed=3)
        gate, up = both[:, :100], both[:, 100:]
    elif layout == "leading_dims":
        both = rnd(2, 3, 2 * 40, dtype=dtype, seed=4)
        gate, up = both[..., :40], both[..., 40:]
    else:
        gate, up = rnd(0, 96, dtype=dtype), rnd(0, 96, dtype=dtype)
    assert_matches(K.silu_and_mul(gate, up), F.silu(gate) * up)


def test_silu_and_mul_several_column_blocks(monkeypatch):
    monkeypatch.setattr(K, "MAX_ACT_BLOCK", 32)
    both = rnd(5, 2 * 100, dtype=torch.float16, seed=5)  # 4 column blocks of 32, the last one partial
    gate, up = both[:, :100], both[:, 100:]
    assert_matches(K.silu_and_mul(gate, up), F.silu(gate) * up)


# -- installing on models ----------------------------------------------------------------------------------------

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=200, max_position_embeddings=128)
IDS = torch.tensor([[5, 17, 42, 99, 7, 150, 33], [88, 3, 120, 45, 46, 47, 48]])


def tiny_model(config: transformers.PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random norm weights, so a wrong style or a wrong eps shows
        for module in model.modules():
            if type(module).__name__ in fused.FUSABLE_NORMS:
                module.weight.add_(0.3 * torch.randn_like(module.weight))
    return model.to(DEVICE)


def in_engine_step():
    """What the engine sets around its forwards: the fused forwards only run inside one (this model is not
    accelerated, so its attention stays stock; only the context matters here)."""
    from hf_accel.attention.context import ForwardContext, forward_context

    return forward_context(ForwardContext(metadata=None, backend=None, kv_caches=[]))


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad(), in_engine_step():
        return model(IDS.to(DEVICE)).logits


def has_instance_forward(module: torch.nn.Module) -> bool:
    return "forward" in module.__dict__


@pytest.fixture
def spy_silu_and_mul(monkeypatch):
    """Records, per fused MLP call, whether gate and up were column slices of one product (the one-GEMM path)."""
    calls: list[bool] = []
    real = K.silu_and_mul

    def spy(gate, up):
        calls.append(gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr())
        return real(gate, up)

    monkeypatch.setattr(K, "silu_and_mul", spy)
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_install_matches_stock_and_uninstalls(family, spy_silu_and_mul):
    config = (transformers.LlamaConfig(**TINY) if family == "llama"
              else transformers.Qwen3Config(**TINY, head_dim=16))
    model = tiny_model(config)
    ref = logits(model)
    record = fused.install_fused_ops(model, allow_cpu=True)
    per_layer = 2 if family == "llama" else 4  # Qwen3 adds q_norm / k_norm over the head dim
    assert (record.norms, record.mlps) == (2 * per_layer + 1, 2)
    assert len(record.modules) == record.norms + record.mlps
    torch.testing.assert_close(logits(model), ref, rtol=1e-5, atol=1e-5)
    assert spy_silu_and_mul == [False, False]  # unpacked weights: two GEMMs
    patched = list(record.modules)
    fused.uninstall_fused_ops(record)
    assert not any(has_instance_forward(m) for m in patched)
    assert torch.equal(logits(model), ref)


def test_packed_gate_up_takes_one_gemm(spy_silu_and_mul):
    model = tiny_model(transformers.LlamaConfig(**TINY))
    ref = logits(model)
    packed = pack_sibling_linears(model)
    record = fused.install_fused_ops(model, allow_cpu=True)
    mlps = [m for m in record.modules if isinstance(m, LlamaMLP)]
    assert len(mlps) == 2 and all(fused.gate_packed_with_up(m) for m in mlps)
    torch.testing.assert_close(logits(model), ref, rtol=1e-5, atol=1e-5)
    assert spy_silu_and_mul == [True, True]
    # unpacking after install (restore does) must switch back to two GEMMs, never read past the gate weight
    unpack_sibling_linears(packed)
    assert not any(fused.gate_packed_with_up(m) for m in mlps)
    torch.testing.assert_close(logits(model), ref, rtol=1e-5, atol=1e-5)
    assert spy_silu_and_mul[2:] == [False, False]
    fused.uninstall_fused_ops(record)


def test_gemma2_norms_gemma_style_mlp_not_fused():
    model = tiny_model(transformers.Gemma2Config(**TINY, head_dim=16, sliding_window=8))
    ref = logits(model)
    record = fused.install_fused_ops(model, allow_cpu=True)
    assert (record.norms, record.mlps) == (2 * 4 + 1, 0)  # four norms a layer; GELU-tanh MLP left alone
    assert all(fused.FUSABLE_NORMS[type(m).__name__] == "gemma" for m in record.modules)
    assert not any(has_instance_forward(m) for m in model.modules() if type(m).__name__ == "Gemma2MLP")
    torch.testing.assert_close(logits(model), ref, rtol=1e-5, atol=1e-5)
    fused.uninstall_fused_ops(record)


def test_non_silu_mlp_and_hooked_projection_not_fused():
    model = tiny_model(transformers.LlamaConfig(**TINY, hidden_act="gelu"))
    assert fused.install_fused_ops(model, allow_cpu=True).mlps == 0
    model = tiny_model(transformers.LlamaConfig(**TINY))
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda *a: None)  # the one-GEMM path would skip it
    record = fused.install_fused_ops(model, allow_cpu=True)
    assert record.mlps == 1 and not has_instance_forward(model.model.layers[0].mlp)


def test_never_patches_twice_and_keeps_foreign_forwards():
    model = tiny_model(transformers.LlamaConfig(**TINY))
    norm = model.model.norm
    foreign = norm.forward  # e.g. accelerate's device hook sets an instance forward
    norm.forward = foreign
    first = fused.install_fused_ops(model, allow_cpu=True)
    assert norm not in first.modules and first.norms == 4
    second = fused.install_fused_ops(model, allow_cpu=True)
    assert (second.norms, second.mlps, second.modules) == (0, 0, [])
    fused.uninstall_fused_ops(first)
    assert norm.__dict__["forward"] is foreign


def test_falls_back_to_class_forward(monkeypatch):
    """Autograd, keyword calls and (without allow_cpu) CPU tensors all take the stock forward."""
    model = tiny_model(transformers.LlamaConfig(**TINY))
    ref = logits(model)
    record = fused.install_fused_ops(model, allow_cpu=True)
    calls: list[str] = []
    monkeypatch.setattr(K, "rms_norm", lambda *a: calls.append("norm"))
    monkeypatch.setattr(K, "silu_and_mul", lambda *a: calls.append("mlp"))
    with in_engine_step():
        out = model(IDS.to(DEVICE)).logits  # grad enabled, parameters require grad
    assert out.requires_grad and calls == []
    torch.testing.assert_close(out.detach(), ref, rtol=0, atol=0)
    with torch.no_grad():  # outside an engine step (a plain forward): the stock modules, even without autograd
        assert torch.equal(model(IDS.to(DEVICE)).logits, ref) and calls == []
    norm = model.model.norm
    x = rnd(3, 64)
    with torch.no_grad(), in_engine_step():
        assert torch.equal(norm(hidden_states=x), LlamaRMSNorm.forward(norm, x)) and calls == []
    fused.uninstall_fused_ops(record)
    if not ON_GPU:
        assert fused.install_fused_ops(model).modules == []  # CPU parameters: skipped without allow_cpu


# -- the listed classes ------------------------------------------------------------------------------------------


class _Canonical(ast.NodeTransformer):
    """Rename a forward's input argument to `x` and drop annotations, docstrings and the function name."""

    def __init__(self, arg: str) -> None:
        self.arg = arg

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(id="x", ctx=node.ctx) if node.id == self.arg else node


def _canonical_body(fn: ast.FunctionDef) -> str:
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    module = ast.Module(body=body, type_ignores=[])
    return ast.dump(_Canonical(fn.args.args[1].arg).visit(module))


def _inlined_return(fn: ast.FunctionDef) -> str:
    """`y = EXPR; return y` and `return EXPR` both give the dump of EXPR (with the input renamed to `x`)."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) == 2 and isinstance(body[0], ast.Assign) and isinstance(body[1], ast.Return):
        expr = body[0].value
    elif len(body) == 1 and isinstance(body[0], ast.Return):
        expr = body[0].value
    else:
        return "<other>"
    return ast.dump(_Canonical(fn.args.args[1].arg).visit(ast.Expression(body=expr)))


def _class_definitions(name: str) -> list[ast.ClassDef]:
    """Every definition of class `name` in the installed transformers' modeling files (names are not unique)."""
    root = pathlib.Path(transformers.__file__).parent / "models"
    found = []
    pattern = re.compile(rf"^class {re.escape(name)}\(", re.M)
    for path in root.glob("*/modeling_*.py"):
        text = path.read_text()
        if pattern.search(text):
            found += [n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == name]
    return found


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _ref_class(cls: type) -> ast.ClassDef:
    return ast.parse(inspect.getsource(cls)).body[0]


def test_listed_classes_compute_the_fused_formulas():
    """Each listed class (every definition of its name in transformers) has the forward the kernels replicate."""
    ref_llama = _canonical_body(_methods(_ref_class(LlamaRMSNorm))["forward"])
    ref_gemma = {k: _canonical_body(v) for k, v in _methods(_ref_class(GemmaRMSNorm)).items()
                 if k in ("forward", "_norm")}
    ref_mlp = _inlined_return(_methods(_ref_class(LlamaMLP))["forward"])
    assert "down_proj" in ref_mlp and "act_fn" in ref_mlp
    for name, style in fused.FUSABLE_NORMS.items():
        defs = _class_definitions(name)
        assert defs, f"{name} is not defined in this transformers"
        for cls in defs:
            methods = _methods(cls)
            if style == "llama":
                assert _canonical_body(methods["forward"]) == ref_llama, name
            else:
                assert {k: _canonical_body(methods[k]) for k in ("forward", "_norm")} == ref_gemma, name
    for name in fused.FUSABLE_MLPS:
        defs = _class_definitions(name)
        assert defs, f"{name} is not defined in this transformers"
        for cls in defs:
            assert _inlined_return(_methods(cls)["forward"]) == ref_mlp, name


def test_fused_module_imports_no_triton():
    """hf_accel.ops.fused (and what it imports at top level) must import without triton."""
    for mod in (fused, sys.modules["hf_accel.compilation.linear_packing"]):
        tree = ast.parse(pathlib.Path(mod.__file__).read_text())
        names = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)]
        assert not any("triton" in n or "fused_kernels" in n for n in names), names


# -- GPU ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cls", [LlamaRMSNorm, Gemma2RMSNorm])
def test_gpu_bf16_real_size(cls):
    """Hidden 4096 / intermediate 14336 in bf16, compiled, inside a CUDA graph: equal to stock almost everywhere."""
    module = make_norm(cls, 4096, torch.bfloat16)
    x = rnd(3, 37, 4096, dtype=torch.bfloat16)
    both = rnd(111, 2 * 14336, dtype=torch.bfloat16, seed=7)
    gate, up = both[:, :14336], both[:, 14336:]
    gemma = cls is Gemma2RMSNorm
    with torch.no_grad():
        ref_norm, ref_act = module(x), F.silu(gate) * up
        assert_matches(K.rms_norm(x, module.weight, 1e-6, gemma), ref_norm)
        assert_matches(K.silu_and_mul(gate, up), ref_act)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_norm = K.rms_norm(x, module.weight, 1e-6, gemma)
            out_act = K.silu_and_mul(gate, up)
        x.copy_(rnd(3, 37, 4096, dtype=torch.bfloat16, seed=9))
        graph.replay()
        assert_matches(out_norm, module(x))
        assert_matches(out_act, ref_act)



# -- accelerate_model wiring -------------------------------------------------------------------------------------------
def test_accelerate_model_installs_and_suspends_for_the_stock_path(monkeypatch):
    """accelerate_model(compile=False) installs the fused forwards (forced here on CPU through the interpreter); greedy
    output stays stock's; a stock-path call (beam search) runs the model's own modules; restore() removes them."""
    from transformers import LlamaConfig, LogitsProcessor, LogitsProcessorList

    from hf_accel import accelerate_model, api, restore

    monkeypatch.setattr(api, "_wants_fused_ops", lambda cfg, device: not cfg.enforce_eager)
    monkeypatch.setattr(api, "install_fused_ops", lambda model: fused.install_fused_ops(model, allow_cpu=True))
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=200, max_position_embeddings=128)
    stock = tiny_model(cfg)
    model = tiny_model(cfg)
    ids = torch.tensor([[5, 17, 42, 99, 7, 150, 33]], device=DEVICE)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = stock.generate(**kw)
    accelerate_model(model, compile=False, attention_backend="torch")
    info = api.engine_info(model)["fused_ops"]
    assert info == {"norms": 5, "mlps": 2}
    assert torch.equal(model.generate(**kw), want)

    kernel_calls: list[str] = []
    monkeypatch.setattr(K, "rms_norm", lambda *a: kernel_calls.append("norm"))
    monkeypatch.setattr(K, "silu_and_mul", lambda *a: kernel_calls.append("mlp"))
    seen = []

    class Probe(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen.append(len(kernel_calls))
            return scores

    with pytest.warns(UserWarning, match="beam search"):
        want_beam = stock.generate(**kw, num_beams=2)
        got_beam = model.generate(**kw, num_beams=2, logits_processor=LogitsProcessorList([Probe()]))
    assert seen and not kernel_calls, "the stock path ran the fused forwards"
    assert torch.equal(got_beam, want_beam)
    assert any(has_instance_forward(m) for m in model.modules()), "fused forwards are installed"
    restore(model)
    assert not any(has_instance_forward(m) for m in model.modules())
    accelerate_model(model, enforce_eager=True)  # enforce_eager keeps the model's own modules
    assert api.engine_info(model)["fused_ops"] is None
    restore(model)
