"""The public API: accelerate_model, restore, available_backends (and engine_info for tools)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig

from hf_accel.attention.autotune import (
    DECODE_WEIGHT,
    autotune_backends,
    autotune_cache_file,
    load_cached_choice,
    store_choice,
)
from hf_accel.attention.backend import AttentionSpec
from hf_accel.attention.op import is_ours, register_implementation, stock_implementation
from hf_accel.attention.registry import (
    BACKEND_NAMES,
    auto_candidates,
    available_backends_for,
    backend_reasons,
    load_backend_class,
    probable_auto_names,
    select_backend,
)
from hf_accel.compilation.linear_packing import PackRecord, pack_sibling_linears, unpack_sibling_linears
from hf_accel.config import AccelConfig, CUDAGraphMode
from hf_accel.engine.engine import LLMEngine, ModelShape
from hf_accel.engine.loop import EngineCall, EngineLoop
from hf_accel.engine.model_state import is_tuner_layer
from hf_accel.engine.tensor_parallel import TensorParallel, tensor_parallel_of
from hf_accel.generation import (
    EngineGenerator,
    PreparedCall,
    eos_ids,
    pad_and_attention_mask,
    padding_reason,
    stock_reason,
)
from hf_accel.ops.fused import FusedRecord, install_fused_ops, uninstall_fused_ops
from hf_accel.ops.triton_build import pin_ptxas
from hf_accel.patches import family_patch
from hf_accel.patches.quantization import (
    decompress_packed_weights,
    quantization_quirks,
    settle_lazy_quantized_state,
)
from hf_accel.progress import StartupProgress
from hf_accel.streams import AsyncWaker, GenerationStream, StockGenerationStream, run_async

logger = logging.getLogger("hf_accel")
_STATE = "_hf_accel_state"
_LOCK = "_hf_accel_lock"


class _ModelLock:
    """The lock of one model, held briefly by every call's admission, by restore() and by accelerate_model() (for the
    whole rebuild). It lives on the model, not on one acceleration, so a rebuild in progress is never interleaved with
    another entry point. Re-entrant: a streamer may call generate() again on the same thread. `changed` (on the same
    lock) is notified whenever a call ends or the acceleration is replaced or removed. A deep copy or a pickle of the
    model gets a lock of its own."""

    def __init__(self) -> None:
        self.rlock = threading.RLock()
        self.changed = threading.Condition(self.rlock)

    def __deepcopy__(self, memo) -> _ModelLock:
        return _ModelLock()

    def __reduce__(self):
        return (_ModelLock, ())


def _model_lock_record(model) -> _ModelLock:
    return model.__dict__.setdefault(_LOCK, _ModelLock())


def model_lock(model) -> threading.RLock:
    return _model_lock_record(model).rlock


@dataclass
class AccelState:
    config: AccelConfig
    engine: LLMEngine
    generator: EngineGenerator
    original_attn_implementation: str
    backend_name: str
    startup: dict[str, float] = field(default_factory=dict)
    extra_info: dict[str, Any] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)
    packed_linears: PackRecord | None = None
    fused_ops: FusedRecord | None = None
    loop: EngineLoop | None = None
    active_calls: int = 0  # calls admitted and not yet over (any thread, sync or async)
    tp_out_of_step: str | None = None  # tensor parallel: why this rank can no longer pair steps with the others
    following: bool = False  # tensor parallel: this rank runs rank 0's schedule (follow_tensor_parallel)
    stopping_lead: bool = False  # rank 0's stop_leading_tensor_parallel() waits for the calls admitted while led
    plan_group: Any = None  # tensor parallel: the CPU (gloo) group rank 0's step plans travel on
    closing: bool = False  # restore() is waiting for the active calls: new calls wait, then run stock
    running_threads: dict[int, int] = field(default_factory=dict)  # thread id -> sync calls it is waiting in
    async_threads: dict[int, int] = field(default_factory=dict)  # thread id -> async calls open on its event loop

    def __reduce__(self):
        """Pickled (torch.save of the whole model), the state is dropped as in a deep copy: no engine is saved."""
        return (_no_state, ())

    def __deepcopy__(self, memo) -> None:
        """A deep copy of an accelerated model (a frozen reference model in an RL loop) is a stock model with the
        same weights: it gets no engine of its own (no second KV cache); its generate() runs stock generate() and
        its forward the stock attention. accelerate_model(copy) accelerates it."""
        return None


def _no_state() -> None:
    return None


def base_model_of(model):
    """The transformers model hf_accel patches: `model` itself, or the base model a PEFT wrapper holds.

    PEFT's `PeftModel.generate()` ends in the base model's `generate()`, and the LoRA layers live inside the base
    model's modules, so accelerating (and restoring) the base model serves the wrapper too, whichever was first.
    """
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and hasattr(model, "peft_config"):
        return get_base()
    return model


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _attention_spec(model: torch.nn.Module, tp: TensorParallel | None = None) -> AttentionSpec:
    """The attention shape one rank runs (`tp`: the model's tensor-parallel group, if any)."""
    shape = ModelShape.from_config(model.config, tp)
    text = model.config.get_text_config()
    dtype = next(model.parameters()).dtype
    return AttentionSpec(
        num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype=dtype,
        uses_softcap=bool(getattr(text, "attn_logit_softcapping", None)),
        uses_sliding_window=bool(getattr(text, "sliding_window", None))
        and getattr(text, "use_sliding_window", True) is not False,
    )


def _check_supported(model: torch.nn.Module) -> None:
    if not hasattr(model, "generate") or not hasattr(model, "config"):
        raise TypeError(f"accelerate_model expects a transformers causal LM, got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise NotImplementedError(f"{type(model).__name__} is an encoder-decoder model; hf_accel accelerates "
                                  "decoder-only causal LMs")
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if not getattr(model, "_supports_attention_backend", False) or (callable(can_set) and not can_set()):
        raise NotImplementedError(
            f"{type(model).__name__} does not use transformers' AttentionInterface, so hf_accel cannot plug its "
            "paged attention in; use the model without accelerate_model()")
    reason = family_patch(model.config.model_type).unsupported_reason(model.config)
    if reason:
        raise NotImplementedError(f"{type(model).__name__}: {reason}")
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        raise NotImplementedError(
            f"{type(model).__name__} uses attention sinks (learned per-head logits in the softmax, as GPT-OSS does); "
            "hf_accel's attention backends do not implement them, so it would give wrong answers")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("the model has parameters on the meta device (offloaded); load it fully on one device")
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(f"the model is spread over several devices {sorted(map(str, devices))}; hf_accel runs "
                         "a model on one device")


def accelerate_model(model, *, attention_backend: str = "auto", cudagraph_mode: str | None = None,
                     cudagraph_capture_sizes: list[int] | None = None, compile: bool | None = None,
                     enforce_eager: bool = False, block_size: int | None = None, num_kv_blocks: int | None = None,
                     gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256,
                     max_num_batched_tokens: int = 8192, enable_prefix_caching: bool = True,
                     config: AccelConfig | None = None):
    """Patch `model` in place so generate(), generate_batch() and pipelines run on the hf_accel engine.

    Keyword arguments override the fields of `config`. Returns the same model object; `restore(model)` undoes it.
    Calling it again on an accelerated model first restores it, then applies the new options; invalid options raise
    before that, leaving the current acceleration in place. A PEFT model (`PeftModel`) is accelerated through its
    base model (see `base_model_of`), before or after the adapters were added.

    Outside an engine step the model stays the stock model: a plain forward or backward (training, evaluation) runs
    the original attention implementation and the model's own modules.

    One process-wide effect outlives `restore`: on a GPU, `TRITON_PTXAS_PATH` is set to torch's own ptxas unless you
    set it (`ops.triton_build.pin_ptxas`: the assembler Inductor's workers use, so warm starts find their kernels).
    """
    t0 = time.perf_counter()
    wrapper, model = model, base_model_of(model)
    with model_lock(model):
        try:
            _accelerate_locked(model, t0, attention_backend=attention_backend, cudagraph_mode=cudagraph_mode,
                               cudagraph_capture_sizes=cudagraph_capture_sizes, compile=compile,
                               enforce_eager=enforce_eager, block_size=block_size, num_kv_blocks=num_kv_blocks,
                               gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens,
                               enable_prefix_caching=enable_prefix_caching, config=config)
        except BaseException:
            # a re-accelerate keeps our methods while it builds (`_restore`); failed, the model is restored: drop them
            if _STATE not in model.__dict__:
                _unpatch_generate(model)
            raise
    return wrapper


def _apply_quantization_quirks(model, cfg: AccelConfig) -> str | None:
    """Keep off what the model's quantized modules cannot take (patches/quantization.py); the caller's `cfg` is
    changed in place. Returns why (None: no quirk applies), the same on every accelerate of the model, a re-accelerate
    with the options already turned off included; warns once when this call turned something off."""
    notes: list[str] = []
    turned_off = False
    for quirk in quantization_quirks(model):
        what = []
        if not quirk.compiles:
            turned_off |= bool(cfg.compile)
            cfg.compile = False
            what.append("torch.compile")
        if not quirk.captures:
            turned_off |= CUDAGraphMode(cfg.cudagraph_mode or "none").value != "none"
            cfg.cudagraph_mode = CUDAGraphMode.NONE
            what.append("CUDA graphs")
        if what:
            notes.append(f"{' and '.join(what)} off for {quirk.method}: {quirk.why}")
    if not notes:
        return None
    message = "; ".join(notes)
    if turned_off:
        logger.warning("hf_accel: %s", message)
    return message


def _accelerate_locked(model, t0: float, *, config: AccelConfig | None, **options) -> None:
    _check_supported(model)
    # keyword arguments the caller actually passed win over `config`
    sig = inspect.signature(accelerate_model)
    passed = {k: v for k, v in options.items() if v != sig.parameters[k].default}
    cfg = (config or AccelConfig()).updated(**passed)
    device = _model_device(model)
    cfg = cfg.resolve_for(device)
    decompressed = decompress_packed_weights(model)
    if decompressed:
        logger.info("hf_accel: %s", decompressed)
    settle_lazy_quantized_state(model)
    quant_fallback = _apply_quantization_quirks(model, cfg)
    tp = tensor_parallel_of(model)
    spec = _attention_spec(model, tp)
    # select_s: the checks and the optional libraries they import (every candidate's when autotuning, the winner's
    # alone when its answer is remembered); autotune_s is the timing itself
    t_select = time.perf_counter()
    probed = probable_auto_names(spec, device) if _autotunes(cfg, device) else []
    backend_cls, autotune_info = None, None
    if not probed:  # resolved now: a backend that cannot run (or "auto" with none) raises before anything is undone
        backend_cls = select_backend(cfg.attention_backend, spec, device)
        if cfg.attention_backend == "auto":  # static order, but never a library that would JIT-build first
            backend_cls = _static_auto_choice(backend_cls, cfg, spec, device)
    select_s = time.perf_counter() - t_select
    if hasattr(model, _STATE):
        # before autotuning: the old engine's KV cache would leave it no memory
        _restore(model, keep_methods=True)
    if device.type == "cuda":  # before the first Triton build of this process (the autotune): one ptxas for all
        pin_ptxas()
    on_gpu_graphs = device.type == "cuda" and (cfg.compile or CUDAGraphMode(cfg.cudagraph_mode).value != "none")
    progress = StartupProgress(total_phases=7, enabled=on_gpu_graphs)  # a bar only where starts take long
    try:
        if backend_cls is None:
            t_select = time.perf_counter()
            progress.phase("choose the attention backend",
                           "autotune, or the answer remembered for this GPU and shape")
            backend_cls, autotune_info = _choose_backend(model, cfg, spec, device, probed)
            select_s += time.perf_counter() - t_select - (autotune_info or {}).get("seconds", 0.0)
        if tp is not None:  # one backend and block size on every rank (engine/tensor_parallel.py): rank 0's
            mine = f"{backend_cls.name}|{cfg.block_size or ''}"
            chosen = tp.broadcast_str(mine)
            if chosen != mine:
                name, block = chosen.split("|")
                logger.info("hf_accel: rank %d uses rank 0's attention backend %s, block size %s (it chose %s)",
                            tp.rank, name, block or "default", mine)
                backend_cls = select_backend(name, spec, device)
                cfg.block_size = int(block) if block else None
    except BaseException:
        progress.close()
        raise
    if device.type == "cuda" and cfg.compile:
        from hf_accel.compilation.piecewise import start_compile_workers

        # after the backend timing (their start-up must not load the CPU it measures), before the KV cache and the
        # trace, which they come up beside
        start_compile_workers()
    original = model.config._attn_implementation
    if is_ours(original):  # a deep copy of an accelerated model: its stock implementation is in the name
        original = stock_implementation(original)
    model.set_attn_implementation(register_implementation(original))
    packed: PackRecord | None = None
    fused: FusedRecord | None = None
    # compile off on CUDA (and not enforce_eager, which keeps the model's own modules): RMSNorms and SiLU MLPs get
    # one-kernel Triton forwards, what Inductor's fusion gives the compiled path
    fuse = _wants_fused_ops(cfg, device)
    try:
        # compiled forwards run q/k/v and gate/up as one GEMM each (the fused MLP gate/up): give those weights one
        # storage (no copy kept); the storages they leave go back to the GPU before the KV cache is sized
        t_pack = time.perf_counter()
        if cfg.compile or fuse:
            progress.phase("pack q/k/v and gate/up weights")
            packed = pack_sibling_linears(model)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if fuse:
            fused = install_fused_ops(model)
        pack_s = time.perf_counter() - t_pack
        patch_s = time.perf_counter() - t0
        engine = LLMEngine(model, cfg, backend_cls, spec, progress=progress)
        progress.close()
    except BaseException:
        progress.close()
        model.set_attn_implementation(original)
        if fused is not None:
            uninstall_fused_ops(fused)
        if packed is not None:
            unpack_sibling_linears(packed)
        raise
    if engine.runner.full_graphs is not None:  # decode and prefill both ran at warm-up: its kernels are built
        _mark_built(backend_cls, spec, device, cfg)
    state = AccelState(config=cfg, engine=engine, generator=EngineGenerator(model, engine),
                       original_attn_implementation=original, backend_name=backend_cls.name, packed_linears=packed,
                       fused_ops=fused, loop=EngineLoop(engine))
    ci = engine.compile_info
    autotune_s = (autotune_info or {}).get("seconds", 0.0)
    state.startup = {"patch_s": patch_s - autotune_s, "select_s": select_s, "pack_s": pack_s, "autotune_s": autotune_s,
                     "kv_cache_s": engine.stats.timings.get("kv_cache_s", 0.0),
                     "compile_s": ci.get("compile_s", 0.0), "capture_s": ci.get("capture_s", 0.0)}
    state.startup.update({k: ci[k] for k in ("trace_s", "trace_source", "split_compile_s", "small_m_gemm_s",
                                             "capture_build_ahead", "capture_split") if k in ci})
    state.startup["phases"] = dict(progress.times)
    state.extra_info.update(graph_pool_bytes=ci.get("graph_pool_bytes", 0), compile_cache=ci.get("compile_cache"),
                            effective_cudagraph_mode=ci.get("cudagraph_mode", "none"), backend_autotune=autotune_info,
                            quantization_fallback=quant_fallback, quantization_decompressed=decompressed)
    setattr(model, _STATE, state)
    model.generate = types.MethodType(_accelerated_generate, model)
    model.generate_batch = types.MethodType(_accelerated_generate_batch, model)
    # no stock counterpart to fall back on by name when a copy is unpickled: bound with partial, a copy keeps them
    # bound to itself (where, with no engine, they run stock generate() in a worker thread)
    model.agenerate = functools.partial(agenerate, model)
    model.agenerate_stream = functools.partial(agenerate_stream, model)
    _model_lock_record(model).changed.notify_all()
    state.startup["total_s"] = time.perf_counter() - t0
    logger.info("hf_accel: accelerated %s with the %s backend in %.1f s", type(model).__name__, backend_cls.name,
                state.startup["total_s"])


def _wants_fused_ops(cfg: AccelConfig, device: torch.device) -> bool:
    """Fused Triton norms/MLPs: on CUDA with compile off (Inductor fuses the compiled path), not enforce_eager."""
    return device.type == "cuda" and not cfg.compile and not cfg.enforce_eager


def _autotunes(cfg: AccelConfig, device: torch.device) -> bool:
    """Whether the backend is chosen by timing: "auto" on CUDA with autotune_attention on."""
    return cfg.attention_backend == "auto" and device.type == "cuda" and cfg.autotune_attention


def _choose_backend(model, cfg: AccelConfig, spec: AttentionSpec, device: torch.device,
                    probed: list[str] | None = None) -> tuple[type, dict[str, Any] | None]:
    """The backend class, and for "auto" on CUDA with several candidates the autotune record (chosen, timings).

    The static rule (registry.select_backend) names the candidates in preference order; autotuning times them on
    this model's shapes and keeps the fastest; the answer is remembered on disk beside the compile cache (keyed by
    GPU, shape, candidate names, library versions and our sources), so a second start skips the timing, and imports
    only the remembered winner's library (the candidate names come from a probe that imports nothing). If
    autotuning itself fails, the static choice stands (logged). `probed`: `probable_auto_names()`, if the caller
    has it already.
    """
    if not _autotunes(cfg, device):
        return select_backend(cfg.attention_backend, spec, device), None
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    # decode is timed as the engine will run it: replayed from a full CUDA graph only in modes that have them
    decode_in_graph = CUDAGraphMode(cfg.cudagraph_mode or "none").has_full
    shape = {"num_decode_seqs": min(32, cfg.max_num_seqs), "num_layers": text.num_hidden_layers,
             "block_size_hint": cfg.block_size, "decode_in_graph": decode_in_graph}
    probed = probable_auto_names(spec, device) if probed is None else probed
    # candidates whose library would JIT-build first (FlashInfer on a fresh machine) are not timed now: they build in
    # the background, and the remembered answer is keyed by what was pending, so a start after the build re-times
    pending = _pending_builds(probed, spec, device, cfg)
    cache_file = autotune_cache_file(cfg.compile_cache_dir, spec, device, probed, pending=sorted(pending), **shape)
    remembered = _remembered_backend(cache_file, spec, device, cfg.block_size)
    if remembered is not None:
        _start_builds(pending, spec, device, cfg)
        return remembered
    static = select_backend("auto", spec, device)
    candidates = auto_candidates(spec, device)
    # present on disk but failing the full check (a broken install): re-checked on every remembered start, since
    # fixing the install changes neither the key nor the library's version
    unusable = [name for name in probed if name not in {c.name for c in candidates}]
    if cfg.block_size is not None:  # a block size the user fixed must suit the winner
        candidates = [c for c in candidates if cfg.block_size in c.supported_block_sizes] or candidates
    ready = [c for c in candidates if c.name not in pending] or candidates  # all pending: one of them must build
    skipped = {c.name: pending[c.name] for c in candidates if c not in ready}
    if skipped:
        logger.info("hf_accel: attention autotune skips %s: %s", ", ".join(skipped), "; ".join(skipped.values()))
        _start_builds(skipped, spec, device, cfg)
    if len(ready) < 2:
        if not skipped:
            return ready[0], None
        return ready[0], {"chosen": ready[0].name, "static_choice": static.name, "seconds": 0.0, "cached": False,
                          "candidates": [c.name for c in ready], "timings": {}, "pending_builds": skipped}
    t0 = time.perf_counter()
    try:
        best, timings = autotune_backends(ready, spec, device, cfg.block_size,
                                          num_decode_seqs=shape["num_decode_seqs"], num_layers=shape["num_layers"],
                                          decode_in_graph=decode_in_graph)
    except Exception as exc:
        fallback = static if static in ready else ready[0]
        logger.warning("hf_accel: attention autotune failed (%s: %s); using the static choice %s",
                       type(exc).__name__, exc, fallback.name)
        return fallback, {"chosen": fallback.name, "static_choice": static.name, "error": str(exc),
                          "seconds": time.perf_counter() - t0, "pending_builds": skipped}
    seconds = time.perf_counter() - t0
    for cls in ready:  # a library that ran its first calls in the timing has built what it needs
        if "score" in timings.get(cls.name, {}):
            _mark_built(cls, spec, device, cfg)
    store_choice(cache_file, best, timings, static_choice=static.name, candidates=[c.name for c in ready],
                 unusable=unusable)
    summary = ", ".join(f"{name} " + (f"{t['score']:.3f}" if "score" in t else "not timed" if "skipped" in t
                                      else "failed") for name, t in timings.items())
    logger.info("hf_accel: attention autotune chose %s in %.1f s (score = %s x decode ms + prefill ms: %s)",
                best.name, seconds, DECODE_WEIGHT, summary)
    return best, {"chosen": best.name, "static_choice": static.name, "seconds": seconds, "cached": False,
                  "candidates": [c.name for c in ready], "timings": timings, "pending_builds": skipped}


def _pending_builds(names: list[str], spec: AttentionSpec, device: torch.device, cfg: AccelConfig) -> dict[str, str]:
    """name -> why its first use here would JIT-build, for the named backends (imports no optional library)."""
    pending = {}
    for name in names:
        cls, _ = load_backend_class(name)
        reason = cls.pending_build(spec, device, cfg.compile_cache_dir) if cls is not None else None
        if reason:
            pending[name] = reason
    return pending


def _start_builds(pending: dict[str, str], spec: AttentionSpec, device: torch.device, cfg: AccelConfig) -> None:
    """Build the pending backends' kernels in a background process each (AccelConfig.background_builds)."""
    if not cfg.background_builds:
        return
    from hf_accel.attention import prebuild

    for name in pending:
        cls, _ = load_backend_class(name)
        marker = cls.build_marker(spec, device, cfg.compile_cache_dir) if cls is not None else None
        if marker is not None:
            prebuild.start_background_build(name, spec, device, marker, cfg.block_size)


def _mark_built(cls, spec: AttentionSpec, device: torch.device, cfg: AccelConfig) -> None:
    marker = cls.build_marker(spec, device, cfg.compile_cache_dir) if device.type == "cuda" else None
    if marker is not None:
        from hf_accel.attention import prebuild

        prebuild.mark_built(marker, cls.library_cache_dir() or "")


def _static_auto_choice(first, cfg: AccelConfig, spec: AttentionSpec, device: torch.device):
    """"auto" without autotuning: the static order's first backend whose library need not JIT-build first."""
    if not first.pending_build(spec, device, cfg.compile_cache_dir):
        return first
    candidates = auto_candidates(spec, device)
    if cfg.block_size is not None:  # a block size the user fixed must suit the choice
        candidates = [c for c in candidates if cfg.block_size in c.supported_block_sizes]
    ready = [c for c in candidates if not c.pending_build(spec, device, cfg.compile_cache_dir)]
    if not ready:
        return first
    _start_builds({first.name: ""}, spec, device, cfg)
    return ready[0]


def _remembered_backend(cache_file, spec: AttentionSpec, device: torch.device,
                        block_size: int | None) -> tuple[type, dict[str, Any]] | None:
    """The remembered autotune winner, fully checked (its library imported) and still able to run; else None."""
    remembered = load_cached_choice(cache_file)
    if remembered is None:
        return None
    name, record = remembered
    if name not in BACKEND_NAMES or backend_reasons(name, spec, device):
        return None
    for other in record.get("unusable") or []:  # a backend that could not run then but can now: time again
        if other in BACKEND_NAMES and not backend_reasons(other, spec, device):
            return None
    cls, _ = load_backend_class(name)
    if cls is None or (block_size is not None and block_size not in cls.supported_block_sizes):
        return None
    logger.info("hf_accel: attention autotune: %s (remembered in %s)", name, cache_file)
    return cls, {"chosen": name, "static_choice": record.get("static_choice"), "seconds": 0.0, "cached": True,
                 "candidates": record.get("candidates"), "timings": record.get("timings", {})}


def restore(model):
    """Undo accelerate_model(): stock generate, the original attention implementation, the engine freed.

    Waits for the calls running in other threads (and async streams) to finish first; calls that arrive meanwhile
    wait too, then run stock. On rank 0 of a led tensor-parallel model it stops leading first (the other ranks'
    `follow_tensor_parallel` returns). Called from inside a running call (its streamer, logits processor or stopping
    criterion) it raises, since that call could not finish.
    """
    return _restore(model, keep_methods=False)


def _restore(model, keep_methods: bool):
    """restore(); with `keep_methods`, our generate methods stay on the model: a re-accelerate builds the new engine
    next, and calls arriving meanwhile must wait for it (`_current_state`) rather than find stock methods, or none
    (agenerate). If that fails, accelerate_model removes them."""
    wrapper, model = model, base_model_of(model)
    record = _model_lock_record(model)
    with record.rlock:
        state: AccelState | None = model.__dict__.get(_STATE)
        if state is None:
            if not keep_methods:
                _strip_copied_patches(model)
            return wrapper
        if state.running_threads.get(threading.get_ident()) or state.loop.on_engine_thread:
            raise RuntimeError("restore() was called from inside a running generate() of this model (a streamer, "
                               "logits processor or stopping criterion); call it after generate() returns")
        if state.async_threads.get(threading.get_ident()):
            raise RuntimeError("restore() was called on an event loop's thread while agenerate()/agenerate_stream() "
                               "calls of this model are open on that loop: they could never finish (their ends run "
                               "on the loop restore() would block); await or close them first, or restore from "
                               "another thread")
        state.closing = True
        led = state.loop.driver is not None
        state.stopping_lead = led  # calls arriving meanwhile are refused (on rank 0 alone they could only hang)
        try:
            record.changed.wait_for(lambda: state.active_calls == 0)
        except BaseException:
            state.closing = state.stopping_lead = False
            record.changed.notify_all()
            raise
        if led:  # the other ranks are told to stop following first
            state.loop.stop_driving()
        state.loop.wait_idle()
        _restore_locked(model, state, keep_methods=keep_methods)
        record.changed.notify_all()
    return wrapper


def _strip_copied_patches(model) -> None:
    """What a deep copy (or pickle) of an accelerated model carries besides its (empty) state: our generate methods,
    our attention name and the fused forwards (which run the stock modules outside an engine step anyway)."""
    model.__dict__.pop(_STATE, None)
    _unpatch_generate(model)
    if is_ours(getattr(model.config, "_attn_implementation", None)):
        model.set_attn_implementation(stock_implementation(model.config._attn_implementation))
    uninstall_fused_ops(FusedRecord(modules=list(model.modules())))


def _unpatch_generate(model) -> None:
    """Drop the instance methods accelerate_model set (ours only: another library's own patch of a never-accelerated
    model stays): the class's own generate()/generate_batch() show again."""
    for name, fn in _PATCHED_METHODS.items():
        attr = model.__dict__.get(name)
        if getattr(attr, "__func__", None) is fn or getattr(attr, "func", None) is fn:
            del model.__dict__[name]


def _restore_locked(model, state: AccelState, keep_methods: bool = False) -> None:
    if not keep_methods:
        _unpatch_generate(model)
    model.set_attn_implementation(state.original_attn_implementation)
    if state.fused_ops is not None:
        uninstall_fused_ops(state.fused_ops)
    if state.packed_linears is not None:
        unpack_sibling_linears(state.packed_linears)
    cache = getattr(state.engine.runner, "compile_cache", None)
    if cache is not None:  # the user's own torch.compile calls must not write into our per-model cache
        cache.restore_env()
    delattr(model, _STATE)
    state.engine.kv_caches.clear()
    if torch.cuda.is_available():
        # the graphs' memory pools go back now, not when the last reference to the old engine goes: a
        # re-acceleration sizes its new KV cache while its caller still holds the old state
        try:
            state.engine.runner.drop_graphs([])
        except Exception as exc:  # freeing early is an optimisation; the engine is done either way
            logger.debug("hf_accel: dropping the restored engine's CUDA graphs failed: %s", exc)
        torch.cuda.empty_cache()


def available_backends(model=None) -> dict[str, str | None]:
    """Every attention backend with None if it can run here (for `model`, if given) or the reasons it cannot."""
    if model is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return available_backends_for(None, device)
    model = base_model_of(model)
    return available_backends_for(_attention_spec(model, tensor_parallel_of(model)), _model_device(model))


def engine_of(model) -> LLMEngine:
    """The engine behind an accelerated model (for tools and tests: its block manager, scheduler and stats)."""
    return _state_of(model).engine


def engine_info(model) -> dict[str, Any]:
    """What accelerate_model set up: backend, graph mode, cache sizes and startup timings."""
    state = _state_of(model)
    eng = state.engine
    return {
        "attention_backend": state.backend_name,
        "attention_backend_declaration": type(eng.backend).declaration(),
        "cudagraph_mode": state.extra_info.get("effective_cudagraph_mode", "none"),
        "compile": bool(state.config.compile), "block_size": eng.block_size, "num_kv_blocks": eng.num_kv_blocks,
        "kv_cache_bytes": eng.kv_cache_bytes, "graph_pool_bytes": state.extra_info.get("graph_pool_bytes", 0),
        # the token counts captured as piecewise graphs (steps holding a prefill chunk, where full graphs serve decode)
        "piecewise_graph_sizes": (list(eng.runner.dispatcher.piecewise_sizes)
                                  if getattr(eng.runner, "dispatcher", None) is not None else []),
        "startup": dict(state.startup), "compile_cache": state.extra_info.get("compile_cache"),
        "backend_autotune": state.extra_info.get("backend_autotune"),
        "pdl": bool(getattr(eng, "use_pdl", False)),
        "tensor_parallel": ({"size": eng.tp.size, "rank": eng.tp.rank} if getattr(eng, "tp", None) is not None
                            else None),
        "small_m_gemm": eng.compile_info.get("small_m_gemm"),
        "packed_linear_groups": state.packed_linears.groups if state.packed_linears is not None else 0,
        # torchao int8 weight-only linears the compiled forward runs through hf_accel::int8_weight_linear
        "int8_weight_linears": (len(eng.runner.piecewise.stats.int8_weight_linears)
                                if getattr(eng.runner, "piecewise", None) is not None else 0),
        "int8_gemm": eng.compile_info.get("int8_gemm"),
        # RMSNorms (with their residual adds) the compiled forward runs inside the linear after them (norm_folding)
        "folded_norms": (eng.runner.piecewise.stats.folded_norms
                         if getattr(eng.runner, "piecewise", None) is not None else 0),
        # gated MLPs whose gate/up linear runs with its SiLU-and-mul as one op (gated_activation), and the decisions
        "gated_linears": (len(eng.runner.piecewise.stats.gated_linears)
                          if getattr(eng.runner, "piecewise", None) is not None else 0),
        "gated_gemm": eng.compile_info.get("gated_gemm"),
        # folded norms whose residual add's linear joined their op (AccelConfig.chain_residual_norms)
        "chained_norms": (eng.runner.piecewise.stats.chained_norms
                          if getattr(eng.runner, "piecewise", None) is not None else 0),
        # Inductor's combo kernels were in force for the compiled pieces (AccelConfig.combo_kernels, compiled, GPU)
        "combo_kernels": bool(eng.compile_info.get("combo_kernels")),
        # the compiled pieces round as eager PyTorch does (a model that quantizes activations; patches/quantization)
        "eager_precision_casts": bool(eng.compile_info.get("eager_precision_casts")),
        # what was turned off at startup and why (e.g. a quantized module that a CUDA graph cannot capture)
        "fallbacks": {**{k: eng.compile_info[k] for k in ("compile_error", "capture_error", "combo_kernels_error")
                         if k in eng.compile_info},
                      **({"quantization": state.extra_info["quantization_fallback"]}
                         if state.extra_info.get("quantization_fallback") else {})},
        # a compressed-tensors checkpoint: its packed weights were decompressed (patches/quantization.py)
        "quantization_decompressed": state.extra_info.get("quantization_decompressed"),
        "fused_ops": ({"norms": state.fused_ops.norms, "mlps": state.fused_ops.mlps}
                      if state.fused_ops is not None and state.fused_ops.modules else None),
        "config": {k: (v.value if hasattr(v, "value") else v) for k, v in vars(state.config).items()},
    }


def _admit(model, counted_thread: bool) -> AccelState | None:
    """Admit one call: the state it runs on, or None when it must run stock (the model was restored, or could not be
    accelerated again). The caller must `_leave(model, state, counted_thread)` when the call is over.

    Under the model's lock: a restore() in progress is waited out. When no call is active, the engine is brought up
    to date first (`LLMEngine.sync_with_model`): weights or adapters that changed drop the cached prefixes; a changed
    structure under compiled code, or a switched attention implementation, dtype or device, rebuilds the acceleration
    with the same options. A call that joins running calls shares the check their first call made: it runs on the
    weights they run on (changing weights while calls are running is not supported; the next idle start sees it).
    `counted_thread`: a sync call whose thread waits inside the call (restore() from that thread must refuse).
    """
    record = _model_lock_record(model)
    with record.rlock:
        while True:
            state: AccelState | None = model.__dict__.get(_STATE)
            if state is None:
                return None
            if not state.closing:
                break
            if state.stopping_lead:  # restore() of a led TP model: no stock call on rank 0 alone afterwards
                raise RuntimeError("hf_accel: the tensor-parallel model is being restored while it is led")
            record.changed.wait()
        if state.tp_out_of_step is not None:
            raise RuntimeError(
                "hf_accel: this tensor-parallel rank is out of step with the others since a call ended early on it "
                f"({state.tp_out_of_step}); their collectives can no longer pair up, so the job must end")
        if state.following:
            raise RuntimeError("hf_accel: this tensor-parallel rank is following rank 0's schedule "
                               "(follow_tensor_parallel); it takes no calls of its own until rank 0 stops leading")
        driven = state.loop.driver is not None  # rank 0 serving a TP model: its loop keeps the ranks in step
        if driven and state.stopping_lead:
            raise RuntimeError("hf_accel: the tensor-parallel model is stopping leading (stop_leading_tensor_parallel)")
        if state.active_calls and state.engine.tp is not None and not driven:
            raise RuntimeError(
                "hf_accel: a tensor-parallel model takes one call at a time per rank, made in the same order on "
                "every rank (the collectives of each step pair up by order); this call came while another was "
                "running on this rank")
        if state.active_calls == 0 and not driven:  # (a served TP model is not changed while it is served)
            state.loop.wait_idle()  # the last call's step in flight, if any: at most one step
            if state.engine.sync_with_model():
                state = _reaccelerate(model, state)
                if state is None:
                    return None
        state.active_calls += 1
        counts = state.running_threads if counted_thread else state.async_threads
        tid = threading.get_ident()
        counts[tid] = counts.get(tid, 0) + 1
        return state


def _leave(model, state: AccelState, counted_thread: bool, tid: int | None = None) -> None:
    """The call admitted by `_admit` on thread `tid` (default: this one) is over. A stream may end on another
    thread than the one that opened it (dropped, it is closed from a helper thread)."""
    record = _model_lock_record(model)
    with record.rlock:
        state.active_calls -= 1
        counts = state.running_threads if counted_thread else state.async_threads
        tid = threading.get_ident() if tid is None else tid
        counts[tid] -= 1
        if not counts[tid]:
            del counts[tid]
        record.changed.notify_all()


def _reaccelerate(model, state: AccelState) -> AccelState | None:
    """The model changed under an idle engine in a way the engine cannot follow: accelerate it again with the same
    options. None (restored, calls run stock) if that fails."""
    logger.warning("hf_accel: %s changed since accelerate_model() (attention implementation, dtype, device, "
                   "parameters, modules or adapters); accelerating it again for the new model", type(model).__name__)
    chosen = model.config._attn_implementation  # the user's own switch, if any, is kept
    _restore_locked(model, state, keep_methods=True)  # calls arriving meanwhile wait for the new engine
    if not is_ours(chosen) and chosen != model.config._attn_implementation:
        model.set_attn_implementation(chosen)
    try:
        accelerate_model(model, config=state.config)
    except Exception as exc:  # e.g. a dtype no backend runs: stay restored, serve this call stock
        if getattr(state.engine, "tp", None) is not None:  # one rank alone must never run stock: end the job
            raise RuntimeError(f"hf_accel: could not accelerate the changed tensor-parallel model again on this rank "
                               f"({type(exc).__name__}: {exc}); the ranks cannot stay in step") from exc
        logger.warning("hf_accel: could not accelerate the changed model again (%s: %s); it is restored and this "
                       "call runs stock generate()", type(exc).__name__, exc)
        return None
    return model.__dict__[_STATE]


def _run_sync(model, state: AccelState, prepare: Callable[[AccelState], PreparedCall]) -> Any:
    """A call from a thread that waits for it: admitted, prepared, run on the model's engine loop beside whatever
    else runs, and finished on this thread. None from `_admit` means stock: returns `_STOCK`."""
    current = _admit(model, counted_thread=True)
    if current is None:
        return _STOCK
    try:
        prepared = prepare(current)
        call = EngineCall(prepared.requests, wants_events=prepared.on_events is not None)
        driven = current.loop.driver is not None
        current.loop.submit(call)  # a refusal here ran nothing: every rank refuses the same call alike
        try:
            current.loop.run_sync(call, prepared.on_events, prepared.before, submitted=True)
        except BaseException as exc:
            if getattr(current.engine, "tp", None) is not None and not driven:
                # the call ended on this rank at a step of its own (a streamer or callback that raised, Ctrl-C, a
                # failed step): the other ranks may have run more steps, so no further call can pair up (a driven
                # engine hands its aborts to the other ranks instead)
                current.tp_out_of_step = f"{type(exc).__name__}: {exc}"
            raise
        return prepared.finish()
    finally:
        _leave(model, current, counted_thread=True)


_STOCK = object()  # _run_sync's answer when the call must run stock generate()


def _warn_stock(state: AccelState | None, reason: str) -> None:
    if state is not None and (state.following or state.loop.driver is not None):
        # stock generate() would run the sharded forward's collectives on this thread, between the plans and steps
        # the ranks exchange: they would pair with the wrong partners and the job would hang
        raise NotImplementedError(f"hf_accel does not accelerate {reason}, and stock generate() cannot run on a "
                                  "tensor-parallel rank that leads or follows (its collectives would interleave "
                                  "with the ranks' step plans)")
    if state is None or reason not in state.warned:
        if state is not None:
            state.warned.add(reason)
        warnings.warn(f"hf_accel does not accelerate {reason}; this call runs stock transformers generate()",
                      UserWarning, stacklevel=3)


def _accelerated_generate(self, inputs: torch.Tensor | None = None, generation_config=None, logits_processor=None,
                          stopping_criteria=None, prefix_allowed_tokens_fn=None, synced_gpus=None,
                          assistant_model=None, streamer=None, negative_prompt_ids=None,
                          negative_prompt_attention_mask=None, **kwargs):
    """transformers' generate(), served by the hf_accel engine (stock path, with a warning, for other modes).

    Any number of threads may call it at once: their calls join one running batch on the model's engine loop
    (engine/loop.py), each returning exactly what it would alone. The stock path runs `type(model).generate` on the
    accelerated model as it is: outside an engine step the attention and the modules are the stock ones, so nothing
    has to be switched back (and no other thread's engine step sees a switched model).
    """
    plan = _plan_generate(self, _generate_args(inputs, generation_config, logits_processor, stopping_criteria,
                                               prefix_allowed_tokens_fn, synced_gpus, assistant_model, streamer,
                                               negative_prompt_ids, negative_prompt_attention_mask, **kwargs))
    if plan.prepare is not None:
        out = _run_sync(self, plan.state, plan.prepare)
        if out is not _STOCK:
            return out
    return type(self).generate(self, **plan.stock_args)


@dataclass
class _GeneratePlan:
    """How one generate()-style call runs: `prepare` builds its engine call on the admitted state; None (and for an
    admission that finds the model restored) means stock generate() with `stock_args`."""

    stock_args: dict[str, Any]
    state: AccelState | None = None
    prepare: Callable[[AccelState], PreparedCall] | None = None
    input_ids: Any = None  # the prompt, however it was passed
    generation_config: GenerationConfig | None = None  # resolved as stock resolves it (None: left to stock)


def _plan_generate(model, stock_args: dict[str, Any], seed: int | None = None) -> _GeneratePlan:
    """Resolve a generate() call's arguments as stock does and decide engine or stock (warning once per reason)."""
    state: AccelState | None = _current_state(model)
    plan = _GeneratePlan(stock_args=stock_args, state=state)
    kwargs = dict(stock_args)
    inputs, generation_config = kwargs.pop("inputs"), kwargs.pop("generation_config")
    logits_processor, stopping_criteria = kwargs.pop("logits_processor"), kwargs.pop("stopping_criteria")
    streamer = kwargs.pop("streamer")
    extra = {k: kwargs.pop(k) for k in ("prefix_allowed_tokens_fn", "synced_gpus", "assistant_model",
                                        "negative_prompt_ids", "negative_prompt_attention_mask")}
    tokenizer = kwargs.pop("tokenizer", None)
    kwargs.pop("assistant_tokenizer", None)
    input_ids = kwargs.pop("input_ids", None)
    if inputs is not None and input_ids is not None:
        raise ValueError("pass the prompt either as `inputs` or as `input_ids`, not both")
    input_ids = plan.input_ids = inputs if inputs is not None else input_ids
    if isinstance(input_ids, torch.Tensor) and input_ids.dtype not in (torch.int64, torch.int32):
        return plan  # token ids must be integers: stock generate() raises its own error for anything else
    # the same test stock generate() makes, on the raw arguments: no max_length anywhere -> 20 *new* tokens
    has_default_max_length = (kwargs.get("max_length") is None
                              and (generation_config is None or generation_config.max_length is None)
                              and model.generation_config.max_length is None)
    gc, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    plan.generation_config = gc
    reason = stock_reason(gc, model_kwargs, dict(extra, stopping_criteria=stopping_criteria,
                                                 num_rows=_num_rows(input_ids)))
    if reason is None and isinstance(input_ids, torch.Tensor):
        _, mask = pad_and_attention_mask(input_ids, gc, model_kwargs)
        model_kwargs = {**model_kwargs, "attention_mask": mask}  # inferred once: prepare_generate takes it as given
        reason = padding_reason(input_ids, mask)
    if reason is None:
        reason = _module_reason(model)
    if reason is None:
        reason = _autocast_reason(model)
    if reason is None and _peft_prompt_learning(model):
        reason = ("a PEFT prompt-learning adapter (prompt / prefix / p-tuning: its virtual tokens enter through "
                  "prepare_inputs_for_generation, which the engine does not run)")
    if reason is None and state is None:
        reason = "a copy of an accelerated model (accelerate_model(copy) to accelerate it)"
    if reason is None and input_ids is None:
        reason = "generation without input_ids (inputs_embeds or an unconditional start)"
    if reason is None and state.loop.on_engine_thread:
        reason = "generate() from a callback running inside this model's engine step"
    if reason is not None:
        _warn_stock(state, reason)
        return plan

    def prepare(current: AccelState) -> PreparedCall:
        return current.generator.prepare_generate(input_ids, gc, model_kwargs, logits_processor, stopping_criteria,
                                                  streamer, tokenizer=tokenizer,
                                                  has_default_max_length=has_default_max_length, seed=seed)

    plan.prepare = prepare
    return plan


def _current_state(model) -> AccelState | None:
    """The model's acceleration state; while another thread rebuilds it (state briefly absent), wait and look again."""
    state = model.__dict__.get(_STATE)
    if state is None and _LOCK in model.__dict__:
        with model_lock(model):
            state = model.__dict__.get(_STATE)
    return state


def _all_modules(model) -> Iterator[torch.nn.Module]:
    """Every module of the tree (each once), depth first: what `model.modules()` gives, without building names.
    Every call walks the tree twice (dropout, per-row adapters); with 64 threads arriving at once that walk is on the
    critical path of the first engine steps."""
    seen: set[int] = set()
    stack = [model]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        yield m
        stack.extend(c for c in reversed(m._modules.values()) if c is not None)


def _peft_prompt_learning(model) -> bool:
    """Whether PEFT's generate() is driving this call for a prompt-learning adapter. PeftModelForCausalLM.generate
    installs its own prepare_inputs_for_generation on the base model, which prepends the virtual tokens' embeddings
    (prompt tuning) or their KV (prefix tuning); the engine packs the plain ids, so the adapter would be ignored."""
    owner = getattr(vars(model).get("prepare_inputs_for_generation"), "__self__", None)
    if owner is None or owner is model:
        return False
    try:
        return bool(getattr(owner.active_peft_config, "is_prompt_learning", False))
    except Exception:  # noqa: BLE001 - not a PEFT model, or one whose active config cannot be read: not this case
        return False


def _module_reason(model) -> str | None:
    """Why the modules' state sends this call stock, from one walk of the tree: dropout that a forward would apply
    now (a module in training mode that is a Dropout with p > 0 or holds a dropout rate above 0, as attention
    modules pass `attention_dropout` to the attention function when training, or a config dropout / jitter rate
    above 0 while any module trains), or PEFT's per-row adapters (`generate(adapter_names=[...])` works through
    forward pre-hooks on its tuner layers that pass each row's adapter; the engine packs all rows into one
    sequence)."""
    training = dropout = per_row = False
    hooked = _user_hook_module(_global_hooks())
    for m in _all_modules(model):
        if m._forward_pre_hooks and is_tuner_layer(m):
            per_row = True
        if hooked is None and (m._forward_hooks or m._forward_pre_hooks):
            hooked = _user_hook_module(m._forward_hooks.values(), m._forward_pre_hooks.values())
        if not m.training or dropout:
            continue
        training = True
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            dropout = m.p > 0
        else:
            dropout = any("dropout" in k and isinstance(v, float) and v > 0 for k, v in vars(m).items())
    if training and not dropout:
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        dropout = any(("dropout" in k or "jitter" in k) and isinstance(v, float) and v > 0
                      for cfg in {id(model.config): model.config, id(text): text}.values()
                      for k, v in vars(cfg).items())
    if dropout:
        return "generation in training mode with dropout (stock applies it at every step)"
    if per_row:
        return "per-row PEFT adapters (adapter_names)"
    if hooked is not None:
        return (f"forward hooks on the model's modules (from {hooked}): a hook would see the engine's packed steps "
                "(every row of every call in one [1, tokens, hidden] sequence), not stock's per-call shapes, and "
                "its own state is not part of what the engine or its compiled code can follow")
    return None


# Hooks libraries install that neither read nor change what a forward computes: transformers' output capturing (a
# no-op unless a call asks for hidden states or attentions, which runs stock anyway) and gradient checkpointing's
# input-grad hook; PEFT's per-row adapter hooks are judged above; hf_accel's own.
_BENIGN_HOOK_MODULES = ("transformers.", "peft.", "hf_accel.")


def _global_hooks() -> list:
    from torch.nn.modules import module as nn_module

    return [*nn_module._global_forward_hooks.values(), *nn_module._global_forward_pre_hooks.values()]


def _user_hook_module(*hook_lists) -> str | None:
    """The module a user forward hook or pre-hook comes from (`__main__`, a library), or None if there is none."""
    for hooks in hook_lists:
        for hook in hooks:
            fn = getattr(hook, "__func__", hook)
            origin = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", "") or "?"
            if not origin.startswith(_BENIGN_HOOK_MODULES):
                return origin
    return None


def _autocast_reason(model) -> str | None:
    """Why the caller's `torch.autocast` sends a generate() call stock. Stock runs the forward on the caller's
    thread, so autocast recasts its matmuls (a float32 model computes in bf16); autocast is thread-local, and the
    engine steps on its own thread, with kernels compiled and captured for the model's own dtypes, so it would
    compute in float32 and part from stock's tokens. (Stock `generate_batch()` runs the model on a thread of its
    own, without the caller's autocast, as the engine does.) Cast the model instead (`model.to(torch.bfloat16)`)
    to run it accelerated."""
    device_type = _model_device(model).type
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: no device argument
        enabled = torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()
    if not enabled:
        return None
    return (f"torch.autocast({device_type!r}) around generate() (the engine runs on its own thread in the model's "
            f"dtype; cast the model, e.g. model.to(torch.bfloat16), to accelerate it)")


def _num_rows(input_ids) -> int:
    return int(input_ids.shape[0]) if isinstance(input_ids, torch.Tensor) and input_ids.dim() > 1 else 1


def _accelerated_generate_batch(self, inputs: list[list[int]], generation_config=None,
                                continuous_batching_config=None, record_timestamps: bool = False,
                                progress_bar: bool = False, persistent_manager: bool = False, warmup: bool = True,
                                **kwargs):
    """transformers' generate_batch(): same signature and return type, served by the hf_accel engine.

    `continuous_batching_config`, `persistent_manager` and `warmup` are accepted and ignored: the engine is
    configured by accelerate_model() and already warm. Concurrent calls (and generate() calls) share one batch.
    """
    state: AccelState | None = _current_state(self)
    stock = dict(generation_config=generation_config, continuous_batching_config=continuous_batching_config,
                 record_timestamps=record_timestamps, progress_bar=progress_bar,
                 persistent_manager=persistent_manager, warmup=warmup, **kwargs)
    if state is None:  # a copy of an accelerated model (stripped of our patches first: stock rejects our name)
        _strip_copied_patches(self)
        return type(self).generate_batch(self, inputs, **stock)
    if state.loop.on_engine_thread:
        _warn_stock(state, "generate_batch() from a callback running inside this model's engine step")
        return type(self).generate_batch(self, inputs, **stock)
    max_new_tokens = kwargs.pop("max_new_tokens", None)
    if kwargs:
        logger.warning("hf_accel generate_batch ignores unsupported keyword arguments %s", sorted(kwargs))
    if not inputs:
        return {}
    out = _run_sync(self, state, lambda current: current.generator.prepare_generate_batch(
        inputs, generation_config, progress_bar, max_new_tokens))
    if out is _STOCK:  # restore()d while this call waited
        return type(self).generate_batch(self, inputs, generation_config=generation_config,
                                          progress_bar=progress_bar, max_new_tokens=max_new_tokens)
    return out


def _generate_args(inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None,
                   prefix_allowed_tokens_fn=None, synced_gpus=None, assistant_model=None, streamer=None,
                   negative_prompt_ids=None, negative_prompt_attention_mask=None, **kwargs) -> dict[str, Any]:
    """generate()'s arguments by name, as stock generate() takes them."""
    return dict(inputs=inputs, generation_config=generation_config, logits_processor=logits_processor,
                stopping_criteria=stopping_criteria, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                synced_gpus=synced_gpus, assistant_model=assistant_model, streamer=streamer,
                negative_prompt_ids=negative_prompt_ids, negative_prompt_attention_mask=negative_prompt_attention_mask,
                **kwargs)


async def agenerate(self, inputs: torch.Tensor | None = None, generation_config=None, logits_processor=None,
                    stopping_criteria=None, streamer=None, *, seed: int | None = None, **kwargs):
    """`await model.agenerate(...)`: generate() for asyncio code, on the same engine loop as every other call.

    Takes generate()'s arguments and returns what it returns (tensor or `GenerateDecoderOnlyOutput`); the event loop
    is free while the call runs, and the call joins the running batch like any other. `seed` (an hf_accel addition)
    seeds this call's sampling; without it the seed comes from torch's global RNG, as in generate(). A streamer is fed
    on the event loop (transformers' `AsyncTextIteratorStreamer` fits). Cancelling the awaiting task aborts the call
    and frees its KV blocks. Calls that must run stock run it in a worker thread (`asyncio.to_thread`).
    """
    _refuse_async_on_tensor_parallel(self, "agenerate")
    plan = _plan_generate(self, _generate_args(inputs, generation_config, logits_processor, stopping_criteria,
                                               streamer=streamer, **kwargs), seed=seed)
    state = _admit(self, counted_thread=False) if plan.prepare is not None else None
    if state is None:
        return await asyncio.to_thread(type(self).generate, self, **plan.stock_args)
    try:
        prepared = plan.prepare(state)
        if prepared.before is not None:
            prepared.before()
        waker = AsyncWaker(asyncio.get_running_loop())
        call = EngineCall(prepared.requests, wants_events=prepared.on_events is not None, notify=waker)
        state.loop.submit(call)
        await run_async(state.loop, call, waker, prepared.on_events)
        return prepared.finish()
    finally:
        _leave(self, state, counted_thread=False)


def agenerate_stream(self, inputs: torch.Tensor | None = None, generation_config=None, logits_processor=None,
                     stopping_criteria=None, *, seed: int | None = None, **kwargs):
    """`async for delta in model.agenerate_stream(input_ids, max_new_tokens=...)`: tokens as they are generated.

    Takes generate()'s arguments (no streamer: the deltas are the stream) and returns a `GenerationStream` of
    `GenerationDelta(sequence, token_ids, finish_reason)`, one sequence per output row of generate(). Bad input raises
    here, before anything runs. `stream.abort(i)` cancels one sequence; leaving the loop early, cancelling the task
    or `await stream.aclose()` cancels the rest and frees their KV blocks. Call it from the event loop's thread.
    `seed` as in `agenerate`. This is what `hf-accel serve` is built on.
    """
    _refuse_async_on_tensor_parallel(self, "agenerate_stream")
    if kwargs.get("streamer") is not None:
        raise ValueError("agenerate_stream() takes no streamer: iterate over the stream it returns")
    kwargs.pop("streamer", None)
    plan = _plan_generate(self, _generate_args(inputs, generation_config, logits_processor, stopping_criteria,
                                               **kwargs), seed=seed)
    state = _admit(self, counted_thread=False) if plan.prepare is not None else None
    if state is None:
        return _stock_stream(self, plan)
    try:
        prepared = plan.prepare(state)
        waker = AsyncWaker(asyncio.get_running_loop())
        call = EngineCall(prepared.requests, wants_events=True, notify=waker)
        state.loop.submit(call)
    except BaseException:
        _leave(self, state, counted_thread=False)
        raise
    tid = threading.get_ident()
    return GenerationStream(state.loop, call, waker, on_close=lambda: _leave(self, state, False, tid))


def lead_tensor_parallel(model) -> None:
    """Rank 0 of an accelerated tensor-parallel model that is about to be served: from now on its engine hands every
    step's schedule to the other ranks, which must call `follow_tensor_parallel(model)` at the same time
    (engine/tp_driver.py). Calls may then come from any thread or task, at any time, and end at any time
    (`agenerate_stream`, aborts), as on one GPU. What a plan cannot carry is refused: host callbacks that decide
    tokens or stops (logits processors, stopping criteria, stop strings in generate(), max_time), and calls that would
    run stock generate(). The model must not change while it is led (nothing checks its weights meanwhile), and no
    other code may run its forward. `stop_leading_tensor_parallel(model)` ends it. This is what `hf-accel serve` runs
    under torchrun.
    """
    _tensor_parallel_role(model, "lead_tensor_parallel", leader=True)


def stop_leading_tensor_parallel(model, timeout: float | None = None) -> bool:
    """End `lead_tensor_parallel`: new calls are refused, the calls running finish (streams must be closed), then
    the other ranks' `follow_tensor_parallel` returns. True once it has. False if that did not happen within
    `timeout` seconds: if the calls were still running, the model stays led; if they had finished but the engine
    thread had not yet told the other ranks, it keeps refusing calls and stops as soon as it can."""
    model = base_model_of(model)
    state = _state_of(model)
    record = _model_lock_record(model)
    deadline = None if timeout is None else time.monotonic() + timeout
    with record.rlock:
        if state.loop.driver is None:
            return True
        state.stopping_lead = True
        try:
            if not record.changed.wait_for(lambda: state.active_calls == 0, timeout):
                return False
            # no call is between its admission and its submit now: none can reach a loop that no longer drives
            return state.loop.stop_driving(None if deadline is None else max(0.0, deadline - time.monotonic()))
        finally:
            state.stopping_lead = False


def follow_tensor_parallel(model) -> int:
    """Every rank but 0 of a served tensor-parallel model: run rank 0's schedule, step by step, on this thread until
    rank 0 stops leading (see `lead_tensor_parallel`). Returns the number of forward steps run. Other calls on this
    rank are refused meanwhile. An error raises (torchrun then ends every rank); the rank is then out of step and
    refuses further calls."""
    from hf_accel.engine.tp_driver import follow

    model = base_model_of(model)
    state, plans = _tensor_parallel_role(model, "follow_tensor_parallel", leader=False)
    try:
        return follow(state.engine, plans)
    except BaseException as exc:
        state.tp_out_of_step = f"following rank 0 failed: {type(exc).__name__}: {exc}"
        state.engine.recover()
        raise
    finally:
        with _model_lock_record(model).rlock:
            state.following = False
            _model_lock_record(model).changed.notify_all()


def _tensor_parallel_role(model, name: str, *, leader: bool) -> tuple[AccelState, TensorParallel]:
    """Checks (before any collective), then the agreed start of leading or following, under the model's lock: the
    model unchanged on every rank, and the CPU group the plans travel on (gloo: a plan never waits for the GPU's
    queued work). Rank 0's engine starts driving before the lock is let go, so no call admitted meanwhile can take
    the undriven path."""
    import torch.distributed as dist

    from hf_accel.engine.tp_driver import LeaderDriver

    model = base_model_of(model)
    state = _state_of(model)
    tp = state.engine.tp
    if tp is None:
        raise ValueError(f"{name}(): the model is not tensor-parallel")
    if leader != (tp.rank == 0):
        raise ValueError(f"{name}(): rank 0 leads and the other ranks follow (this is rank {tp.rank})")
    if state.tp_out_of_step is not None:
        raise RuntimeError(f"{name}(): this rank is out of step with the others ({state.tp_out_of_step})")
    with _model_lock_record(model).rlock:
        if state.loop.driver is not None or state.following:
            raise RuntimeError(f"{name}(): this rank already leads or follows")
        if state.active_calls:
            raise RuntimeError(f"{name}(): calls are running on this model")
        state.loop.wait_idle()
        if state.plan_group is None:  # created by the group's ranks alone, in the same order (lead pairs follow)
            state.plan_group = dist.new_group(dist.get_process_group_ranks(tp.group), backend="gloo",
                                              use_local_synchronization=True)
        if state.engine.sync_with_model():  # agreed with the other ranks, which run the same check
            raise RuntimeError(f"{name}(): the model changed since it was accelerated; accelerate it again on every "
                               "rank first")
        plans = TensorParallel(size=tp.size, rank=tp.rank, group=state.plan_group, device=torch.device("cpu"))
        if leader:
            state.loop.start_driving(LeaderDriver(plans))
        else:
            state.following = True
    return state, plans


def check_led_model_servable(model) -> None:
    """Raise NotImplementedError, with the reason, when a plain call on this led tensor-parallel model, greedy or
    sampled, could not be driven (its generation config asks for a stock-only mode, or for host callbacks such as
    `no_repeat_ngram_size` or stop strings): `hf-accel serve` then refuses to start instead of failing requests.
    Builds the requests of one-token calls and discards them; nothing runs."""
    from hf_accel.engine.tp_driver import unsupported_reason

    model = base_model_of(model)
    state = _state_of(model)
    if state.loop.driver is None:
        raise ValueError("check_led_model_servable(): the model is not led (lead_tensor_parallel)")
    prompt = torch.tensor([[1]], device=_model_device(model))
    for sampling in ({"do_sample": False}, {"do_sample": True, "temperature": 0.7, "top_p": 0.9}):
        plan = _plan_generate(model, _generate_args(prompt, max_new_tokens=1, **sampling))  # (_warn_stock raises)
        if plan.prepare is None:
            raise NotImplementedError("this model's calls would run stock generate()")
        for req in plan.prepare(state).requests:
            reason = unsupported_reason(req)
            if reason is not None:
                raise NotImplementedError(f"this model's generation config adds host callbacks: {reason}")


def _state_of(model) -> AccelState:
    state: AccelState | None = base_model_of(model).__dict__.get(_STATE)
    if state is None:
        raise ValueError("model is not accelerated (call accelerate_model first)")
    return state


def _refuse_async_on_tensor_parallel(model, name: str) -> None:
    """A cancelled task, an abort or a stream left early lands between steps at a different step on each rank, so
    the ranks' collectives would stop pairing up: the async entry points are refused on tensor-parallel models,
    unless rank 0 leads (`lead_tensor_parallel`: its aborts reach the other ranks in its step plans)."""
    state = base_model_of(model).__dict__.get(_STATE)
    if state is not None and getattr(state.engine, "tp", None) is not None and state.loop.driver is None:
        raise NotImplementedError(
            f"{name}() is not supported on a tensor-parallel model: cancelling, aborting or leaving a stream early "
            "would end the call at a different step on each rank; use generate() or generate_batch(), the same "
            "calls in the same order on every rank")


def _stock_stream(model, plan: _GeneratePlan) -> StockGenerationStream:
    """agenerate_stream() for a call that runs stock: the plan's resolved config says the EOS ids and row count."""
    gc, ids = plan.generation_config, plan.input_ids
    eos = set(eos_ids(gc)) if gc is not None else set()
    rows = _num_rows(ids) * max(1, (gc.num_return_sequences if gc is not None else 1) or 1)
    prompt_len = int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else 0  # embeds only: stock returns new tokens
    return StockGenerationStream(lambda: type(model).generate(model, **plan.stock_args), prompt_len, eos, rows)


# bound to a model as instance attributes, these pickle as `getattr(model, name)`: under these names a pickled
# accelerated model comes back with the class's own (stock) methods, its state dropped (`AccelState.__reduce__`)
_accelerated_generate.__name__ = "generate"
_accelerated_generate_batch.__name__ = "generate_batch"
_PATCHED_METHODS = {"generate": _accelerated_generate, "generate_batch": _accelerated_generate_batch,
                    "agenerate": agenerate, "agenerate_stream": agenerate_stream}
