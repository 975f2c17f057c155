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
        if getattr(config, "index_topk", None) or getattr(config, "index_head_dim", None):
            return ("its sparse attention (a lightning indexer picks index_topk keys per query, as DeepSeek-V3.2 "
                    "does) is not implemented by hf_accel's attention backends")
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
        limits = []
        chunk = getattr(config, "attention_chunk_size", None)
        layer_types = getattr(config, "layer_types", None)
        if chunk and (layer_types is None or "chunked_attention" in layer_types):
            limits.append((int(chunk), f"its chunked attention (attention_chunk_size={int(chunk)}) is not "
                                       "implemented by hf_accel; within one chunk it is plain causal attention"))
        original = _longrope_original_length(config)
        if original is not None:
            limits.append((original, f"its longrope RoPE switches every position to the long factors once any "
                                     f"position of a forward reaches original_max_position_embeddings={original} "
                                     "(transformers decides from the whole forward's largest position id), so in "
                                     "a packed engine step one sequence would change another's; below that length "
                                     "every forward uses the short factors, in stock generate() as here"))
        step = self.step_token_limit(config)
        if step is not None:
            limits.append(step)
        if not limits:
            return None
        limit, why = min(limits)
        return limit, (f"{why}, so hf_accel serves sequences of up to {limit} tokens (use restore(model) and stock "
                       "generate() for longer ones)")

    def step_token_limit(self, config) -> tuple[int, str] | None:
        """The most tokens one engine step may pack for this configuration, with why; else None.

        Llama 4's no-rope layers with `attn_temperature_tuning` scale each query by log1p(floor((i + 1) /
        floor_scale)), where transformers takes i from the forward's own token count (0..T-1 without a cache),
        not from the position ids. That factor is exactly 1 while i + 1 < floor_scale, in stock generate()
        and in a packed engine step alike, so both the context and a step's tokens stay below floor_scale - 1."""
        no_rope = getattr(config, "no_rope_layers", None)
        floor_scale = getattr(config, "floor_scale", None)
        if not getattr(config, "attn_temperature_tuning", False) or not floor_scale or not no_rope or all(no_rope):
            return None
        return int(floor_scale) - 1, (f"its no-rope layers scale queries by the token's index once it reaches "
                                      f"floor_scale - 1 ({int(floor_scale) - 1}), which transformers counts within "
                                      "each forward, not from the positions")


def _longrope_original_length(config) -> int | None:
    """`original_max_position_embeddings` of a longrope RoPE (Phi-3 / Phi-3.5 long-context), the smallest over layer
    types; None for any other RoPE."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    per_layer_type = not ("rope_type" in params or "type" in params)
    sets = [v for v in params.values() if isinstance(v, dict)] if per_layer_type else [params]
    found = []
    for rp in sets:
        if (rp.get("rope_type") or rp.get("type")) == "longrope":
            original = rp.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                               None)
            if original:
                found.append(int(original))
    return min(found) if found else None
