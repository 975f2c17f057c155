"""Qwen2-MoE: Qwen2 attention with routed experts plus a shared expert.

Qwen2MoeMLP is the shared expert (and the dense MLP of non-sparse layers) and has the gated SiLU form; the routed
experts (Qwen2MoeExperts, 3D weights) are not an MLP of that form and are not listed.
"""

from hf_accel.patches.base import FamilyPatch

PATCH = FamilyPatch(
    rms_norms={"Qwen2MoeRMSNorm": "llama"},
    gated_silu_mlps=frozenset({"Qwen2MoeMLP"}),
)
