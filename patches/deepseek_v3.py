"""DeepSeek-V3: multi-head latent attention with routed experts plus shared experts.

DeepseekV3MLP (the shared experts and the dense MLP of the first layers) has the gated SiLU form; the routed experts
(DeepseekV3Experts, 3D weights) are not listed. The norms (including the latent q/kv norms) are DeepseekV3RMSNorm.
"""

from hf_accel.patches.base import FamilyPatch

PATCH = FamilyPatch(
    rms_norms={"DeepseekV3RMSNorm": "llama"},
    gated_silu_mlps=frozenset({"DeepseekV3MLP"}),
)
