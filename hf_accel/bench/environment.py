"""What the report records about the run: library versions, machine, git revision, accelerate_model options."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import importlib
import importlib.metadata
import importlib.util
import math
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from hf_accel.config import switch_values


# ------------------------------------------------------------------------------------------------- environment
def library_versions() -> dict[str, str]:
    """Versions of the libraries that decide speed; "absent" when not importable."""
    candidates = {
        "torch": ("torch", ("torch",)),
        "transformers": ("transformers", ("transformers",)),
        "triton": ("triton", ("triton",)),
        "flashinfer": ("flashinfer", ("flashinfer-python", "flashinfer")),
        "flash-attn": ("flash_attn", ("flash-attn-4", "flash-attn", "flash_attn")),
        "hf_accel": ("hf_accel", ("hf_accel",)),
    }
    out: dict[str, str] = {}
    for name, (module, dists) in candidates.items():
        try:
            mod = importlib.import_module(module)
        except Exception:
            out[name] = "absent"
            continue
        version = getattr(mod, "__version__", None)
        for dist in dists:
            if version:
                break
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                version = importlib.metadata.version(dist)
        out[name] = str(version or "present (version unknown)")
    out["python"] = platform.python_version()
    out["cuda"] = str(torch.version.cuda) if torch.version.cuda else "absent"
    return out


def _git_revision() -> dict[str, Any] | None:
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except Exception:
        return None
    return {"commit": rev, "dirty": bool(dirty)}


def python_bytecode_cache() -> bool:
    """Whether a new process finds torch's modules compiled: Python may write its bytecode cache, or the .pyc of a
    module every compiled start imports exists already. Without it every start compiles them from source (on the
    H200 image, which sets PYTHONDONTWRITEBYTECODE and ships no .pyc files: an 8B warm start of 15.7 s against 9.2 s
    with the cache, same lease)."""
    if not sys.flags.dont_write_bytecode:
        return True
    try:
        spec = importlib.util.find_spec("torch._inductor.compile_fx")
    except (ImportError, ValueError):
        return False
    return bool(spec and spec.cached and Path(spec.cached).exists())


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"versions": library_versions(), "platform": platform.platform(), "device": str(device),
                           "hostname": platform.node(), "git": _git_revision(),
                           "python_bytecode_cache": python_bytecode_cache()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu_name"] = props.name
        env["gpu_memory_bytes"] = props.total_memory
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["gpu_count"] = torch.cuda.device_count()
    else:
        env["gpu_name"] = None
    return env


# ---------------------------------------------------------------------------------------------- accel options
def accel_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Only the accelerate_model options the user set, so the library's own defaults apply otherwise."""
    kw: dict[str, Any] = {}
    if args.attention_backend != "auto":
        kw["attention_backend"] = args.attention_backend
    if args.cudagraph_mode is not None:
        kw["cudagraph_mode"] = args.cudagraph_mode
    if args.cudagraph_capture_sizes:
        kw["cudagraph_capture_sizes"] = [int(s) for s in args.cudagraph_capture_sizes.split(",") if s.strip()]
    if args.compile is not None:
        kw["compile"] = args.compile
    if args.enforce_eager:
        kw["enforce_eager"] = True
    for name in ("block_size", "num_kv_blocks", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.no_prefix_caching:
        kw["enable_prefix_caching"] = False
    switches: dict[str, Any] = switch_values(args)
    if getattr(args, "piecewise_capture_sizes", None):
        switches["piecewise_capture_sizes"] = [int(s) for s in args.piecewise_capture_sizes.split(",") if s.strip()]
    if switches:  # AccelConfig fields without a keyword of their own in accelerate_model
        from hf_accel.config import AccelConfig

        kw["config"] = AccelConfig(**switches)
    return kw


def _accel_argv(args: argparse.Namespace) -> list[str]:
    """The command-line options that reproduce `args`' model and accelerate_model settings (startup children)."""
    argv = ["--model", args.model] if args.model else ["--shape", args.shape]
    argv += ["--dtype", args.dtype, "--scale", args.scale, "--attention-backend", args.attention_backend]
    if getattr(args, "quantization", "none") != "none":
        argv += ["--quantization", args.quantization]
    if args.device:
        argv += ["--device", args.device]
    if args.cudagraph_mode is not None:
        argv += ["--cudagraph-mode", args.cudagraph_mode]
    if args.cudagraph_capture_sizes:
        argv += ["--cudagraph-capture-sizes", args.cudagraph_capture_sizes]
    if getattr(args, "piecewise_capture_sizes", None):
        argv += ["--piecewise-capture-sizes", args.piecewise_capture_sizes]
    if args.compile is not None:
        argv.append("--compile" if args.compile else "--no-compile")
    if args.enforce_eager:
        argv.append("--enforce-eager")
    for name in ("block_size", "num_kv_blocks", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) is not None:
            argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.no_prefix_caching:
        argv.append("--no-prefix-caching")
    for name, on in switch_values(args).items():
        flag = name.replace("_", "-")
        argv.append(f"--{flag}" if on else f"--no-{flag}")
    return argv


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    if isinstance(obj, torch.dtype | torch.device):
        return str(obj)
    return repr(obj)


def resolved_accel_config(kwargs: dict[str, Any], device: torch.device) -> dict[str, Any] | None:
    """Every AccelConfig field as accelerate_model resolves it on this device."""
    try:
        from hf_accel.config import AccelConfig

        rest = dict(kwargs)
        base = rest.pop("config", None) or AccelConfig()  # accelerate_model's rule: its keywords win over config
        cfg = base.updated(**rest).resolve_for(device)
        return _jsonable(dataclasses.asdict(cfg))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _api():
    return importlib.import_module("hf_accel.api")


def _engine_info(model) -> dict[str, Any] | None:
    fn = getattr(_api(), "engine_info", None)
    if fn is None:
        return None
    try:
        return _jsonable(fn(model))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


