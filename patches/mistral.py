"""Mistral: Llama's layout with an optional sliding attention window.

The window arrives through the attention interface (`sliding_window=`), so the generic path handles it; the norm and
MLP are Llama's formulas under Mistral's class names.
"""

from hf_accel.patches.base import FamilyPatch

PATCH = FamilyPatch(
    rms_norms={"MistralRMSNorm": "llama"},
    gated_silu_mlps=frozenset({"MistralMLP"}),
)
