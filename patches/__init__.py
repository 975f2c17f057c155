"""Per-family knowledge: what each model family needs beyond the generic path.

A family with no module here runs through `FamilyPatch` (the generic path): the model's own modules compute
projections, norms and RoPE; only attention is swapped. A family module (named by the transformers `model_type`)
defines `PATCH = FamilyPatch(...)`: which of its RMSNorm / MLP classes the fused ops may replace, unsupported
configurations, quirks worth knowing. Shipped as the subpackage `hf_accel.patches`.
"""

from __future__ import annotations

import importlib
import pkgutil

from hf_accel.patches.base import NORM_STYLES, FamilyPatch

_NOT_FAMILIES = frozenset({"base", "quantization"})


def family_patch(model_type: str) -> FamilyPatch:
    """The patch for `model_type`, or the generic `FamilyPatch()` when no module declares one."""
    if model_type in _NOT_FAMILIES:
        return FamilyPatch()
    try:
        module = importlib.import_module(f"{__name__}.{model_type}")
    except ImportError:
        return FamilyPatch()
    return getattr(module, "PATCH", None) or FamilyPatch()


def all_family_patches() -> dict[str, FamilyPatch]:
    """model_type -> PATCH for every family module shipped in this package (aliases such as gemma3_text included)."""
    patches: dict[str, FamilyPatch] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.ispkg or info.name.startswith("_") or info.name in _NOT_FAMILIES:
            continue
        patch = getattr(importlib.import_module(f"{__name__}.{info.name}"), "PATCH", None)
        if isinstance(patch, FamilyPatch):
            patches[info.name] = patch
    return patches


def fusable_norms() -> dict[str, str]:
    """RMSNorm class name -> formula style, merged over all families (a class declared twice must agree)."""
    merged: dict[str, str] = {}
    for model_type, patch in all_family_patches().items():
        for name, style in patch.rms_norms.items():
            if merged.setdefault(name, style) != style:
                raise ValueError(f"{model_type} declares {name} as {style!r}, another family as {merged[name]!r}")
    return merged


def fusable_mlps() -> frozenset[str]:
    """Class names of gated SiLU MLPs, merged over all families."""
    return frozenset().union(*(patch.gated_silu_mlps for patch in all_family_patches().values()))


__all__ = ["NORM_STYLES", "FamilyPatch", "all_family_patches", "family_patch", "fusable_mlps", "fusable_norms"]
