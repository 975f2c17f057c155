"""The startup workload: `accelerate_model` to the first generated token, cold then warm caches.

With process isolation each phase runs in a fresh `python -m hf_accel.bench --startup-child ...` whose compile
caches live in a temporary directory.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from .environment import _accel_argv, _api, _engine_info, _jsonable, accel_kwargs
from .workloads import (
    SCALES,
    Progress,
    build_model,
    call_generate,
    free_memory,
    random_prompts,
    resolve_device,
    resolve_dtype,
    timed,
)


# -------------------------------------------------------------------------------------------------- startup
def measure_startup_once(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                         cache_dir: str) -> dict[str, Any]:
    """Build a fresh model (not timed), then time accelerate_model and the first generated token."""
    from hf_accel.config import AccelConfig

    api = _api()
    model = build_model(args.shape, args.model, dtype, device, getattr(args, "quantization", "none"))
    spec = SCALES[args.scale]["w1"]
    prompts = random_prompts(spec.prompt_lengths(), 0, model.config.get_text_config().vocab_size)
    cfg = AccelConfig(**accel_kwargs(args), compile_cache_dir=cache_dir)
    free_memory(device)
    accelerate = functools.partial(api.accelerate_model, model, config=cfg)
    profile_dir = getattr(args, "startup_profile", None)
    if profile_dir:  # a host-side profile of the start (the figures then include cProfile's own overhead)
        stem = Path(profile_dir) / f"startup-{args.startup_child or 'inline'}"
        accelerate = functools.partial(_profiled, accelerate, stem)
    accel_s, _ = timed(accelerate, device)
    first_s, out = timed(call_generate(model, prompts, 1, device), device)
    info = _engine_info(model) or {}
    rec = {"accelerate_s": accel_s, "first_token_s": first_s, "total_s": accel_s + first_s,
           "engine_startup": info.get("startup"), "compile_cache": info.get("compile_cache"),
           "graph_pool_bytes": info.get("graph_pool_bytes"), "engine_info": info,
           "valid": not out.problems, "reasons": out.problems}
    api.restore(model)
    del model
    free_memory(device)
    return rec


def _profiled(fn: Any, stem: Path) -> Any:
    """Run `fn()` under cProfile; write `<stem>.pstats` and the top functions by cumulative and own time."""
    import cProfile
    import io
    import pstats

    stem.parent.mkdir(parents=True, exist_ok=True)
    profiler = cProfile.Profile()
    try:
        return profiler.runcall(fn)
    finally:
        profiler.dump_stats(str(stem) + ".pstats")
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(80)
        stats.sort_stats("tottime").print_stats(50)
        Path(str(stem) + ".txt").write_text(text.getvalue())


def _startup_child(args: argparse.Namespace) -> int:
    """Entry point of a fresh process measuring one startup (the parent reads its JSON)."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    try:
        rec = measure_startup_once(args, device, dtype, args.compile_cache_dir)
    except Exception as exc:
        rec = {"valid": False, "reasons": [f"{type(exc).__name__}: {exc}"], "traceback": traceback.format_exc()}
    Path(args.startup_out).write_text(json.dumps(_jsonable(rec), indent=1))
    return 0


def run_startup(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                progress: Progress) -> dict[str, Any]:
    """Cold (empty compile caches) then warm (same caches) startup, each on a fresh model object.

    With isolation "process" each phase is a fresh Python process whose Inductor, Triton and FlashInfer caches
    also live in the temporary directory, so cold is truly cold and warm is what a second launch of a program sees
    (background kernel builds are off in both, so the warm start is not raced by one).
    """
    result: dict[str, Any] = {"isolation": args.startup_isolation}
    with tempfile.TemporaryDirectory(prefix="hf_accel_bench_cache_") as tmp:
        cache_dir = os.path.join(tmp, "hf_accel")
        for phase in ("cold", "warm"):
            with progress.step(f"startup {phase}"):
                if args.startup_isolation == "inline":
                    if phase == "warm":
                        torch._dynamo.reset()
                    try:
                        rec = measure_startup_once(args, device, dtype, cache_dir)
                    except Exception as exc:
                        rec = {"valid": False, "reasons": [f"{type(exc).__name__}: {exc}"],
                               "traceback": traceback.format_exc()}
                else:
                    rec = _startup_subprocess(args, tmp, cache_dir, phase)
            result[phase] = rec
    return result


def _startup_subprocess(args: argparse.Namespace, tmp: str, cache_dir: str, phase: str) -> dict[str, Any]:
    out_path = os.path.join(tmp, f"startup_{phase}.json")
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
    # FlashInfer's JIT cache too: a fresh start must not find kernels an earlier run built on this machine
    env["FLASHINFER_WORKSPACE_BASE"] = os.path.join(tmp, "flashinfer")
    # no detached kernel builds racing the warm start (or outliving the temporary directory)
    env["HF_ACCEL_BACKGROUND_BUILDS"] = "0"
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    profile = ["--startup-profile", args.startup_profile] if getattr(args, "startup_profile", None) else []
    cmd = [sys.executable, "-m", "hf_accel.bench", *_accel_argv(args), *profile, "--startup-child", phase,
           "--startup-out", out_path, "--compile-cache-dir", cache_dir]
    builds_before = triton_builds(env["TRITON_CACHE_DIR"])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.startup_timeout)
    except subprocess.TimeoutExpired:
        return {"valid": False, "reasons": [f"startup process exceeded {args.startup_timeout} s"]}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not os.path.exists(out_path):
        return {"valid": False, "reasons": [f"startup process exited with {proc.returncode}"],
                "stderr_tail": proc.stderr[-4000:]}
    rec = json.loads(Path(out_path).read_text())
    rec["process_wall_s"] = wall
    # a warm start should build nothing: a kernel it builds again means a cache key that differs between processes
    rec["triton_kernels_built"] = triton_builds(env["TRITON_CACHE_DIR"]) - builds_before
    return rec


def triton_builds(cache_dir: str) -> int:
    """Kernels in a Triton cache directory: one `__grp__<name>.json` per build."""
    root = Path(cache_dir)
    return sum(1 for _ in root.rglob("__grp__*.json")) if root.is_dir() else 0


