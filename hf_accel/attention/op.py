"""The opaque attention op and the function registered in transformers' AttentionInterface.

`hf_accel::attention` is a `torch.library` custom op that writes K/V into the paged cache and runs the selected
backend into a preallocated output. Dynamo does not trace into it, so a compiled forward is one graph with exactly
one such call per layer: the piecewise compiler cuts there.
"""

from __future__ import annotations

import torch

from hf_accel.attention.context import get_forward_context

# registered in AttentionInterface; no "flash"/"paged" in it (transformers special-cases those names)
ATTN_IMPLEMENTATION_NAME = "hf_accel"


@torch.library.custom_op("hf_accel::attention", mutates_args=("output",))
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer_idx: int,
              scale: float, sliding_window: int, softcap: float) -> None:
    """query/output `[T, H, D]`, key/value `[T, Hkv, D]`; only the first `metadata.num_tokens` rows are real."""
    ctx = get_forward_context()
    meta = ctx.metadata
    k_cache, v_cache = ctx.kv_caches[layer_idx]
    if key.shape[1] != k_cache.shape[2]:
        raise ValueError(f"hf_accel: layer {layer_idx} attends with {key.shape[1]} key/value heads but the KV cache "
                         f"was sized for {k_cache.shape[2]} (the config's num_key_value_heads); this model's "
                         "attention does not match its config, so hf_accel cannot run it")
    # all rows, padded ones included: their slot is -1 (skipped), and no token count is frozen into a CUDA graph
    ctx.backend.write_kv(key, value, k_cache, v_cache, meta)
    ctx.backend.forward(query, k_cache, v_cache, meta, output, scale, sliding_window, softcap)


@attention.register_fake
def _(query, key, value, output, layer_idx, scale, sliding_window, softcap) -> None:
    return None


def hf_accel_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, scaling: float | None = None,
                               dropout: float = 0.0, sliding_window: int | None = None,
                               softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query `[1, H, T, D]`, key/value `[1, Hkv, T, D]`.

    Returns `[1, T, H, D]` as the stock functions do. The mask is ignored: causality, sequence boundaries and
    windows come from the step metadata. Attention sinks (`s_aux`) are refused, never silently dropped.
    """
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("hf_accel attention does not implement attention sinks (s_aux)")
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    torch.ops.hf_accel.attention(
        q.contiguous(), k.contiguous(), v.contiguous(), out, int(module.layer_idx), scale,
        int(sliding_window or 0), float(softcap or 0.0),
    )
    return out.unsqueeze(0), None
