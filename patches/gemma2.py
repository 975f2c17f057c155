"""Gemma 2: attention logit softcapping and alternating sliding-window layers.

Both arrive through the attention interface (`softcap=`, `sliding_window=` per layer) and the final-logit
softcap stays in Gemma2ForCausalLM.forward, so the generic path is exact; this module documents that.
"""

from hf_accel.patches.base import FamilyPatch

# Gemma's "gemma" norm formula. Not listed: Gemma2MLP (GELU-tanh).
PATCH = FamilyPatch(
    rms_norms={"Gemma2RMSNorm": "gemma"},
)
