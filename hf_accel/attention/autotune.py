"""Pick the fastest attention backend for this model on this GPU by timing it on synthetic steps.

The static "auto" order (registry.py) is a good guess, but which kernel wins depends on head dim, GQA group size,
window/softcap and GPU. So `accelerate_model(attention_backend="auto")` on CUDA times each valid candidate on one
decode step and one prefill step shaped like the model's (its heads, head dim, dtype and layer count), within a
small time budget, and keeps the fastest. A step costs the host's `prepare()` plus the GPU time of one forward per
layer (decode replayed from a CUDA graph, as the engine runs it). Decode counts more (`decode_weight`): a
generation runs one decode step per new token but prefills each prompt once.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hf_accel.attention.backend import AttentionBackend, AttentionSpec, CUDAGraphSupport
from hf_accel.attention.metadata import StepMetadata
from hf_accel.compilation.cuda_graph import capture_graph

logger = logging.getLogger(__name__)

MIN_SAMPLES = 3  # timed samples per shape even when the budget is spent (first-call compiles can eat it)
MAX_SAMPLES = 50
WARMUP_CALLS = 2  # after the first call, which may JIT-compile
DECODE_WEIGHT = 4.0  # a decode step's time counts this many times a prefill step's in the score


def synthetic_step_metadata(seqs: list[tuple[int, int]], block_size: int, device: torch.device, *,
                            pad_rows_to: int | None = None,
                            generator: torch.Generator | None = None) -> tuple[StepMetadata, int]:
    """Step metadata for sequences given as (context_len, query_len), with blocks scattered over the cache.

    Returns the metadata and the number of cache blocks it needs (block 0 stays the null block).
    `pad_rows_to` adds rows the way the runner pads a uniform decode batch for a CUDA graph: one token each,
    slot -1, seq_len 0, block-table row of zeros; the tensors then have `pad_rows_to` rows.
    """
    n = len(seqs)
    rows = max(n, pad_rows_to or 0)
    query_lens = [q for _, q in seqs]
    seq_lens = [c + q for c, q in seqs]
    pages = [-(-s // block_size) for s in seq_lens]
    width = max(pages)
    blocks = torch.randperm(sum(pages), generator=generator) + 1
    table = [[0] * width for _ in range(rows)]
    starts = [0, *itertools.accumulate(pages)]
    for i, p in enumerate(pages):
        table[i][:p] = blocks[starts[i] : starts[i] + p].tolist()
    slots = [
        table[i][pos // block_size] * block_size + pos % block_size
        for i, (context, q) in enumerate(seqs)
        for pos in range(context, context + q)
    ]
    slots += [-1] * (rows - n)
    query_start_loc = [0, *itertools.accumulate(query_lens + [1] * (rows - n))]
    meta = StepMetadata(
        num_tokens=sum(query_lens),
        num_seqs=n,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens + [0] * (rows - n), dtype=torch.int32, device=device),
        context_lens=torch.tensor([c for c, _ in seqs] + [0] * (rows - n), dtype=torch.int32, device=device),
        block_tables=torch.tensor(table, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return meta, 1 + sum(pages)


def _capture(fn, device: torch.device) -> torch.cuda.CUDAGraph | None:
    """`fn` recorded in a CUDA graph, or None when it cannot be captured (then it is timed eagerly)."""
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        with torch.cuda.device(device):
            graph, _ = capture_graph(fn, pool=None)  # a failed capture leaves the CUDA RNG usable
        return graph
    except Exception as exc:
        logger.info("attention autotune: cannot capture %s in a CUDA graph (%s); timing it eagerly",
                    getattr(fn, "__qualname__", fn), exc)
        torch.cuda.synchronize(device)
        return None


def _step_fn(backend: AttentionBackend, spec: AttentionSpec, meta: StepMetadata, caches: tuple,
             num_layers: int):
    """One step of this shape: `num_layers` attention forwards (prepare() is the caller's)."""
    rows = meta.slot_mapping.shape[0]
    query = torch.randn(rows, spec.num_heads, spec.head_dim, device=backend.device, dtype=spec.dtype)
    output = torch.empty_like(query)
    scale = spec.head_dim**-0.5
    softcap = 50.0 if spec.uses_softcap else 0.0

    def layers() -> None:
        for _ in range(num_layers):
            backend.forward(query, caches[0], caches[1], meta, output, scale, 0, softcap)

    return layers


def _build_first_steps(backend: AttentionBackend, spec: AttentionSpec, metas: list[StepMetadata],
                       caches: tuple) -> float:
    """Build the Triton kernels of each shape's first step at once (ops/triton_build.py), not one after another
    inside the timing's first calls; returns the seconds it took. A backend without Triton kernels of its own is
    left alone. Never raises: whatever did not build here builds in the first calls, as before."""
    from hf_accel.ops.triton_build import ahead, build_ahead_enabled, build_in_parallel

    if not (backend.builds_triton_kernels and build_ahead_enabled()):
        return 0.0

    def first_step(meta: StepMetadata) -> None:
        backend.prepare(meta)
        _step_fn(backend, spec, meta, caches, 1)()

    t0 = time.perf_counter()
    try:
        build_in_parallel([ahead(lambda m=m: first_step(m)) for m in metas])
    except Exception as exc:
        logger.info("attention autotune: building %s's first steps ahead failed (%s: %s)", backend.name,
                    type(exc).__name__, exc)
    return time.perf_counter() - t0


def _time_shape(backend: AttentionBackend, spec: AttentionSpec, meta: StepMetadata, caches: tuple, *,
                num_layers: int, budget_s: float, graph: bool) -> tuple[float, float]:
    """Milliseconds of one step of this shape (host prepare() plus the GPU time of num_layers forwards), and the
    seconds the first, untimed step took (where a library JIT-compiles its kernels).

    With `graph`, the forwards are timed as one CUDA-graph replay, as the engine runs them (otherwise a small
    decode step would measure Python launch overhead, not the kernels); prepare() runs on the host before every
    step either way, so its median wall time is added.
    """
    device = backend.device
    layers = _step_fn(backend, spec, meta, caches, num_layers)
    t_first = time.perf_counter()
    backend.prepare(meta)
    layers()  # may compile or plan; raises for a candidate that cannot run this shape
    torch.cuda.synchronize(device)
    first_call_s = time.perf_counter() - t_first
    prepare_s = []
    for _ in range(WARMUP_CALLS + MIN_SAMPLES):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        backend.prepare(meta)
        prepare_s.append(time.perf_counter() - t0)
    captured = _capture(layers, device) if graph else None
    run = captured.replay if captured is not None else layers
    for _ in range(WARMUP_CALLS):
        run()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < MIN_SAMPLES or (len(samples) < MAX_SAMPLES and time.perf_counter() < deadline):
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples) + 1e3 * statistics.median(prepare_s), first_call_s


def _time_candidate(cls: type[AttentionBackend], spec: AttentionSpec, device: torch.device,
                    block_size_hint: int | None, decode_seqs: list[tuple[int, int]],
                    prefill_seqs: list[tuple[int, int]], *, num_layers: int, budget_s: float,
                    decode_in_graph: bool = True) -> dict[str, float]:
    block_size = block_size_hint if block_size_hint in cls.supported_block_sizes else cls.supported_block_sizes[0]
    generator = torch.Generator().manual_seed(0)
    decode_meta, decode_blocks = synthetic_step_metadata(decode_seqs, block_size, device, generator=generator)
    prefill_meta, prefill_blocks = synthetic_step_metadata(prefill_seqs, block_size, device, generator=generator)
    num_blocks = max(decode_blocks, prefill_blocks)
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    caches = (torch.randn(shape, device=device, dtype=spec.dtype), torch.randn(shape, device=device, dtype=spec.dtype))
    max_blocks_per_seq = max(decode_meta.block_tables.shape[1], prefill_meta.block_tables.shape[1])
    backend = cls(spec, device, block_size, max_num_seqs=max(len(decode_seqs), len(prefill_seqs)),
                  max_num_tokens=max(decode_meta.num_tokens, prefill_meta.num_tokens),
                  max_blocks_per_seq=max_blocks_per_seq)
    # decode steps replay as full CUDA graphs where the backend allows it; prefill attention runs eagerly between
    # piecewise graphs, so it is timed eagerly (its kernels dwarf the launch cost anyway)
    graph_decode = decode_in_graph and backend.cudagraph_support != CUDAGraphSupport.NEVER
    if graph_decode and hasattr(backend, "set_cudagraph_batch_sizes"):
        backend.set_cudagraph_batch_sizes([len(decode_seqs)])
    build_ahead_s = _build_first_steps(backend, spec, [decode_meta, prefill_meta], caches)
    decode_ms, decode_first_s = _time_shape(backend, spec, decode_meta, caches, num_layers=num_layers,
                                            budget_s=budget_s / 2, graph=graph_decode)
    prefill_ms, prefill_first_s = _time_shape(backend, spec, prefill_meta, caches, num_layers=num_layers,
                                              budget_s=budget_s / 2, graph=False)
    return {"decode_ms": decode_ms, "prefill_ms": prefill_ms, "block_size": float(block_size),
            "first_call_s": decode_first_s + prefill_first_s, "build_ahead_s": build_ahead_s}


REFERENCE_BACKEND = "torch"


def autotune_backends(candidates: list[type[AttentionBackend]], spec: AttentionSpec, device: torch.device,
                      block_size_hint: int | None, num_decode_seqs: int = 32, decode_context: int = 1024,
                      prefill_tokens: int = 2048, time_budget_s: float = 2.0, *, num_layers: int = 1,
                      decode_weight: float = DECODE_WEIGHT, prefill_seq_len: int = 1024,
                      decode_in_graph: bool = True,
                      ) -> tuple[type[AttentionBackend], dict[str, dict[str, float | str]]]:
    """Time each candidate on a decode and a prefill step of this model's attention shape; return the fastest.

    Candidates come in preference order (registry.auto_candidates); off CUDA, or with one candidate, the first is
    returned untimed. The torch reference backend is timed only when no other candidate could be timed (its entry
    then says "skipped"). Each candidate runs at `block_size_hint` if it supports it, else at its own preferred block
    size (the one the engine would give it). `decode_in_graph`: time decode as a CUDA-graph replay (the engine's
    full graphs) or eagerly (graph modes without full graphs).
    Timings per backend name: {"decode_ms", "prefill_ms", "score"} (score = decode_weight * decode + prefill), with
    "first_call_s" (the untimed first steps, where libraries JIT-compile), "build_ahead_s" (our Triton kernels of
    those steps, built before them in parallel: ops/triton_build.py) and "seconds" (the candidate's whole
    share of autotuning), or {"error": "..."} for a candidate that cannot run here or raised on its first call
    (it is dropped).
    `num_layers` forwards per prepare() weigh the per-step planning cost as a real model would.
    """
    if not candidates:
        raise ValueError("autotune_backends needs at least one candidate")
    if device.type != "cuda" or len(candidates) == 1:
        return candidates[0], {}
    decode_seqs = [(decode_context - 1, 1)] * num_decode_seqs
    prefill_seqs = []
    remaining = prefill_tokens
    while remaining > 0:
        prefill_seqs.append((0, min(prefill_seq_len, remaining)))
        remaining -= prefill_seq_len

    timings: dict[str, dict[str, float | str]] = {}
    per_candidate_s = time_budget_s / len(candidates)
    # the reference backend last, and timed only when nothing compiled ran: on the H200 it was 20x slower than triton
    # at decode on every shape measured and cannot live in a CUDA graph, so timing it only cost a fresh start ~2 s
    ordered = ([c for c in candidates if c.name != REFERENCE_BACKEND]
               + [c for c in candidates if c.name == REFERENCE_BACKEND])
    unavailable = {c.name: c.unavailable_reasons(spec, device) for c in ordered}
    contenders = [c for c in ordered if c.name != REFERENCE_BACKEND and not unavailable[c.name]]
    if len(contenders) == 1:
        # nothing to choose between: the one contender wins if its first calls run (else the reference does), so
        # it is run for its record and validation with the fewest samples, not for a time budget (~1 s of a fresh
        # start where triton is the only library backend installed)
        per_candidate_s = 0.0
    with torch.inference_mode():
        for cls in ordered:
            if cls.name == REFERENCE_BACKEND and any("score" in t for t in timings.values()):
                timings[cls.name] = {"skipped": "the reference backend is timed only when no other candidate runs"}
                continue
            reasons = unavailable[cls.name]
            if reasons:
                timings[cls.name] = {"error": "; ".join(reasons)}
                continue
            t0 = time.perf_counter()
            try:
                result = _time_candidate(cls, spec, device, block_size_hint, decode_seqs, prefill_seqs,
                                         num_layers=num_layers, budget_s=per_candidate_s,
                                         decode_in_graph=decode_in_graph)
            except Exception as exc:  # a backend that cannot run this model is dropped, never fatal
                logger.warning("attention autotune: %s failed: %s: %s", cls.name, type(exc).__name__, exc)
                timings[cls.name] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            result["score"] = decode_weight * result["decode_ms"] + result["prefill_ms"]
            result["seconds"] = time.perf_counter() - t0  # all of it: construction, first calls, timing
            timings[cls.name] = dict(result)
    torch.cuda.empty_cache()  # the synthetic caches and workspaces go back before the engine sizes its KV cache

    timed = [cls for cls in candidates if "score" in timings.get(cls.name, {})]
    if not timed:
        raise RuntimeError(f"attention autotune: no candidate could run: {timings}")
    best = min(timed, key=lambda cls: timings[cls.name]["score"])
    return best, timings


# ---- the choice, remembered per GPU / model shape / library versions ------------------------------------------------
def autotune_cache_file(cache_dir: str | None, spec: AttentionSpec, device: torch.device,
                        candidates: list[str], **shape: Any) -> Path | None:
    """Where this exact tuning problem's answer is kept (None: caching disabled by cache_dir="").

    The key holds everything the timings depend on: GPU, attention shape, layer count, the candidate names (as
    `registry.probable_auto_names` finds them, without imports), the versions of torch/triton/flashinfer/flash-attn
    and hf_accel's own sources (a kernel change re-times).
    """
    if cache_dir is not None and str(cache_dir) == "":
        return None
    from hf_accel.compilation.cache import _package_version, default_cache_root, source_hash

    try:
        gpu = f"{torch.cuda.get_device_name(device)} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    except Exception:
        gpu = "unknown"
    payload = {
        "gpu": gpu, "spec": repr(spec), "candidates": list(candidates),
        "shape": {k: str(v) for k, v in sorted(shape.items())},
        "versions": {name: _package_version(name) for name in ("torch", "triton", "flashinfer-python", "flash-attn",
                                                                "flash-attn-4")},
        "hf_accel_sources": source_hash(),
    }
    key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    base = root.parent if cache_dir is None else root  # default: ~/.cache/hf_accel/autotune beside .../compile
    return base / "autotune" / f"{key}.json"


def load_cached_choice(path: Path | None) -> tuple[str, dict[str, Any]] | None:
    """The remembered winner's name and its record (timings, static choice), if `path` holds a readable one."""
    if path is None:
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):  # missing, unreadable or torn: time again
        return None
    if not isinstance(record, dict) or not isinstance(record.get("chosen"), str):
        return None
    if not isinstance(record.get("timings", {}), dict):
        return None
    return record["chosen"], record


def store_choice(path: Path | None, chosen: type[AttentionBackend], timings: dict[str, Any],
                 static_choice: str | None = None, candidates: list[str] | None = None,
                 unusable: list[str] | None = None) -> None:
    """Remember the winner, its timings, the candidates timed and those present but unable to run (re-checked on
    each remembered start)."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        record = {"chosen": chosen.name, "static_choice": static_choice, "candidates": candidates,
                  "unusable": unusable or [], "timings": timings}
        tmp.write_text(json.dumps(record, indent=1, default=str))
        os.replace(tmp, path)  # readers never see half a file
    except OSError as exc:  # a read-only home is not a reason to fail accelerate_model
        logger.debug("attention autotune: cannot write %s: %s", path, exc)
