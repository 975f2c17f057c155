"""The compilation layer: piecewise split + compile, Dynamo bypass, dispatcher, compile cache, CUDA graphs (GPU).

CPU tests use tiny random Llama/Qwen3 models in float32 with the torch attention backend over a paged KV cache and a
hand-built StepMetadata, and compare the compiled forward to the uncompiled one. The split and the Dynamo behaviour
are checked with the "eager" piece compiler (fast); one test runs Inductor for real (the slow one, ~1 min cold).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import make_llama
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import hf_accel.compilation.cache as cache_mod
from hf_accel.attention.backend import AttentionBackend, AttentionSpec, CUDAGraphSupport
from hf_accel.attention.context import ForwardContext, forward_context
from hf_accel.attention.metadata import StepMetadata
from hf_accel.attention.op import ATTN_IMPLEMENTATION_NAME, hf_accel_attention_forward
from hf_accel.attention.torch_backend import TorchAttentionBackend
from hf_accel.compilation.cache import (
    INDUCTOR_SUBDIR,
    KEY_FILE,
    compile_cache_key,
    setup_compile_cache,
)
from hf_accel.compilation.cuda_graph import FullCUDAGraphRunner, pad_to_capture_size, weak_ref_tensor
from hf_accel.compilation.dispatcher import (
    BatchKey,
    CUDAGraphDispatcher,
    RuntimeMode,
    resolve_cudagraph_mode,
)
from hf_accel.compilation.piecewise import PiecewiseForward, compile_piecewise, graph_signature
from hf_accel.config import CUDAGraphMode, default_capture_sizes, thinned_capture_sizes

AttentionInterface.register(ATTN_IMPLEMENTATION_NAME, hf_accel_attention_forward)

BLOCK = 16
BLOCKS_PER_SEQ = 8
COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=256)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_model(family: str, num_layers: int = 3, device: str = "cpu", dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=num_layers, **COMMON))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=num_layers, head_dim=16, **COMMON))
    model.config._attn_implementation = ATTN_IMPLEMENTATION_NAME
    return model.eval().to(device=device, dtype=dtype)


def forward_fn_of(model):
    def forward_fn(input_ids, position_ids, logits_indices):
        return model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=logits_indices,
                     use_cache=False).logits

    return forward_fn


class PagedSteps:
    """A runner in miniature: persistent input/metadata buffers, paged KV caches, one ForwardContext per step.

    Sequence i owns blocks 1 + i * BLOCKS_PER_SEQ ...; cache contents start random, so steps with context read
    (arbitrary but fixed) earlier K/V, identically for the eager and the compiled forward.
    """

    def __init__(self, model, backend_cls: type[AttentionBackend] = TorchAttentionBackend, max_tokens: int = 64,
                 max_seqs: int = 8) -> None:
        cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        spec = AttentionSpec(cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, self.dtype)
        self.backend = backend_cls(spec, self.device, BLOCK, max_seqs, max_tokens, BLOCKS_PER_SEQ)
        gen = torch.Generator().manual_seed(1)
        num_blocks = 1 + max_seqs * BLOCKS_PER_SEQ
        shape = (num_blocks, BLOCK, cfg.num_key_value_heads, head_dim)
        self.kv_caches = [(torch.randn(shape, generator=gen).to(self.device, self.dtype),
                           torch.randn(shape, generator=gen).to(self.device, self.dtype))
                          for _ in range(cfg.num_hidden_layers)]
        dev, i32, i64 = self.device, torch.int32, torch.int64
        self.input_ids = torch.zeros(1, max_tokens, dtype=i64, device=dev)
        self.positions = torch.zeros(1, max_tokens, dtype=i64, device=dev)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=i64, device=dev)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=i32, device=dev)
        self.seq_lens = torch.zeros(max_seqs, dtype=i32, device=dev)
        self.context_lens = torch.zeros(max_seqs, dtype=i32, device=dev)
        self.block_tables = torch.zeros(max_seqs, BLOCKS_PER_SEQ, dtype=i32, device=dev)
        self.logits_indices = torch.zeros(max_seqs, dtype=i64, device=dev)
        self.vocab = cfg.vocab_size

    def step(self, query_lens: list[int], context_lens: list[int] | None = None, pad_tokens_to: int | None = None,
             pad_seqs_to: int | None = None, seed: int = 0):
        """Fill the buffers for one step; returns (forward args as buffer views, ForwardContext)."""
        context_lens = context_lens or [0] * len(query_lens)
        b, t = len(query_lens), sum(query_lens)
        tp, bp = pad_tokens_to or t, pad_seqs_to or b
        gen = torch.Generator().manual_seed(seed)
        seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
        tables = torch.zeros(bp, BLOCKS_PER_SEQ, dtype=torch.int32)
        positions, slots = [], []
        for i in range(b):
            tables[i] = torch.arange(1 + i * BLOCKS_PER_SEQ, 1 + (i + 1) * BLOCKS_PER_SEQ)
            for p in range(context_lens[i], seq_lens[i]):
                positions.append(p)
                slots.append(int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        qsl += [min(t + 1 + j, tp) for j in range(bp - b)]  # padded rows: one (padding) token each
        dev = self.device
        self.input_ids[0, :tp] = 0
        self.input_ids[0, :t] = torch.randint(0, self.vocab, (t,), generator=gen).to(dev)
        self.positions[0, :tp] = 0
        self.positions[0, :t] = torch.tensor(positions).to(dev)
        self.slot_mapping[:tp] = -1
        self.slot_mapping[:t] = torch.tensor(slots).to(dev)
        self.query_start_loc[: bp + 1] = torch.tensor(qsl, dtype=torch.int32).to(dev)
        self.seq_lens[:bp] = torch.tensor(seq_lens + [0] * (bp - b), dtype=torch.int32).to(dev)
        self.context_lens[:bp] = torch.tensor(context_lens + [0] * (bp - b), dtype=torch.int32).to(dev)
        self.block_tables[:bp] = tables.to(dev)
        self.logits_indices[:bp] = torch.tensor(qsl[1 : bp + 1]).to(dev) - 1  # padded rows: a padding token
        meta = StepMetadata(
            num_tokens=t, num_seqs=b, max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=BLOCK,
            query_start_loc=self.query_start_loc[: bp + 1], seq_lens=self.seq_lens[:bp],
            context_lens=self.context_lens[:bp], block_tables=self.block_tables[:bp],
            slot_mapping=self.slot_mapping[:tp], query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens)
        self.backend.prepare(meta)
        args = (self.input_ids[:, :tp], self.positions[:, :tp], self.logits_indices[:bp])
        return args, ForwardContext(meta, self.backend, self.kv_caches)

    def run(self, fn, query_lens, context_lens=None, **kw) -> torch.Tensor:
        args, ctx = self.step(query_lens, context_lens, **kw)
        with torch.inference_mode(), forward_context(ctx):
            return fn(*args).clone()


STEPS = [  # (query_lens, context_lens): prefill, single token, mixed prefill+decode, uniform decode
    ([3], None),
    ([1], None),
    ([2, 7, 1], [0, 4, 20]),
    ([1, 1, 1], [5, 17, 30]),
    ([6, 4], [0, 0]),
]


def check_against_eager(steps: PagedSteps, eager, compiled, atol: float = 1e-5) -> None:
    for query_lens, context_lens in STEPS:
        ref = steps.run(eager, query_lens, context_lens)
        out = steps.run(compiled, query_lens, context_lens)
        assert out.shape == ref.shape == (1, len(query_lens), steps.vocab)
        torch.testing.assert_close(out, ref, atol=atol, rtol=1e-4, msg=f"step {query_lens}/{context_lens}")
    # padded tokens (as the runner pads T to a capture size) must not change the real rows
    ref = steps.run(eager, [4, 3], [2, 0])
    out = steps.run(compiled, [4, 3], [2, 0], pad_tokens_to=16)
    torch.testing.assert_close(out, ref, atol=atol, rtol=1e-4)


def compile_on_example(steps: PagedSteps, pf: PiecewiseForward) -> torch.Tensor:
    args, ctx = steps.step([5, 9], [0, 3])
    with torch.inference_mode(), forward_context(ctx):
        return pf.compile(*args)


# ------------------------------------------------------------------------------------------------ split + Dynamo
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_split_one_cut_per_layer_and_matches_eager(family):
    model = make_model(family, num_layers=3)
    eager = forward_fn_of(model)
    steps = PagedSteps(model)
    pf = compile_piecewise(eager, capture_sizes=[4, 8, 16], use_cudagraph=False, compiler="eager")
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    first = compile_on_example(steps, pf)
    assert first.shape == (1, 2, 128)

    layers = model.config.num_hidden_layers
    assert pf.stats.num_attention == layers
    assert pf.stats.num_pieces == layers + 1
    assert pf.stats.num_compiled == 3  # first, middle (shared by the middle layers), last
    assert pf.stats.num_graphable == layers  # the last piece gathers logits_indices (length N): no graph
    for name in pf.attention_names:  # each attention submodule is exactly one attention op
        sub = pf.split_gm._modules[name]  # the GraphModule (the attribute is its bound forward)
        calls = [n for n in sub.graph.nodes if n.op == "call_function"]
        assert len(calls) == 1 and "hf_accel" in str(calls[0].target)
    assert pf.bypasses_dynamo

    check_against_eager(steps, eager, pf)
    assert pf.num_backend_calls == 1  # T=1, N=1 and other sizes: no re-trace
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1


def test_dynamo_path_traces_once_for_several_sizes():
    """Through Dynamo itself (guards on): HF code must not specialize on T or N (sizes >= 2)."""
    model = make_model("llama", num_layers=2)
    eager = forward_fn_of(model)
    steps = PagedSteps(model)
    pf = compile_piecewise(eager, use_cudagraph=False, compiler="eager", bypass_dynamo=False)
    compile_on_example(steps, pf)
    assert not pf.bypasses_dynamo
    for query_lens, context_lens in [([6, 5], [0, 2]), ([2, 3, 4], [1, 0, 9]), ([17, 2], None)]:
        ref = steps.run(eager, query_lens, context_lens)
        out = steps.run(pf, query_lens, context_lens)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    assert pf.num_backend_calls == 1


def test_dynamo_path_recompile_keeps_no_step_alive():
    """Through Dynamo, a runtime recompile (here the 0/1 specialization of a one-token step) compiles a new graph
    whose first call is a serving step, not compile()'s: its inputs and logits must not stay referenced until the
    next recompile (only compile()'s own first call is recorded, to prove the direct-call layout)."""
    import weakref

    model = make_model("llama", num_layers=2)
    eager = forward_fn_of(model)
    steps = PagedSteps(model)
    pf = compile_piecewise(eager, use_cudagraph=False, compiler="eager", bypass_dynamo=False)
    compile_on_example(steps, pf)
    assert pf._first_call_args is None and pf._first_call_out is None
    args, ctx = steps.step([1])  # T = 1, N = 1: Dynamo specializes, so the backend compiles again
    with torch.inference_mode(), forward_context(ctx):
        out = pf(*args)
        ref = eager(*args)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    assert pf.num_backend_calls == 2
    dead = weakref.ref(out)
    del out
    assert pf._first_call_args is None and pf._first_call_out is None
    assert dead() is None


def test_compile_rejects_degenerate_example_sizes():
    model = make_model("llama", num_layers=2)
    steps = PagedSteps(model)
    pf = PiecewiseForward(forward_fn_of(model), compiler="eager")
    args, ctx = steps.step([4])  # N = 1: Dynamo would specialize it
    with torch.inference_mode(), forward_context(ctx), pytest.raises(ValueError, match="distinct dynamic sizes"):
        pf.compile(*args)


def test_graph_signature_ignores_names_not_structure():
    def f(x, w):
        return torch.relu(x @ w) + 1

    def g(x, w):
        return torch.sigmoid(x @ w) + 1

    x, w = torch.randn(3, 4), torch.randn(4, 4)
    a, b, c = torch.fx.symbolic_trace(f), torch.fx.symbolic_trace(f), torch.fx.symbolic_trace(g)
    assert graph_signature(a, [x, w]) == graph_signature(b, [x, w])
    assert graph_signature(a, [x, w]) != graph_signature(c, [x, w])
    assert graph_signature(a, [x, w]) != graph_signature(a, [x.double(), w])


def test_inductor_piecewise_matches_eager_and_fills_compile_cache(tmp_path, monkeypatch):
    """Inductor for real (cold: about a minute on 2 cores); also checks the compile cache directory fills up."""
    monkeypatch.setattr(cache_mod, "source_hash", lambda: "fixed")  # others may edit hf_accel meanwhile
    # torchao's quantization configs switch coordinate-descent tuning on process-wide; the pieces compile without
    import torch._inductor.compile_fx as compile_fx_mod
    import torch._inductor.config as inductor_config

    # ... and each reduction kernel gets Inductor's heuristic config, not the winner of a timing at its first launch
    monkeypatch.delenv("HF_ACCEL_INDUCTOR_AUTOTUNE_REDUCTIONS", raising=False)
    seen, fixed, real_compile_fx = [], [], compile_fx_mod.compile_fx
    monkeypatch.setattr(compile_fx_mod, "compile_fx", lambda *a, **k: (
        seen.append(inductor_config.coordinate_descent_tuning),
        fixed.append(inductor_config.test_configs.force_filter_reduction_configs), real_compile_fx(*a, **k))[2])
    with inductor_config.patch(coordinate_descent_tuning=True):
        model = make_model("llama", num_layers=3)
        eager = forward_fn_of(model)
        steps = PagedSteps(model)
        info = setup_compile_cache(str(tmp_path), model.config, torch.float32, [4, 8])
        try:
            assert info.path is not None and not info.warm
            assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(info.path / INDUCTOR_SUBDIR)
            pf = compile_piecewise(eager, capture_sizes=[4, 8], use_cudagraph=False, compiler="inductor")
            compile_on_example(steps, pf)
            assert pf.stats.num_compiled == 3 and pf.stats.num_pieces == 4
            assert pf.bypasses_dynamo
            check_against_eager(steps, eager, pf, atol=1e-4)
            assert pf.num_backend_calls == 1
            assert seen and not any(seen) and inductor_config.coordinate_descent_tuning
            assert fixed and all(fixed) and not inductor_config.test_configs.force_filter_reduction_configs
            again = setup_compile_cache(str(tmp_path), model.config, torch.float32, [4, 8])
            assert again.path == info.path and again.warm
        finally:
            info.restore_env()


def test_fixed_reduction_configs_switch(monkeypatch):
    """The pieces' reduction kernels take one heuristic config unless HF_ACCEL_INDUCTOR_AUTOTUNE_REDUCTIONS=1
    restores Inductor's timing of several at the first launch (the A/B switch); nothing leaks out of the context."""
    import torch._inductor.config as inductor_config

    from hf_accel.compilation.piecewise import inductor_settings

    for env, expect in (("", True), ("0", True), ("1", False)):
        monkeypatch.setenv("HF_ACCEL_INDUCTOR_AUTOTUNE_REDUCTIONS", env)
        with inductor_settings(pdl=False):
            assert inductor_config.test_configs.force_filter_reduction_configs is expect
        assert inductor_config.test_configs.force_filter_reduction_configs is False


class _SimulatedGraph:
    """CPU stand-in for a CUDA graph: replay re-runs the captured call on the capture-time arguments and writes the
    results into the capture-time outputs, i.e. exactly the fixed-address semantics of a real graph."""

    replaying = False

    def __init__(self, fn, out) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        _SimulatedGraph.replaying = True
        try:
            new = self.fn()
        finally:
            _SimulatedGraph.replaying = False
        pairs = zip(self.out, new, strict=True) if isinstance(self.out, (tuple, list)) else [(self.out, new)]
        for old, fresh in pairs:
            if isinstance(old, torch.Tensor):
                old.copy_(fresh)


def test_piecewise_graph_data_flow_simulated_on_cpu(monkeypatch):
    """Capture/replay bookkeeping of the piecewise graphs, with graphs simulated: every piece must read its inputs
    from the addresses seen at capture (persistent buffers, outputs of earlier pieces) and still match eager."""
    import hf_accel.compilation.piecewise as pw

    def fake_capture(fn, pool):
        out = fn()
        return _SimulatedGraph(fn, out), out

    monkeypatch.setattr(pw, "capture_graph", fake_capture)
    monkeypatch.setattr(pw, "weak_ref_tree", lambda out: out)  # CPU memory is really freed: keep it owned
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(pw, "CaptureMemory", lambda: type("M", (), {"delta": lambda self: (0, 0)})())

    model = make_model("llama", num_layers=3)
    eager = forward_fn_of(model)
    steps = PagedSteps(model)
    sizes = [8, 16]
    pf = compile_piecewise(eager, capture_sizes=sizes, use_cudagraph=True, compiler="eager")
    compile_on_example(steps, pf)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # after compiling: Dynamo would believe it

    def run_dummy(size: int) -> None:
        args, ctx = steps.step([size - 1, 1], seed=size)
        with torch.inference_mode(), forward_context(ctx):
            pf(*args)

    pf.capture(None, run_dummy)
    assert sorted(pf.stats.captured_sizes) == sizes and pf.graphs_enabled
    assert [sorted(p.captures) for p in pf.pieces] == [sizes] * 3 + [[]]  # the logits piece has no graph
    calls = []

    def counting(f):  # count executions of the compiled code outside a replay
        return lambda *a: (None if _SimulatedGraph.replaying else calls.append(1)) or f(*a)

    for piece in pf.pieces[:3]:
        piece.fn = counting(piece.fn)
    for query_lens, context_lens in STEPS + [([4, 3], [2, 0]), ([9, 2], [0, 30])]:
        ref = steps.run(eager, query_lens, context_lens)
        out = steps.run(pf, query_lens, context_lens, pad_tokens_to=pad_to_capture_size(sum(query_lens), sizes))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4, msg=f"step {query_lens}/{context_lens}")
    assert not calls  # every graphable piece ran from its (simulated) graph
    # the forward's own inputs may come from other tensors: copied into the captured buffers
    ref = steps.run(eager, [5, 3], [1, 2])
    args, ctx = steps.step([5, 3], [1, 2], pad_tokens_to=8)
    moved = [a.clone() for a in args]
    steps.input_ids.zero_()
    steps.positions.zero_()
    with torch.inference_mode(), forward_context(ctx):
        out = pf(*moved)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    # a size that was not captured runs the compiled pieces
    torch.testing.assert_close(steps.run(pf, [6, 5], None), steps.run(eager, [6, 5], None), atol=1e-5, rtol=1e-4)
    assert len(calls) == 3


class _LazyPerSize:
    """Wraps a piece (or a whole forward) so that it behaves like code that sets something up on its first run at
    each size: run inside a (simulated) capture before it ever ran outside one at that size, it raises as CUDA does
    for a host sync during capture."""

    def __init__(self, fn, size_of, lazy_sizes, capturing) -> None:
        self.fn, self.size_of, self.lazy_sizes, self.capturing = fn, size_of, set(lazy_sizes), capturing
        self.ran_outside: set[int] = set()

    def __call__(self, *args):
        size = self.size_of(args)
        if self.capturing["on"] and size in self.lazy_sizes and size not in self.ran_outside:
            raise RuntimeError("operation not permitted when stream is capturing")
        if not self.capturing["on"]:
            self.ran_outside.add(size)
        return self.fn(*args)


def _simulate_captures(monkeypatch, module) -> dict:
    capturing = {"on": False}

    def fake_capture(fn, pool):
        capturing["on"] = True
        try:
            out = fn()
        finally:
            capturing["on"] = False
        return _SimulatedGraph(fn, out), out

    monkeypatch.setattr(module, "capture_graph", fake_capture)
    monkeypatch.setattr(module, "weak_ref_tree", lambda out: out)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(module, "CaptureMemory", lambda: type("M", (), {"delta": lambda self: (0, 0)})())
    return capturing


@pytest.mark.parametrize("lazy_sizes,expect_warmups,expect_retries", [
    ((), 2, 0),  # one warm-up per class: 32 (multiples of 16) and 24 (others)
    ((16,), 3, 1),  # 16 sets something up on first use: its direct capture fails, it is warmed up and redone
    ((8, 16), 4, 2),
])
def test_piecewise_capture_warms_up_once_per_class_and_retries_a_lazy_size(monkeypatch, lazy_sizes, expect_warmups,
                                                                           expect_retries):
    import hf_accel.compilation.piecewise as pw

    capturing = _simulate_captures(monkeypatch, pw)
    model = make_model("llama", num_layers=3)
    eager = forward_fn_of(model)
    steps = PagedSteps(model)
    sizes = [8, 16, 24, 32]
    pf = compile_piecewise(eager, capture_sizes=sizes, use_cudagraph=True, compiler="eager")
    compile_on_example(steps, pf)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lazy = pf.pieces[1]
    lazy.fn = _LazyPerSize(lazy.fn, lazy._size, lazy_sizes, capturing)
    warmed: list[int] = []

    def run_dummy(size: int) -> None:
        if not pf.graphs_enabled:
            warmed.append(size)
        args, ctx = steps.step([size - 1, 1], seed=size)
        with torch.inference_mode(), forward_context(ctx):
            pf(*args)

    pf.capture(None, run_dummy, warmup_key=lambda t: t % 16 == 0)
    assert pf.stats.capture_warmups == expect_warmups and pf.stats.capture_retries == expect_retries
    assert warmed == [32, 24] + [s for s in (16, 8) if s in lazy_sizes]
    assert sorted(pf.stats.captured_sizes) == sizes
    assert [sorted(p.captures) for p in pf.pieces] == [sizes] * 3 + [[]]
    for query_lens, context_lens in [([5, 3], [1, 2]), ([9, 2], [0, 30]), ([20, 7], [3, 0]), ([1] * 8, list(range(8)))]:
        ref = steps.run(eager, query_lens, context_lens)
        out = steps.run(pf, query_lens, context_lens, pad_tokens_to=pad_to_capture_size(sum(query_lens), sizes))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4, msg=f"step {query_lens}/{context_lens}")


def test_piecewise_capture_that_fails_after_its_warm_up_raises_and_keeps_no_partial_graphs(monkeypatch):
    import hf_accel.compilation.piecewise as pw

    capturing = _simulate_captures(monkeypatch, pw)
    model = make_model("llama", num_layers=3)
    eager = forward_fn_of(model)
    steps = PagedSteps(model)
    pf = compile_piecewise(eager, capture_sizes=[8, 16], use_cudagraph=True, compiler="eager")
    compile_on_example(steps, pf)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    broken = pf.pieces[1]
    inner = broken.fn

    def always_fails_in_capture(*args):
        if capturing["on"] and broken._size(args) == 8:
            raise RuntimeError("operation not permitted when stream is capturing")
        return inner(*args)

    broken.fn = always_fails_in_capture

    def run_dummy(size: int) -> None:
        args, ctx = steps.step([size - 1, 1], seed=size)
        with torch.inference_mode(), forward_context(ctx):
            pf(*args)

    with pytest.raises(RuntimeError, match="not permitted"):
        pf.capture(None, run_dummy, warmup_key=lambda t: 0)
    assert pf.stats.capture_retries == 1 and pf.stats.captured_sizes == [16]
    assert all(8 not in p.captures for p in pf.pieces)  # the piece captured before the failure was dropped


def test_piecewise_retry_moves_to_a_new_pool_and_never_captures_into_the_failed_one(monkeypatch):
    """A failed capture's pool is not captured into again (cuda_graph.capture_graph): the retry and every later
    capture, including the full graphs the runner hands the same pool, use a new handle."""
    import hf_accel.compilation.piecewise as pw

    capturing = _simulate_captures(monkeypatch, pw)
    handles = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: f"pool{next(handles)}")
    failed_pools: set[str] = set()
    used: list[tuple[int, str]] = []
    simulated = pw.capture_graph

    def refusing_capture(fn, pool):
        assert pool not in failed_pools, f"captured into the failed pool {pool}"
        used.append((pf.capturing_size, pool))
        try:
            return simulated(fn, pool)
        except RuntimeError:
            failed_pools.add(pool)
            raise

    monkeypatch.setattr(pw, "capture_graph", refusing_capture)
    model = make_model("llama", num_layers=3)
    eager = forward_fn_of(model)
    steps = PagedSteps(model)
    sizes = [8, 16, 24]
    pf = compile_piecewise(eager, capture_sizes=sizes, use_cudagraph=True, compiler="eager", graph_pool="pool-runner")
    compile_on_example(steps, pf)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lazy = pf.pieces[2]
    lazy.fn = _LazyPerSize(lazy.fn, lazy._size, [16], capturing)

    def run_dummy(size: int) -> None:
        args, ctx = steps.step([size - 1, 1], seed=size)
        with torch.inference_mode(), forward_context(ctx):
            pf(*args)

    pf.capture(None, run_dummy, warmup_key=lambda t: 0)
    assert failed_pools == {"pool-runner"} and pf.graph_pool not in failed_pools and pf.stats.capture_retries == 1
    assert {pool for size, pool in used if size == 8} == {pf.graph_pool}  # after the failure: the new handle
    assert sorted(pf.stats.captured_sizes) == sizes


@pytest.mark.parametrize("lazy_keys,expect_warmups", [((), 2), ((2,), 3)])
def test_full_graph_capture_warms_up_once_per_class_and_retries_a_lazy_key(monkeypatch, lazy_keys, expect_warmups):
    import hf_accel.compilation.cuda_graph as cg

    capturing = _simulate_captures(monkeypatch, cg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    x = torch.arange(4.0)
    state: dict = {}
    forward = _LazyPerSize(lambda b: x * b, lambda args: args[0], lazy_keys, capturing)
    runner = FullCUDAGraphRunner(pool="pool")
    prepared: list[int] = []

    def prepare(b: int) -> None:
        prepared.append(b)
        state["b"] = b

    runner.capture([1, 2, 4, 8], lambda b: forward(b), prepare_fn=prepare, warmup_key=lambda b: b == 1)
    assert runner.warmups == expect_warmups and runner.retries == len(lazy_keys)
    assert sorted(runner.captured_keys) == [1, 2, 4, 8]
    for b in (1, 2, 4, 8):
        torch.testing.assert_close(runner.replay(b), x * b)
    # every capture (and every warm-up) was preceded by its prepare_fn
    assert prepared[:3] == [8, 8, 4] and prepared.count(2) == (3 if lazy_keys else 1)


def test_capture_warmup_classes_follow_kernels_and_stay_per_size_where_unsafe(monkeypatch):
    from hf_accel.engine.runner import capture_warmup_class

    model = make_model("llama", num_layers=2)
    cls = capture_warmup_class(model, small_m_gemm=True, tensor_parallel=False)
    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 128, 512]
    groups: dict = {}
    for t in sizes:
        groups.setdefault(cls(t), []).append(t)
    assert sorted(groups.values()) == sorted([[1], [2, 4, 8], [16], [24, 40, 56], [32, 48, 64], [72, 88],
                                              [80, 96, 128, 512]])
    no_small_m = capture_warmup_class(model, small_m_gemm=False, tensor_parallel=False)
    assert no_small_m(8) == no_small_m(72) and no_small_m(16) == no_small_m(512) and no_small_m(1) != no_small_m(2)
    # every size its own class: tensor-parallel ranks, the switch, and weights that are not plain parameters
    assert len({capture_warmup_class(model, small_m_gemm=True, tensor_parallel=True)(t) for t in sizes}) == len(sizes)
    monkeypatch.setenv("HF_ACCEL_CAPTURE_WARMUP", "every")
    assert len({capture_warmup_class(model, small_m_gemm=True, tensor_parallel=False)(t) for t in sizes}) == len(sizes)
    monkeypatch.delenv("HF_ACCEL_CAPTURE_WARMUP")

    class QuantizedParam(torch.nn.Parameter):  # stands in for bitsandbytes' Params4bit
        pass

    model.model.register_buffer("ids", torch.arange(4))  # int64 buffers (position ids) are not quantized weights
    assert capture_warmup_class(model, small_m_gemm=True, tensor_parallel=False)(24) == cls(40)
    model.model.layers[1].mlp.down_proj.register_buffer("qweight", torch.zeros(4, 4, dtype=torch.int32))  # GPTQ
    assert len({capture_warmup_class(model, small_m_gemm=True, tensor_parallel=False)(t) for t in sizes}) == len(sizes)
    del model.model.layers[1].mlp.down_proj.qweight
    layer = model.model.layers[0].mlp.down_proj
    layer.weight = QuantizedParam(layer.weight.data)
    assert len({capture_warmup_class(model, small_m_gemm=True, tensor_parallel=False)(t) for t in sizes}) == len(sizes)
    layer.weight = torch.nn.Parameter(layer.weight.data.to(torch.float8_e4m3fn), requires_grad=False)
    assert len({capture_warmup_class(model, small_m_gemm=True, tensor_parallel=False)(t) for t in sizes}) == len(sizes)


# ------------------------------------------------------------------------------------------------ dispatcher
@pytest.mark.parametrize("mode,support,piecewise,expected,downgraded", [
    ("full_and_piecewise", CUDAGraphSupport.UNIFORM_DECODE, True, CUDAGraphMode.FULL_AND_PIECEWISE, False),
    ("full_and_piecewise", CUDAGraphSupport.NEVER, True, CUDAGraphMode.PIECEWISE, True),
    ("full_and_piecewise", CUDAGraphSupport.UNIFORM_DECODE, False, CUDAGraphMode.FULL_DECODE_ONLY, True),
    ("full_and_piecewise", CUDAGraphSupport.NEVER, False, CUDAGraphMode.NONE, True),
    ("full", CUDAGraphSupport.ALWAYS, True, CUDAGraphMode.FULL, False),
    ("full", CUDAGraphSupport.UNIFORM_DECODE, True, CUDAGraphMode.FULL_AND_PIECEWISE, True),
    ("full", CUDAGraphSupport.UNIFORM_DECODE, False, CUDAGraphMode.FULL_DECODE_ONLY, True),
    ("full", CUDAGraphSupport.NEVER, True, CUDAGraphMode.PIECEWISE, True),
    ("full_decode_only", CUDAGraphSupport.UNIFORM_DECODE, False, CUDAGraphMode.FULL_DECODE_ONLY, False),
    ("full_decode_only", CUDAGraphSupport.NEVER, True, CUDAGraphMode.NONE, True),
    ("piecewise", CUDAGraphSupport.NEVER, True, CUDAGraphMode.PIECEWISE, False),
    ("piecewise", CUDAGraphSupport.ALWAYS, False, CUDAGraphMode.NONE, True),
    ("none", CUDAGraphSupport.ALWAYS, True, CUDAGraphMode.NONE, False),
])
def test_resolve_mode(mode, support, piecewise, expected, downgraded):
    resolved, reason = resolve_cudagraph_mode(mode, support, piecewise_available=piecewise)
    assert resolved == expected
    assert (reason is not None) == downgraded


def test_dispatch_full_and_piecewise():
    d = CUDAGraphDispatcher("full_and_piecewise", [1, 2, 4, 8, 16, 32], CUDAGraphSupport.UNIFORM_DECODE,
                            full_capture_sizes=[1, 2, 4, 8])
    assert d.downgrade_reason is None
    assert d.dispatch(3, uniform_decode=True) == d.dispatch(4, True)
    assert d.dispatch(3, True).mode == RuntimeMode.FULL and d.dispatch(3, True).num_tokens == 4
    assert d.dispatch(8, True).key == BatchKey(8, True)
    # decode above the largest full size: piecewise, padded
    assert (d.dispatch(9, True).mode, d.dispatch(9, True).num_tokens) == (RuntimeMode.PIECEWISE, 16)
    # mixed batches: piecewise up to the largest capture size, then no graph at the exact size
    assert (d.dispatch(3, False).mode, d.dispatch(3, False).num_tokens) == (RuntimeMode.PIECEWISE, 4)
    assert (d.dispatch(32, False).mode, d.dispatch(32, False).num_tokens) == (RuntimeMode.PIECEWISE, 32)
    assert (d.dispatch(33, False).mode, d.dispatch(33, False).num_tokens) == (RuntimeMode.NONE, 33)
    assert d.full_capture_keys() == [BatchKey(s, True) for s in (1, 2, 4, 8)]
    assert max(d.full_capture_keys()) == BatchKey(8, True)  # keys sort (FullCUDAGraphRunner captures largest first)
    assert d.piecewise_sizes == [1, 2, 4, 8, 16, 32]
    with pytest.raises(ValueError):
        d.dispatch(0, True)


def test_piecewise_sizes_beside_full_graphs_are_the_mixed_list():
    """With full decode graphs, piecewise graphs serve steps holding a prefill chunk: the thinned list is captured;
    without full graphs piecewise graphs serve decode too, so every capture size is kept."""
    sizes, mixed = [1, 2, 4, 8, 16, 24, 32, 40], [1, 2, 4, 8, 16, 24, 40]
    d = CUDAGraphDispatcher("full_and_piecewise", sizes, CUDAGraphSupport.UNIFORM_DECODE,
                            full_capture_sizes=sizes, mixed_capture_sizes=mixed)
    assert d.piecewise_sizes == mixed and d.full_sizes == sizes
    assert (d.dispatch(32, True).mode, d.dispatch(32, True).num_tokens) == (RuntimeMode.FULL, 32)
    assert (d.dispatch(32, False).mode, d.dispatch(32, False).num_tokens) == (RuntimeMode.PIECEWISE, 40)
    assert (d.dispatch(41, False).mode, d.dispatch(41, False).num_tokens) == (RuntimeMode.NONE, 41)
    no_full = CUDAGraphDispatcher("full_and_piecewise", sizes, CUDAGraphSupport.NEVER, mixed_capture_sizes=mixed)
    assert no_full.piecewise_sizes == sizes
    assert (no_full.dispatch(32, True).mode, no_full.dispatch(32, True).num_tokens) == (RuntimeMode.PIECEWISE, 32)
    piecewise_only = CUDAGraphDispatcher("piecewise", sizes, CUDAGraphSupport.UNIFORM_DECODE,
                                         mixed_capture_sizes=mixed)
    assert piecewise_only.piecewise_sizes == sizes


def test_thinned_capture_sizes_pad_a_mixed_step_by_at_most_an_eighth():
    from hf_accel.config import MIXED_STEP_PAD, default_capture_sizes, thinned_capture_sizes

    for max_num_seqs in (1, 3, 8, 64, 100, 256, 1024):
        full = default_capture_sizes(max_num_seqs)
        thin = thinned_capture_sizes(full)
        assert set(thin) <= set(full) and thin[-1] == full[-1]
        assert [s for s in full if s <= 16] == [s for s in thin if s <= 16]
        for a, b in zip(thin, thin[1:]):
            if a >= 16 and b != thin[-1]:
                assert b >= a * (1 + MIXED_STEP_PAD)  # thinned ...
            if a >= 16:  # ... but never by more than the original list's next step allows
                assert b <= max(a * (1 + MIXED_STEP_PAD) + 8, a + 8)
        for n in range(1, full[-1] + 1):  # every step that had a piecewise graph still has one
            assert pad_to_capture_size(n, thin) is not None
    assert len(thinned_capture_sizes(default_capture_sizes(256))) == 26  # of 67
    assert thinned_capture_sizes([]) == []


def test_piecewise_capture_sizes_config():
    from hf_accel.config import AccelConfig, default_capture_sizes, thinned_capture_sizes

    cuda = torch.device("cuda")
    default = AccelConfig().resolve_for(cuda)
    assert default.piecewise_capture_sizes == thinned_capture_sizes(default_capture_sizes(256))
    explicit = AccelConfig(cudagraph_capture_sizes=[4, 1, 8, 8]).resolve_for(cuda)
    assert explicit.cudagraph_capture_sizes == [1, 4, 8] and explicit.piecewise_capture_sizes is None  # not thinned
    chosen = AccelConfig(piecewise_capture_sizes=[64, 8]).resolve_for(cuda)
    assert chosen.piecewise_capture_sizes == [8, 64] and len(chosen.cudagraph_capture_sizes) == 67
    with pytest.raises(ValueError, match="piecewise_capture_sizes"):
        AccelConfig(piecewise_capture_sizes=[0, 8]).resolve_for(cuda)
    with pytest.raises(ValueError, match="piecewise_capture_sizes"):
        AccelConfig(piecewise_capture_sizes=[]).resolve_for(cuda)
    # a resolved config given other capture sizes derives its piecewise sizes again (not the old thinned list)
    again = default.updated(cudagraph_capture_sizes=[1, 2, 1024, 2048]).resolve_for(cuda)
    assert again.piecewise_capture_sizes is None and again.cudagraph_capture_sizes == [1, 2, 1024, 2048]
    kept = chosen.updated(cudagraph_capture_sizes=[1, 2]).resolve_for(cuda)
    assert kept.piecewise_capture_sizes == [8, 64]  # chosen by the user: kept
    assert default.updated(max_num_seqs=4).piecewise_capture_sizes == default.piecewise_capture_sizes



def test_large_piecewise_sizes_stop_where_a_step_is_gpu_bound():
    from hf_accel.config import LARGE_STEP_GRAPH_FLOPS, large_piecewise_sizes

    # qwen3-0.6b (0.44 B matmul parameters): every doubling up to the 8,192-token budget, which ends the list
    assert large_piecewise_sizes(512, 8192, 2 * 0.44e9) == [1024, 2048, 4096, 8192]
    # a budget that is no power of two is itself the last size (a full chunked-prefill step pads nothing)
    assert large_piecewise_sizes(512, 6000, 2 * 0.44e9) == [1024, 2048, 4096, 6000]
    assert large_piecewise_sizes(512, 1500, 2 * 0.44e9) == [1024, 1500]
    # a budget within 12.5 % above a doubling replaces it: one capture, not two nearly equal ones
    assert large_piecewise_sizes(512, 1025, 2 * 0.44e9) == [1025]
    assert large_piecewise_sizes(512, 4500, 2 * 0.44e9) == [1024, 2048, 4500]
    assert large_piecewise_sizes(512, 4700, 2 * 0.44e9) == [1024, 2048, 4096, 4700]
    # llama-3.2-1b (0.97 B): its 8,192-token step computes more than the limit; llama-3.1-8b (6.98 B): nothing added
    assert large_piecewise_sizes(512, 8192, 2 * 0.97e9) == [1024, 2048, 4096]
    assert large_piecewise_sizes(512, 8192, 2 * 6.98e9) == []
    for fpt in (1e6, 2 * 0.44e9, 2 * 0.97e9, 3e9, 2 * 6.98e9):
        assert all(size * fpt <= LARGE_STEP_GRAPH_FLOPS for size in large_piecewise_sizes(512, 8192, fpt))
    # nothing above a budget the default sizes already cover, or with no parameter count
    assert large_piecewise_sizes(512, 512, 1e6) == [] and large_piecewise_sizes(512, 300, 1e6) == []
    assert large_piecewise_sizes(512, 8192, 0) == []


def test_engine_adds_large_piecewise_sizes_only_to_derived_ones(monkeypatch):
    """The engine hands the runner the derived piecewise sizes plus the large ones its model is small enough for,
    in full_and_piecewise mode only (the one mode where these sizes are used); sizes the user gave, at construction
    or through updated(), go through unchanged. CPU: the mode is forced and the compilation faked."""
    from hf_accel import accelerate_model, restore
    from hf_accel.config import AccelConfig, large_piecewise_sizes
    from hf_accel.engine.engine import matmul_parameters
    from hf_accel.engine.runner import ModelRunner

    seen = []

    def fake_enable_compilation(self, mode, capture_sizes, compile, *args, mixed_capture_sizes=None, **kwargs):
        seen.append(mixed_capture_sizes)
        return {"compile_s": 0.0, "capture_s": 0.0, "graph_pool_bytes": 0, "cudagraph_mode": "none"}

    resolve_for = AccelConfig.resolve_for

    def as_on_cuda(self, device):  # what resolve_for gives on a GPU: graphs on unless asked otherwise
        cfg = resolve_for(self, device)
        if self.cudagraph_mode in (None, CUDAGraphMode.FULL_AND_PIECEWISE) and not self.enforce_eager:
            cfg.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        return cfg

    monkeypatch.setattr(ModelRunner, "enable_compilation", fake_enable_compilation)
    monkeypatch.setattr(AccelConfig, "resolve_for", as_on_cuda)
    model = make_llama(0)
    params = matmul_parameters(model)
    embed = model.get_input_embeddings().weight.numel()
    assert params == sum(p.numel() for p in model.parameters()) - embed - model.lm_head.weight.numel()

    def sizes_for(**kwargs):
        seen.clear()
        accelerate_model(model, compile=True, **kwargs)
        restore(model)
        return seen[-1] if seen else "not compiled"

    derived = sizes_for(max_num_batched_tokens=4096)
    assert derived[:26] == thinned_capture_sizes(default_capture_sizes(256))
    assert derived[26:] == large_piecewise_sizes(512, 4096, 2.0 * params) == [1024, 2048, 4096]
    # a small max_num_seqs: the derived sizes end at 2 x max_num_seqs and the doubling starts there
    assert sizes_for(max_num_seqs=4, max_num_batched_tokens=100) == [1, 2, 4, 8, 16, 32, 64, 100]
    # given sizes are kept as given, also when set on a config resolved before (its sizes were derived)
    assert sizes_for(max_num_batched_tokens=4096, config=AccelConfig(piecewise_capture_sizes=[8, 64])) == [8, 64]
    resolved = AccelConfig().resolve_for(torch.device("cpu"))
    assert resolved._piecewise_sizes_derived and resolved.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert sizes_for(max_num_batched_tokens=4096, config=resolved) == derived
    assert sizes_for(max_num_batched_tokens=4096, config=resolved.updated(piecewise_capture_sizes=[16])) == [16]
    # other modes do not use these sizes: nothing added (the runner gets the derived list, or is not called)
    assert sizes_for(max_num_batched_tokens=4096, cudagraph_mode="piecewise") == derived[:26]
    assert sizes_for(max_num_batched_tokens=4096, enforce_eager=True) == "not compiled"


def test_matmul_parameters_of_a_model_without_embedding_accessors(monkeypatch):
    """A model whose get_input_embeddings raises (transformers' default for an unusual layout) still accelerates:
    its embedding counts as a matmul weight (a high estimate: fewer large graphs)."""
    from hf_accel.engine.engine import matmul_parameters

    model = make_llama(0)

    def unknown(self):
        raise NotImplementedError

    monkeypatch.setattr(type(model), "get_input_embeddings", unknown)
    monkeypatch.setattr(type(model), "get_output_embeddings", lambda self: None)
    assert matmul_parameters(model) == sum(p.numel() for p in model.parameters())



def test_dispatch_downgrades_once_with_a_reason(caplog):
    with caplog.at_level("WARNING", logger="hf_accel.compilation.dispatcher"):
        d = CUDAGraphDispatcher("full_and_piecewise", [1, 2, 4], CUDAGraphSupport.NEVER, backend_name="torch")
        for n in (1, 2, 3, 4, 5):
            d.dispatch(n, uniform_decode=True)
    lines = [r for r in caplog.records if "downgraded" in r.getMessage()]
    assert len(lines) == 1 and "cannot run inside a CUDA graph" in lines[0].getMessage()
    assert d.mode == CUDAGraphMode.PIECEWISE and d.full_capture_keys() == []
    assert d.dispatch(1, True).mode == RuntimeMode.PIECEWISE
    assert d.dispatch(5, True).mode == RuntimeMode.NONE


def test_dispatch_full_mixed_and_none():
    d = CUDAGraphDispatcher("full", [2, 4], CUDAGraphSupport.ALWAYS)
    assert d.dispatch(3, False) == d.dispatch(4, False)
    assert d.dispatch(3, False).mode == RuntimeMode.FULL and d.dispatch(3, False).key == BatchKey(4, False)
    assert set(d.full_capture_keys()) == {BatchKey(2, True), BatchKey(4, True), BatchKey(2, False),
                                          BatchKey(4, False)}
    assert d.dispatch(5, True).mode == RuntimeMode.NONE
    off = CUDAGraphDispatcher("none", [2, 4], CUDAGraphSupport.ALWAYS)
    assert off.dispatch(1, True) .mode == RuntimeMode.NONE and off.dispatch(1, True).num_tokens == 1
    empty = CUDAGraphDispatcher("piecewise", [], CUDAGraphSupport.NEVER)
    assert empty.mode == CUDAGraphMode.NONE


def test_pad_to_capture_size():
    sizes = [1, 2, 4, 8, 16]
    assert [pad_to_capture_size(n, sizes) for n in (1, 3, 4, 5, 16, 17)] == [1, 4, 4, 8, 16, None]
    assert pad_to_capture_size(3, [8, 2, 4]) == 4
    assert pad_to_capture_size(1, []) is None


# ------------------------------------------------------------------------------------------------ cache
def test_cache_key_stable_and_sensitive(monkeypatch):
    monkeypatch.setattr(cache_mod, "source_hash", lambda: "v1")
    cfg = LlamaConfig(num_hidden_layers=2, **COMMON)
    key = compile_cache_key(cfg, torch.bfloat16, [1, 2, 4])
    assert key == compile_cache_key(LlamaConfig(num_hidden_layers=2, **COMMON), torch.bfloat16, [4, 2, 1])
    assert key != compile_cache_key(LlamaConfig(num_hidden_layers=3, **COMMON), torch.bfloat16, [1, 2, 4])
    assert key != compile_cache_key(cfg, torch.float16, [1, 2, 4])
    assert key != compile_cache_key(cfg, torch.bfloat16, [1, 2, 4, 8])
    assert key != compile_cache_key(cfg, torch.bfloat16, [1, 2, 4], extra={"device": "NVIDIA H200"})
    monkeypatch.setattr(cache_mod, "source_hash", lambda: "v2")  # an hf_accel source file changed
    assert key != compile_cache_key(cfg, torch.bfloat16, [1, 2, 4])


def test_source_hash_covers_the_package():
    assert cache_mod.source_hash() == cache_mod.source_hash()
    assert any(p.name == "hf_accel" for p in cache_mod._source_dirs())


def test_setup_compile_cache_dirs(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "source_hash", lambda: "fixed")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cfg = LlamaConfig(num_hidden_layers=2, **COMMON)
    off = setup_compile_cache("", cfg, torch.float32, [1])
    assert off.path is None and not off.warm and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    info = setup_compile_cache(tmp_path, cfg, torch.float32, [1])
    try:
        assert info.path == tmp_path / info.key and not info.warm
        assert json.loads((info.path / KEY_FILE).read_text())["dtype"] == "torch.float32"
        (info.path / INDUCTOR_SUBDIR / "artifact").write_text("x")
        assert setup_compile_cache(tmp_path, cfg, torch.float32, [1]).warm
        other = setup_compile_cache(tmp_path, cfg, torch.float32, [1, 2])
        assert other.path != info.path and not other.warm
    finally:
        info.restore_env()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    monkeypatch.setenv("HF_ACCEL_CACHE_DIR", str(tmp_path / "root"))
    default = setup_compile_cache(None, cfg, torch.float32, [1])
    default.restore_env()
    assert default.path == tmp_path / "root" / "compile" / default.key


def test_weak_ref_tensor_aliases():
    base = torch.arange(12.0).view(3, 4)
    view = base[1:, 1:3]
    weak = weak_ref_tensor(view)
    assert weak.data_ptr() == view.data_ptr() and weak.shape == view.shape and weak.stride() == view.stride()
    base[2, 2] = -1.0
    assert weak[1, 1].item() == -1.0


# ------------------------------------------------------------------------------------------------ GPU
class GraphSafeDecodeBackend(TorchAttentionBackend):
    """Uniform decode attention with no host state (reads only the seq_lens/block_tables buffers), so a graph can
    hold it; other batches (the compile example) take the torch backend's path."""

    name = "test_graph_safe_decode"
    cudagraph_support = CUDAGraphSupport.UNIFORM_DECODE

    def prepare(self, meta: StepMetadata) -> None:
        if not meta.is_uniform_decode:
            super().prepare(meta)

    def forward(self, query, k_cache, v_cache, meta, output, scale, sliding_window, softcap) -> None:
        if not meta.is_uniform_decode:
            return super().forward(query, k_cache, v_cache, meta, output, scale, sliding_window, softcap)
        b, num_heads, head_dim = query.shape  # one query token per (padded) sequence
        num_kv_heads = k_cache.shape[2]
        blocks = meta.block_tables[:b].long()
        k = k_cache[blocks].flatten(1, 2).float()  # [B, L, Hkv, D]
        v = v_cache[blocks].flatten(1, 2).float()
        valid = torch.arange(k.shape[1], device=query.device)[None, :] < meta.seq_lens[:b, None]
        q = query.float().view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.einsum("bhgd,blhd->bhgl", q, k) * scale
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded rows (seq_len 0) attend to nothing
        out = torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(b, num_heads, head_dim)
        output.copy_(out.to(output.dtype))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("one_warmup", [False, True], ids=["warmup-per-size", "one-warmup"])
def test_gpu_piecewise_graphs_match_eager(one_warmup):
    """Real graphs against eager; with `one_warmup` only the largest size is warmed up and the others are captured
    straight away (the runner's warm-up classes at their coarsest)."""
    model = make_model("llama", num_layers=3, device="cuda")
    eager = forward_fn_of(model)
    steps = PagedSteps(model)
    sizes = [4, 8, 16, 32]
    pf = compile_piecewise(eager, capture_sizes=sizes, use_cudagraph=True, compiler="inductor")
    compile_on_example(steps, pf)

    def run_dummy(size: int) -> None:  # one prefill of `size` tokens, as the runner's warm-up would
        args, ctx = steps.step([size])
        with torch.inference_mode(), forward_context(ctx):
            pf(*args)

    pf.capture(sizes, run_dummy, warmup_key=(lambda t: 0) if one_warmup else None)
    assert sorted(pf.stats.captured_sizes) == sizes
    assert pf.stats.capture_warmups == (1 if one_warmup else len(sizes)) and pf.stats.capture_retries == 0
    assert all(len(p.captures) == (len(sizes) if p.graphable else 0) for p in pf.pieces)
    for query_lens, context_lens in STEPS + [([4, 3], [2, 0]), ([9, 9, 9], [0, 1, 2])]:
        t = sum(query_lens)
        padded = pad_to_capture_size(t, sizes)
        ref = steps.run(eager, query_lens, context_lens)
        out = steps.run(pf, query_lens, context_lens, pad_tokens_to=padded)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    ref = steps.run(eager, [40], None)  # above the largest size: compiled pieces without graphs
    torch.testing.assert_close(steps.run(pf, [40], None), ref, atol=1e-4, rtol=1e-4)
    # inputs that are not the captured buffers are allowed (copied into them)
    ref = steps.run(eager, [5, 3], [1, 2])
    args, ctx = steps.step([5, 3], [1, 2], pad_tokens_to=8)
    moved = [a.clone() for a in args]
    steps.input_ids.zero_()
    steps.positions.zero_()
    with torch.inference_mode(), forward_context(ctx):
        out = pf(*moved).clone()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("one_warmup", [False, True], ids=["warmup-per-size", "one-warmup"])
def test_gpu_full_graphs_for_uniform_decode_match_eager(one_warmup):
    model = make_model("qwen3", num_layers=2, device="cuda")
    eager = forward_fn_of(model)
    steps = PagedSteps(model, backend_cls=GraphSafeDecodeBackend)
    sizes = [1, 2, 4, 8]
    pool = torch.cuda.graph_pool_handle()
    pf = compile_piecewise(eager, capture_sizes=sizes, use_cudagraph=True, compiler="inductor", graph_pool=pool)
    compile_on_example(steps, pf)
    full = FullCUDAGraphRunner(pool=pool)
    state: dict = {}

    def prepare(b: int) -> None:  # a dummy decode batch of b sequences at distinct context lengths
        state["args"], state["ctx"] = steps.step([1] * b, [3 + i for i in range(b)], pad_seqs_to=b)

    def run(b: int):
        with torch.inference_mode(), forward_context(state["ctx"]), pf.graphs_disabled():
            return pf(*state["args"])

    full.capture(sizes, run, prepare_fn=prepare, warmup_key=(lambda b: 0) if one_warmup else None)
    assert sorted(full.captured_keys) == sizes
    assert full.warmups == (1 if one_warmup else len(sizes)) and full.retries == 0
    for b in (1, 3, 5, 8):
        ctx_lens = [7 + 5 * i for i in range(b)]
        ref = steps.run(eager, [1] * b, ctx_lens)
        padded = pad_to_capture_size(b, sizes)
        steps.step([1] * b, ctx_lens, pad_tokens_to=padded, pad_seqs_to=padded)  # fill the persistent buffers
        with torch.inference_mode():
            out = full.replay(padded)[:, :b].clone()
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------ q/k/v and gate/up as one GEMM
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_packed_sibling_linears_merge_into_one_gemm(family, compiler):
    from hf_accel.compilation.linear_packing import pack_sibling_linears, unpack_sibling_linears

    model = make_model(family, num_layers=3)
    layers = model.config.num_hidden_layers
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eager = forward_fn_of(model)
    steps = PagedSteps(model)

    record = pack_sibling_linears(model)
    assert record.groups == 2 * layers  # q/k/v and gate/up in every layer
    attn = model.model.layers[1].self_attn
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert k.storage_offset() == q.numel() and v.storage_offset() == q.numel() + k.numel()
    for name, value in model.state_dict().items():  # same values and shapes: the modules are untouched
        assert torch.equal(value, before[name]), name

    pf = compile_piecewise(eager, capture_sizes=[4, 8, 16], use_cudagraph=False, compiler=compiler)
    compile_on_example(steps, pf)
    assert pf.stats.num_merged_linears == 2 * layers
    assert pf.stats.num_compiled == 3  # the middle layers' pieces are still shared
    for name in pf.piece_names:  # inside every piece: no more than two linears per layer's worth of projections
        sub = pf.split_gm._modules[name]
        assert not any(n.target is torch.nn.functional.linear and n.args[1].name.endswith("k_proj_parameters_weight_")
                       for n in sub.graph.nodes if n.op == "call_function")
    check_against_eager(steps, eager, pf)  # the eager forward uses the packed weights as plain parameters

    unpack_sibling_linears(record)
    assert k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_packing_skips_tied_and_mismatched_weights():
    from hf_accel.compilation.linear_packing import pack_sibling_linears

    model = make_model("llama", num_layers=2)
    mlp = model.model.layers[0].mlp
    mlp.up_proj.weight = mlp.gate_proj.weight  # tied: must keep its own storage
    attn = model.model.layers[1].self_attn
    attn.k_proj.weight.data = attn.k_proj.weight.data.to(torch.float64)  # dtype differs from q/v
    record = pack_sibling_linears(model)
    assert record.groups == 2  # layer 0 q/k/v and layer 1 gate/up only
    assert attn.q_proj.weight.untyped_storage().data_ptr() != attn.v_proj.weight.untyped_storage().data_ptr()


def compiled_qwen3_matching_stock(**config):
    """A two-layer qwen3 accelerated with compile on (`AccelConfig(compile_cache_dir="", **config)`): checks that it
    compiled (no eager fallback) and that its greedy tokens are stock's; returns it, still accelerated."""
    from hf_accel import accelerate_model, engine_info
    from hf_accel.config import AccelConfig

    model = make_model("qwen3", num_layers=2)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(10, 100, (3, 9))
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    accelerate_model(model, compile=True, num_kv_blocks=64, config=AccelConfig(compile_cache_dir="", **config))
    info = engine_info(model)
    assert "compile_error" not in info.get("fallbacks", {}), info.get("fallbacks")
    assert model._hf_accel_state.engine.runner.piecewise is not None  # compiled, not the eager fallback
    got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    return model


def test_compiled_at_a_larger_example_step_matches_stock(monkeypatch):
    """HF_ACCEL_COMPILE_TOKENS (the first compiled step's size, the A/B switch of Inductor's tuning hint): the
    compiled forward then serves every step shape as before, greedy output equal to stock."""
    monkeypatch.setenv("HF_ACCEL_COMPILE_TOKENS", "48")
    compiled_qwen3_matching_stock()


def test_combo_kernels_switch_reaches_inductor_and_matches_stock(monkeypatch):
    """AccelConfig(combo_kernels) (Inductor's horizontal fusion: on by default, False for the A/B) is in force while
    the pieces compile, and only then: `inductor_settings` sets it explicitly either way, whatever the process set,
    and puts it back after. The compiled model still gives stock's greedy tokens. Inductor combines no CPU kernels,
    so this checks the plumbing and that the option is harmless here; test_gpu_ab's combo test checks that it
    combines kernels."""
    import contextlib

    import torch._inductor.config as inductor_config

    from hf_accel import engine_info
    from hf_accel.compilation import piecewise

    for on in (False, True):
        with inductor_config.patch(combo_kernels=not on), piecewise.inductor_settings(pdl=False, combo_kernels=on):
            assert inductor_config.combo_kernels is on
    assert inductor_config.combo_kernels is False

    in_force = []  # Inductor's setting while each piece compiles
    real = piecewise.inductor_settings

    @contextlib.contextmanager
    def spy(*args, **kwargs):
        with real(*args, **kwargs):
            in_force.append(inductor_config.combo_kernels)
            yield

    monkeypatch.setattr(piecewise, "inductor_settings", spy)
    model = compiled_qwen3_matching_stock(combo_kernels=True)
    assert in_force and all(in_force)
    info = engine_info(model)
    assert info["config"]["combo_kernels"] is True and info["combo_kernels"] is False  # asked for; none on CPU


def test_piece_that_inductor_refuses_with_combo_kernels_compiles_without_them(monkeypatch, caplog):
    """Inductor still raises for some pieces with combo kernels on (the default), e.g. a dynamic reduction dimension:
    such a piece compiles again without them, from an untouched copy of its graph, instead of the whole forward
    falling back to eager. Here every compile with them raises; every piece then compiles without them, the model
    stays compiled with stock's greedy tokens, and engine_info names the fallback."""
    import logging

    import torch._inductor.compile_fx as compile_fx_mod
    import torch._inductor.config as inductor_config

    from hf_accel import engine_info

    real = compile_fx_mod.compile_fx
    calls = []

    def refusing(gm, *args, **kwargs):
        calls.append(inductor_config.combo_kernels)
        if inductor_config.combo_kernels:
            gm.graph.erase_node(next(iter(reversed(gm.graph.nodes))))  # what a half-done pass may leave behind
            raise NotImplementedError("Dynamic shape on reduction dimension is not supported")
        return real(gm, *args, **kwargs)

    monkeypatch.setattr(compile_fx_mod, "compile_fx", refusing)
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        model = compiled_qwen3_matching_stock()  # combo kernels on: the default
    stats = model._hf_accel_state.engine.runner.piecewise.stats
    assert stats.num_compiled > 0 and stats.combo_fallback_pieces == stats.num_compiled
    assert calls == [True, False] * stats.num_compiled
    assert "combo_kernels_error" in engine_info(model)["fallbacks"]
    assert any("without them" in r.getMessage() for r in caplog.records)


def test_compile_with_one_sequence_per_step_falls_back_instead_of_failing():
    """max_num_seqs=1: the compiler needs an example step of two sequences, which the runner's buffers cannot hold;
    accelerate_model warns and runs uncompiled (it raised before), with greedy output equal to stock."""
    from hf_accel import accelerate_model, engine_info
    from hf_accel.config import AccelConfig

    model = make_model("llama", num_layers=1)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(10, 100, (1, 7))
    want = model.generate(ids, max_new_tokens=5, do_sample=False)
    accelerate_model(model, compile=True, num_kv_blocks=32, max_num_seqs=1,
                     config=AccelConfig(compile_cache_dir=""))
    assert "compile_error" in engine_info(model).get("fallbacks", {})
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), want)


@pytest.mark.parametrize("restored", [True, False])
def test_compiled_model_is_freed_once_dropped(restored):
    """A compiled model dropped by its user (after restore(), or still accelerated) is freed with its engine and
    compiled forward. torch.compile keeps every backend in a process-wide dict, Dynamo stores the compiled graph as
    a global of the compiled frame, and a guard on the model's forward is held by a `weakref.finalize` on it until
    it dies: each of these held the compiled pieces, their CUDA graphs and the model for the life of the process
    (a re-acceleration, e.g. a PEFT adapter switch, added one more set each time)."""
    import gc
    import weakref

    from hf_accel import accelerate_model, restore
    from hf_accel.config import AccelConfig

    model = make_model("llama", num_layers=1)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(10, 100, (1, 7))
    want = model.generate(ids, max_new_tokens=4, do_sample=False)
    accelerate_model(model, compile=True, num_kv_blocks=32, config=AccelConfig(compile_cache_dir=""))
    piecewise = model._hf_accel_state.engine.runner.piecewise
    assert piecewise is not None  # compiled, not the eager fallback
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), want)
    refs = [weakref.ref(x) for x in (model, piecewise, model._hf_accel_state.engine, piecewise.split_gm)]
    del piecewise
    if restored:
        restore(model)
    del model
    gc.collect()
    alive = [type(r()).__name__ for r in refs if r() is not None]
    assert not alive, f"still alive after the model was dropped: {alive}"


def test_accelerate_and_restore_pack_and_unpack_with_compile(tmp_path):
    from hf_accel import accelerate_model, restore

    model = make_model("llama", num_layers=2)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(10, 100, (1, 9))
    want = model.generate(ids, max_new_tokens=6, do_sample=False)
    from hf_accel.config import AccelConfig

    accelerate_model(model, compile=True, num_kv_blocks=64, config=AccelConfig(compile_cache_dir=""))
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), want)
    model.save_pretrained(tmp_path / "saved")  # packed views save as ordinary tensors
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.equal(reloaded.model.layers[0].self_attn.k_proj.weight, attn.k_proj.weight)
    restore(model)
    assert attn.k_proj.weight.untyped_storage().data_ptr() != attn.q_proj.weight.untyped_storage().data_ptr()


# ------------------------------------------------------------------ full graphs for mixed steps (capture skipped)
class _FakeFullGraphs:
    """Stands in for FullCUDAGraphRunner: replay returns logits whose row r holds r (one row per padded token) and
    greedy tokens 100 + r, as run_full's (logits, tokens) output."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.replayed = vocab, []

    def __contains__(self, key) -> bool:
        return True

    def replay(self, key):
        self.replayed.append(key)
        logits = torch.arange(key.num_tokens, dtype=torch.float32)[None, :, None].expand(1, key.num_tokens, self.vocab)
        return logits, 100 + torch.arange(key.num_tokens)


def test_full_mode_mixed_steps_gather_each_sequences_last_token():
    from hf_accel import accelerate_model, engine_info
    from hf_accel.attention.backend import CUDAGraphSupport as Support
    from hf_accel.compilation.dispatcher import BatchKey
    from hf_accel.engine.runner import ModelRunner

    assert ModelRunner.full_capture_query_lens(BatchKey(8, True), 4096) == [1] * 8
    assert ModelRunner.full_capture_query_lens(BatchKey(8, False), 4096) == [8]  # prefill-shaped: no decode path
    assert ModelRunner.full_capture_query_lens(BatchKey(1, False), 4096) == [1]
    assert ModelRunner.full_capture_query_lens(BatchKey(64, False), 24) == [24, 24, 16]  # within the context

    model = make_model("llama", num_layers=1)
    model.config._attn_implementation = "sdpa"
    model.config.max_position_embeddings = 32  # a context shorter than the largest capture sizes
    accelerate_model(model, attention_backend="torch", enforce_eager=True, num_kv_blocks=32)
    assert engine_info(model)["cudagraph_mode"] == "none"
    runner = model._hf_accel_state.engine.runner
    runner.dispatcher = CUDAGraphDispatcher("full", [8, 16], Support.ALWAYS, piecewise_available=False)
    runner.full_graphs = fake = _FakeFullGraphs(vocab=4)

    mixed, greedy = runner._compiled_forward(runner.dummy_inputs([3, 1, 2]))  # 6 tokens -> the mixed graph of 8
    assert fake.replayed[-1] == BatchKey(8, False)
    assert mixed[:, 0].tolist() == [2.0, 3.0, 5.0]  # each sequence's last token, not rows 0..2
    assert greedy.tolist() == [102, 103, 105]  # the graph's greedy tokens of the same rows

    decode, greedy = runner._compiled_forward(runner.dummy_inputs([1, 1, 1]))
    assert fake.replayed[-1] == BatchKey(8, True)
    assert decode[:, 0].tolist() == [0.0, 1.0, 2.0]
    assert greedy.tolist() == [100, 101, 102]

    # the capture step of a mixed graph larger than the context fits the persistent buffers (no width overflow)
    b = 2 * runner.max_model_len + 3
    lens = ModelRunner.full_capture_query_lens(BatchKey(b, False), runner.max_model_len)
    assert lens == [32, 32, 3]
    runner.upload(runner.dummy_inputs(lens), b, b)
    # and so does a piecewise graph's capture step (the large piecewise sizes reach 8,192 tokens, a context may be
    # 512: as one sequence its block table was wider than the buffer and the whole capture failed)
    assert ModelRunner.prefill_query_lens(b, runner.max_model_len) == lens
    runner.upload(runner.dummy_inputs(ModelRunner.prefill_query_lens(b, runner.max_model_len)))
    with pytest.raises(RuntimeError):  # what the capture step did before, and what must not happen again
        runner.upload(runner.dummy_inputs([b]))

    one_each = runner.dummy_inputs([1, 1, 1])  # one token each, but the middle one is a mid-prompt chunk
    one_each.logits_indices = np.array([0, 2], dtype=np.int64)
    got, greedy = runner._compiled_forward(one_each)
    assert fake.replayed[-1] == BatchKey(8, True)
    assert got[:, 0].tolist() == [0.0, 2.0]
    assert greedy.tolist() == [100, 102]


def test_compile_example_step_fits_the_context_and_the_batch(monkeypatch):
    """The first compiled step (whose token count Inductor tunes its kernels for): prefill sequences no longer than
    the context plus one decode row, `HF_ACCEL_COMPILE_TOKENS` tokens in all where the context and `max_num_seqs`
    allow, and a step the runner's buffers take."""
    from hf_accel import accelerate_model
    from hf_accel.engine import runner as runner_module

    monkeypatch.delenv("HF_ACCEL_COMPILE_TOKENS", raising=False)
    assert runner_module.compile_example_tokens(8192) == runner_module.COMPILE_EXAMPLE_TOKENS
    monkeypatch.setenv("HF_ACCEL_COMPILE_TOKENS", "256")
    assert runner_module.compile_example_tokens(8192) == 256
    assert runner_module.compile_example_tokens(100) == 100  # never past the step buffers
    for low in ("1", "2", "0", "-5"):  # the compiler needs distinct token and sequence counts, both >= 2
        monkeypatch.setenv("HF_ACCEL_COMPILE_TOKENS", low)
        assert runner_module.compile_example_tokens(8192) == 3
    assert runner_module.compile_example_tokens(1) == 1  # but never past the buffers
    monkeypatch.setenv("HF_ACCEL_COMPILE_TOKENS", "abc")
    with pytest.raises(ValueError, match="HF_ACCEL_COMPILE_TOKENS"):
        runner_module.compile_example_tokens(8192)
    monkeypatch.setenv("HF_ACCEL_COMPILE_TOKENS", "1")

    model = make_model("llama", num_layers=1)
    model.config._attn_implementation = "sdpa"
    model.config.max_position_embeddings = 32
    accelerate_model(model, attention_backend="torch", enforce_eager=True, num_kv_blocks=64)
    runner = model._hf_accel_state.engine.runner
    assert runner.compile_example_lens(16) == [15, 1]  # the step compiled before the switch existed
    assert runner.compile_example_lens(3) == [2, 1]  # the smallest that compiles (3 tokens, 2 sequences)
    assert runner.compile_example_lens(256)[-1] == 1 and max(runner.compile_example_lens(256)) <= 32
    lens = runner.compile_example_lens(256)
    assert sum(lens) == min(256, (runner.max_num_seqs - 1) * 32 + 1) and len(lens) <= runner.max_num_seqs
    runner.upload(runner.dummy_inputs(lens))  # the buffers take it
    monkeypatch.setattr(runner, "max_num_seqs", 3)
    assert runner.compile_example_lens(256) == [32, 32, 1]
    assert runner.compile_example_lens(1) == [1]
    monkeypatch.setattr(runner, "max_num_seqs", 1)
    assert runner.compile_example_lens(256) == [32]


@pytest.mark.parametrize("mutate", [False, True])
def test_linear_merge_never_crosses_an_in_place_write(mutate):
    from hf_accel.compilation.linear_packing import merge_packed_linears

    packed = torch.randn(12, 4)
    wq, wk, wv = packed[:4], packed[4:8], packed[8:]  # consecutive rows of one storage, as packing leaves them
    merged = []

    def backend(gm, example_inputs):
        merged.append(merge_packed_linears(gm, example_inputs))
        return gm.forward

    def fn(x, wq, wk, wv):
        h = x * 1
        q = torch.nn.functional.linear(h, wq)
        if mutate:
            h.mul_(2)  # k and v must see the doubled input
        return q, torch.nn.functional.linear(h, wk), torch.nn.functional.linear(h, wv)

    x = torch.randn(3, 4)
    torch._dynamo.reset()
    got = torch.compile(fn, backend=backend, fullgraph=True)(x, wq, wk, wv)
    want = fn(x, wq, wk, wv)
    assert merged == [0 if mutate else 1]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_restore_puts_the_inductor_cache_dir_back(tmp_path, monkeypatch):
    from hf_accel import accelerate_model, restore
    from hf_accel.config import AccelConfig

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "users_own"))
    model = make_model("llama", num_layers=1)
    model.config._attn_implementation = "sdpa"
    accelerate_model(model, compile=True, num_kv_blocks=32, config=AccelConfig(compile_cache_dir=str(tmp_path)))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path))  # ours while accelerated
    restore(model)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "users_own")


@pytest.mark.gpu
@needs_cuda
def test_gpu_failed_capture_leaves_the_allocator_and_rng_usable():
    """A capture that fails (a host read inside it) raises fn's error, and afterwards the device's random ops still
    run: torch marks the default generator as capturing until a capture ends cleanly, so without the re-arm every
    later torch.randint on the device raised "Offset increment outside graph capture" (found 2026-12-01)."""
    from hf_accel.compilation.cuda_graph import capture_graph

    x = torch.ones(8, device="cuda")

    def host_read():
        return (x * 2).sum().item()

    torch.manual_seed(5)
    noise = torch.empty(4, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    earlier, _ = capture_graph(lambda: noise.uniform_(), pool=pool)  # a graph that draws random numbers
    earlier.replay()
    first = noise.clone()
    with pytest.raises(Exception, match="operation not permitted when stream is capturing") as failed:
        capture_graph(host_read, pool=pool)  # the same pool: the live graph's reference must survive the release
    assert failed.value.__context__ is None  # the capture's own error, not a cleanup step's
    earlier.replay()  # the earlier graph still replays and advances the generator
    assert not torch.equal(noise, first)
    # the allocator knows the capture is over: a freed block used on another stream goes back at once (while it
    # believes a capture is under way it defers such frees for good; an engine after a failed capture found
    # 122 GiB gone)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    side = torch.cuda.Stream()
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    big.record_stream(side)
    del big
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= before
    a = torch.randint(0, 1000, (16,), device="cuda")
    torch.manual_seed(3)
    b = torch.rand(4, device="cuda")
    torch.manual_seed(3)
    assert torch.equal(b, torch.rand(4, device="cuda"))  # seeding still governs the generator
    graph, out = capture_graph(lambda: x * 3, pool=None)  # and a later capture works and replays
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 3) and a.shape == (16,)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_upload_never_rewrites_a_host_mirror_a_pending_copy_reads(device):
    """Step inputs go to the device through pinned host mirrors (one per buffer, reused): an upload must wait until
    the copies of the one before it have left the mirrors, warm-up uploads that never reach `_stage` included, and
    an upload cut short by an exception must still mark its copies. On CUDA the GPU is held busy (`_sleep`) so the
    first upload's copies are still queued when the second one writes its mirrors."""
    from hf_accel import accelerate_model

    model = make_model("llama", num_layers=1, device=device)
    accelerate_model(model, attention_backend="torch", enforce_eager=True, num_kv_blocks=32)
    runner = model._hf_accel_state.engine.runner
    first, second = runner.dummy_inputs([3]), runner.dummy_inputs([5])
    first.input_ids = np.arange(100, 103, dtype=np.int64)
    second.input_ids = np.arange(200, 205, dtype=np.int64)
    runner.upload(runner.dummy_inputs([5]))  # every mirror allocated now: no pinned allocation below may sync
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the copies below
    runner.upload(first)
    seen = runner.input_ids[:3].clone()  # queued after the first upload's copies
    seen_lens = (runner.query_start_loc[:2].clone(), runner.seq_lens[:1].clone())  # the shared per-sequence copy
    runner.upload(second)
    if device == "cuda":
        torch.cuda.synchronize()
    assert seen.tolist() == [100, 101, 102]
    assert [t.tolist() for t in seen_lens] == [[0, 3], [3]]
    assert runner.input_ids[:5].tolist() == list(range(200, 205))
    assert runner.query_start_loc[:2].tolist() == [0, 5] and runner.seq_lens[:1].tolist() == [5]

    broken = runner.dummy_inputs([2])
    broken.pending_rows, broken.pending_src = [1], [0]  # a pending token with no previous step's tokens
    before = runner.inputs_ready
    with pytest.raises(RuntimeError, match="internal error"):
        runner.upload(broken)
    if device == "cuda":
        assert runner.inputs_ready is not None and runner.inputs_ready is not before  # its copy is marked
    else:
        assert runner.inputs_ready is None  # CPU copies are synchronous: nothing to wait for


@pytest.mark.parametrize("can_split", [False, True])
def test_split_mixed_attention_reaches_the_backend(monkeypatch, caplog, can_split):
    """AccelConfig.split_mixed_attention: None (the default) and True turn it on where the backend has a split path,
    False off; an explicit True says so where it has no effect. On the CPU the torch backend stands in for both
    kinds of backend (it has no split path; posing as one, since the triton backend needs a GPU), and
    cudagraph_mode="full" runs without graphs (nothing is captured whole), so the split stays on there and nothing
    is logged; on the GPU, tests/test_gpu_ab.py checks the triton backend and that "full" turns it off."""
    import logging

    from hf_accel import accelerate_model, restore
    from hf_accel.api import engine_of
    from hf_accel.attention.torch_backend import TorchAttentionBackend
    from hf_accel.attention.triton_backend import TritonAttentionBackend
    from hf_accel.config import AccelConfig

    assert AccelConfig().split_mixed_attention is None and TritonAttentionBackend.splits_mixed_steps
    if can_split:
        monkeypatch.setattr(TorchAttentionBackend, "splits_mixed_steps", True)
    model = make_model("qwen3", num_layers=2)
    for split, mode in ((None, None), (True, None), (False, None), (None, "full"), (True, "full")):
        kwargs = {"cudagraph_mode": mode} if mode else {}
        with caplog.at_level(logging.INFO, logger="hf_accel"):
            accelerate_model(model, num_kv_blocks=64, config=AccelConfig(split_mixed_attention=split,
                                                                         compile_cache_dir=""), **kwargs)
        assert engine_of(model).backend.split_mixed is (can_split and split is not False), (split, mode)
        noted = "split_mixed_attention=True has no effect here (the torch backend" in caplog.text
        assert noted is (split is True and not can_split), (split, mode)
        if can_split:
            assert "split_mixed_attention=True has no effect" not in caplog.text, (split, mode)
        caplog.clear()
        restore(model)
