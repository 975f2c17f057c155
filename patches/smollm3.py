"""SmolLM3: Llama's layout where some layers skip RoPE (`no_rope_layers`).

The rotary embedding is applied inside the model's own attention module before the attention interface, so the
generic path keeps the per-layer choice; the norm and MLP are Llama's formulas.
"""

from hf_accel.patches.base import FamilyPatch

PATCH = FamilyPatch(
    rms_norms={"SmolLM3RMSNorm": "llama"},
    gated_silu_mlps=frozenset({"SmolLM3MLP"}),
)
