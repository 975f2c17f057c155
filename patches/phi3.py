"""Phi-3: Llama-style norms with packed projections (one `qkv_proj`, one `gate_up_proj`).

The norm is Llama's formula. Not listed: Phi3MLP (one `gate_up_proj` and other attribute names, not the separate
`gate_proj`/`up_proj` the fused MLP expects).
"""

from hf_accel.patches.base import FamilyPatch

PATCH = FamilyPatch(
    rms_norms={"Phi3RMSNorm": "llama"},
)
