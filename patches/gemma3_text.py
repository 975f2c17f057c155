"""Gemma 3 text-only checkpoints (model_type `gemma3_text`): the same classes and patch as gemma3."""

from hf_accel.patches.gemma3 import PATCH

__all__ = ["PATCH"]
