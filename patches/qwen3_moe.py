"""Qwen3-MoE: Qwen3 attention (q/k norms) with a routed mixture-of-experts feed-forward.

Qwen3MoeMLP (the dense MLP of layers that are not sparse) has the gated SiLU form; the routed experts
(Qwen3MoeExperts, 3D weights) are not listed.
"""

from hf_accel.patches.base import FamilyPatch

PATCH = FamilyPatch(
    rms_norms={"Qwen3MoeRMSNorm": "llama"},
    gated_silu_mlps=frozenset({"Qwen3MoeMLP"}),
)
