"""Llama: the reference decoder (RMSNorm, RoPE, grouped-query attention, gated SiLU MLP) the generic path is built on.

Its RMSNorm is the "llama" formula and its MLP the gated SiLU form; both are the references tests/test_fused_ops.py
compares every other listed class against.
"""

from hf_accel.patches.base import FamilyPatch

PATCH = FamilyPatch(
    rms_norms={"LlamaRMSNorm": "llama"},
    gated_silu_mlps=frozenset({"LlamaMLP"}),
)
