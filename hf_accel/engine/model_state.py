"""What the KV cache and the compiled forward depend on: the model's structure, its adapters and its weights.

Two questions are asked at the start of every call on an idle engine:

1. Is the compiled code still the model's? Compiled pieces and CUDA graphs froze the module tree (which modules
   run, which PEFT adapters are active or disabled or merged) and read parameters at fixed addresses. The
   *structure key* covers exactly that: every parameter's identity, address, shape and dtype, and the adapter
   state of every PEFT tuner layer. When it changes, compiled code must be rebuilt (`api` re-accelerates).
   The *engine key* (attention implementation names, parameters' dtype and device) must hold even without compiled
   code: the KV cache and the backend were built for it.
2. Can cached prefixes be reused? Their KV was computed under some weights. The *prefix key* is the structure key
   plus modules' scalar attributes, buffers and the weights' contents, so any change (an optimizer step,
   `load_state_dict`, an edit through `.data` that bypasses version counters, a PEFT adapter switched, disabled,
   merged or rescaled, a dtype cast) gives a new key, and the engine drops the cached prefixes.

Content is read by `weights_digest` (see there) unless `AccelConfig.prefix_cache_weight_check` is "version",
which trusts parameters' in-place version counters (free, but blind to `.data` edits and to PEFT's merge, which
writes through `.data`). Compiled code also froze modules' scalar attributes (an epsilon, a scaling): changing one
invalidates cached prefixes but does not rebuild the compiled code (model code changes some of them itself, e.g.
dynamic RoPE); call `accelerate_model(model)` again after such an edit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

# integer views of each float width: the digest sums raw bits, so any change to any element changes it
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ODD = 0x9E3779B97F4A7C15 - (1 << 64)  # odd multiplier (int64) that spreads the position weights


def _is_tuner_layer(m: torch.nn.Module) -> bool:
    """PEFT tuner layers (LoRA, IA3, ...) carry an adapter state. Duck-typed: no import of peft."""
    return hasattr(m, "active_adapters") and hasattr(m, "disable_adapters") and hasattr(m, "merged_adapters")


def _adapter_state(module: torch.nn.Module) -> tuple:
    scaling = getattr(module, "scaling", None)
    scaling = tuple(sorted((k, float(v)) for k, v in scaling.items())) if isinstance(scaling, dict) else None
    return (tuple(module.active_adapters), bool(module.disable_adapters), tuple(module.merged_adapters), scaling)


def engine_key(model: torch.nn.Module) -> tuple:
    """What the engine itself was built for, compiled or not: the attention implementation every config names (ours
    routes to the paged cache; another one, set after accelerate_model, would not), the parameters' dtype (the KV
    cache and the backend were chosen for it) and device."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None),
                                                                          "_attn_implementation")}
    first = next(model.parameters())
    return tuple(sorted(str(c._attn_implementation) for c in configs.values())), first.dtype, str(first.device)


def structure_key(model: torch.nn.Module) -> tuple:
    """Everything compiled code froze: parameters (identity, address, shape, dtype, device), every module's class,
    the adapter state of every PEFT tuner layer, and which modules carry forward hooks."""
    params = tuple((name, id(p), p.data_ptr(), tuple(p.shape), p.dtype, str(p.device))
                   for name, p in model.named_parameters())
    modules = []
    for name, m in model.named_modules():
        modules.append((name, id(m), type(m).__module__, type(m).__qualname__))
        if _is_tuner_layer(m):
            modules.append((name, _adapter_state(m)))
        if m._forward_hooks or m._forward_pre_hooks:
            modules.append((name, "hooks", len(m._forward_hooks), len(m._forward_pre_hooks)))
    return params, tuple(modules)


_SCALARS = (bool, int, float, str, type(None))


def attribute_key(model: torch.nn.Module) -> tuple:
    """Plain values the forward reads besides tensors: every module's scalar attributes (norm epsilons, attention
    scaling, window sizes, the training flag) and its buffers' addresses and versions (RoPE tables)."""
    out = []
    for name, m in model.named_modules():
        scalars = tuple(sorted((k, v) for k, v in vars(m).items() if isinstance(v, _SCALARS)
                               and not k.startswith("_")))
        buffers = tuple((k, b.data_ptr(), b._version, b.dtype) for k, b in m._buffers.items() if b is not None)
        out.append((name, scalars, buffers))
    return tuple(out)


def version_key(model: torch.nn.Module) -> tuple:
    """In-place version counters of every parameter (cheap; blind to writes through `.data`)."""
    return tuple(p._version for p in model.parameters())


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor's raw bits as integers of the same width (no copy), or None for a tensor we cannot view."""
    t = t.detach()
    if type(t) is not torch.Tensor or t.dtype.is_complex:
        return None  # a tensor subclass (quantized weights): its storage is not one plain tensor
    target = _INT_OF_SIZE.get(t.element_size())
    if target is None:
        return None
    return (t if t.is_contiguous() else t.contiguous()).view(target)


def _position_weights(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(1, n + 1, dtype=torch.int64, device=device) * _ODD


def weights_digest(params: Iterable[torch.Tensor]) -> bytes:
    """A digest of every parameter's contents, exact at the bit level for any single changed element.

    Per tensor, viewed as integers `x` of its own width and as a matrix `[rows, cols]` (the last dimension is the
    columns): the row sums and the column sums of `x`, each accumulated in int64 (exact) and folded with position
    weights. Changing one element changes its row sum; moving values between rows or between columns (a flip, a
    roll, a transpose of a square weight) changes the position-weighted sums. Two reductions per tensor, read at
    memory speed, one host sync at the end for the whole model. A tensor that cannot be viewed as integers (a
    quantized tensor subclass) contributes its version counter instead. Not a cryptographic hash: an edit crafted
    to keep every row sum and every column sum of the raw bits (+d, -d, -d, +d at the corners of a rectangle) is
    not seen; ordinary edits (scaling, adding a delta, copying other weights, any single element) are.
    """
    parts: list[torch.Tensor] = []
    fallback: list[int] = []
    for p in params:
        x = _bits(p)
        if x is None or x.numel() == 0:
            fallback.append(int(p._version))
            continue
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(1, -1)
        rows = x2.sum(dim=1, dtype=torch.int64)
        cols = x2.sum(dim=0, dtype=torch.int64)
        parts.append(torch.stack([(rows * _position_weights(rows.numel(), rows.device)).sum(),
                                  (cols * _position_weights(cols.numel(), cols.device)).sum()]))
    h = hashlib.blake2b(digest_size=16)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in parts:
        by_device.setdefault(t.device, []).append(t)
    for device in sorted(by_device, key=str):
        h.update(torch.cat(by_device[device]).cpu().numpy().tobytes())
    h.update(repr(fallback).encode())
    return h.digest()


def prefix_key(model: torch.nn.Module, structure: tuple, check: str) -> bytes:
    """The key cached prefixes are valid under: structure, scalar attributes, versions, plus the contents of
    parameters and buffers unless `check` is "version"."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(structure).encode())
    h.update(repr(attribute_key(model)).encode())
    h.update(repr(version_key(model)).encode())
    if check == "content":
        h.update(weights_digest(p for _, p in model.named_parameters()))
        h.update(weights_digest(b for _, b in model.named_buffers()))
    return h.digest()
