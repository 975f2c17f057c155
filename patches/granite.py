"""Granite: Llama's layout with scalar multipliers (embedding, residual, attention scaling, logits scaling).

The multipliers live in the model's own forwards and the attention scaling arrives through the attention interface,
so the generic path needs nothing extra; the norm and MLP are Llama's formulas.
"""

from hf_accel.patches.base import FamilyPatch

PATCH = FamilyPatch(
    rms_norms={"GraniteRMSNorm": "llama"},
    gated_silu_mlps=frozenset({"GraniteMLP"}),
)
