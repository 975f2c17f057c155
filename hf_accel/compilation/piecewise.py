"""Piecewise compilation: one Dynamo trace of the forward, cut at every attention op.

Why: attention runs on per-step metadata (sequence boundaries, block tables) whose shapes change every step, so it
cannot live inside a CUDA graph captured for a token count; everything else in a decoder layer depends only on the
token count T. So the traced forward is split at each `torch.ops.hf_accel.attention` call: attention runs eagerly,
and each piece between two attention calls is compiled once by Inductor for a symbolic T (fusing RMSNorm+residual,
SiLU*mul, RoPE) and, on CUDA, captured as one graph per padded T and replayed.

Pieces whose inputs carry another dynamic size (the last piece gathers `logits_indices`, of length N) run compiled
but never as graphs; T values that were not captured run the compiled pieces without graphs.

Structurally identical pieces (the middle layers of a model) are compiled once and the compiled code is shared: a
32-layer model costs three Inductor compiles, not 33.

Calls after the first bypass Dynamo: the trace is done once, then the compiled split graph is called directly with
the arguments laid out as Dynamo traced them. That removes the per-call guard evaluation (hundreds of weight guards)
and Dynamo's 0/1 specialization (T=1 or N=1 would otherwise recompile at runtime, on a user's request). The binding
is checked against what Dynamo itself passed on the first call; if it cannot be proven, calls go through Dynamo.

Graph input contract: captured pieces read their inputs at the addresses seen during capture. Activations flowing
between pieces are graph outputs and keep their addresses by construction. The forward's own inputs
(`input_ids`, `position_ids`) should be slices `buf[:, :T]` of persistent buffers: then replay copies nothing. Any
other tensor is copied into the captured one (correct, slightly slower).
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import hashlib
import itertools
import logging
import os
import time
import types
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_symbols
from torch.fx.passes.split_module import split_module
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import hf_accel.attention.op  # noqa: F401  (registers torch.ops.hf_accel.attention)
from hf_accel.compilation.cuda_graph import CaptureMemory, capture_graph, capture_with_warmups, weak_ref_tree
from hf_accel.compilation.gated_activation import fuse_silu_mul_into_linears
from hf_accel.compilation.linear_packing import merge_packed_linears
from hf_accel.compilation.norm_folding import chain_residual_norms, fold_norms_into_linears
from hf_accel.compilation.small_m_linear import route_int8_weight_only_linears, route_small_m_linears
from hf_accel.compilation.trace_cache import TraceCache

logger = logging.getLogger(__name__)


def default_splitting_ops() -> tuple[Any, ...]:
    return (torch.ops.hf_accel.attention, torch.ops.hf_accel.attention.default)


@dataclass
class CompileStats:
    num_pieces: int = 0  # compute pieces (attention excluded)
    num_attention: int = 0  # attention submodules (one per layer)
    num_compiled: int = 0  # distinct compiles after sharing identical pieces
    num_graphable: int = 0  # pieces that get CUDA graphs
    num_merged_linears: int = 0  # groups of sibling linears run as one GEMM (linear_packing)
    routed_linears: list[tuple[int, int, bool]] = field(default_factory=list)  # (n, k, bias) via hf_accel::linear
    # (n, k, bias) of each torchao int8 weight-only linear run through hf_accel::int8_weight_linear
    int8_weight_linears: list[tuple[int, int, bool]] = field(default_factory=list)
    folded_norms: int = 0  # RMSNorms (with their residual adds) run inside the linear after them (norm_folding)
    # (n, k, bias) of each gate/up linear that runs with the SiLU-and-mul after it as one op (gated_activation)
    gated_linears: list[tuple[int, int, bool]] = field(default_factory=list)
    # each folded norm whose residual add's linear joined its op (norm_folding.chain_residual_norms): the two
    # linears' weight shapes (the places ops.linear.tune_linears times chain tiles for)
    chain_pairs: list = field(default_factory=list)
    # pieces whose compile with Inductor's combo kernels raised and that compiled again without them
    combo_fallback_pieces: int = 0
    trace_seconds: float = 0.0  # Dynamo trace (first call, up to the backend), or reading the stored trace
    # where the traced graph came from: "dynamo", "stored" (compilation/trace_cache.py) or "" before compile()
    trace_source: str = ""
    compile_seconds: float = 0.0  # split + Inductor
    capture_seconds: float = 0.0
    # where capture time goes: the untimed warm-up forward per size, and the capturing forward itself
    capture_warmup_seconds: float = 0.0
    capture_record_seconds: float = 0.0
    capture_warmups: int = 0  # sizes warmed up (the first of each warm-up class, and any retried)
    capture_retries: int = 0  # sizes whose capture without a warm-up of their own failed and was redone
    captured_sizes: list[int] = field(default_factory=list)
    pool_bytes_allocated: int = 0
    pool_bytes_reserved: int = 0

    @property
    def chained_norms(self) -> int:
        """Folded norms whose residual add's linear joined their op."""
        return len(self.chain_pairs)


def start_compile_workers() -> bool:
    """Start Inductor's pool of kernel-compile worker processes now, in the background; True if it was started.

    Inductor builds (and, at a warm start, loads from its cache) the pieces' Triton kernels in worker processes that
    it starts on first use, each importing torch: seconds at the first compiled piece. torch.compile's own backend
    starts them as Dynamo begins; our pieces call `compile_fx` directly, so accelerate_model starts them once the
    attention backend is chosen, and they come up while the KV cache is sized and the trace is read or made. Nothing
    happens where Inductor would not use them (one compile thread, `TORCH_WARM_POOL=0`, no triton)."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:
        return False
    try:
        maybe_warm_pool()
    except Exception as exc:  # the pool then starts on first use, as before
        logger.debug("hf_accel: could not start Inductor's compile workers early: %s", exc)
        return False
    return True


def inductor_settings(pdl: bool, eager_casts: bool = False,
                      combo_kernels: bool = False) -> contextlib.AbstractContextManager:
    """Inductor config for the pieces, whatever the process set globally, so each switch is one flag here:

    - generated Triton kernels use PDL (`triton.enable_pdl`, torch >= 2.10) when `pdl`, explicitly not otherwise
      (TORCHINDUCTOR_ENABLE_PDL aside);
    - no coordinate-descent tuning. torchao's quantization configs switch it on for the whole process when they
      quantize a model (`recommended_inductor_config_setter`); it then re-times every generated kernel on its first
      run, which took a llama-3.1-8b float8 start from about 20 s of compile to 166 s on the H200, for kernels that
      are a small part of a decode step next to the GEMMs and attention;
    - with `eager_casts`, fused kernels round each intermediate to its eager dtype and divide exactly, as eager
      PyTorch does (`eager_rounding_settings`), for models that quantize activations
      (`patches.quantization.quantizes_activations` says why); elsewhere Inductor's extra precision is kept;
    - each generated reduction kernel gets one launch configuration from Inductor's heuristics
      (`fixed_reduction_settings`) instead of the fastest of several timed at its first launch;
    - with `combo_kernels`, Inductor launches independent GPU kernels of a piece together, up to eight per launch
      (horizontal fusion): Qwen3's q-norm + RoPE and k-norm + RoPE kernels become one launch per layer
      (`AccelConfig.combo_kernels`); explicitly not otherwise. Inductor combines no CPU kernels.
    """
    import torch._inductor.config as inductor_config

    settings: dict[str, Any] = {"coordinate_descent_tuning": False, "coordinate_descent_check_all_directions": False}
    settings.update(fixed_reduction_settings(inductor_config))
    settings["combo_kernels"] = bool(combo_kernels)
    if hasattr(inductor_config.triton, "enable_pdl"):
        settings["triton.enable_pdl"] = bool(pdl)
    if eager_casts:
        settings.update(eager_rounding_settings(inductor_config))
    return inductor_config.patch(settings)


def fixed_reduction_settings(inductor_config: Any) -> dict[str, bool]:
    """Inductor's switch that gives each reduction kernel one configuration by its heuristics (which it otherwise
    times among up to four at the kernel's first launch), unless HF_ACCEL_INDUCTOR_AUTOTUNE_REDUCTIONS=1.

    Why: the first launch is the compile example's step (16 tokens, `engine.runner.COMPILE_EXAMPLE_TOKENS`), where
    the candidates of a small reduction such as Qwen3's q/k norm + RoPE time within noise of each other, and the one
    picked then serves every step shape. Which one won differed between builds: on an H100 the q-norm + RoPE kernel
    took 3.1 us a call at W3's 256 decode rows in one build and 11.4 us in another (the same kernel source, a
    `gated_gemm` build), costing that build about 1 % of W3. A fixed choice also gives every build of a model the
    same kernels, so the same bits (the candidates differ in warps, so in their reduction order).

    The switch is the config filter that Inductor's `deterministic` mode applies
    (`filter_reduction_configs_for_determinism`), without that mode's other effects; torch files it under
    `test_configs`, so it is set only where it exists. It is part of Inductor's FX graph cache key, so a warm cache
    never serves kernels of the other setting."""
    if os.environ.get("HF_ACCEL_INDUCTOR_AUTOTUNE_REDUCTIONS", "").strip() == "1":
        return {}
    if hasattr(getattr(inductor_config, "test_configs", None), "force_filter_reduction_configs"):
        return {"test_configs.force_filter_reduction_configs": True}
    return {}


def eager_rounding_settings(inductor_config: Any) -> dict[str, bool]:
    """The Inductor switches that make fused kernels round as eager PyTorch does, under whichever names this torch
    has: keep each intermediate's downcast (`emulate_precision_casts`), and divide with IEEE rounding. Triton's
    float32 `/` is an approximate division (`div.full.f32`, up to 2 ulp off) where eager rounds exactly; torchao's
    float8 quantization divides each activation by its scale just before the e4m3 cast, so one ulp there is a whole
    quantization step. The switch is `emulate_divison_rounding` (sic) up to torch 2.11 and
    `eager_numerics.division_rounding` after."""
    out: dict[str, bool] = {}
    if hasattr(inductor_config, "emulate_precision_casts"):
        out["emulate_precision_casts"] = True
    if hasattr(inductor_config, "emulate_divison_rounding"):
        out["emulate_divison_rounding"] = True
    elif hasattr(getattr(inductor_config, "eager_numerics", None), "division_rounding"):
        out["eager_numerics.division_rounding"] = True
    return out


def _is_splitting_node(node: torch.fx.Node, ops: Sequence[Any]) -> bool:
    return node.op == "call_function" and any(node.target is op for op in ops)


def _describe(value: Any) -> str:
    """What an input looks like to a compiled piece (shape/stride symbols included), for sharing compiles."""
    if isinstance(value, torch.Tensor):
        outer = (f"T({tuple(value.shape)},{value.stride()},{value.storage_offset()},{value.dtype},"
                 f"{value.device},{value.requires_grad})")
        if is_traceable_wrapper_subclass(value):
            # a quantized weight (torchao): the compiled code is specialised to its type, its metadata (block
            # size, ...) and each inner tensor's layout, not only to the outer shape. Two layers whose scales
            # differ in shape or dtype must not share one artifact (they once did: an assertion, or wrong tokens)
            names, ctx = value.__tensor_flatten__()
            inner = ",".join(f"{n}={_describe(getattr(value, n))}" for n in names)
            return f"{outer}:{type(value).__qualname__}[{ctx!r}]({inner})"
        return outer
    if isinstance(value, torch.SymInt):
        return f"S({value.node.expr})"
    return f"C({type(value).__name__}:{value!r})"


def _target_name(target: Any) -> str:
    try:
        return torch.fx.node._get_qualified_name(target)
    except Exception:  # a local function or other oddity: equal only to itself
        return f"{target!r}@{id(target)}"


def graph_signature(gm: torch.fx.GraphModule, args: Sequence[Any]) -> str | None:
    """A hash equal for two pieces exactly when one compiled artifact can serve both (None: never share)."""
    index: dict[torch.fx.Node, int] = {}
    parts: list[str] = []
    placeholders = 0
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "placeholder":
            parts.append("in:" + _describe(args[placeholders]))
            placeholders += 1
            continue
        if node.op in ("get_attr", "call_module"):
            return None  # holds module state: not shareable
        fmt = lambda a: torch.fx.node.map_arg(a, lambda n: f"%{index[n]}")  # noqa: B023
        target = node.target if isinstance(node.target, str) else _target_name(node.target)
        parts.append(f"{node.op}:{target}:{fmt(node.args)!r}:{fmt(node.kwargs)!r}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


_entry_counter = itertools.count()


def _fresh_entry(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A wrapper with its own code object and its own globals.

    The code object: Dynamo caches compiled frames per code object and caps recompiles (8), so models compiled in
    one process through the same forward function would otherwise exhaust one shared cap. The globals: Dynamo
    stores the compiled graph as a global of the compiled frame (`__compiled_fn_...`); in this module's globals
    that entry would keep the compiled pieces, their CUDA graphs and the model alive for the life of the process.
    In a dict of the wrapper's own it goes when the wrapper does."""

    def entry(*args: Any) -> Any:
        return fn(*args)

    code = entry.__code__.replace(co_name=f"hf_accel_forward_{next(_entry_counter)}")
    own_globals = {"__builtins__": builtins, "__name__": __name__}
    return types.FunctionType(code, own_globals, code.co_name, None, entry.__closure__)


def _alive(ref: weakref.ref) -> Any:
    """The object behind `ref`; a clear error if it was freed (a trace of a compiled forward that is gone)."""
    obj = ref()
    if obj is None:
        raise RuntimeError("hf_accel: the compiled forward this trace belongs to was freed")
    return obj


class _WeakBackend:
    """The torch.compile backend handed to Dynamo: calls `PiecewiseForward._backend` through a weak reference.

    Dynamo keeps every backend it is given in a process-wide dict until `torch._dynamo.reset()`
    (`torch._dynamo.eval_frame.cached_backends`). Handed the bound method, it kept the PiecewiseForward alive for
    the life of the process, and with it the model (weights), the compiled pieces and every captured piecewise CUDA
    graph with its memory pool, after restore() and after the model itself was dropped. Only this small object
    stays there now."""

    __slots__ = ("_owner",)
    __name__ = "hf_accel_piecewise_backend"  # what Dynamo's messages call the backend

    def __init__(self, owner: PiecewiseForward) -> None:
        self._owner = weakref.ref(owner)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        return _alive(self._owner)._backend(gm, example_inputs)


class _DynamoEntry:
    """What the backend gives Dynamo to stand for the traced graph: the split graph, reached through weak references.

    Dynamo keeps it alive from its guards, and a guard on an object (the model's forward) is held by a
    `weakref.finalize` on that same object until it dies, which it could never do while this entry held the
    split graph (and through it the PiecewiseForward and the model) strongly. On its first call inside compile()
    it records what Dynamo passes and gets back, which proves (or not) the direct-call layout; the first call of a
    graph Dynamo recompiled while serving is a step like any other, and keeping its inputs and logits would hold
    them until the next recompile."""

    __slots__ = ("_owner", "_split_gm", "_recorded")

    def __init__(self, owner: PiecewiseForward, split_gm: torch.fx.GraphModule) -> None:
        self._owner = weakref.ref(owner)
        self._split_gm = weakref.ref(split_gm)
        self._recorded = False

    def __call__(self, *args: Any) -> Any:
        out = _alive(self._split_gm).forward(*args)
        if not self._recorded:
            self._recorded = True
            owner = _alive(self._owner)
            if owner._tracing_args is not None:  # compile()'s own call: _finish_binding reads it and lets go
                owner._first_call_args, owner._first_call_out = list(args), out
        return out


class _Capture:
    """One captured piece for one T: the graph, its (weak) outputs and the inputs whose addresses it reads."""

    __slots__ = ("graph", "outputs", "checks")

    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: Any,
                 checks: list[tuple[int, int, torch.Tensor | None]]) -> None:
        self.graph = graph
        self.outputs = outputs
        self.checks = checks  # (arg index, data_ptr at capture, the captured tensor if we own a copy target)


class PieceRunner:
    """Runs one compiled piece: from its CUDA graph when one is captured for this T, else the compiled code."""

    def __init__(self, owner: PiecewiseForward, index: int, fn: Callable, size_arg: tuple[int, int | None] | None,
                 graphable: bool, check_args: list[int]) -> None:
        self.owner = owner
        self.index = index
        self.fn = fn
        self.size_arg = size_arg
        self.graphable = graphable
        self.check_args = check_args
        self.captures: dict[int, _Capture] = {}

    def _size(self, args: Sequence[Any]) -> int:
        i, dim = self.size_arg  # type: ignore[misc]
        return int(args[i]) if dim is None else args[i].shape[dim]

    def __call__(self, *args: Any) -> Any:
        owner = self.owner
        if not self.graphable or not owner.graphs_enabled:
            return self.fn(*args)
        size = self._size(args)
        cap = self.captures.get(size)
        if cap is not None:
            return self._replay(cap, args, size)
        if owner.capturing_size == size and not torch.cuda.is_current_stream_capturing():
            return self._capture(args, size)
        return self.fn(*args)

    def _replay(self, cap: _Capture, args: Sequence[Any], size: int) -> Any:
        if torch.cuda.is_current_stream_capturing():  # inside someone else's (full) capture: no nesting
            return self.fn(*args)
        for i, ptr, static in cap.checks:
            arg = args[i]
            if arg.data_ptr() != ptr:
                if static is None:
                    raise RuntimeError(
                        f"piecewise CUDA graph of piece {self.index} (T={size}): input {i} moved; it is an output of "
                        "an earlier captured piece and must keep its address")
                static.copy_(arg)
        cap.graph.replay()
        return cap.outputs

    def _capture(self, args: Sequence[Any], size: int) -> Any:
        owner = self.owner
        checks: list[tuple[int, int, torch.Tensor | None]] = []
        for i in self.check_args:
            arg = args[i]
            # outputs of earlier captured pieces live in the pool and keep their address; anything else we keep
            # alive so a moved input can be copied into it at replay
            in_pool = arg.untyped_storage().data_ptr() in owner.pool_ptrs
            checks.append((i, arg.data_ptr(), None if in_pool else arg))
        graph, out = capture_graph(lambda: self.fn(*args), owner.graph_pool)
        graph.replay()  # capture only records the kernels: run them so this forward's result is real
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                owner.pool_ptrs.add(t.untyped_storage().data_ptr())
        self.captures[size] = _Capture(graph, weak_ref_tree(out), checks)
        # Return the real (owning) outputs: the pool must see them alive exactly as long as this forward uses them,
        # so later captures reuse only memory that is dead by then. Replays return the weak aliases.
        return out


class PiecewiseForward:
    """The compiled forward: `logits = pf(input_ids[1, T], position_ids[1, T], logits_indices[N])`.

    Lifecycle (all at warm-up, never on a user's request):
    1. `compile(input_ids, position_ids, logits_indices)`: the first call. Traces (Dynamo), splits, compiles and
       runs once; the caller sets the forward context around it, exactly as for any forward. T >= 2, N >= 2 and
       N != T there (Dynamo would otherwise specialize or unify the two sizes).
    2. `capture(sizes, run_fn)`: for each T in `sizes`, largest first, `run_fn(T)` must run one forward at padded
       size T (context set, buffers filled) through this object; it is called twice (warm-up, then capture).
    3. `pf(...)`: any T >= 1, any N >= 1; captured T replay graphs, others run compiled.
    """

    def __init__(self, forward_fn: Callable[..., torch.Tensor], *, capture_sizes: Iterable[int] = (),
                 use_cudagraph: bool = False, graph_pool: Any = None, compiler: str = "inductor",
                 splitting_ops: Sequence[Any] | None = None, share_identical_pieces: bool = True,
                 token_dims: Sequence[tuple[int, int]] = ((0, 1), (1, 1)),
                 other_dynamic_dims: Sequence[tuple[int, int]] = ((2, 0),),
                 bypass_dynamo: bool = True, merge_linears: bool = True, route_linears: bool = False,
                 pdl: bool = False, eager_casts: bool = False, trace_cache: TraceCache | None = None,
                 fold_norms: bool = False, gated_gemm: bool = False, combo_kernels: bool = False,
                 chain_residual_norms: bool = False) -> None:
        """`route_linears`: linears go through `hf_accel::linear` (small-M GEMM where tuned; compile pass
        `small_m_linear`). `fold_norms` (with `route_linears`): RMSNorms feeding one routed linear go into it
        (compile pass `norm_folding`). `gated_gemm` (with `route_linears`): a gate/up linear and the SiLU-and-mul
        after it become one op (compile pass `gated_activation`). `chain_residual_norms` (with `fold_norms`): the
        linear whose output a folded norm's residual add takes joins that op (`norm_folding.chain_residual_norms`).
        `pdl`: Inductor's kernels are generated with programmatic dependent launch
        (sm90+). `combo_kernels`: Inductor launches a piece's independent GPU kernels together (`inductor_settings`).
        `eager_casts`: Inductor rounds intermediates as eager does (`inductor_settings`). `trace_cache`: where the
        traced graph is stored and found again (a later start skips Dynamo; compilation/trace_cache.py)."""
        if compiler not in ("inductor", "eager"):
            raise ValueError(f"compiler must be 'inductor' or 'eager', got {compiler!r}")
        self.forward_fn = forward_fn
        self.capture_sizes = sorted({int(s) for s in capture_sizes})
        self.use_cudagraph = use_cudagraph
        self.graph_pool = graph_pool
        self.compiler = compiler
        self.splitting_ops = tuple(splitting_ops) if splitting_ops is not None else default_splitting_ops()
        self.share_identical_pieces = share_identical_pieces
        self.token_dims = tuple(token_dims)
        self.other_dynamic_dims = tuple(other_dynamic_dims)
        self.bypass_dynamo = bypass_dynamo
        self.merge_linears = merge_linears
        self.route_linears = route_linears
        self.fold_norms = fold_norms
        self.gated_gemm = gated_gemm
        self.chain_residual_norms = chain_residual_norms
        self.combo_kernels = combo_kernels
        self.pdl = pdl
        self.eager_casts = eager_casts
        self.trace_cache = trace_cache
        self._trace_blob: bytes | None = None  # the traced graph as stored, once compile() has proved it works
        self.stats = CompileStats()
        # set by the backend
        self.split_gm: torch.fx.GraphModule | None = None
        self.pieces: list[PieceRunner] = []
        self.attention_names: list[str] = []
        self.piece_names: list[str] = []
        self.num_backend_calls = 0
        # CUDA graph state
        self.graphs_enabled = False
        self.capturing_size: int | None = None
        self.pool_ptrs: set[int] = set()
        # direct-call binding (Dynamo bypass)
        self._dynamo_fn: Callable | None = None
        self._tracing_args: tuple[torch.Tensor, ...] | None = None
        self._template: list[Any] | None = None
        self._arg_slots: list[tuple[int, int]] = []
        self._size_slots: list[tuple[int, int, int, int]] = []
        self._direct: Callable | None = None
        self._bind_error: str | None = None
        self._first_call_args: list[Any] | None = None
        # every split graph built, kept here (the entries standing for them hold them weakly): after a Dynamo
        # recompile, inputs that pass an earlier entry's guards still run that entry's graph
        self._split_graphs: list[torch.fx.GraphModule] = []
        self._first_call_out: Any = None

    # ------------------------------------------------------------------ compile
    @property
    def compiled(self) -> bool:
        return self.split_gm is not None

    @property
    def bypasses_dynamo(self) -> bool:
        return self._direct is not None

    def compile(self, *example_inputs: torch.Tensor) -> torch.Tensor:
        """Trace, split, compile and run the forward once on `example_inputs` (forward context must be set)."""
        if self.compiled:
            return self(*example_inputs)
        self._check_example(example_inputs)
        if self.trace_cache is not None:
            out = self._compile_stored(tuple(example_inputs))
            if out is not None:
                return out
        for k, d in self.token_dims + self.other_dynamic_dims:
            torch._dynamo.mark_dynamic(example_inputs[k], d)
        self._dynamo_fn = torch.compile(_fresh_entry(self.forward_fn), backend=_WeakBackend(self), fullgraph=True)
        self._tracing_args = tuple(example_inputs)
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                out = self._dynamo_fn(*example_inputs)
                total = time.perf_counter() - t0
            if not self.compiled:
                raise RuntimeError("torch.compile ran the forward without calling the hf_accel backend "
                                   "(Dynamo recompile limit reached, or compilation disabled?)")
            self._finish_binding(out, tuple(example_inputs))
        finally:
            self._tracing_args = None
        self.stats.trace_seconds = max(0.0, total - self.stats.compile_seconds)
        self.stats.trace_source = "dynamo"
        if self.trace_cache is not None and self._trace_blob is not None and self.bypasses_dynamo:
            self.trace_cache.store(self._trace_blob)  # only a graph whose direct calls were proved is stored
        self._log_compiled(total)
        return out

    def _compile_stored(self, example_inputs: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """compile() from the stored trace, without Dynamo; None when there is none or it cannot be used."""
        t0 = time.perf_counter()
        loaded = self.trace_cache.load(example_inputs)  # type: ignore[union-attr]
        if loaded is None:
            return None
        self._tracing_args = example_inputs
        try:
            with torch.no_grad():
                forward = self._build_rebuilt(*loaded)
                if self._template is None or self._bind_error is not None:
                    raise RuntimeError(self._bind_error or "no direct-call layout")
                out = forward(*self._bind(example_inputs))[0]  # the first call, recorded as Dynamo's would be
                self._finish_binding(out, example_inputs)
                if not self.bypasses_dynamo:
                    raise RuntimeError(self._bind_error or "direct calls unavailable")
        except Exception as exc:
            logger.warning("hf_accel: compiling the stored traced forward failed (%s: %s); tracing it again",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self._reset_compiled()
            return None
        finally:
            self._tracing_args = None
        total = time.perf_counter() - t0
        self.stats.trace_seconds = max(0.0, total - self.stats.compile_seconds)
        self.stats.trace_source = "stored"
        self._log_compiled(total)
        return out

    def _reset_compiled(self) -> None:
        """Forget a half-built compile (a stored trace that failed), so that compile() can trace afresh."""
        self.split_gm, self.pieces, self.attention_names, self.piece_names = None, [], [], []
        self._template, self._arg_slots, self._size_slots = None, [], []
        self._direct, self._bind_error = None, None
        self._first_call_args = self._first_call_out = None
        self._split_graphs = []
        self.stats = CompileStats()

    def _log_compiled(self, total: float) -> None:
        logger.info(
            "piecewise compile: %d pieces (%d compiled, %d graphable, %d merged linear groups) + %d attention ops "
            "in %.2f s "
            "(trace+first run %.2f s, split+%s %.2f s); %s", self.stats.num_pieces, self.stats.num_compiled,
            self.stats.num_graphable, self.stats.num_merged_linears, self.stats.num_attention, total,
            self.stats.trace_seconds, self.compiler,
            self.stats.compile_seconds,
            "calls bypass Dynamo" if self.bypasses_dynamo else f"calls go through Dynamo ({self._bind_error})")

    def _check_example(self, example_inputs: Sequence[torch.Tensor]) -> None:
        tok = {example_inputs[k].shape[d] for k, d in self.token_dims}
        other = [example_inputs[k].shape[d] for k, d in self.other_dynamic_dims]
        if len(tok) != 1:
            raise ValueError(f"token dims disagree in the example inputs: {tok}")
        (t,) = tok
        sizes = [t, *other]
        if min(sizes) < 2 or len(set(sizes)) != len(sizes):
            raise ValueError(
                f"compile with distinct dynamic sizes >= 2 (got T={t}, others={other}): Dynamo specializes sizes "
                "0/1 and would merge equal sizes into one symbol")

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        """The torch.compile backend: split at the splitting ops, compile the pieces, return the split graph."""
        self.num_backend_calls += 1
        if self.split_gm is not None:
            logger.warning("hf_accel piecewise backend called again (Dynamo recompiled the forward)")
        if self._tracing_args is not None and self.trace_cache is not None:
            # compile what a later start will read back, not Dynamo's own metadata: cold and warm starts then give
            # Inductor identical graphs (same symbols), so the warm one hits Inductor's cache
            blob = self.trace_cache.encode(gm, example_inputs, self._tracing_args)
            if blob is not None:
                try:
                    rebuilt = self.trace_cache.decode(blob, self._tracing_args)
                except Exception as exc:
                    logger.info("hf_accel: the traced forward does not read back (%s: %s); not stored",
                                type(exc).__name__, exc)
                else:
                    self._trace_blob = blob
                    return self._build_rebuilt(*rebuilt)
        return self._build_traced(gm, example_inputs)

    def _build_rebuilt(self, gm: torch.fx.GraphModule, example_inputs: list[Any], fake_mode: Any) -> Callable:
        """`_build_traced` for a graph read back from the trace cache, whose fake values belong to `fake_mode`
        (Inductor checks that they match the tracing context's)."""
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            return self._build_traced(gm, example_inputs)

    def _build_traced(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        """Graph passes, split, compile, and the direct-call layout; returns the callable standing for `gm`."""
        t0 = time.perf_counter()
        if self.merge_linears:
            self.stats.num_merged_linears = merge_packed_linears(gm, example_inputs)
        if self.route_linears:
            self.stats.routed_linears = route_small_m_linears(gm, self.pdl)
            if self.fold_norms:
                # a chain normalizes from partial sums at any width: with chains on, wide rows fold too
                self.stats.folded_norms = fold_norms_into_linears(gm, any_width=self.chain_residual_norms)
            if self.gated_gemm:
                self.stats.gated_linears = fuse_silu_mul_into_linears(gm)
            if self.fold_norms and self.chain_residual_norms:
                self.stats.chain_pairs = chain_residual_norms(gm)
        self.stats.int8_weight_linears = route_int8_weight_only_linears(gm, self.pdl)
        split_gm = self._build(gm, example_inputs)
        self.stats.compile_seconds = time.perf_counter() - t0
        if self._tracing_args is not None:
            self._prepare_binding(gm, example_inputs)
        self._split_graphs.append(split_gm)
        return _DynamoEntry(self, split_gm)

    def _build(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> torch.fx.GraphModule:
        # 1. partition: a new piece after every splitting op, each op alone in its own
        part: dict[torch.fx.Node, int] = {}
        attention_parts: set[int] = set()
        pid = 0
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if _is_splitting_node(node, self.splitting_ops):
                pid += 1
                part[node] = pid
                attention_parts.add(pid)
                pid += 1
            else:
                part[node] = pid
        split_gm = split_module(gm, None, lambda n: part[n], keep_original_order=True)

        # 2. fake inputs of every submodule: split_module copies Dynamo's example values onto each piece's
        #    placeholders. Re-running the split graph on fake tensors instead would concretize sizes on some
        #    torch versions (2.11 turns `aten.size` into ints, pinning T), so that is only the fallback.
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        fake_args = [n.meta.get("example_value", ex) for n, ex in zip(placeholders, example_inputs, strict=True)]
        fake_mode = next((a.fake_mode for a in fake_args if isinstance(a, torch._subclasses.FakeTensor)), None)
        sub_args: dict[str, list[Any]] = {}
        for name, submod in split_gm.named_children():
            values = [n.meta.get("example_value") for n in submod.graph.nodes if n.op == "placeholder"]
            if all(v is not None for v in values):
                sub_args[name] = values
        if len(sub_args) < len(list(split_gm.named_children())):
            sub_args.clear()

            class _Recorder(torch.fx.Interpreter):
                def call_module(self, target, args, kwargs):  # type: ignore[override]
                    sub_args[target] = list(args)
                    return super().call_module(target, args, kwargs)

            ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
            with ctx:
                _Recorder(split_gm).run(*fake_args)

        # 3. which outer inputs are weights (fixed address, never checked at replay): tensors that are neither an
        #    argument of the forward nor sized by a dynamic dimension; and which symbols are dynamic sizes other
        #    than T (a piece that depends on one gets no graph). Symbols that only describe strides do not count.
        arg_fakes = self._forward_arg_fakes(placeholders, example_inputs)
        token_sym = self._token_symbol(arg_fakes)
        size_syms: set[Any] = set()
        for fake in arg_fakes.values():
            for s in fake.shape:
                size_syms |= free_symbols(s) if isinstance(s, torch.SymInt) else set()
        other_syms = size_syms - {token_sym}
        outer_static = {n.name for n, ex, fake in zip(placeholders, example_inputs, fake_args, strict=True)
                        if isinstance(ex, torch.Tensor) and not any(ex is a for a in self._tracing_args or ())
                        and not free_symbols(fake)}

        # 4. compile each piece (sharing identical ones) and install runners
        compiled_by_sig: dict[str, Callable] = {}
        self.pieces, self.attention_names, self.piece_names = [], [], []
        call_nodes = {n.target: n for n in split_gm.graph.nodes if n.op == "call_module"}
        for name, submod in list(split_gm.named_children()):
            node = call_nodes[name]
            args = sub_args[name]
            if int(name.rsplit("_", 1)[1]) in attention_parts:
                self.attention_names.append(name)
                split_gm.__dict__[name] = submod.forward  # eager, no Module.__call__ overhead
                continue
            sig = graph_signature(submod, args) if self.share_identical_pieces else None
            if sig is not None and sig in compiled_by_sig:
                fn = compiled_by_sig[sig]
            else:
                t0 = time.perf_counter()
                fn = self._compile_piece(submod, args, fake_mode)
                self.stats.num_compiled += 1
                logger.debug("compiled piece %s (%d nodes) in %.2f s", name, len(submod.graph.nodes),
                             time.perf_counter() - t0)
                if sig is not None:
                    compiled_by_sig[sig] = fn
            size_arg, graphable = self._size_info(args, token_sym, other_syms)
            check_args = [i for i, (a, n) in enumerate(zip(args, node.args, strict=True))
                          if isinstance(a, torch.Tensor)
                          and not (isinstance(n, torch.fx.Node) and n.op == "placeholder" and n.name in outer_static)]
            runner = PieceRunner(self, len(self.pieces), fn, size_arg, graphable, check_args)
            self.pieces.append(runner)
            self.piece_names.append(name)
            split_gm.__dict__[name] = runner
        self.stats.num_pieces = len(self.pieces)
        self.stats.num_attention = len(self.attention_names)
        self.stats.num_graphable = sum(p.graphable for p in self.pieces)
        self.split_gm = split_gm
        return split_gm

    def _forward_arg_fakes(self, placeholders: list[torch.fx.Node], example_inputs: list[Any]) -> dict[int, Any]:
        """Fake tensor of each forward argument, by identity with what Dynamo passed (empty after a recompile)."""
        fakes: dict[int, Any] = {}
        for n, ex in zip(placeholders, example_inputs, strict=True):
            for k, a in enumerate(self._tracing_args or ()):
                if ex is a and "example_value" in n.meta:
                    fakes[k] = n.meta["example_value"]
        return fakes

    def _token_symbol(self, arg_fakes: dict[int, Any]) -> Any:
        """The symbol of T in the traced graph (None after a recompile outside compile(): no graphs then)."""
        k, d = self.token_dims[0]
        if k not in arg_fakes:
            return None
        size = arg_fakes[k].shape[d]
        if isinstance(size, torch.SymInt):
            return size.node.expr
        raise RuntimeError(f"the token dimension was specialized to {size} while tracing the forward")

    @staticmethod
    def _size_info(args: Sequence[Any], token_sym: Any,
                   other_syms: set[Any]) -> tuple[tuple[int, int | None] | None, bool]:
        """Where to read T from the piece's arguments, and whether the piece depends on no other dynamic size."""
        if token_sym is None:
            return None, False
        size_arg: tuple[int, int | None] | None = None
        only_t = True
        for i, a in enumerate(args):
            syms = free_symbols(a) if isinstance(a, (torch.Tensor, torch.SymInt)) else set()
            if syms & other_syms:
                only_t = False
            if size_arg is not None:
                continue
            if isinstance(a, torch.SymInt) and a.node.expr == token_sym:
                size_arg = (i, None)
            elif isinstance(a, torch.Tensor):
                for d, s in enumerate(a.shape):
                    if isinstance(s, torch.SymInt) and s.node.expr == token_sym:
                        size_arg = (i, d)
                        break
        return size_arg, only_t and size_arg is not None

    def _compile_piece(self, submod: torch.fx.GraphModule, args: list[Any], fake_mode: Any) -> Callable:
        """Inductor for a symbolic T: `args` are Dynamo's fake tensors, so the compiled code is shape-generic."""
        if self.compiler == "eager":
            return submod.forward
        from torch._inductor.compile_fx import compile_fx

        ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
        # combo kernels are on by default, and Inductor still refuses some pieces with them (e.g. a dynamic
        # reduction dimension): such a piece compiles again without them, on an untouched copy of its graph, rather
        # than the whole forward falling back to eager (or a tensor-parallel job ending)
        pristine = torch.fx.GraphModule(submod, copy.deepcopy(submod.graph)) if self.combo_kernels else None
        try:
            with ctx, torch.no_grad(), inductor_settings(self.pdl, self.eager_casts, self.combo_kernels):
                return compile_fx(submod, args)  # positional arguments (`_boxed_call` copied from an inner function)
        except Exception as exc:
            if pristine is None:
                raise
            self.stats.combo_fallback_pieces += 1
            logger.warning("hf_accel: Inductor could not compile a piece with combo kernels (%s: %s); compiling it "
                           "without them", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        with ctx, torch.no_grad(), inductor_settings(self.pdl, self.eager_casts, combo_kernels=False):
            return compile_fx(pristine, args)

    # ------------------------------------------------------------------ Dynamo bypass
    def _prepare_binding(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
        """Lay out the traced graph's inputs: forward arguments, sizes read from them, and fixed objects."""
        args = self._tracing_args or ()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        arg_fakes = self._forward_arg_fakes(placeholders, example_inputs)
        template: list[Any] = []
        arg_slots, size_slots = [], []
        for pos, (n, ex) in enumerate(zip(placeholders, example_inputs, strict=True)):
            template.append(None)
            if isinstance(ex, torch.Tensor):
                k = next((k for k, a in enumerate(args) if ex is a), None)
                if k is None:
                    template[pos] = ex  # weights and buffers: bound by reference
                else:
                    arg_slots.append((pos, k))
            elif isinstance(ex, torch.SymInt):
                expr = n.meta["example_value"].node.expr if "example_value" in n.meta else ex.node.expr
                loc = self._locate_symbol(arg_fakes, expr)
                if loc is None:
                    self._bind_error = f"graph input {n.name} is a size not read off the forward's arguments"
                    return
                size_slots.append((pos, *loc))
            else:
                self._bind_error = f"graph input {n.name} has unsupported type {type(ex).__name__}"
                return
        self._template, self._arg_slots, self._size_slots = template, arg_slots, size_slots

    @staticmethod
    def _locate_symbol(arg_fakes: dict[int, Any], expr: Any) -> tuple[int, int, int] | None:
        """(argument, kind, dim) where a symbol can be read: kind 0 a size, 1 a stride, 2 the storage offset."""
        for kind in (0, 1, 2):
            for k, fake in arg_fakes.items():
                values = fake.shape if kind == 0 else fake.stride() if kind == 1 else (fake.storage_offset(),)
                for d, v in enumerate(values):
                    if isinstance(v, torch.SymInt) and v.node.expr == expr:
                        return k, kind, d
        return None

    def _bind(self, args: Sequence[torch.Tensor]) -> list[Any]:
        flat = list(self._template)  # type: ignore[arg-type]
        for pos, k in self._arg_slots:
            flat[pos] = args[k]
        for pos, k, kind, d in self._size_slots:
            a = args[k]
            flat[pos] = a.shape[d] if kind == 0 else a.stride(d) if kind == 1 else a.storage_offset()
        return flat

    def _finish_binding(self, out: Any, example_inputs: tuple[torch.Tensor, ...]) -> None:
        """Enable direct calls only if they reproduce exactly what Dynamo passed and returned."""
        recorded, graph_out = self._first_call_args, self._first_call_out
        self._first_call_args = self._first_call_out = None
        if not self.bypass_dynamo:
            self._bind_error = self._bind_error or "disabled"
            return
        if self._bind_error is not None or recorded is None or self._template is None:
            self._bind_error = self._bind_error or "binding unavailable"
            return
        mine = self._bind(example_inputs)
        same = len(mine) == len(recorded) and all(
            (a is b) if isinstance(a, torch.Tensor) else (a == b) for a, b in zip(mine, recorded, strict=True))
        if not same:
            self._bind_error = "argument layout differs from Dynamo's"
            return
        if not (isinstance(graph_out, (tuple, list)) and len(graph_out) == 1 and graph_out[0] is out):
            self._bind_error = "the forward's return value is not the graph's single output"
            return
        self._direct = self.split_gm.forward  # type: ignore[union-attr]

    # ------------------------------------------------------------------ run
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        direct = self._direct
        if direct is not None:
            return direct(*self._bind((input_ids, position_ids, logits_indices)))[0]
        if self._dynamo_fn is None:
            raise RuntimeError("PiecewiseForward: call compile(...) first (at warm-up)")
        return self._dynamo_fn(input_ids, position_ids, logits_indices)

    @contextlib.contextmanager
    def graphs_disabled(self) -> Iterator[None]:
        """Run the compiled pieces without piecewise graphs (e.g. inside a full-graph capture)."""
        previous, self.graphs_enabled = self.graphs_enabled, False
        try:
            yield
        finally:
            self.graphs_enabled = previous

    # ------------------------------------------------------------------ CUDA graphs
    def drop_graphs(self) -> None:
        """Forget every piecewise graph and capture no more: the pieces run compiled, without graphs (after a
        capture failed, e.g. on an op that cannot run inside a CUDA graph)."""
        self.use_cudagraph = False
        self.graphs_enabled = False
        self.capturing_size, self.pool_ptrs = None, set()
        # every split graph's pieces: those of graphs a Dynamo recompile replaced may hold captures too
        for gm in self._split_graphs:
            for piece in vars(gm).values():
                if isinstance(piece, PieceRunner):
                    piece.captures.clear()
        self.stats.captured_sizes.clear()
        self.stats.pool_bytes_allocated = self.stats.pool_bytes_reserved = 0

    def capture(self, sizes: Iterable[int] | None, run_fn: Callable[[int], Any],
                warmup_key: Callable[[int], Hashable] | None = None) -> None:
        """Capture the graphable pieces for every T in `sizes` (default: capture_sizes), largest first.

        `warmup_key(T)`: sizes of one class share the warm-up of its largest (cuda_graph.capture_with_warmups);
        None warms up every size.
        """
        if not self.use_cudagraph:
            return
        if not self.compiled:
            raise RuntimeError("PiecewiseForward.capture: compile(...) first")
        if not torch.cuda.is_available():
            raise RuntimeError("piecewise CUDA graphs need CUDA")
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        todo = sorted({int(s) for s in (sizes if sizes is not None else self.capture_sizes)}
                      - set(self.stats.captured_sizes), reverse=True)
        if not todo:
            return
        mem = CaptureMemory()
        t0 = time.perf_counter()
        capture_with_warmups(todo, warmup_key, lambda t: self._warm_up(t, run_fn),
                             lambda t: self._capture_size(t, run_fn), self._count_retry, "piecewise")
        elapsed = time.perf_counter() - t0
        allocated, reserved = mem.delta()
        self.stats.capture_seconds += elapsed
        self.stats.pool_bytes_allocated += allocated
        self.stats.pool_bytes_reserved += reserved
        logger.info("captured piecewise CUDA graphs for %d sizes x %d pieces in %.2f s, %d warm-ups (device memory: "
                    "%+.1f MiB allocated, %+.1f MiB reserved)", len(todo), self.stats.num_graphable, elapsed,
                    self.stats.capture_warmups, allocated / 2**20, reserved / 2**20)

    def _count_retry(self) -> None:
        self.stats.capture_retries += 1

    def _warm_up(self, size: int, run_fn: Callable[[int], Any]) -> None:
        t0 = time.perf_counter()
        with self.graphs_disabled():
            run_fn(size)  # Triton autotuning, cuBLAS workspaces, lazy init: outside any capture
        torch.cuda.synchronize()
        self.stats.capture_warmups += 1
        self.stats.capture_warmup_seconds += time.perf_counter() - t0

    def _capture_size(self, size: int, run_fn: Callable[[int], Any]) -> None:
        """One forward at padded size T that captures every graphable piece (attention runs eagerly between them).
        On failure no piece keeps a graph of this T, and later captures take a new pool handle."""
        t0 = time.perf_counter()
        self.graphs_enabled = True
        self.capturing_size, self.pool_ptrs = size, set()
        try:
            run_fn(size)
        except BaseException:
            self.graph_pool = torch.cuda.graph_pool_handle()  # see cuda_graph.capture_graph: never reuse a failed one
            for piece in self.pieces:
                piece.captures.pop(size, None)
            raise
        finally:
            self.capturing_size, self.pool_ptrs = None, set()
            self.stats.capture_record_seconds += time.perf_counter() - t0
        self.stats.captured_sizes.append(size)


def compile_piecewise(forward_fn: Callable[..., torch.Tensor], *, capture_sizes: Iterable[int] = (),
                      use_cudagraph: bool = False, example_inputs: Sequence[torch.Tensor] | None = None,
                      **kwargs: Any) -> PiecewiseForward:
    """Build the piecewise-compiled forward; with `example_inputs`, compile right away (forward context set)."""
    pf = PiecewiseForward(forward_fn, capture_sizes=capture_sizes, use_cudagraph=use_cudagraph, **kwargs)
    if example_inputs is not None:
        pf.compile(*example_inputs)
    return pf
