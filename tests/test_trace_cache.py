"""The stored Dynamo trace (compilation/trace_cache.py): a later start of the same model skips tracing, and never
reuses a graph traced from something else.

The end-to-end tests compile with Inductor on the CPU (about 15 s cold for the 2-layer model, a few seconds warm).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import fresh_copy, make_llama

import hf_accel.compilation.cache as cache_mod
from hf_accel import accelerate_model, engine_info, restore
from hf_accel.compilation.trace_cache import model_fingerprint as fingerprint_and_refusals
from hf_accel.compilation.trace_cache import model_tensor_names
from hf_accel.config import AccelConfig


def model_fingerprint(model) -> str:
    fingerprint, refusals = fingerprint_and_refusals(model)
    assert not refusals, refusals  # a stock model is never refused
    return fingerprint


PROMPTS = torch.tensor([[5, 17, 23, 9, 41, 7, 3, 88, 14, 60, 21, 33]])


def _greedy(model, n: int = 6) -> torch.Tensor:
    prompts = PROMPTS.to(model.device)
    return model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, do_sample=False).cpu()


def _accelerated_run(model, cache_dir, **config) -> tuple[torch.Tensor, str]:
    """Accelerate (compiled) with the compile cache in `cache_dir`; the greedy tokens and where the trace came from."""
    accelerate_model(model, compile=True, num_kv_blocks=64,
                     config=AccelConfig(compile_cache_dir=str(cache_dir), **config))
    try:
        out = _greedy(model)
        source = engine_info(model)["startup"].get("trace_source")
    finally:
        restore(model)
    return out, source


def _stored_files(cache_dir) -> list:
    return sorted(cache_dir.rglob("dynamo-graph-*.pkl"))


@pytest.fixture
def fixed_sources(monkeypatch):
    # the compile cache directory is keyed by our sources' hash; others may edit hf_accel while the suite runs
    monkeypatch.setattr(cache_mod, "source_hash", lambda: "fixed")


# ------------------------------------------------------------------------------------------------ fingerprint
def test_fingerprint_equal_for_equal_models_in_another_process():
    """Same structure, other weights, another process: one fingerprint (else a warm start would never hit)."""
    here = model_fingerprint(make_llama(seed=0))
    assert model_fingerprint(make_llama(seed=3)) == here
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, "tests")
        from conftest import make_llama
        from hf_accel.compilation.trace_cache import model_fingerprint
        print(model_fingerprint(make_llama(seed=1))[0])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == here


def _set_eps(m):
    m.model.norm.variance_epsilon = 1e-3


def _set_training(m):
    m.model.layers[1].mlp.train()


def _add_tensor_attribute(m):
    m.model.layers[0].mlp.control = torch.zeros(64)


def _tie(m):
    m.lm_head.weight = m.model.embed_tokens.weight


def _half_a_weight(m):
    m.model.layers[0].mlp.down_proj.weight.data = m.model.layers[0].mlp.down_proj.weight.data.to(torch.bfloat16)


def _dict_scalar(m):
    m.model.layers[0].self_attn.extra_scales = {"default": 2.0}


def _swap_class(m):
    mlp = m.model.layers[0].mlp
    mlp.__class__ = type("ScaledMLP", (type(mlp),), {"forward": lambda self, x: 2 * type(mlp).forward(self, x)})


def _frozen(m):
    m.model.embed_tokens.weight.requires_grad_(False)


@pytest.mark.parametrize("change", [_set_eps, _set_training, _add_tensor_attribute, _tie, _half_a_weight,
                                    _dict_scalar, _frozen])
def test_fingerprint_sees_what_a_trace_reads(change):
    base = make_llama()
    changed = make_llama()
    change(changed)
    assert model_fingerprint(changed) != model_fingerprint(base)


def test_fingerprint_sees_a_tensor_attributes_shape():
    a, b = make_llama(), make_llama()
    a.model.layers[0].mlp.control = torch.zeros(64)
    b.model.layers[0].mlp.control = torch.zeros(1, 64)
    assert model_fingerprint(a) != model_fingerprint(b)
    assert model_tensor_names(a)[id(a.model.layers[0].mlp.control)] == "model.layers.0.mlp.control"


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_warm_start_reads_the_stored_trace_and_binds_the_live_weights(tmp_path, fixed_sources, device):
    """Cold start traces and stores; a second start of an equal model (other weights) reads the graph back, binds
    its own weights and matches stock (float32; on CUDA with piecewise and full graphs, small-M GEMMs and PDL).
    Without the option nothing is read."""
    first = make_llama(seed=0).to(device)
    want_first = _greedy(fresh_copy(first))
    got, source = _accelerated_run(first, tmp_path)
    assert source == "dynamo" and torch.equal(got, want_first)
    assert len(_stored_files(tmp_path)) == 1

    other = make_llama(seed=5).to(device)  # same structure, other weights: the stored graph must read these
    want_other = _greedy(fresh_copy(other))
    assert not torch.equal(want_other, want_first)
    got, source = _accelerated_run(other, tmp_path)
    assert source == "stored" and torch.equal(got, want_other)

    got, source = _accelerated_run(make_llama(seed=5).to(device), tmp_path, reuse_traced_graph=False)
    assert source == "dynamo" and torch.equal(got, want_other)


def test_another_set_of_graph_passes_is_a_cold_start(tmp_path, fixed_sources, monkeypatch):
    """The graph passes' switches and the eager precision casts (a model whose weights quantize their activations,
    its config unchanged) are part of the compile cache key: a start with another setting compiles other graphs, so
    it gets its own directory and reports itself cold (not warm from the first setting's artifacts)."""
    import hf_accel.patches.quantization as quantization

    seen = []
    for fold, casts in ((True, False), (False, False), (False, True)):
        monkeypatch.setattr(quantization, "quantizes_activations", lambda model, casts=casts: casts)
        model = make_llama(seed=0)
        accelerate_model(model, compile=True, num_kv_blocks=64,
                         config=AccelConfig(compile_cache_dir=str(tmp_path), fold_norms=fold))
        try:
            seen.append(engine_info(model)["compile_cache"])
            assert engine_info(model)["eager_precision_casts"] is casts
        finally:
            restore(model)
    assert len({s["dir"] for s in seen}) == 3 and not any(s["warm"] for s in seen)


def test_changed_model_is_traced_again_not_served_the_stored_graph(tmp_path, fixed_sources):
    """The same config, but a norm's eps edited in place (not in the config): the stored graph baked the old eps,
    so it must not be used; the new trace is stored beside it."""
    _accelerated_run(make_llama(seed=0), tmp_path)
    changed = make_llama(seed=0)
    changed.model.layers[0].post_attention_layernorm.variance_epsilon = 10.0  # large enough to change the tokens
    want = _greedy(fresh_copy(changed))
    assert not torch.equal(want, _greedy(make_llama(seed=0)))
    got, source = _accelerated_run(changed, tmp_path)
    assert source == "dynamo" and torch.equal(got, want)
    assert len(_stored_files(tmp_path)) == 2


def test_unreadable_stored_trace_warns_and_traces_again(tmp_path, fixed_sources, caplog):
    model = make_llama(seed=0)
    want = _greedy(fresh_copy(model))
    _accelerated_run(fresh_copy(model), tmp_path)
    (path,) = _stored_files(tmp_path)
    path.write_bytes(b"not a pickle")
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        got, source = _accelerated_run(fresh_copy(model), tmp_path)
    assert source == "dynamo" and torch.equal(got, want)
    assert any("could not be used" in r.getMessage() for r in caplog.records)
    got, source = _accelerated_run(fresh_copy(model), tmp_path)  # rewritten by the trace above
    assert source == "stored" and torch.equal(got, want)


def test_no_trace_is_stored_without_a_compile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ACCEL_CACHE_DIR", str(tmp_path))
    model = make_llama(seed=0)
    want = _greedy(fresh_copy(model))
    accelerate_model(model, compile=True, num_kv_blocks=64, config=AccelConfig(compile_cache_dir=""))
    try:
        assert torch.equal(_greedy(model), want)
        assert engine_info(model)["startup"]["trace_source"] == "dynamo"
    finally:
        restore(model)
    assert not _stored_files(tmp_path)


def _patch_instance_forward(m):
    mlp = m.model.layers[0].mlp
    mlp.forward = lambda x: 2 * type(mlp).forward(mlp, x)


def _patch_class_method(m, monkeypatch):
    cls = type(m.model.layers[0].mlp)
    monkeypatch.setattr(cls, "forward", lambda self, x: 2 * self.down_proj(self.act_fn(self.up_proj(x))))


def _patch_module_function(m, monkeypatch):
    import transformers.models.llama.modeling_llama as modeling

    monkeypatch.setattr(modeling, "rotate_half", lambda x: -x)


def _set_object_attribute(m):
    m.model.rotary_emb.config.rope_theta_hint = object()  # plain objects: their attributes
    m.model.layers[0].self_attn.helper = type("Helper", (), {})()
    m.model.layers[0].self_attn.helper.scale = 3.0


def _patch_torch_function(m, monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "silu", lambda x, inplace=False: x * torch.sigmoid(2 * x))


def _patch_class_constant(m, monkeypatch):
    monkeypatch.setattr(type(m.model.layers[0].mlp), "SCALE", -1.0, raising=False)


@pytest.mark.parametrize("change", [_patch_instance_forward, _patch_class_method, _patch_module_function,
                                    _patch_torch_function, _swap_class])
def test_code_from_outside_the_libraries_is_never_stored(change, monkeypatch):
    """A forward, method or helper the user (or a kernel library) patched in may read globals, defaults and
    closures of its own that the check cannot see (the hostile review found six such wrong answers): such a model
    is refused, i.e. traced every time."""
    changed = make_llama()
    if "monkeypatch" in change.__code__.co_varnames:
        change(changed, monkeypatch)
    else:
        change(changed)
    fingerprint, refusals = fingerprint_and_refusals(changed)
    assert refusals and "test_trace_cache" in " ".join(refusals)


@pytest.mark.parametrize("change", [_set_object_attribute, _patch_class_constant])
def test_fingerprint_sees_object_attributes_and_class_constants(change, monkeypatch):
    base = model_fingerprint(make_llama())
    changed = make_llama()
    if "monkeypatch" in change.__code__.co_varnames:
        change(changed, monkeypatch)
    else:
        change(changed)
    assert fingerprint_and_refusals(changed)[0] != base


def test_fingerprint_sees_numpy_scalars_and_refuses_user_objects_and_deep_values():
    import dataclasses

    import numpy as np

    @dataclasses.dataclass(slots=True)
    class Knob:
        scale: float

    def with_attr(value):
        m = make_llama()
        m.model.layers[0].mlp.knob = value
        return fingerprint_and_refusals(m)

    assert with_attr(Knob(1.0))[1]  # a class of the user's: its properties could read anything
    assert with_attr(np.float32(1.0))[0] != with_attr(np.float32(-1.0))[0]
    assert not with_attr(np.float32(1.0))[1]
    deep = 1.0
    for _ in range(10):
        deep = [deep]
    assert with_attr(deep)[1]  # too deep to describe: refused, not truncated
    assert with_attr(list(range(5000)))[1]  # too long to describe: refused


def test_fingerprint_ignores_hook_handle_ids():
    """Hook dictionaries are keyed by handle ids, which count up per process: they must not change it."""
    a, b = make_llama(), make_llama()
    torch.nn.Module().register_forward_hook(lambda *args: None)  # move the global handle counter on
    for m in (a, b):
        m.model.embed_tokens.register_forward_hook(print)  # (never called: a builtin stands for a library's hook)
    assert model_fingerprint(a) == model_fingerprint(b)


def test_fingerprint_ignores_kernel_machinery_that_fills_in_as_a_process_runs():
    """Our fused forwards close over the kernels module and Triton functions, whose caches fill as kernels compile
    (a cold start compiles some before the fingerprint, a warm one does not): such objects count by type only."""
    import types as pytypes

    import hf_accel.ops.fused as fused

    kernels = pytypes.ModuleType("kernels")  # stands for the Triton kernels module the real forward closes over
    forward = fused._norm_forward("llama", False, kernels)  # hf_accel's own fused norm forward
    a, b = make_llama(), make_llama()
    for m in (a, b):
        norm = m.model.norm
        norm.forward = pytypes.MethodType(forward, norm)
    before = model_fingerprint(a)
    kernels.rms_norm_cache = {"compiled": object()}  # the module's contents change as kernels compile
    assert model_fingerprint(b) == before


def test_unregistered_module_attribute_and_patched_torch_builtin_are_seen():
    """A torch module kept as a plain attribute (called instead of the registered one) has settings the
    description cannot reach: refused. A torch builtin rebound to another (`torch.rsqrt = torch.sqrt`) changes the
    fingerprint. (Both found by the second hostile review.)"""
    m = make_llama()
    object.__setattr__(m.model.layers[0].mlp, "act_fn", torch.nn.Hardtanh(-0.5, 0.5))
    assert fingerprint_and_refusals(m)[1]
    base = model_fingerprint(make_llama())
    rsqrt = torch.rsqrt
    torch.rsqrt = torch.sqrt
    try:
        assert fingerprint_and_refusals(make_llama())[0] != base
    finally:
        torch.rsqrt = rsqrt


def test_function_wrapped_as_a_module_is_described_not_refused():
    """transformers >= 5.2x with `kernels` (a dependency of transformers now) keeps helpers such as
    `apply_rotary_pos_emb` as parameterless modules in an attention module's `__dict__`. Such a module is described by
    its class's code (a change to it changes the fingerprint), not refused; given a setting of its own, it is."""

    def wrapper_class(scale: float) -> type:
        class Wrapper(torch.nn.Module):
            def forward(self, x):
                return x * scale

        # defined by a trusted library, as kernels' Func
        Wrapper.__module__ = Wrapper.forward.__module__ = "transformers.fake_hub_kernels"
        return Wrapper

    def with_wrapper(cls: type, **attrs) -> torch.nn.Module:
        m = make_llama()
        wrapper = cls()
        for key, value in attrs.items():
            setattr(wrapper, key, value)
        m.model.layers[0].self_attn.__dict__["_kernel_funcs"] = {"rotary": wrapper}
        return m

    first, refusals = fingerprint_and_refusals(with_wrapper(wrapper_class(2.0)))
    assert refusals == []
    assert first != model_fingerprint(make_llama())
    assert fingerprint_and_refusals(with_wrapper(wrapper_class(3.0)))[0] != first  # its forward's closure differs
    assert fingerprint_and_refusals(with_wrapper(wrapper_class(2.0), scale=1.0))[1]  # a setting of its own


def test_remote_code_helpers_beside_the_modeling_file_are_hashed(tmp_path, monkeypatch):
    """Remote code (`transformers_modules.*`) may keep helpers in other files of its folder: all are hashed."""
    import importlib

    package = tmp_path / "transformers_modules" / "tiny"
    package.mkdir(parents=True)
    (tmp_path / "transformers_modules" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "helper.py").write_text("def post(x):\n    return x * 1.0\n")
    (package / "modeling_tiny.py").write_text(
        "from transformers.models.llama.modeling_llama import LlamaMLP\n"
        "from . import helper\n\n\n"
        "class TinyMLP(LlamaMLP):\n"
        "    def forward(self, x):\n"
        "        return helper.post(super().forward(x))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    modeling = importlib.import_module("transformers_modules.tiny.modeling_tiny")

    def fingerprint() -> str:
        m = make_llama()
        m.model.layers[0].mlp.__class__ = modeling.TinyMLP
        return model_fingerprint(m)

    import hf_accel.compilation.trace_cache as trace_cache

    before = fingerprint()
    (package / "helper.py").write_text("def post(x):\n    return x * 25.0\n")
    monkeypatch.setattr(trace_cache, "_SOURCE_HASHES", {})  # a new process: nothing remembered
    assert fingerprint() != before


def test_fingerprint_sees_a_dict_of_functions_in_the_modeling_file(monkeypatch):
    """`ROPE_INIT_FUNCTIONS` (imported into the modeling file) maps rope types to functions a forward may call."""
    import transformers.models.llama.modeling_llama as modeling

    base = model_fingerprint(make_llama())
    table = getattr(modeling, "ROPE_INIT_FUNCTIONS", None)
    if not isinstance(table, dict) or "linear" not in table or "dynamic" not in table:
        pytest.skip("this transformers keeps no rope table in the modeling file")
    monkeypatch.setitem(table, "linear", table["dynamic"])  # a library function under another name
    assert model_fingerprint(make_llama()) != base
