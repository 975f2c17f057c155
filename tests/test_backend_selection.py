"""Backend selection and availability reasons (CPU, libraries faked), plus GPU parity of the FlashInfer and
flash-attn backends against the torch reference (bf16; `pytest -m gpu`, skipped without CUDA or the library)."""

from __future__ import annotations

import enum
import itertools
import sys
import types

import pytest
import torch

from hf_accel.attention import registry
from hf_accel.attention.autotune import autotune_backends, synthetic_step_metadata
from hf_accel.attention.backend import AttentionSpec
from hf_accel.attention.flash_attn_backend import FlashAttnBackend, detect_variant
from hf_accel.attention.flashinfer_backend import FlashInferBackend
from hf_accel.attention.torch_backend import TorchAttentionBackend

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)


# ---- fakes ---------------------------------------------------------------------------------------------------------


def fa4_varlen(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
               min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
               softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
               num_splits=1, pack_gqa=None, deterministic=False, return_lse=False):
    raise AssertionError("fake")


def fa2_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
               causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
               return_attn_probs=False, block_table=None):
    raise AssertionError("fake")


def fa2_varlen_without_paging(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                              softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    raise AssertionError("fake")


@pytest.fixture(autouse=True)
def _fresh_detection():
    detect_variant.cache_clear()
    yield
    detect_variant.cache_clear()


@pytest.fixture
def no_libs(monkeypatch):
    """flashinfer and every flash-attn variant absent, whatever is installed here."""
    for name in ("flashinfer", "flash_attn", "flash_attn.cute", "flash_attn_interface"):
        monkeypatch.setitem(sys.modules, name, None)


def fake_cuda(monkeypatch, capability=(9, 0)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def fake_flashinfer(monkeypatch, version="0.6.12"):
    module = types.ModuleType("flashinfer")
    module.__version__ = version
    monkeypatch.setitem(sys.modules, "flashinfer", module)


def fake_fa4(monkeypatch):
    package = types.ModuleType("flash_attn")
    package.__path__ = []  # a package, so flash_attn.cute resolves through sys.modules
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = fa4_varlen
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return package


def fake_fa2(monkeypatch, fn=fa2_varlen, package=None):
    module = package or types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = fn
    monkeypatch.setitem(sys.modules, "flash_attn", module)


# ---- names and the CPU choice --------------------------------------------------------------------------------------


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="unknown attention_backend"):
        registry.select_backend("vllm", SPEC, CPU)


def test_auto_on_cpu_picks_torch():
    assert registry.select_backend("auto", SPEC, CPU) is TorchAttentionBackend
    assert registry.auto_candidates(SPEC, CPU) == [TorchAttentionBackend]


@pytest.mark.parametrize("name", ["flashinfer", "flash_attn"])
def test_named_gpu_backend_on_cpu_raises_with_reasons(name):
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        registry.select_backend(name, SPEC, CPU)


def test_backend_modules_import_without_libraries(no_libs):
    reasons = registry.available_backends_for(SPEC, CPU)
    assert set(reasons) == set(registry.BACKEND_NAMES)
    assert reasons["torch"] is None
    assert "flashinfer is not installed" in reasons["flashinfer"]
    assert "no usable flash-attn variant" in reasons["flash_attn"]
    for variant in ("FA4", "FA3", "FA2"):
        assert variant in reasons["flash_attn"]


# ---- the import-free probe (what a remembered autotune answer is keyed by) -------------------------------------------


def _on_disk(tmp_path, monkeypatch, files: dict[str, str]) -> None:
    """Packages written under tmp_path and put on sys.path, with any cached copies of their names dropped."""
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flashinfer", "flash_attn", "flash_attn.cute", "flash_attn_interface"):
        monkeypatch.setitem(sys.modules, name, None)  # records the entry, so what the test imports is dropped after
        monkeypatch.delitem(sys.modules, name)


def test_module_present_never_imports(tmp_path, monkeypatch):
    boom = "raise RuntimeError('imported')\n"
    _on_disk(tmp_path, monkeypatch, {"flashinfer/__init__.py": boom, "flash_attn/cute/__init__.py": boom})
    assert registry.module_present("flashinfer")
    assert registry.module_present("flash_attn.cute")
    assert not registry.module_present("flash_attn")  # only a namespace (flash-attn-4 alone): not FA2
    assert not registry.module_present("flash_attn_interface")
    assert not registry.module_present("flashinfer.nope")
    assert "flashinfer" not in sys.modules and "flash_attn.cute" not in sys.modules
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # None in sys.modules: absent
    assert not registry.module_present("flash_attn_interface")


def test_probe_sees_installed_libraries_without_importing_them(tmp_path, monkeypatch):
    """A present-but-broken library passes the probe (no import) and fails the full check (the import)."""
    boom = "raise RuntimeError('broken install')\n"
    _on_disk(tmp_path, monkeypatch, {"flashinfer/__init__.py": boom, "flash_attn/cute/__init__.py": boom})
    fake_cuda(monkeypatch)
    assert FlashInferBackend.probe_reasons(SPEC, CUDA) == []
    assert FlashAttnBackend.probe_reasons(SPEC, CUDA) == []
    assert {"flashinfer", "flash_attn"} <= set(registry.probable_auto_names(SPEC, CUDA))
    assert "flashinfer" not in sys.modules and "flash_attn.cute" not in sys.modules
    assert "installed but failed to import (RuntimeError: broken install)" in "; ".join(
        FlashInferBackend.unavailable_reasons(SPEC, CUDA))
    assert "flash_attn.cute is installed but failed to import (RuntimeError: broken install)" in "; ".join(
        FlashAttnBackend.unavailable_reasons(SPEC, CUDA))
    assert [c.name for c in registry.auto_candidates(SPEC, CUDA)][:1] != ["flashinfer"]


def test_a_missing_dependency_is_not_a_missing_library(tmp_path, monkeypatch):
    """flashinfer present but one of its own imports absent (as when a CuTe DSL wheel is half installed)."""
    missing = "import hf_accel_no_such_dependency  # noqa\n"
    _on_disk(tmp_path, monkeypatch, {"flashinfer/__init__.py": missing, "flash_attn/cute/__init__.py": missing})
    fake_cuda(monkeypatch)
    fi = "; ".join(FlashInferBackend.unavailable_reasons(SPEC, CUDA))
    assert "flashinfer is installed but failed to import" in fi and "hf_accel_no_such_dependency" in fi
    fa = "; ".join(FlashAttnBackend.unavailable_reasons(SPEC, CUDA))
    assert "flash_attn.cute is installed but failed to import" in fa
    assert "flash_attn_interface not installed" in fa and "flash_attn not installed" in fa


def test_an_imported_namespace_is_still_not_a_module(tmp_path, monkeypatch):
    _on_disk(tmp_path, monkeypatch, {"flash_attn/cute/__init__.py": "X = 1\n"})
    import flash_attn.cute  # noqa: F401  (leaves the bare flash_attn namespace in sys.modules)

    assert "flash_attn" in sys.modules
    assert not registry.module_present("flash_attn") and registry.module_present("flash_attn.cute")


def test_module_present_asks_meta_path_finders(monkeypatch):
    """Editable installs and build-backend finders serve modules the path finder does not see."""
    import importlib.machinery
    import importlib.util

    class Finder:
        @staticmethod
        def find_spec(fullname, path=None, target=None):
            if fullname == "hf_accel_meta_only":
                return importlib.util.spec_from_loader(fullname, loader=None, origin="meta://hf_accel_meta_only")
            return None

    assert not registry.module_present("hf_accel_meta_only")
    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    assert registry.module_present("hf_accel_meta_only")


def test_probe_keeps_the_class_limits(tmp_path, monkeypatch, no_libs):
    fake_cuda(monkeypatch, capability=(7, 5))
    assert "not installed" in "; ".join(FlashInferBackend.probe_reasons(SPEC, CUDA))
    assert "no flash-attn variant" in "; ".join(FlashAttnBackend.probe_reasons(SPEC, CUDA))
    fake_flashinfer(monkeypatch)
    fake_fa4(monkeypatch)
    assert "sm80+" in "; ".join(FlashInferBackend.probe_reasons(SPEC, CUDA))  # Turing: too old for either
    assert "no flash-attn variant" in "; ".join(FlashAttnBackend.probe_reasons(SPEC, CUDA))
    odd = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=80, dtype=torch.bfloat16)
    fake_cuda(monkeypatch, capability=(9, 0))
    assert "head_dim 80" in "; ".join(FlashInferBackend.probe_reasons(odd, CUDA))
    assert FlashAttnBackend.probe_reasons(odd, CUDA) == []  # FA4 takes head dim 80 on Hopper
    assert registry.probable_auto_names(SPEC, CPU) == ["torch"]


# ---- flashinfer --------------------------------------------------------------------------------------------------


def test_flashinfer_absent_is_a_reason(monkeypatch, no_libs):
    fake_cuda(monkeypatch)
    with pytest.raises(ValueError, match="flashinfer is not installed"):
        registry.select_backend("flashinfer", SPEC, CUDA)


def test_flashinfer_present_is_the_auto_choice(monkeypatch, no_libs):
    fake_cuda(monkeypatch)
    fake_flashinfer(monkeypatch)
    assert FlashInferBackend.unavailable_reasons(SPEC, CUDA) == []
    assert registry.select_backend("auto", SPEC, CUDA) is FlashInferBackend
    assert registry.select_backend("flashinfer", SPEC, CUDA) is FlashInferBackend
    assert registry.auto_candidates(SPEC, CUDA)[0] is FlashInferBackend
    assert FlashInferBackend.supported_block_sizes[0] == 16


def test_flashinfer_head_dim_80_excluded(monkeypatch, no_libs):
    fake_cuda(monkeypatch)
    fake_flashinfer(monkeypatch)
    spec = AttentionSpec(num_heads=32, num_kv_heads=32, head_dim=80, dtype=torch.float16)
    assert any("head_dim 80" in r for r in FlashInferBackend.unavailable_reasons(spec, CUDA))
    with pytest.raises(ValueError, match="head_dim 80"):
        registry.select_backend("flashinfer", spec, CUDA)
    assert registry.select_backend("auto", spec, CUDA) is not FlashInferBackend
    assert FlashInferBackend not in registry.auto_candidates(spec, CUDA)


@pytest.mark.parametrize(
    "spec_kwargs, version, capability, expected",
    [
        ({"dtype": torch.float32}, "0.6.12", (9, 0), "dtype"),
        ({}, "0.5.3", (9, 0), "too old"),
        ({}, "0.6.12", (7, 5), "sm80+"),
    ],
)
def test_flashinfer_reasons(monkeypatch, no_libs, spec_kwargs, version, capability, expected):
    fake_cuda(monkeypatch, capability)
    fake_flashinfer(monkeypatch, version)
    spec = AttentionSpec(**{**dict(num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16), **spec_kwargs})
    reasons = FlashInferBackend.unavailable_reasons(spec, CUDA)
    assert any(expected in r for r in reasons), reasons


# ---- flash-attn variants -----------------------------------------------------------------------------------------


def test_fa2_forces_block_size_256(monkeypatch, no_libs):
    fake_cuda(monkeypatch, (8, 0))
    fake_fa2(monkeypatch)
    assert FlashAttnBackend.variant(CUDA).name == "FA2"
    assert FlashAttnBackend.supported_block_sizes == (256,)
    assert FlashAttnBackend.unavailable_reasons(SPEC, CUDA) == []
    assert registry.select_backend("auto", SPEC, CUDA) is FlashAttnBackend


def test_fa4_is_preferred_over_fa2(monkeypatch, no_libs):
    fake_cuda(monkeypatch, (9, 0))
    fake_fa2(monkeypatch, package=fake_fa4(monkeypatch))
    assert FlashAttnBackend.variant(CUDA).name == "FA4"
    assert FlashAttnBackend.supported_block_sizes[0] == 128
    assert FlashAttnBackend.unavailable_reasons(SPEC, CUDA) == []


def test_fa4_on_ampere_falls_back_to_fa2(monkeypatch, no_libs):
    fake_cuda(monkeypatch, (8, 0))
    fake_fa2(monkeypatch, package=fake_fa4(monkeypatch))
    variant, notes = detect_variant((8, 0))
    assert variant.name == "FA2"
    assert any(note.startswith("FA4: installed") for note in notes)
    assert FlashAttnBackend.supported_block_sizes == (256,)


def test_fa4_alone_on_ampere_is_a_gpu_arch_reason(monkeypatch, no_libs):
    fake_cuda(monkeypatch, (8, 6))
    fake_fa4(monkeypatch)
    reasons = FlashAttnBackend.unavailable_reasons(SPEC, CUDA)
    assert any("sm86" in r and "sm9x" in r for r in reasons), reasons


def test_fa2_without_paging_is_too_old(monkeypatch, no_libs):
    fake_cuda(monkeypatch, (8, 0))
    fake_fa2(monkeypatch, fn=fa2_varlen_without_paging)
    reasons = FlashAttnBackend.unavailable_reasons(SPEC, CUDA)
    assert any("block_table" in r for r in reasons), reasons


@pytest.mark.parametrize("head_dim, capability, ok", [(80, (9, 0), True), (192, (10, 0), False), (512, (9, 0), False)])
def test_fa4_head_dims(monkeypatch, no_libs, head_dim, capability, ok):
    fake_cuda(monkeypatch, capability)
    fake_fa4(monkeypatch)
    spec = AttentionSpec(num_heads=8, num_kv_heads=8, head_dim=head_dim, dtype=torch.float16)
    reasons = FlashAttnBackend.unavailable_reasons(spec, CUDA)
    assert (reasons == []) is ok, reasons


def test_flash_attn_is_second_in_auto_order(monkeypatch, no_libs):
    fake_cuda(monkeypatch)
    fake_fa4(monkeypatch)
    assert registry.select_backend("auto", SPEC, CUDA) is FlashAttnBackend
    fake_flashinfer(monkeypatch)
    assert registry.auto_candidates(SPEC, CUDA)[:2] == [FlashInferBackend, FlashAttnBackend]


# ---- autotune ----------------------------------------------------------------------------------------------------


def test_autotune_on_cpu_returns_sole_candidate():
    chosen, timings = autotune_backends([TorchAttentionBackend], SPEC, CPU, 16)
    assert chosen is TorchAttentionBackend
    assert timings == {}


class _CompiledStandIn(TorchAttentionBackend):
    name = "compiled_stand_in"


class _BrokenStandIn(TorchAttentionBackend):
    name = "broken_stand_in"


@pytest.mark.parametrize("first", [_CompiledStandIn, _BrokenStandIn])
def test_autotune_times_the_reference_backend_only_when_nothing_else_ran(monkeypatch, first):
    """The torch reference backend never won a timing on a GPU (20x slower, no CUDA graphs): it is timed, and can
    be chosen, only when no other candidate could be timed. Timing itself is faked (no GPU here)."""
    import hf_accel.attention.autotune as at

    timed: list[str] = []

    def fake_time(cls, *args, **kwargs):
        timed.append(cls.name)
        if cls is _BrokenStandIn:
            raise RuntimeError("kernel failed to build")
        ms = 1.0 if cls is _CompiledStandIn else 20.0
        return {"decode_ms": ms, "prefill_ms": ms, "block_size": 16.0, "first_call_s": 0.1}

    monkeypatch.setattr(at, "_time_candidate", fake_time)
    # the reference first in the list: still timed last, as a fallback
    chosen, timings = autotune_backends([TorchAttentionBackend, first], SPEC, CUDA, 16)
    if first is _CompiledStandIn:
        assert chosen is _CompiledStandIn and timed == ["compiled_stand_in"]
        assert "skipped" in timings["torch"] and "score" in timings["compiled_stand_in"]
    else:
        assert chosen is TorchAttentionBackend and timed == ["broken_stand_in", "torch"]
        assert "error" in timings["broken_stand_in"] and "score" in timings["torch"]


def test_a_sole_contender_is_run_with_the_fewest_samples_not_the_budget(monkeypatch):
    """One candidate besides the reference: nothing to choose between, so it runs (validation, the record) without a
    time budget; two contenders share the budget as before."""
    import hf_accel.attention.autotune as at

    budgets: dict[str, float] = {}

    def fake_time(cls, *args, budget_s, **kwargs):
        budgets[cls.name] = budget_s
        return {"decode_ms": 1.0, "prefill_ms": 1.0, "block_size": 16.0, "first_call_s": 0.1}

    monkeypatch.setattr(at, "_time_candidate", fake_time)
    chosen, timings = autotune_backends([_CompiledStandIn, TorchAttentionBackend], SPEC, CUDA, 16, time_budget_s=2.0)
    assert chosen is _CompiledStandIn and budgets == {"compiled_stand_in": 0.0} and "skipped" in timings["torch"]
    budgets.clear()

    class _Other(TorchAttentionBackend):
        name = "other_stand_in"

    autotune_backends([_CompiledStandIn, _Other, TorchAttentionBackend], SPEC, CUDA, 16, time_budget_s=3.0)
    assert budgets == {"compiled_stand_in": 1.0, "other_stand_in": 1.0}


def test_synthetic_metadata_pads_like_the_runner():
    meta, num_blocks = synthetic_step_metadata([(5, 1), (20, 1)], 16, CPU, pad_rows_to=4)
    assert meta.num_seqs == 2 and meta.num_tokens == 2
    assert meta.slot_mapping.tolist()[2:] == [-1, -1]
    assert meta.seq_lens.tolist() == [6, 21, 0, 0]
    assert meta.block_tables[2:].abs().sum() == 0
    assert num_blocks == 1 + 1 + 2
    assert 0 not in meta.block_tables[:2, :1].tolist()


# ---- host-side logic on CPU, through fakes that compute what the real kernels document ----------------------------

CPU_SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
CPU_SCENARIOS = {
    "decode": ([(0, 1), (5, 1), (17, 1), (40, 1), (300, 1)], None),
    "prefill_with_prefix": ([(0, 7), (20, 13), (33, 16)], None),
    "mixed": ([(45, 1), (0, 9), (16, 17), (3, 1)], None),
    "graph_padded_decode": ([(3, 1), (40, 1), (129, 1)], 6),
}
LAYER_PARAMS = [(0, 0.0), (5, 0.0), (0, 2.0), (5, 2.0)]  # (sliding_window, softcap)


def paged_reference(q, k_cache, v_cache, q_bounds, kv_pages, kv_lens, scale, window_left, softcap):
    """Causal attention with the query block aligned to the end of each sequence's KV (the kernels' convention);
    window_left: a query at position p sees keys at positions >= p - window_left (-1: all)."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for (start, end), pages, kv_len in zip(q_bounds, kv_pages, kv_lens, strict=True):
        k = k_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)
        v = v_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(end - start)[:, None] + kv_len - (end - start)
        k_pos = torch.arange(kv_len)[None, :]
        mask = k_pos <= q_pos
        if window_left >= 0:
            mask &= q_pos - k_pos <= window_left
        out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~mask, float("-inf")), -1), v)
    return out


class _FakeFlashInferWrapper:
    """Keeps what plan() got (or, in CUDA-graph mode, copies it into the caller's buffers, read back by run())."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        assert kv_layout == "NHD"
        self.use_cuda_graph = use_cuda_graph
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.int_workspace = None

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer):
        self.int_workspace = int_workspace_buffer

    def _keep(self, qo_indptr, indptr, indices, last_page_len, page_size, window_left, logits_soft_cap, sm_scale):
        if self.use_cuda_graph:
            indptr_buf, indices_buf, last_buf = self.buffers
            assert len(last_page_len) == len(last_buf), "batch size must match the graph wrapper's"
            indptr_buf.copy_(indptr)
            indices_buf[: len(indices)].copy_(indices)
            last_buf.copy_(last_page_len)
            indptr, indices, last_page_len = self.buffers
        self.plan_args = (qo_indptr, indptr, indices, last_page_len, page_size, window_left,
                          logits_soft_cap or 0.0, sm_scale)

    def run(self, q, paged_kv_cache, *args, out=None, **kwargs):
        qo_indptr, indptr, indices, last_page_len, page_size, window_left, softcap, scale = self.plan_args
        batch = len(last_page_len)
        qo = qo_indptr.tolist() if qo_indptr is not None else list(range(batch + 1))
        assert q.shape[0] == qo[-1] and out.shape == q.shape
        ptr = indptr.tolist()
        pages = [indices[ptr[i] : ptr[i + 1]].long() for i in range(batch)]
        kv_lens = [(len(p) - 1) * page_size + int(last_page_len[i]) for i, p in enumerate(pages)]
        k_cache, v_cache = paged_kv_cache
        out.copy_(paged_reference(q, k_cache, v_cache, list(itertools.pairwise(qo)), pages, kv_lens, scale,
                                  window_left, softcap))
        return out


class FakeDecodeWrapper(_FakeFlashInferWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False):
        self._keep(None, indptr, indices, last_page_len, page_size, window_left, logits_soft_cap, sm_scale)


class FakePrefillWrapper(_FakeFlashInferWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True):
        assert causal
        self._keep(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size, window_left,
                   logits_soft_cap, sm_scale)


def fa_reference(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, page_table, scale, window_size, softcap, causal):
    assert causal and window_size[1] in (0, -1, None)
    page_size = k_cache.shape[1]
    cu = cu_seqlens_q.tolist()
    kv_lens = seqlens_k.tolist()
    pages = [page_table[i, : -(-n // page_size)].long() for i, n in enumerate(kv_lens)]
    window_left = -1 if window_size[0] is None else window_size[0]
    return paged_reference(q, k_cache, v_cache, list(itertools.pairwise(cu)), pages, kv_lens, scale, window_left,
                           softcap)


def fake_fa4_semantics(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None,
                       page_table=None, softmax_scale=None, causal=False, window_size=(None, None),
                       learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
                       return_lse=False):
    assert q.shape[0] == cu_seqlens_q[-1] and page_table.dtype == torch.int32
    return fa_reference(q, k, v, cu_seqlens_q, seqused_k, page_table, softmax_scale, window_size, softcap,
                        causal), None


def fake_fa2_semantics(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                       softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                       deterministic=False, return_attn_probs=False, block_table=None):
    assert k.shape[1] % 256 == 0
    lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    assert int(lens.max()) <= max_seqlen_k
    return fa_reference(q, k, v, cu_seqlens_q, lens, block_table, softmax_scale, window_size, softcap, causal)


def fake_fa3_semantics(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                       cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                       cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                       q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                       window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                       scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0, return_softmax_lse=False):
    return fa_reference(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, page_table, softmax_scale, window_size,
                        softcap, causal)


def install_flash_attn_variant(monkeypatch, variant):
    if variant == "FA4":
        fake_fa4(monkeypatch).__dict__.clear()
        sys.modules["flash_attn.cute"].flash_attn_varlen_func = fake_fa4_semantics
        sys.modules["flash_attn"].__path__ = []
    elif variant == "FA3":
        monkeypatch.setitem(sys.modules, "flash_attn_interface", types.ModuleType("flash_attn_interface"))
        sys.modules["flash_attn_interface"].flash_attn_with_kvcache = fake_fa3_semantics
    else:
        fake_fa2(monkeypatch, fn=fake_fa2_semantics)


@pytest.fixture
def cpu_flashinfer(monkeypatch, no_libs):
    from hf_accel.attention import flashinfer_backend

    fake_flashinfer(monkeypatch)
    sys.modules["flashinfer"].BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    sys.modules["flashinfer"].BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    monkeypatch.setattr(flashinfer_backend, "FLOAT_WORKSPACE_BYTES", 64)
    monkeypatch.setattr(flashinfer_backend, "INT_WORKSPACE_BYTES", 64)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def _run_layers(backend, seqs, pad_rows_to, block_size, graph_sizes=()):
    """One step through `backend` and the torch reference for every LAYER_PARAMS combination, twice (the second
    step re-plans in prepare() what the first planned lazily)."""
    torch.manual_seed(0)
    meta, num_blocks = synthetic_step_metadata(seqs, block_size, CPU, pad_rows_to=pad_rows_to,
                                               generator=torch.Generator().manual_seed(0))
    shape = (num_blocks, block_size, CPU_SPEC.num_kv_heads, CPU_SPEC.head_dim)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    query = torch.randn(meta.slot_mapping.shape[0], CPU_SPEC.num_heads, CPU_SPEC.head_dim)
    reference = TorchAttentionBackend(CPU_SPEC, CPU, block_size, meta.num_seqs, meta.num_tokens,
                                      meta.block_tables.shape[1])
    reference.prepare(meta)
    scale = CPU_SPEC.head_dim**-0.5
    for _ in range(2):
        backend.prepare(meta)
        for window, softcap in LAYER_PARAMS:
            out, expected = torch.zeros_like(query), torch.zeros_like(query)
            backend.forward(query, k_cache, v_cache, meta, out, scale, window, softcap)
            reference.forward(query, k_cache, v_cache, meta, expected, scale, window, softcap)
            torch.testing.assert_close(out[: meta.num_tokens], expected[: meta.num_tokens], atol=1e-4, rtol=1e-4)
    return meta


@pytest.mark.parametrize("scenario", list(CPU_SCENARIOS))
def test_flashinfer_plans_match_reference(cpu_flashinfer, scenario):
    seqs, pad_rows_to = CPU_SCENARIOS[scenario]
    backend = FlashInferBackend(CPU_SPEC, CPU, 16, max_num_seqs=8, max_num_tokens=64, max_blocks_per_seq=32)
    if pad_rows_to:
        backend.set_cudagraph_batch_sizes([pad_rows_to, 8])
    _run_layers(backend, seqs, pad_rows_to, 16)
    wrappers = set(map(id, backend._planned.values()))
    assert len(wrappers) == len(LAYER_PARAMS)  # one plan per (window, softcap, scale), not per layer
    kinds = {type(w).__name__ for w in backend._planned.values()}
    assert kinds == {"FakePrefillWrapper" if scenario in ("prefill_with_prefix", "mixed") else "FakeDecodeWrapper"}
    assert all(w.use_cuda_graph == (pad_rows_to is not None) for w in backend._planned.values())
    if pad_rows_to:  # padded rows: one page, the null block, one token
        n = len(seqs)
        assert backend._graph_kv_last_page_len[n:pad_rows_to].tolist() == [1] * (pad_rows_to - n)
        indptr = backend._graph_kv_indptr[: pad_rows_to + 1].tolist()
        assert backend._graph_kv_indices[indptr[n] : indptr[-1]].tolist() == [0] * (pad_rows_to - n)
        assert backend.get_decode_wrapper_for(pad_rows_to) is backend._planned[(-1, 0.0, CPU_SPEC.head_dim**-0.5)]


def test_flashinfer_graph_capture_needs_declared_size(cpu_flashinfer, monkeypatch):
    backend = FlashInferBackend(CPU_SPEC, CPU, 16, max_num_seqs=8, max_num_tokens=64, max_blocks_per_seq=32)
    meta, num_blocks = synthetic_step_metadata([(3, 1), (9, 1)], 16, CPU, pad_rows_to=4)
    shape = (num_blocks, 16, CPU_SPEC.num_kv_heads, CPU_SPEC.head_dim)
    query = torch.randn(4, CPU_SPEC.num_heads, CPU_SPEC.head_dim)
    backend.prepare(meta)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="set_cudagraph_batch_sizes"):
        backend.forward(query, torch.zeros(shape), torch.zeros(shape), meta, torch.empty_like(query), 0.25, 0, 0.0)


@pytest.mark.parametrize("variant, block_size", [("FA4", 128), ("FA3", 16), ("FA2", 256)])
@pytest.mark.parametrize("scenario", list(CPU_SCENARIOS))
def test_flash_attn_variants_match_reference(monkeypatch, no_libs, variant, block_size, scenario):
    install_flash_attn_variant(monkeypatch, variant)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert FlashAttnBackend.variant(CPU).name == variant
    assert FlashAttnBackend.supported_block_sizes[0] == block_size
    seqs, pad_rows_to = CPU_SCENARIOS[scenario]
    backend = FlashAttnBackend(CPU_SPEC, CPU, block_size, max_num_seqs=4, max_num_tokens=64, max_blocks_per_seq=32)
    assert backend.supported_block_sizes[0] == block_size
    if pad_rows_to:
        backend.set_cudagraph_batch_sizes([2, pad_rows_to])
        assert backend._capacity == pad_rows_to
    meta = _run_layers(backend, seqs, pad_rows_to, block_size)
    if pad_rows_to:  # padded rows read one token of the null block
        n = len(seqs)
        assert backend._seqused_k[n:pad_rows_to].tolist() == [1] * (pad_rows_to - n)
        assert backend._page_table[n:pad_rows_to].abs().sum() == 0
        assert backend._capacity >= meta.seq_lens.shape[0]


# ---- GPU parity against the torch reference ----------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU_SPECS = {
    "gqa4-d128": AttentionSpec(num_heads=16, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16),
    "gqa8-d256": AttentionSpec(num_heads=16, num_kv_heads=2, head_dim=256, dtype=torch.bfloat16),
}
SCENARIOS = {
    "decode": ([(0, 1), (5, 1), (17, 1), (100, 1), (333, 1), (1000, 1)], None),
    "prefill_with_prefix": ([(0, 37), (48, 20), (130, 64)], None),
    "mixed": ([(200, 1), (0, 50), (64, 33), (10, 1)], None),
    "graph_padded_decode": ([(3, 1), (40, 1), (129, 1), (7, 1), (260, 1)], 8),
}


def _backend_class(name: str):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if name == "flashinfer":
        pytest.importorskip("flashinfer")
    cls, err = registry.load_backend_class(name)
    assert cls is not None, err
    reasons = cls.unavailable_reasons(None, CUDA)
    if reasons:
        pytest.skip("; ".join(reasons))
    return cls


def _make_backend(cls, spec, block_size, rows, max_blocks, graph_sizes=()):
    backend = cls(spec, CUDA, block_size, max_num_seqs=rows, max_num_tokens=4096, max_blocks_per_seq=max_blocks)
    if graph_sizes and hasattr(backend, "set_cudagraph_batch_sizes"):
        backend.set_cudagraph_batch_sizes(list(graph_sizes))
    return backend


def _case(spec, seqs, block_size, pad_rows_to=None, seed=0):
    meta, num_blocks = synthetic_step_metadata(seqs, block_size, CUDA, pad_rows_to=pad_rows_to,
                                               generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    k_cache = torch.randn(shape, device=CUDA, dtype=spec.dtype, generator=gen)
    v_cache = torch.randn(shape, device=CUDA, dtype=spec.dtype, generator=gen)
    rows = meta.slot_mapping.shape[0]
    query = torch.randn(rows, spec.num_heads, spec.head_dim, device=CUDA, dtype=spec.dtype, generator=gen)
    return meta, query, k_cache, v_cache


def _reference(spec, meta, query, k_cache, v_cache, window, softcap):
    ref = TorchAttentionBackend(spec, CUDA, meta.block_size, meta.num_seqs, meta.num_tokens,
                                meta.block_tables.shape[1])
    out = torch.zeros_like(query)
    ref.prepare(meta)
    ref.forward(query, k_cache, v_cache, meta, out, spec.head_dim**-0.5, window, softcap)
    return out[: meta.num_tokens]


def _assert_close(actual, expected):
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("backend_name", ["flashinfer", "flash_attn"])
@pytest.mark.parametrize("spec_name", list(GPU_SPECS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_matches_torch(backend_name, spec_name, scenario):
    cls = _backend_class(backend_name)
    spec = GPU_SPECS[spec_name]
    seqs, pad_rows_to = SCENARIOS[scenario]
    block_size = cls.supported_block_sizes[0]
    meta, query, k_cache, v_cache = _case(spec, seqs, block_size, pad_rows_to)
    rows = meta.slot_mapping.shape[0]
    backend = _make_backend(cls, spec, block_size, rows, meta.block_tables.shape[1],
                            graph_sizes=[pad_rows_to] if pad_rows_to else ())
    out = torch.zeros_like(query)
    backend.prepare(meta)
    backend.forward(query, k_cache, v_cache, meta, out, spec.head_dim**-0.5, 0, 0.0)
    _assert_close(out[: meta.num_tokens], _reference(spec, meta, query, k_cache, v_cache, 0, 0.0))


@gpu
@needs_cuda
@pytest.mark.parametrize("backend_name", ["flashinfer", "flash_attn"])
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_window_and_softcap_layers_in_one_step(backend_name, scenario):
    """gemma2-like: sliding, softcapped and plain layers share one prepare(); each matches the reference."""
    cls = _backend_class(backend_name)
    spec = GPU_SPECS["gqa4-d128"]
    seqs, _ = SCENARIOS[scenario]
    block_size = cls.supported_block_sizes[0]
    meta, query, k_cache, v_cache = _case(spec, seqs, block_size, seed=1)
    backend = _make_backend(cls, spec, block_size, meta.num_seqs, meta.block_tables.shape[1])
    for _ in range(2):  # the second step re-plans every combination in prepare()
        backend.prepare(meta)
        for window, softcap in [(24, 0.0), (0, 30.0), (0, 0.0), (24, 30.0)]:
            out = torch.zeros_like(query)
            backend.forward(query, k_cache, v_cache, meta, out, spec.head_dim**-0.5, window, softcap)
            _assert_close(out[: meta.num_tokens], _reference(spec, meta, query, k_cache, v_cache, window, softcap))


@gpu
@needs_cuda
@pytest.mark.parametrize("backend_name", ["flashinfer", "flash_attn"])
def test_cuda_graph_decode_replays_new_metadata(backend_name):
    """Capture a padded decode batch once, replay it on other sequences: the plan/buffers follow prepare()."""
    cls = _backend_class(backend_name)
    spec = GPU_SPECS["gqa4-d128"]
    block_size = cls.supported_block_sizes[0]
    batch = 8
    first = _case(spec, [(3, 1), (40, 1), (129, 1), (7, 1), (260, 1)], block_size, pad_rows_to=batch, seed=2)
    second = _case(spec, [(300, 1), (1, 1), (77, 1), (500, 1), (16, 1), (2, 1), (999, 1)], block_size,
                   pad_rows_to=batch, seed=3)
    max_blocks = max(first[0].block_tables.shape[1], second[0].block_tables.shape[1])
    backend = _make_backend(cls, spec, block_size, batch, max_blocks, graph_sizes=[batch])
    num_blocks = max(first[2].shape[0], second[2].shape[0])
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    k_cache = torch.randn(shape, device=CUDA, dtype=spec.dtype)
    v_cache = torch.randn(shape, device=CUDA, dtype=spec.dtype)
    query = torch.zeros_like(first[1])
    out = torch.zeros_like(query)
    scale = spec.head_dim**-0.5

    meta = first[0]
    query.copy_(first[1])
    backend.prepare(meta)
    backend.forward(query, k_cache, v_cache, meta, out, scale, 0, 0.0)  # warm-up: plans, compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    backend.prepare(meta)
    with torch.cuda.graph(graph):
        backend.forward(query, k_cache, v_cache, meta, out, scale, 0, 0.0)

    for meta, q, _, _ in (first, second):
        query.copy_(q)
        backend.prepare(meta)
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out[: meta.num_tokens], _reference(spec, meta, query, k_cache, v_cache, 0, 0.0))


class _FailingBackend(TorchAttentionBackend):
    name = "failing"

    def forward(self, *args, **kwargs) -> None:
        raise RuntimeError("boom")


@gpu
@needs_cuda
def test_autotune_times_candidates_and_drops_failures():
    spec = GPU_SPECS["gqa4-d128"]
    candidates = [*registry.auto_candidates(spec, CUDA), _FailingBackend]
    chosen, timings = autotune_backends(candidates, spec, CUDA, 16, num_decode_seqs=8, decode_context=256,
                                        prefill_tokens=512, time_budget_s=1.0)
    assert chosen in candidates and chosen is not _FailingBackend
    assert "boom" in timings["failing"]["error"]
    for cls in candidates[:-1]:
        entry = timings[cls.name]
        if cls.name == "torch" and any("score" in timings[c.name] for c in candidates if c.name != "torch"):
            # the reference backend is timed only when nothing else ran
            assert "skipped" in entry
            continue
        assert "error" in entry or entry["decode_ms"] > 0 and entry["prefill_ms"] > 0
        assert "error" in entry or entry["seconds"] >= entry["first_call_s"] > 0
    assert "score" in timings[chosen.name]


# ---- "auto" at accelerate_model: autotune wiring (CPU, the timing faked) ---------------------------------------------
class _FakeConfig:
    num_hidden_layers = 7


class _FakeModel:
    config = _FakeConfig()


def _fake_choice(monkeypatch, outcome):
    from hf_accel import api
    from hf_accel.attention.triton_backend import TritonAttentionBackend

    calls = {}
    full_checks = []  # every check that imports the optional libraries

    def select_backend(name, spec, device):
        full_checks.append("select_backend")
        return FlashInferBackend

    def auto_candidates(spec, device):
        full_checks.append("auto_candidates")
        return [FlashInferBackend, TritonAttentionBackend]

    monkeypatch.setattr(api, "select_backend", select_backend)
    monkeypatch.setattr(api, "auto_candidates", auto_candidates)
    # the import-free probe and the winner's own check, as on a GPU with flashinfer installed
    monkeypatch.setattr(api, "probable_auto_names", lambda spec, device: ["flashinfer", "triton"])
    monkeypatch.setattr(api, "backend_reasons", lambda name, spec, device: [])
    # ... with flashinfer's kernels already built there (tests/test_startup_builds.py covers the unbuilt case)
    monkeypatch.setattr(FlashInferBackend, "pending_build", classmethod(lambda cls, spec, device, cache_dir=None: None))

    def fake_autotune(candidates, spec, device, block_size_hint, **kw):
        calls.update(kw, candidates=[c.name for c in candidates])
        if isinstance(outcome, Exception):
            raise outcome
        return TritonAttentionBackend, {"flashinfer": {"score": 2.0}, "triton": {"score": 1.0}}

    monkeypatch.setattr(api, "autotune_backends", fake_autotune)
    return api, calls, full_checks


def test_auto_on_cuda_keeps_the_autotuned_backend_and_remembers_it(monkeypatch, tmp_path):
    from hf_accel.config import AccelConfig

    api, calls, full_checks = _fake_choice(monkeypatch, None)
    cfg = AccelConfig(max_num_seqs=8, compile_cache_dir=str(tmp_path), cudagraph_mode="full_and_piecewise")
    cls, info = api._choose_backend(_FakeModel(), cfg, SPEC, CUDA)
    assert calls["decode_in_graph"] is True  # decode timed the way full graphs run it
    assert cls.name == "triton"
    assert info["chosen"] == "triton" and info["static_choice"] == "flashinfer" and info["cached"] is False
    assert info["timings"]["triton"]["score"] == 1.0 and info["seconds"] >= 0
    assert calls["num_layers"] == 7 and calls["num_decode_seqs"] == 8  # the model's own shape
    assert calls["candidates"] == ["flashinfer", "triton"]
    assert len(list((tmp_path / "autotune").glob("*.json"))) == 1

    full_checks.clear()
    calls.clear()  # a second start: the remembered choice, no timing, and no full check of the other candidates
    cls, info = api._choose_backend(_FakeModel(), cfg, SPEC, CUDA)
    assert cls.name == "triton" and info["cached"] is True and not calls and not full_checks
    assert info["timings"]["triton"]["score"] == 1.0 and info["static_choice"] == "flashinfer"

    monkeypatch.setattr(api, "backend_reasons", lambda name, spec, device: ["triton broke"])  # winner gone: re-time
    cls, info = api._choose_backend(_FakeModel(), cfg, SPEC, CUDA)
    assert info["cached"] is False and "num_decode_seqs" in calls
    monkeypatch.setattr(api, "backend_reasons", lambda name, spec, device: [])

    other = AccelConfig(max_num_seqs=16, compile_cache_dir=str(tmp_path))  # another shape: timed again
    api._choose_backend(_FakeModel(), other, SPEC, CUDA)
    assert calls["num_decode_seqs"] == 16

    calls.clear()  # no full graphs: decode timed eagerly, and not the remembered graph-timed answer
    eager = AccelConfig(max_num_seqs=8, compile_cache_dir=str(tmp_path), cudagraph_mode="piecewise")
    api._choose_backend(_FakeModel(), eager, SPEC, CUDA)
    assert calls["decode_in_graph"] is False

    for f in (tmp_path / "autotune").glob("*.json"):  # a torn or foreign file is ignored, not fatal
        f.write_text("[1, 2")
    calls.clear()
    cls, info = api._choose_backend(_FakeModel(), cfg, SPEC, CUDA)
    assert calls and info["cached"] is False

    calls.clear()  # compile_cache_dir="" turns remembering off
    api._choose_backend(_FakeModel(), AccelConfig(max_num_seqs=8, compile_cache_dir=""), SPEC, CUDA)
    assert calls


def test_a_repaired_install_is_timed_again(tmp_path, monkeypatch):
    """flashinfer on disk but failing to import: not timed, and remembered as unusable; once it imports, the
    remembered answer (whose key cannot see the repair) is set aside and the candidates are timed again."""
    import importlib

    from hf_accel import api
    from hf_accel.attention.triton_backend import TritonAttentionBackend
    from hf_accel.config import AccelConfig

    init = "import hf_accel_fi_dependency  # noqa\n__version__ = '0.6.12'\n"
    _on_disk(tmp_path / "site", monkeypatch, {"flashinfer/__init__.py": init})
    monkeypatch.setitem(sys.modules, "hf_accel_fi_dependency", None)
    monkeypatch.delitem(sys.modules, "hf_accel_fi_dependency")
    for name in ("flash_attn", "flash_attn.cute", "flash_attn_interface"):
        monkeypatch.setitem(sys.modules, name, None)
    fake_cuda(monkeypatch)
    timed = []

    def fake_autotune(candidates, spec, device, block_size_hint, **kw):
        timed.append([c.name for c in candidates])
        return TritonAttentionBackend, {c.name: {"score": 1.0} for c in candidates}

    monkeypatch.setattr(api, "autotune_backends", fake_autotune)
    # its kernels count as built (the unbuilt case: tests/test_startup_builds.py)
    monkeypatch.setattr(FlashInferBackend, "pending_build", classmethod(lambda cls, spec, device, cache_dir=None: None))
    cfg = AccelConfig(max_num_seqs=8, compile_cache_dir=str(tmp_path / "cache"))
    assert "flashinfer" in registry.probable_auto_names(SPEC, CUDA)
    _, info = api._choose_backend(_FakeModel(), cfg, SPEC, CUDA)
    assert "flashinfer" not in timed[-1] and info["cached"] is False
    _, info = api._choose_backend(_FakeModel(), cfg, SPEC, CUDA)
    assert info["cached"] is True and len(timed) == 1 and info["candidates"] == timed[0]

    (tmp_path / "site" / "hf_accel_fi_dependency.py").write_text("")  # the install is repaired
    importlib.invalidate_caches()
    _, info = api._choose_backend(_FakeModel(), cfg, SPEC, CUDA)
    assert info["cached"] is False and timed[-1][0] == "flashinfer"


def test_a_block_size_only_one_candidate_takes_picks_that_one(monkeypatch):
    from hf_accel.config import AccelConfig

    api, calls, _ = _fake_choice(monkeypatch, AssertionError("one candidate: nothing to time"))
    monkeypatch.setattr(api, "auto_candidates", lambda spec, device: [FlashInferBackend, TorchAttentionBackend])
    cls, info = api._choose_backend(_FakeModel(), AccelConfig(block_size=256, compile_cache_dir=""), SPEC, CUDA)
    assert cls is TorchAttentionBackend and info is None and "num_decode_seqs" not in calls


def test_autotune_failure_keeps_the_static_choice(monkeypatch):
    from hf_accel.config import AccelConfig

    api, _, _ = _fake_choice(monkeypatch, RuntimeError("no candidate could run"))
    cls, info = api._choose_backend(_FakeModel(), AccelConfig(compile_cache_dir=""), SPEC, CUDA)
    assert cls is FlashInferBackend and "no candidate" in info["error"]


@pytest.mark.parametrize("cfg_kw", [{"attention_backend": "flashinfer"}, {"autotune_attention": False}])
def test_named_backend_or_autotune_off_is_not_timed(monkeypatch, cfg_kw):
    from hf_accel.config import AccelConfig

    api, calls, _ = _fake_choice(monkeypatch, AssertionError("must not be called"))
    cls, info = api._choose_backend(_FakeModel(), AccelConfig(compile_cache_dir="", **cfg_kw), SPEC, CUDA)
    assert cls is FlashInferBackend and info is None and not calls
    cls, info = api._choose_backend(_FakeModel(), AccelConfig(), SPEC, CPU)  # off CUDA: never timed
    assert info is None


# ---- declarations ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", registry.BACKEND_NAMES)
def test_every_backend_declares_what_it_runs(name, no_libs):
    cls, err = registry.load_backend_class(name)
    assert cls is not None, err
    decl = cls.declaration()
    assert decl["kv_layout"] == "NHD" and decl["block_sizes"] and decl["dtypes"]
    assert decl["cudagraph_support"] in ("NEVER", "UNIFORM_DECODE", "ALWAYS")
    assert {"head_dims", "requires_cuda", "min_compute_capability", "softcap", "sliding_window"} <= set(decl)
    expected = {"torch": None, "triton": None, "flashinfer": "sm80", "flash_attn": "sm80"}[name]
    assert decl["min_compute_capability"] == expected


def test_min_compute_capability_is_a_reason_for_any_backend(monkeypatch):
    class PickyBackend(TorchAttentionBackend):
        name = "picky"
        min_compute_capability = (9, 0)

    fake_cuda(monkeypatch, capability=(8, 6))
    assert PickyBackend.unavailable_reasons(SPEC, CUDA) == ["picky needs an sm90+ GPU (this one is sm86)"]
    assert PickyBackend.unavailable_reasons(SPEC, CPU) == []  # a CPU run has no capability to check
    fake_cuda(monkeypatch, capability=(9, 0))
    assert PickyBackend.unavailable_reasons(SPEC, CUDA) == []


def test_engine_refuses_a_kv_layout_it_does_not_allocate():
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_accel.attention.backend import KVLayout
    from hf_accel.config import AccelConfig
    from hf_accel.engine.engine import LLMEngine

    class OtherLayout(str, enum.Enum):
        HND = "HND"

    class HNDBackend(TorchAttentionBackend):
        name = "hnd"
        kv_layout = OtherLayout.HND  # type: ignore[assignment]

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    cfg = AccelConfig(num_kv_blocks=8, max_num_seqs=2, max_num_batched_tokens=64, compile_cache_dir="").resolve_for(CPU)
    with pytest.raises(NotImplementedError, match="reads a HND KV cache"):
        LLMEngine(model, cfg, HNDBackend, spec)
    assert TorchAttentionBackend.kv_layout is KVLayout.NHD

    class PlainStringNHD(TorchAttentionBackend):
        name = "plain"
        kv_layout = "NHD"  # type: ignore[assignment]  (a plugin that wrote the plain string)

    assert LLMEngine(model, cfg, PlainStringNHD, spec).block_size == 16
