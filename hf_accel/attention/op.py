"""The opaque attention op and the function registered in transformers' AttentionInterface.

`hf_accel::attention` is a `torch.library` custom op that writes K/V into the paged cache and runs the selected
backend into a preallocated output. Dynamo does not trace into it, so a compiled forward is one graph with exactly
one such call per layer: the piecewise compiler cuts there.

Outside an engine step (a plain forward or backward: training, evaluation, an RL loop's log-probs, a stock-path
generate()) the registered attention and mask functions hand over to the model's original implementation ("sdpa",
"eager", ...) with exactly the arguments transformers gave them, so the accelerated model computes what the stock
model computes, gradients included. The original is encoded in the registered name itself ("hf_accel" for sdpa,
"hf_accel_eager", "hf_accel_fa2", ...): nothing is kept beside the config, so a deep copy of an accelerated model
(a reference model in an RL loop) still runs its stock attention.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_accel.attention.context import get_forward_context, in_engine_step

# the name registered for a model whose original implementation is sdpa; no "flash"/"paged" in any of our names
# (transformers special-cases those)
ATTN_IMPLEMENTATION_NAME = "hf_accel"
_SUFFIXES = {"sdpa": "", "eager": "_eager", "flash_attention_2": "_fa2", "flash_attention_3": "_fa3",
             "flash_attention_4": "_fa4", "flex_attention": "_flex"}
_STOCK_OF_SUFFIX = {v: k for k, v in _SUFFIXES.items()}


def implementation_name(stock: str) -> str:
    """The name registered for a model whose original attention implementation is `stock`."""
    suffix = _SUFFIXES.get(stock)
    if suffix is None:
        if not stock or any(c in stock for c in ("flash", "paged", "/", ":", "|")) or not stock.isidentifier():
            raise NotImplementedError(f"the model uses the attention implementation {stock!r}; hf_accel cannot route "
                                      "plain forwards back to it (supported: " + ", ".join(_SUFFIXES) + ")")
        suffix = "_" + stock
    return ATTN_IMPLEMENTATION_NAME + suffix


def stock_implementation(name: str) -> str:
    """The original implementation encoded in one of our names."""
    suffix = name[len(ATTN_IMPLEMENTATION_NAME):]
    return _STOCK_OF_SUFFIX.get(suffix, suffix[1:])


def is_ours(name: Any) -> bool:
    return isinstance(name, str) and (name == ATTN_IMPLEMENTATION_NAME or name.startswith(ATTN_IMPLEMENTATION_NAME
                                                                                         + "_"))


def register_implementation(stock: str) -> str:
    """Register our attention and mask functions under the name for `stock`; returns that name."""
    name = implementation_name(stock)
    AttentionInterface.register(name, hf_accel_attention_forward)
    AttentionMaskInterface.register(name, hf_accel_attention_mask)
    return name


@torch.library.custom_op("hf_accel::attention", mutates_args=("output",))
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer_idx: int,
              scale: float, sliding_window: int, softcap: float) -> None:
    """query/output `[T, H, D]` (contiguous), key/value `[T, Hkv, D]` (contiguous in D; rows and heads may be
    strided); only the first `metadata.num_tokens` rows are real."""
    ctx = get_forward_context()
    meta = ctx.metadata
    k_cache, v_cache = ctx.kv_caches[layer_idx]
    if key.shape[1] != k_cache.shape[2]:
        raise ValueError(f"hf_accel: layer {layer_idx} attends with {key.shape[1]} key/value heads but the KV cache "
                         f"was sized for {k_cache.shape[2]} (the config's num_key_value_heads); this model's "
                         "attention does not match its config, so hf_accel cannot run it")
    # all rows, padded ones included: their slot is -1 (skipped), and no token count is frozen into a CUDA graph
    ctx.backend.write_kv_and_forward(query, key, value, k_cache, v_cache, meta, output, scale, sliding_window,
                                     softcap)


@attention.register_fake
def _(query, key, value, output, layer_idx, scale, sliding_window, softcap) -> None:
    return None


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` `[T, Hkv, D]` itself when its last dim is contiguous (every backend's KV write takes row and head
    strides), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _stock_attention_function(module: torch.nn.Module):
    """What transformers itself would call for `module` under its original implementation."""
    stock = stock_implementation(module.config._attn_implementation)
    if stock == "eager":  # the family's own eager function (softcapping and other quirks live there)
        family = sys.modules.get(type(module).__module__)
        fn = getattr(family, "eager_attention_forward", None)
        if fn is None:
            raise NotImplementedError(f"{type(module).__name__}: its module defines no eager_attention_forward")
        return fn
    return ALL_ATTENTION_FUNCTIONS[stock]


def hf_accel_attention_mask(*args: Any, **kwargs: Any):
    """The mask function registered under our names: none inside an engine step (the step metadata says who attends
    to whom), the original implementation's mask outside one."""
    if in_engine_step():
        return None
    stock = stock_implementation(kwargs["config"]._attn_implementation)
    return ALL_MASK_ATTENTION_FUNCTIONS[stock](*args, **kwargs)


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
    v_dim = v.shape[-1]
    if v_dim < q.shape[-1]:  # latent attention (DeepSeek): narrower values ride in the cache padded with zeros,
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - v_dim))  # which add nothing to the output's columns
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    # keys and values go to the KV write as they are when their head dim is dense: values are usually a strided view
    # of the fused q/k/v projection's output, and a copy of them was a kernel per layer
    torch.ops.hf_accel.attention(
        q.contiguous(), _dense_rows(k), _dense_rows(v), out, int(module.layer_idx), scale,
        int(sliding_window or 0), float(softcap or 0.0),
    )
    if v_dim < q.shape[-1]:
        out = out[..., :v_dim]
    return out.unsqueeze(0), None


# Every name for the known stock implementations is registered on import, not only by accelerate_model: a model
# saved whole while accelerated (torch.save / pickle) keeps our name in its config, and loaded in a fresh process
# (which imports hf_accel to unpickle it) its forward and generate() must find that name. Outside an engine step our
# functions hand over to the original implementation, so such a model runs as stock.
for _stock in _SUFFIXES:
    register_implementation(_stock)
