"""Mixtral: Mistral's attention with a sparse mixture-of-experts feed-forward.

Only the RMSNorm is fused. Not listed: the experts (MixtralExperts holds all experts' gate/up and down weights as 3D
parameters and routes tokens itself; it is not the per-module `gate_proj`/`up_proj`/`down_proj` MLP the fused op
replaces).
"""

from hf_accel.patches.base import FamilyPatch

PATCH = FamilyPatch(
    rms_norms={"MixtralRMSNorm": "llama"},
)
