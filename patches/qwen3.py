"""Qwen3: Llama's layout with per-head RMSNorms on queries and keys (`q_norm`, `k_norm`).

The q/k norms are Qwen3RMSNorm too, so they are fused along with the layer norms; the MLP is the gated SiLU form.
"""

from hf_accel.patches.base import FamilyPatch

PATCH = FamilyPatch(
    rms_norms={"Qwen3RMSNorm": "llama"},
    gated_silu_mlps=frozenset({"Qwen3MLP"}),
)
