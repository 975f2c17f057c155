"""Backend registry: name -> backend class, availability reasons, and the "auto" choice.

Backend modules are imported lazily, and a backend module imports its optional library (flashinfer, flash_attn)
only inside functions: a missing library makes its backend unavailable with a reason, never an ImportError for
the whole package.

The "auto" rule (`select_backend("auto", ...)`, the static choice):
- on CUDA, the first backend that can run this model here, in the order flashinfer > flash_attn > triton > torch
  (fastest paged kernels first; torch is the always-works yardstick);
- on any other device, torch (the only backend that runs off CUDA).
`auto_candidates()` returns every backend that can run, in that order; `hf_accel.attention.autotune` can then time
them on the real shapes of the model and pick the fastest.

Importing flashinfer or flash_attn.cute costs seconds. `probable_auto_names()` answers "which backends would auto
consider" without importing them (module present on disk, GPU and shape limits): that is what a remembered autotune
answer is keyed by, so a warm start imports only the library of the backend it runs.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys

import torch

from hf_accel.attention.backend import AttentionBackend, AttentionSpec

# name -> (module, class name)
BACKEND_MODULES: dict[str, tuple[str, str]] = {
    "torch": ("hf_accel.attention.torch_backend", "TorchAttentionBackend"),
    "triton": ("hf_accel.attention.triton_backend", "TritonAttentionBackend"),
    "flashinfer": ("hf_accel.attention.flashinfer_backend", "FlashInferBackend"),
    "flash_attn": ("hf_accel.attention.flash_attn_backend", "FlashAttnBackend"),
}
BACKEND_NAMES = tuple(BACKEND_MODULES)

# "auto" preference on CUDA, fastest first (see the module docstring); off CUDA only "torch" can run.
AUTO_PREFERENCE_CUDA = ("flashinfer", "flash_attn", "triton", "torch")
AUTO_PREFERENCE_OTHER = ("torch",)


def _is_bare_namespace(module) -> bool:
    spec = getattr(module, "__spec__", None)
    return spec is not None and spec.origin in (None, "namespace") and spec.submodule_search_locations is not None


def _find_spec(fullname: str, path) -> importlib.machinery.ModuleSpec | None:
    """Ask each meta-path finder (the path finder, editable-install finders, ...) as `import` would, without
    importing: a finder's find_spec only looks, given the parent package's search path."""
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(fullname, path)
        except Exception:  # a finder that cannot answer is no answer
            continue
        if spec is not None:
            return spec
    return None


def module_present(name: str) -> bool:
    """Whether `import name` would find a module with code of its own, judged without importing it or, for a dotted
    name, its packages. A module already in `sys.modules` counts as present (None there, as tests set it, as absent);
    a bare namespace package, imported or not, as absent (flash-attn-4 installs flash_attn/cute/ under one)."""
    if name in sys.modules:
        module = sys.modules[name]
        return module is not None and not _is_bare_namespace(module)
    path = None
    parts = name.split(".")
    for i in range(len(parts)):
        fullname = ".".join(parts[: i + 1])
        if fullname in sys.modules:
            module = sys.modules[fullname]
            if module is None:
                return False
            path = getattr(module, "__path__", None)
        else:
            spec = _find_spec(fullname, path)
            if spec is None or (i == len(parts) - 1 and spec.origin in (None, "namespace")):
                return False
            path = spec.submodule_search_locations
        if path is None and i < len(parts) - 1:
            return False  # a plain module where a package was needed
    return True


def load_backend_class(name: str) -> tuple[type[AttentionBackend] | None, str | None]:
    """The backend class, or None and why it could not be imported."""
    if name not in BACKEND_MODULES:
        raise ValueError(f"unknown attention_backend {name!r}; choose one of {('auto',) + BACKEND_NAMES}")
    module_name, class_name = BACKEND_MODULES[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return None, f"cannot import {module_name}: {exc}"
    return getattr(module, class_name), None


def backend_reasons(name: str, spec: AttentionSpec | None, device: torch.device) -> list[str]:
    """Why backend `name` cannot run this model on `device`; empty when it can."""
    cls, err = load_backend_class(name)
    if cls is None:
        return [err or f"{name} unavailable"]
    return cls.unavailable_reasons(spec, device)


def available_backends_for(spec: AttentionSpec | None, device: torch.device) -> dict[str, str | None]:
    """Every backend, with None if it can run here or the reasons it cannot (joined by '; ')."""
    result = {}
    for name in BACKEND_NAMES:
        reasons = backend_reasons(name, spec, device)
        result[name] = "; ".join(reasons) if reasons else None
    return result


def auto_candidates(spec: AttentionSpec, device: torch.device) -> list[type[AttentionBackend]]:
    """The backends that can run this model here, in "auto" preference order (the input of autotuning)."""
    order = AUTO_PREFERENCE_CUDA if device.type == "cuda" else AUTO_PREFERENCE_OTHER
    candidates = []
    for name in order:
        if not backend_reasons(name, spec, device):
            cls, _ = load_backend_class(name)
            assert cls is not None
            candidates.append(cls)
    return candidates


def probable_auto_names(spec: AttentionSpec, device: torch.device) -> list[str]:
    """The backends "auto" would consider, in preference order, judged without importing optional libraries.

    Each backend's `probe_reasons()` checks what it can without an import (library present on disk, GPU, head dim,
    dtype). A library that is present but fails to import is caught later, by the full check."""
    order = AUTO_PREFERENCE_CUDA if device.type == "cuda" else AUTO_PREFERENCE_OTHER
    names = []
    for name in order:
        cls, _ = load_backend_class(name)
        if cls is not None and not cls.probe_reasons(spec, device):
            names.append(name)
    return names


def select_backend(name: str, spec: AttentionSpec, device: torch.device) -> type[AttentionBackend]:
    """Resolve `attention_backend` to a class. A named backend that cannot run raises with its reasons."""
    if name == "auto":
        candidates = auto_candidates(spec, device)
        if not candidates:
            raise RuntimeError(
                f"no attention backend can run this model here: {available_backends_for(spec, device)}"
            )
        return candidates[0]
    reasons = backend_reasons(name, spec, device)
    if reasons:
        raise ValueError(f"attention_backend={name!r} cannot run here: " + "; ".join(reasons))
    cls, _ = load_backend_class(name)
    assert cls is not None
    return cls
