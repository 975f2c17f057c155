"""Gemma: Llama's layout with a `1 + weight` RMSNorm and a GELU-tanh gated MLP.

The norm is the "gemma" formula (the weight is an offset from 1, cast to x's dtype last). Not listed: GemmaMLP
(GELU-tanh, not SiLU; the same holds for Gemma2MLP and Gemma3MLP).
"""

from hf_accel.patches.base import FamilyPatch

PATCH = FamilyPatch(
    rms_norms={"GemmaRMSNorm": "gemma"},
)
