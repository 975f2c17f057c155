"""Attention modules that hand their raw query / key projections to the attention op, which normalises and rotates
them itself (`hf_accel.attention.kernels.rope`).

A stock Llama or Qwen3 attention forward applies RoPE (and Qwen3 its per-head q/k RMSNorms) between the projections
and the attention function; compiled, that is two Inductor kernels per layer, each a launch and a pass over the
step's queries or keys. With `install_rope_attention(model)`, each recognised attention module gets an instance
`forward` that, inside an engine step, computes the same projections and passes them to `hf_accel::attention` with
the rotary tables and the norms' weights: the Triton backend's decode kernel then does both in the launch that
reads the queries and writes the new keys (no kernel of its own), every other path does them in one launch first.
`AccelConfig(fused_rope=False)` (`hf-accel bench --no-fused-rope`) keeps the stock forwards: the A/B.

Which classes qualify is family knowledge (`FamilyPatch.rope_attentions` in `patches/<family>.py`: class name ->
"rope", or "qk_norm_rope" when the forward first applies `q_norm` / `k_norm`, Llama-style RMSNorms over the head
dim). The patched forward falls back to the class forward whenever ours would not compute the same thing: outside an
engine step (plain forwards, training), with a KV cache object passed, with rotary tables narrower than the head dim
(partial rotary), or when the norms are not the checked class or carry hooks.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hf_accel.attention.context import in_engine_step
from hf_accel.attention.op import is_ours
from hf_accel.ops.fused import FusedRecord, mark_fused
from hf_accel.patches import fusable_norms, rope_attentions
from hf_accel.patches.base import ROPE_ATTENTION_STYLES

# class name -> style, over every family module (a class is recognised whatever the model's model_type)
ROPE_ATTENTIONS: dict[str, str] = rope_attentions()
_LLAMA_NORMS = frozenset(name for name, style in fusable_norms().items() if style == "llama")


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _norm_ok(norm: Any, head_dim: int) -> bool:
    """A Llama-style RMSNorm over the head dim whose forward is the class's, with no hooks (it is not called)."""
    weight = getattr(norm, "weight", None)
    return (type(norm).__name__ in _LLAMA_NORMS and type(norm).__module__.startswith("transformers.")
            and isinstance(weight, torch.Tensor) and weight.shape == (head_dim,)
            and isinstance(getattr(norm, "variance_epsilon", None), float | int)
            and not norm._forward_hooks and not norm._forward_pre_hooks)


def _fusable_call(module: nn.Module, args: tuple, kwargs: dict, with_norm: bool):
    """(hidden states, (cos, sin), head dim) when the fused path computes what the class forward would, else None."""
    hidden = _arg(args, kwargs, 0, "hidden_states")
    rotary = _arg(args, kwargs, 1, "position_embeddings")
    head_dim = getattr(module, "head_dim", None)
    if not in_engine_step() or not is_ours(module.config._attn_implementation) or len(args) > 3:
        return None
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None or kwargs.get("s_aux") is not None:
        return None
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[0] != 1:
        return None
    if not isinstance(rotary, tuple | list) or len(rotary) != 2 or not all(isinstance(t, torch.Tensor) for t in rotary):
        return None
    if not isinstance(head_dim, int) or head_dim % 2 or rotary[0].dim() != 3 or rotary[0].shape[0] != 1:
        return None
    if rotary[0].shape[-1] != head_dim or rotary[1].shape != rotary[0].shape:
        return None  # partial rotary: tables narrower than the head
    if with_norm and not (_norm_ok(module.q_norm, head_dim) and _norm_ok(module.k_norm, head_dim)
                          and float(module.q_norm.variance_epsilon) == float(module.k_norm.variance_epsilon)):
        return None
    return hidden, rotary, head_dim


def _rope_forward(style: str) -> Callable[..., Any]:
    with_norm = style == "qk_norm_rope"

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = _fusable_call(self, args, kwargs, with_norm)
        if call is None:
            return type(self).forward(self, *args, **kwargs)
        hidden, (cos, sin), head_dim = call
        tokens = hidden.shape[1]
        q = self.q_proj(hidden).view(tokens, -1, head_dim)
        k = self.k_proj(hidden).view(tokens, -1, head_dim)
        v = self.v_proj(hidden).view(tokens, -1, head_dim)
        out = torch.empty((tokens, q.shape[1], head_dim), dtype=q.dtype, device=q.device)
        norms = (self.q_norm.weight, self.k_norm.weight, float(self.q_norm.variance_epsilon)) if with_norm else (
            None, None, 0.0)
        torch.ops.hf_accel.attention(
            q, k if k.stride(-1) == 1 else k.contiguous(), v if v.stride(-1) == 1 else v.contiguous(), out,
            int(self.layer_idx), float(self.scaling), int(getattr(self, "sliding_window", None) or 0), 0.0,
            cos[0], sin[0], *norms,
        )
        return self.o_proj(out.view(1, tokens, -1)), None

    return mark_fused(forward)


def _qualifies(module: nn.Module) -> str | None:
    style = ROPE_ATTENTIONS.get(type(module).__name__)
    if style is None or not type(module).__module__.startswith("transformers."):
        return None
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return None
    if not isinstance(getattr(module, "layer_idx", None), int) or not isinstance(getattr(module, "head_dim", None),
                                                                                  int):
        return None
    if style == "qk_norm_rope" and not all(isinstance(getattr(module, n, None), nn.Module) for n in ("q_norm",
                                                                                                   "k_norm")):
        return None
    return style


def install_rope_attention(model: nn.Module) -> FusedRecord:
    """Give every recognised attention module of `model` the forward above (an instance attribute, removed by
    `hf_accel.ops.fused.uninstall_fused_ops(record)`). A module that already has an instance forward is left alone."""
    record = FusedRecord()
    forwards = {style: _rope_forward(style) for style in ROPE_ATTENTION_STYLES}
    for module in model.modules():
        if "forward" in module.__dict__:
            continue
        style = _qualifies(module)
        if style is not None:
            module.forward = types.MethodType(forwards[style], module)
            record.modules.append(module)
    return record
