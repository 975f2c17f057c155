"""Qwen2: Llama's layout with biases on the q/k/v projections.

The biases stay inside the model's own projections, so the generic path needs nothing extra; the norm and MLP are
Llama's formulas.
"""

from hf_accel.patches.base import FamilyPatch

PATCH = FamilyPatch(
    rms_norms={"Qwen2RMSNorm": "llama"},
    gated_silu_mlps=frozenset({"Qwen2MLP"}),
)
