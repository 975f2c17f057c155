"""The opaque attention op and the function registered in transformers' AttentionInterface.

`hf_accel::attention` is a `torch.library` custom op that writes K/V into the paged cache and runs the selected
backend into a preallocated output. Dynamo does not trace into it, so a compiled forward is one graph with exactly
one such call per layer: the piecewise compiler cuts there.

Outside an engine step (a plain forward or backward: training, evaluation, an RL loop's log-probs) the registered
attention and mask functions hand over to the model's original implementation ("sdpa", "eager", ...) with exactly
the arguments transformers gave them, so the accelerated model computes what the stock model computes, gradients
included. `register_stock_attention(model, name)` records that original per config object (keyed by identity, not
stored on the config, which would serialize it).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_accel.attention.context import get_forward_context, in_engine_step

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


# id(config) -> the attention implementation the model had before accelerate_model (one entry per config object the
# model's modules hold; removed by restore() or when the config is garbage collected)
_STOCK_IMPLEMENTATION: dict[int, str] = {}


def _configs_of(model: torch.nn.Module) -> list[Any]:
    seen: dict[int, Any] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


def register_stock_attention(model: torch.nn.Module, name: str) -> None:
    """Remember `name` as the implementation plain forwards of `model` run (see the module docstring)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION_NAME, hf_accel_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION_NAME, hf_accel_attention_mask)
    for cfg in _configs_of(model):
        sub = getattr(cfg, "_attn_implementation", None)
        own = sub if sub and sub != ATTN_IMPLEMENTATION_NAME else name
        if id(cfg) not in _STOCK_IMPLEMENTATION:
            weakref.finalize(cfg, _STOCK_IMPLEMENTATION.pop, id(cfg), None)
        _STOCK_IMPLEMENTATION[id(cfg)] = own


def unregister_stock_attention(model: torch.nn.Module) -> None:
    for cfg in _configs_of(model):
        _STOCK_IMPLEMENTATION.pop(id(cfg), None)


def _stock_name(config: Any) -> str:
    name = _STOCK_IMPLEMENTATION.get(id(config))
    if name is None:
        raise RuntimeError("hf_accel attention was called for a model config it does not know (a copy of an "
                           "accelerated model?); call accelerate_model() on the model you run, or restore() it")
    return name


def _stock_attention_function(module: torch.nn.Module):
    """What transformers itself would call for `module` under its original implementation."""
    name = _stock_name(module.config)
    if name == "eager":  # the family's own eager function (softcapping and other quirks live there)
        family = sys.modules.get(type(module).__module__)
        fn = getattr(family, "eager_attention_forward", None)
        if fn is None:
            raise NotImplementedError(f"{type(module).__name__}: its module defines no eager_attention_forward")
        return fn
    return ALL_ATTENTION_FUNCTIONS[name]


def hf_accel_attention_mask(*args: Any, **kwargs: Any):
    """The mask function registered under our name: none inside an engine step (the step metadata says who attends
    to whom), the original implementation's mask outside one."""
    if in_engine_step():
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[_stock_name(kwargs.get("config"))](*args, **kwargs)


def hf_accel_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, Any]:
    """transformers' attention-function signature: query `[1, H, T, D]`, key/value `[1, Hkv, T, D]`.

    Inside an engine step: returns `[1, T, H, D]` as the stock functions do. The mask is ignored: causality,
    sequence boundaries and windows come from the step metadata. Attention sinks (`s_aux`) are refused, never
    silently dropped. Outside one: the original implementation, called with exactly these arguments.
    """
    if not in_engine_step():
        return _stock_attention_function(module)(module, query, key, value, attention_mask, **kwargs)
    scaling = kwargs.get("scaling")
    sliding_window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
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
