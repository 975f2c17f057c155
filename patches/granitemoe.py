"""Granite-MoE: Granite's multipliers with a mixture-of-experts feed-forward.

Only the RMSNorm is fused. Not listed: the experts (GraniteMoeExperts holds all experts' weights as 3D parameters,
not the per-module `gate_proj`/`up_proj`/`down_proj` MLP the fused op replaces).
"""

from hf_accel.patches.base import FamilyPatch

PATCH = FamilyPatch(
    rms_norms={"GraniteMoeRMSNorm": "llama"},
)
