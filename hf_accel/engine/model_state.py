"""What the KV cache and the compiled forward depend on: the model's structure, its adapters and its weights.

Two questions are asked at the start of every call on an idle engine:

1. Is the compiled code still the model's? Compiled pieces and CUDA graphs froze the module tree (which modules
   run, which PEFT adapters are active or disabled or merged) and read parameters at fixed addresses. The
   *structure key* covers exactly that: every parameter's identity, address, shape and dtype, and the adapter
   state of every PEFT tuner layer. When it changes, compiled code must be rebuilt (`api` re-accelerates).
   The *engine key* (attention implementation names, parameters' dtype and device) must hold even without compiled
   code: the KV cache and the backend were built for it.
2. Can cached prefixes be reused? Their KV was computed under some weights. The *prefix key* is the structure key
   (modules' scalar attributes included) plus the buffers' and weights' contents, so any change (an optimizer step,
   `load_state_dict`, an edit through `.data` that bypasses version counters, a PEFT adapter switched, disabled,
   merged or rescaled, a dtype cast) gives a new key, and the engine drops the cached prefixes.

Content is read by `weights_digest` (see there) unless `AccelConfig.prefix_cache_weight_check` is "version",
which trusts parameters' in-place version counters (free, but blind to `.data` edits and to PEFT's merge, which
writes through `.data`). Compiled code also froze modules' scalar attributes (an epsilon, a scaling), buffers'
identities, patched forwards and hooks: they are part of the structure, so changing one rebuilds it. The training
flag is not: a call in training mode with dropout runs stock (api).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from hf_accel.engine.tensor_parallel import local_tensor
from hf_accel.patches.quantization import side_tensors

_ODD = 0x9E3779B97F4A7C15 - (1 << 64)  # odd multiplier (int64) that spreads the position weights


_TUNER_NAMES = ("active_adapters", "disable_adapters", "merged_adapters")
_MODULE_GETATTR = torch.nn.Module.__getattr__


def is_tuner_layer(m: torch.nn.Module) -> bool:
    """PEFT tuner layers (LoRA, IA3, ...) carry an adapter state. Duck-typed: no import of peft.

    This runs for every module at every call, so most modules are rejected without `Module.__getattr__` (whose
    miss raises an exception): a name neither in the instance's own attributes nor on the class. A candidate is
    confirmed through the instance (a property may raise AttributeError, a slot may be unset), and a class with its
    own `__getattr__` (a wrapper forwarding names) takes the full lookup. Nothing is remembered per class: a class
    may gain the names later."""
    cls = type(m)
    if cls.__getattr__ is not _MODULE_GETATTR:
        return all(hasattr(m, n) for n in _TUNER_NAMES)
    d = m.__dict__
    for n in _TUNER_NAMES:
        if n not in d and not hasattr(cls, n):
            return False
    return all(hasattr(m, n) for n in _TUNER_NAMES)


def _adapter_state(module: torch.nn.Module) -> tuple:
    scaling = getattr(module, "scaling", None)
    scaling = tuple(sorted((k, float(v)) for k, v in scaling.items())) if isinstance(scaling, dict) else None
    return (tuple(module.active_adapters), bool(module.disable_adapters), tuple(module.merged_adapters), scaling)


_SCALAR_TYPES = frozenset({bool, int, float, str, type(None)})
# what a module's own attributes mostly are besides scalars (its parameter, buffer, submodule and hook tables): no
# tensor check needed for these exact types
_CONTAINER_TYPES = frozenset({dict, collections.OrderedDict, set, list, tuple})


@dataclass
class ModelSnapshot:
    """The model as the engine sees it at the start of a call, from one walk over its modules.

    engine: the attention implementation every config names (ours routes to the paged cache; another one, set after
    accelerate_model, would not) and the configs' plain values (read by forwards, and what the engine's attention
    was sized from: a changed one rebuilds the engine in every mode), the parameters' dtype and device (the KV cache
    and backend were chosen for them).
    structure: what compiled code froze: every parameter's identity, address, shape, dtype and device, every
    module's identity, class and forward function (a patched class or instance forward counts), each PEFT tuner
    layer's adapter state, every forward hook and pre-hook (which ones, not only how many), the global hooks, the
    plain values the forward reads besides tensors (modules' public scalar attributes: norm epsilons, attention
    scaling, window sizes; not the training flag) and buffers' identities and addresses (RoPE tables; their
    contents are in the digest).
    versions: the parameters' and buffers' in-place version counters.
    tensors: parameters and buffers, for the content digest.
    """

    engine: tuple
    structure: tuple
    versions: tuple
    tensors: list[torch.Tensor]


def _config_values(cfg) -> tuple:
    """A config's public plain values (and lists of them): model code reads some in its forward (a sliding window,
    a logit softcap, the layer count), and the engine sized its attention from them."""
    out = []
    for k, v in vars(cfg).items():
        if k[0] == "_":
            continue
        if type(v) in _SCALAR_TYPES:
            out.append((k, v))
        elif isinstance(v, list | tuple) and all(type(x) in _SCALAR_TYPES for x in v):
            out.append((k, tuple(v)))
    return tuple(out)


def take_snapshot(model: torch.nn.Module) -> ModelSnapshot:
    params, modules, attributes, versions, tensors = [], [], [], [], []  # attributes: part of the structure
    implementations: dict[int, str] = {}
    seen: set[int] = set()

    def track(t: torch.Tensor, identity: tuple) -> None:
        """A tensor the forward computes with: its identity in the structure, its version and contents in the key."""
        seen.add(id(t))
        params.append(identity)
        versions.append(_version(t))
        tensors.append(t)
    for name, m in model.named_modules():
        # the forward that runs: the class's (patched classes included) or an instance attribute
        own = m.__dict__.get("forward")
        modules.append((name, id(m), type(m), type(m).forward, getattr(own, "__func__", own)))
        if is_tuner_layer(m):
            modules.append((name, _adapter_state(m)))
        if m._forward_hooks or m._forward_pre_hooks:
            modules.append((name, "hooks", tuple(m._forward_hooks.items()), tuple(m._forward_pre_hooks.items())))
        cfg = m.__dict__.get("config")
        if cfg is not None and id(cfg) not in implementations and hasattr(cfg, "_attn_implementation"):
            implementations[id(cfg)] = (str(cfg._attn_implementation), _config_values(cfg))
        for p in m._parameters.values():
            if p is None or id(p) in seen:
                continue
            track(p, (id(p), p.data_ptr(), p.shape, p.dtype, p.device, _inner_layout(p)))
        for t in side_tensors(m):  # a quantized linear's scales kept outside its parameters (bitsandbytes)
            if id(t) not in seen:
                track(t, (id(t), t.data_ptr(), t.shape, t.dtype, t.device))
        # one pass over the module's own attributes for two things:
        # - public scalars (the training flag is left out: a call in training mode with dropout takes the stock
        #   path, api);
        # - plain tensors held as attributes (neither parameters nor buffers), as control-vector code sets them
        #   (`module.control = vector`): the forward reads them, compiled code holds the object it traced, so
        #   replacing one rebuilds and editing one in place drops the cached prefixes
        scalars = []
        for k, v in m.__dict__.items():
            kind = type(v)
            if kind in _SCALAR_TYPES:
                if k[0] != "_" and k != "training":
                    scalars.append((k, v))
            elif kind not in _CONTAINER_TYPES and isinstance(v, torch.Tensor) and id(v) not in seen:
                track(v, (name, k, id(v), v.data_ptr(), v.shape, v.dtype, v.device))
        scalars = tuple(scalars)
        buffers = tuple((k, id(b), b.data_ptr(), b.dtype) for k, b in m._buffers.items() if b is not None)
        attributes.append((scalars, buffers))
        versions.extend(_version(b) for b in m._buffers.values() if b is not None)
        tensors.extend(b for b in m._buffers.values() if b is not None)
    # the parameters' dtype and device (not another tracked tensor's: a control vector may be float32 in bf16)
    first = next(iter(model.parameters()), None)
    engine = (tuple(implementations.values()), *((first.dtype, first.device) if first is not None else (None, None)))
    hooks = (tuple(torch.nn.modules.module._global_forward_hooks.items()),
             tuple(torch.nn.modules.module._global_forward_pre_hooks.items()))
    return ModelSnapshot(engine=engine, structure=(tuple(params), tuple(modules), tuple(attributes), hooks),
                         versions=tuple(versions), tensors=tensors)


def _version(t: torch.Tensor) -> int:
    """`t`'s in-place version counter; -1 for an inference tensor, which has none (a weight a library replaced
    inside someone's `torch.inference_mode()`): its content is still read by `weights_digest`."""
    return -1 if t.is_inference() else t._version


def _inner_layout(p: torch.Tensor) -> tuple:
    """A tensor subclass's inner tensors as the compiled code sees them (identity, address, shape, stride, dtype);
    () for a plain tensor. A quantized weight's outer tensor keeps its identity and shape when its `qdata` or
    `scale` is replaced (and its data_ptr is 0), but the compiled forward and the CUDA graphs were built for the
    old parts: rebinding one must rebuild the engine, as replacing the parameter does."""
    if type(p) in (torch.Tensor, torch.nn.Parameter):
        return ()
    flatten = getattr(p, "__tensor_flatten__", None)  # no detach(): that dispatches through the subclass, per call
    try:
        names = flatten()[0] if flatten is not None else ()
    except Exception:
        names = ()
    out: list = [type(p)]
    for name in names:
        t = getattr(p, name, None)
        if isinstance(t, torch.Tensor):  # a nested subclass: its own parts below, no storage address of its own
            plain = type(t) in (torch.Tensor, torch.nn.Parameter)
            out.append((name, id(t), t.data_ptr() if plain else 0, t.shape, t.stride(), t.dtype, _inner_layout(t)))
    return tuple(out)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_CHUNK_BYTES = 256 << 20  # bytes summed per reduction: few kernel launches, a bounded temporary
_COLUMNS = 1024  # int32 words per row of a chunk


def plain_parts(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The plain tensors holding `t`'s data: itself; a tensor-parallel rank's own shard; a quantized tensor
    subclass's inner tensors (packed data, scales, zero points: `__tensor_flatten__`), so in-place writes to those
    are seen even though they leave the outer version counter alone. None when there are none to read."""
    if type(t) in _PLAIN_TYPES and t.layout == torch.strided and not (t.is_quantized or t.is_meta):
        return [t]  # the common case (every weight, every call), kept cheap: no detached view built
    t = local_tensor(t.detach())
    if t.is_meta or t.layout != torch.strided or t.is_quantized:  # no plain bytes to read: the version counts
        return None
    if type(t) in _PLAIN_TYPES:
        return [t]
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return None
    try:
        names, _ = flatten()
    except Exception:
        return None
    parts: list[torch.Tensor] = []
    for name in names:
        inner = getattr(t, name, None)
        if isinstance(inner, torch.Tensor):
            sub = plain_parts(inner)
            if sub is None:
                return None
            parts.extend(sub)
    return parts or None


def _plain_bytes(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor's bytes (one of `plain_parts`) as a flat uint8 view (a copy only if it is not contiguous)."""
    t = t.detach()
    t = t if t.is_contiguous() else t.contiguous()
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)  # a one-element view may have any stride


def _position_weights(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(1, n + 1, dtype=torch.int64, device=device) * _ODD


def _chunk_sums(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Two int64 numbers for one chunk of bytes: position-weighted row sums and column sums of its int32 words."""
    flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    if flat.storage_offset() % 4:  # a view starting mid-word cannot be read as int32 in place
        flat = flat.clone()
    pad = (-flat.numel()) % (4 * _COLUMNS)
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int32).view(-1, _COLUMNS)
    if words.device.type == "cpu":  # numpy's widening int32 sums run 5-7x faster than torch's on the CPU
        array = words.numpy()
        rows = torch.from_numpy(array.sum(axis=1, dtype=np.int64))
        cols = torch.from_numpy(array.sum(axis=0, dtype=np.int64))
    else:
        rows = words.sum(dim=1, dtype=torch.int64)
        cols = words.sum(dim=0, dtype=torch.int64)
    return torch.stack([(rows * _position_weights(rows.numel(), rows.device)).sum(),
                        (cols * _position_weights(_COLUMNS, cols.device)).sum()])


_gpu_digest_fn = None


def _gpu_digest():
    """`ops.digest.digest_sums`, or None where triton is missing (the torch path below then serves CUDA too)."""
    global _gpu_digest_fn
    if _gpu_digest_fn is None:
        try:
            from hf_accel.ops.digest import digest_sums
        except Exception:  # no triton
            _gpu_digest_fn = False
        else:
            _gpu_digest_fn = digest_sums
    return _gpu_digest_fn or None


def weights_digest(tensors: Iterable[torch.Tensor]) -> bytes:
    """A digest of the tensors' contents, exact at the bit level for any single changed element.

    On a GPU, one kernel launch per device reads each tensor where it lies and folds its int32 words with two sets
    of position weights (`ops.digest`; a non-contiguous or unaligned tensor is copied first, up to 256 MiB of
    copies per launch).
    Elsewhere (and without triton), the tensors' bytes, in order, are cut into chunks of 256 MiB, each read as a
    matrix of int32 words with 1,024 columns; per chunk, the row sums and the column sums are accumulated in int64
    (exact) and folded with position weights. Changing one element changes its row's sum; moving values between
    rows or between columns changes the position-weighted sums. Big weights are summed in place (their chunks are
    views), small ones are gathered into one chunk first. Either way a whole model costs one host sync (measured on
    the H200: see the CHANGELOG). A quantized tensor subclass contributes its inner tensors (packed data, scales);
    one whose data cannot be read that way contributes its version counter instead. Not a cryptographic hash: an
    edit crafted to cancel in the sums (+d, -d, -d, +d at the corners of a rectangle of words, for the torch path)
    is not seen; ordinary edits (scaling, adding a delta, copying other weights, any single element) are.
    """
    sums: dict[str, list[torch.Tensor]] = {}
    pending: dict[str, tuple[list[torch.Tensor], int]] = {}
    on_gpu: dict[str, list[torch.Tensor]] = {}  # plain tensors per GPU, for one launch each
    fallback: list[int] = []
    gpu_digest = _gpu_digest()

    def byte_views() -> Iterable[torch.Tensor]:
        # one tensor at a time: on the chunk path, a non-contiguous weight's copy lives only while its chunks are built
        for t in tensors:
            parts = plain_parts(t)  # plain tensors only, or None
            if parts is None:
                fallback.append(int(t._version))
                continue
            for part in parts:
                if gpu_digest is not None and part.is_cuda:
                    on_gpu.setdefault(str(part.device), []).append(part)
                else:
                    yield _plain_bytes(part)

    for data in byte_views():
        dev = str(data.device)
        pieces, size = pending.get(dev, ([], 0))
        offset = 0
        while offset < data.numel():
            take = min(data.numel() - offset, _CHUNK_BYTES - size)
            pieces.append(data[offset : offset + take])
            size += take
            offset += take
            if size == _CHUNK_BYTES:
                sums.setdefault(dev, []).append(_chunk_sums(pieces))
                pieces, size = [], 0
        pending[dev] = (pieces, size)
    for dev, (pieces, size) in pending.items():
        if size:
            sums.setdefault(dev, []).append(_chunk_sums(pieces))
    for dev, parts in on_gpu.items():  # one launch per GPU (ops/digest.py)
        sums.setdefault(dev, []).append(gpu_digest(parts))
    h = hashlib.blake2b(digest_size=16)
    for dev in sorted(sums):
        h.update(torch.stack(sums[dev]).cpu().numpy().tobytes())
    h.update(repr(fallback).encode())
    return h.digest()


def prefix_key(snapshot: ModelSnapshot, check: str) -> tuple:
    """The key cached prefixes are valid under: structure (scalar attributes included), versions, plus the contents
    of parameters and buffers unless `check` is "version". Compared as a tuple (no hashing of the host-side parts)."""
    if check != "content":
        return snapshot.structure, snapshot.versions, b""
    # outside inference mode: a caller may hold it (`with torch.inference_mode(): model.generate(...)`), and a
    # tensor subclass's detach() under it fails (torchao sets a version counter an inference tensor cannot have)
    with torch.inference_mode(False):
        digest = weights_digest(snapshot.tensors)
    return snapshot.structure, snapshot.versions, digest
