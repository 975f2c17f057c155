"""Per-family knowledge: what each model family needs beyond the generic path.

A family with no module here runs through `FamilyPatch` (the generic path): the model's own modules compute
projections, norms and RoPE; only attention is swapped. A family module overrides what differs (unsupported
configurations, quirks worth knowing). Shipped as the subpackage `hf_accel.patches`.
"""

from __future__ import annotations

import importlib

from hf_accel.patches.base import FamilyPatch


def family_patch(model_type: str) -> FamilyPatch:
    try:
        module = importlib.import_module(f"hf_accel.patches.{model_type}")
    except ImportError:
        return FamilyPatch()
    return module.PATCH


__all__ = ["FamilyPatch", "family_patch"]
