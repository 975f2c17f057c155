"""The on-disk compile cache: a directory per (model, dtype, versions, capture sizes, hf_accel sources).

Inductor already caches compiled graphs (FX graph cache, AOTAutograd cache, autotuning results, Triton binaries);
what it lacks is a stable home per model. Pointing `TORCHINDUCTOR_CACHE_DIR` at a directory keyed by everything that
changes the compiled code makes a second start of the same model skip codegen and kernel compilation, and keeps
stale artifacts of other versions out of the way. Triton kernels land under it too (Inductor puts them in
`<cache dir>/triton` unless `TRITON_CACHE_DIR` is set).

`cache_dir=None` means the default location (~/.cache/hf_accel/compile, or $HF_ACCEL_CACHE_DIR/compile);
`cache_dir=""` disables ours and leaves torch's own defaults untouched.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

INDUCTOR_SUBDIR = "inductor"
KEY_FILE = "hf_accel_cache_key.json"


def default_cache_root() -> Path:
    base = os.environ.get("HF_ACCEL_CACHE_DIR")
    root = Path(base) if base else Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "hf_accel"
    return root.expanduser() / "compile"


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _source_dirs() -> list[Path]:
    dirs = []
    for pkg in ("hf_accel", "hf_accel.patches"):
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(Path(p) for p in spec.submodule_search_locations)
    return dirs


def source_hash() -> str:
    """Hash of every hf_accel (and hf_accel.patches) .py file: a code change must not reuse old artifacts."""
    h = hashlib.sha256()
    for root in _source_dirs():
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            h.update(str(path.relative_to(root)).encode())
            h.update(b"\0")
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def _config_json(config: Any) -> str:
    if hasattr(config, "to_json_string"):
        return config.to_json_string()
    if isinstance(config, dict):
        return json.dumps(config, sort_keys=True, default=repr)
    return repr(config)


def cache_key_payload(model_config: Any, dtype: torch.dtype | str, capture_sizes: Iterable[int],
                      extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the compiled artifacts depend on (extra: device name, backend, compile options, ...)."""
    return {
        "config": _config_json(model_config),
        "dtype": str(dtype),
        "capture_sizes": sorted({int(s) for s in capture_sizes}),
        "torch": torch.__version__,
        "transformers": _package_version("transformers"),
        "triton": _package_version("triton") or _package_version("pytorch-triton"),
        "python": platform.python_version(),
        "hf_accel_sources": source_hash(),
        "extra": {k: str(v) for k, v in sorted((extra or {}).items())},
    }


def compile_cache_key(model_config: Any, dtype: torch.dtype | str, capture_sizes: Iterable[int],
                      extra: dict[str, Any] | None = None) -> str:
    payload = cache_key_payload(model_config, dtype, capture_sizes, extra)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


@dataclass
class CompileCacheInfo:
    path: Path | None  # the directory used; None when disabled
    warm: bool  # it already held compiled artifacts (a previous start compiled the same thing)
    key: str | None
    _previous_env: dict[str, str | None] = field(default_factory=dict, repr=False)

    def restore_env(self) -> None:
        """Put TORCHINDUCTOR_CACHE_DIR back as it was (the compiled code already loaded stays valid)."""
        for name, value in self._previous_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._previous_env = {}


def _non_empty(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def setup_compile_cache(cache_dir: str | os.PathLike | None, model_config: Any, dtype: torch.dtype | str,
                        capture_sizes: Iterable[int], extra: dict[str, Any] | None = None) -> CompileCacheInfo:
    """Point Inductor's caches at this model's directory; returns it and whether it was warm.

    Process-wide (Inductor reads the environment): call it at warm-up, right before compiling.
    """
    if cache_dir is not None and str(cache_dir) == "":
        logger.info("hf_accel compile cache disabled (torch's default caches apply)")
        return CompileCacheInfo(None, False, None)
    payload = cache_key_payload(model_config, dtype, capture_sizes, extra)
    key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    path = root / key
    inductor_dir = path / INDUCTOR_SUBDIR
    warm = _non_empty(inductor_dir)
    inductor_dir.mkdir(parents=True, exist_ok=True)
    key_file = path / KEY_FILE
    if not key_file.exists():
        key_file.write_text(json.dumps(payload, indent=1, sort_keys=True))
    previous = {"TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.autotune_local_cache = True
    try:
        import torch._functorch.config as functorch_config

        functorch_config.enable_autograd_cache = True
    except (ImportError, AttributeError):  # pragma: no cover - older torch
        pass
    logger.info("hf_accel compile cache: %s (%s)", path, "warm" if warm else "cold")
    return CompileCacheInfo(path, warm, key, previous)
