"""Gemma 3: Gemma 2's layout with q/k norms and interleaved local (sliding-window) and global layers.

The sliding windows arrive through the attention interface per layer; the q/k norms and layer norms are
Gemma3RMSNorm, the "gemma" formula. Not listed: Gemma3MLP (GELU-tanh). The text-only model_type `gemma3_text` uses
this same patch (see gemma3_text.py).
"""

from hf_accel.patches.base import FamilyPatch

PATCH = FamilyPatch(
    rms_norms={"Gemma3RMSNorm": "gemma"},
)
