"""The generic family patch, and the declarative fields a family module fills in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# The RMSNorm formulas the fused kernels (hf_accel.ops.fused) replicate, rounding where the stock forwards round:
#   "llama": `weight * norm(x.float()).to(x.dtype)`           (normalise in fp32, cast to x's dtype, then * weight)
#   "gemma": `(norm(x.float()) * (1 + weight.float())).type_as(x)`  (the weight is an offset from 1, cast last)
# where norm(h) = h * rsqrt(mean(h**2, -1) + eps).
NORM_STYLES: tuple[str, ...] = ("llama", "gemma")


@dataclass(frozen=True)
class FamilyPatch:
    """Defaults for a family that uses transformers' attention interface and nothing unusual.

    rms_norms: RMSNorm class name -> formula style (a key of NORM_STYLES). List a class only after comparing its
        forward with that formula (tests/test_fused_ops.py checks every definition of each listed name in the
        installed transformers), and only classes defined by transformers itself. Checked and left out, with no family
        module of their own: Olmo2/Olmo3/GptOss (`(weight * norm).to(x.dtype)`: another rounding point), Gemma3n/
        Gemma4 (`* weight`, optional weight), Llama4Text (Llama's formula written another way, with `eps`: the source
        check in the tests compares against LlamaRMSNorm's forward, so it is left out rather than special-cased).
    gated_silu_mlps: class names of MLPs whose forward is `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with
        `gate_proj`, `up_proj`, `down_proj` Linears; fused only when act_fn is SiLU (checked per module, so a listed
        class configured with another activation keeps its own forward). Not listed: Llama4TextMLP
        (`activation_fn`), Olmo*MLP and others not checked here.

    Both tables are matched by class name whatever the model's model_type (families share classes), so the fused ops
    use the union over all family modules (`hf_accel.patches.fusable_norms()` / `fusable_mlps()`).
    """

    rms_norms: Mapping[str, str] = field(default_factory=dict)
    gated_silu_mlps: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        bad = {name: style for name, style in self.rms_norms.items() if style not in NORM_STYLES}
        if bad:
            raise ValueError(f"unknown RMSNorm styles {bad}; expected one of {NORM_STYLES}")
        object.__setattr__(self, "gated_silu_mlps", frozenset(self.gated_silu_mlps))

    def unsupported_reason(self, config) -> str | None:
        """Why this configuration of the family cannot be accelerated, or None."""
        v_dim = getattr(config, "v_head_dim", None)
        if v_dim and getattr(config, "qk_rope_head_dim", None) and v_dim > self.attention_head_dim(config):
            return (f"its values are wider (v_head_dim={v_dim}) than its queries and keys "
                    f"({self.attention_head_dim(config)}); the paged KV cache holds one head dim for both")
        return None

    def attention_head_dim(self, config) -> int:
        """The head dim of the queries and keys the model hands to its attention function, which sizes the KV cache.

        Multi-head latent attention (DeepSeek-V2/V3: `qk_nope_head_dim` + `qk_rope_head_dim`) gives q and k both
        parts, and `config.head_dim` there is the rope part only; its values (`v_head_dim`, no wider) are padded to
        this width in the cache, as transformers does for flash-attention (hf_accel.attention.op)."""
        nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
        if nope and rope:
            return int(nope) + int(rope)
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def context_limit(self, config) -> tuple[int, str] | None:
        """A context shorter than `max_position_embeddings` that hf_accel can serve exactly, with why; else None.

        Chunked attention (Llama 4's `attention_chunk_size`: a query at position p sees only the keys of its own
        chunk, [p - p % C, p]) is not implemented by the attention backends. Within the first chunk it is plain
        causal attention, so sequences of up to C tokens are exact and longer ones are refused with this reason
        (stock generate() after restore(model) serves them)."""
        chunk = getattr(config, "attention_chunk_size", None)
        layer_types = getattr(config, "layer_types", None)
        if not chunk or (layer_types is not None and "chunked_attention" not in layer_types):
            return None
        return int(chunk), (f"its chunked attention (attention_chunk_size={int(chunk)}) is not implemented by "
                            "hf_accel; within one chunk it is plain causal attention, so hf_accel serves sequences "
                            "of up to one chunk (use restore(model) and stock generate() for longer ones)")
