"""Fused RMSNorm and SiLU-and-mul on the model's own modules, for the compile-off CUDA path.

With torch.compile on, Inductor already fuses these. With compile off (the user asked for it, or compiling failed)
the stock modules run eagerly: a Llama-style RMSNorm is about six small kernels (cast, pow, mean, add+rsqrt, mul,
cast, mul) and `act_fn(gate) * up` two more, each a launch and a round trip through memory for a memory-bound op.
`install_fused_ops(model)` gives each recognised module a one-kernel forward (a Triton kernel from
`fused_kernels`) as an instance attribute; `uninstall_fused_ops(record)` deletes those attributes again.

The kernels round where the stock forwards round (the norm to the input dtype before the weight for Llama style,
after `1 + weight` for Gemma style; SiLU to the gate's dtype before the product with `up`), so results equal stock up
to the order of float reductions. Only classes whose forward was checked against one of those formulas are listed (by
the family modules in hf_accel.patches), and only classes defined by transformers itself (remote-code copies may
differ). When the gate and up weights are consecutive rows of one storage (`compilation.linear_packing.
pack_sibling_linears` arranges that), both are one GEMM over a view of the packed block.

A patched forward falls back to the class forward whenever the fused one would not be equivalent or is not wanted:
outside an engine step (a plain forward, training and evaluation run the stock modules), autograd needs the result,
the call passes anything but one tensor, gate/up were wrapped or hooked since install (a PEFT adapter), or the
tensors moved off CUDA (CPU runs only when installed with `allow_cpu=True`, which the tests use with the Triton
interpreter). This module does not import triton; the kernels are imported when `install_fused_ops` runs.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hf_accel.attention.context import in_engine_step
from hf_accel.compilation.linear_packing import consecutive_rows
from hf_accel.patches import NORM_STYLES, fusable_mlps, fusable_norms

logger = logging.getLogger(__name__)

# Which classes are fusable is family knowledge: each `patches/<family>.py` declares its RMSNorms (class name ->
# formula style, the styles documented in patches/base.py) and gated SiLU MLPs. A module is recognised by class name
# whatever the model's model_type (families share classes), so these are the unions over all families, built once.
FUSABLE_NORMS: dict[str, str] = fusable_norms()
FUSABLE_MLPS: frozenset[str] = fusable_mlps()

# the attribute each style's module keeps its epsilon in; one entry per style in patches.base.NORM_STYLES
_EPS_ATTR = {"llama": "variance_epsilon", "gemma": "eps"}
if set(_EPS_ATTR) != set(NORM_STYLES):
    raise ImportError(f"norm styles {sorted(NORM_STYLES)} and their kernel wiring {sorted(_EPS_ATTR)} disagree")
_MARK = "_hf_accel_fused"  # set on every fused forward function: how uninstall recognises ours


@dataclass
class FusedRecord:
    """What install_fused_ops patched: each module now has a `forward` instance attribute."""

    modules: list[nn.Module] = field(default_factory=list)
    norms: int = 0
    mlps: int = 0


def _kernels() -> types.ModuleType:
    from hf_accel.ops import fused_kernels

    return fused_kernels


def _from_transformers(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.")


def _on_allowed_device(tensors: list[torch.Tensor], allow_cpu: bool) -> bool:
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        return False
    return device.type == "cuda" or (allow_cpu and device.type == "cpu")


def _fusable_input(args: tuple, kwargs: dict, params: list[torch.Tensor], allow_cpu: bool) -> torch.Tensor | None:
    """The single tensor input when the fused path computes exactly what the class forward would, else None."""
    if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or not in_engine_step():
        return None
    x = args[0]
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return None  # the kernels have no backward
    if not _on_allowed_device([x, *params], allow_cpu):
        return None
    return x


def _mark(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, _MARK, True)
    return fn


def _norm_forward(style: str, allow_cpu: bool, kernels: types.ModuleType) -> Callable[..., torch.Tensor]:
    gemma = style == "gemma"
    eps_attr = _EPS_ATTR[style]

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = _fusable_input(args, kwargs, [self.weight], allow_cpu)
        if x is None:
            return type(self).forward(self, *args, **kwargs)
        return kernels.rms_norm(x, self.weight, getattr(self, eps_attr), gemma)

    return _mark(forward)


def _mlp_forward(allow_cpu: bool, kernels: types.ModuleType) -> Callable[..., torch.Tensor]:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not _still_plain(self):  # wrapped since install (a PEFT adapter on gate/up) or hooked: the class forward
            return type(self).forward(self, *args, **kwargs)
        gate_w, up_w = self.gate_proj.weight, self.up_proj.weight
        x = _fusable_input(args, kwargs, [gate_w, up_w], allow_cpu)
        if x is None:
            return type(self).forward(self, *args, **kwargs)
        lead, inter = x.shape[:-1], gate_w.shape[0]
        x2 = x.reshape(-1, x.shape[-1])
        if gate_packed_with_up(self):
            # one GEMM over both row blocks: a view spanning gate's and up's rows of the packed storage, no copy
            both = gate_w.as_strided((inter + up_w.shape[0], gate_w.shape[1]), gate_w.stride())
            gate_up = F.linear(x2, both)
            hidden = kernels.silu_and_mul(gate_up[:, :inter], gate_up[:, inter:])
        else:
            hidden = kernels.silu_and_mul(F.linear(x2, gate_w), F.linear(x2, up_w))
        return self.down_proj(hidden.view(*lead, inter))

    return _mark(forward)


def gate_packed_with_up(mlp: nn.Module) -> bool:
    """Whether `mlp.up_proj.weight` directly follows `mlp.gate_proj.weight` in one storage (one GEMM covers both).

    Checked on every call: `restore()` or `unpack_sibling_linears` may give the weights their own storage again.
    """
    return consecutive_rows([mlp.gate_proj.weight, mlp.up_proj.weight])


def _still_plain(mlp: nn.Module) -> bool:
    """gate/up are still the plain, unhooked Linears (and act_fn the SiLU) that install_fused_ops checked."""
    return (type(mlp.gate_proj) is nn.Linear and type(mlp.up_proj) is nn.Linear and type(mlp.down_proj) is nn.Linear
            and all(_no_hooks(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.act_fn)))


def _norm_style(module: nn.Module) -> str | None:
    style = FUSABLE_NORMS.get(type(module).__name__)
    if style is None or not _from_transformers(module):
        return None
    weight = getattr(module, "weight", None)
    eps = getattr(module, _EPS_ATTR[style], None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float | int):
        return None
    return style


def _no_hooks(module: nn.Module) -> bool:
    """The fused MLP runs gate/up/act as one product and one kernel: nothing may hook into those submodules."""
    return "forward" not in module.__dict__ and not module._forward_hooks and not module._forward_pre_hooks


def _silu_types() -> tuple[type, ...]:
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # older transformers: ACT2FN["silu"] is nn.SiLU
        return (nn.SiLU,)
    return (nn.SiLU, SiLUActivation)


def _is_fusable_mlp(module: nn.Module) -> bool:
    if type(module).__name__ not in FUSABLE_MLPS or not _from_transformers(module):
        return False
    gate, up, down = (getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
    act = getattr(module, "act_fn", None)
    if not all(type(m) is nn.Linear for m in (gate, up, down)) or type(act) not in _silu_types():
        return False
    if gate.bias is not None or up.bias is not None:
        return False
    if gate.weight.shape != up.weight.shape or down.in_features != gate.out_features:
        return False
    if gate.weight.dtype != up.weight.dtype:
        return False
    return all(_no_hooks(m) for m in (gate, up, act))


def install_fused_ops(model: nn.Module, *, allow_cpu: bool = False) -> FusedRecord:
    """Give every recognised RMSNorm and SiLU MLP of `model` a fused forward (see the module docstring).

    Modules whose parameters are not on CUDA are skipped unless `allow_cpu` (CPU tensors then need the Triton
    interpreter, TRITON_INTERPRET=1). A module that already has an instance `forward` (ours, or another library's
    hook) is left alone. Returns what was patched; nothing is patched when triton cannot be imported.
    """
    record = FusedRecord()
    try:
        kernels = _kernels()
    except ImportError as exc:
        logger.info("fused ops not installed: %s", exc)
        return record
    norm_forwards = {style: _norm_forward(style, allow_cpu, kernels) for style in _EPS_ATTR}
    mlp_forward = _mlp_forward(allow_cpu, kernels)
    for module in model.modules():
        if "forward" in module.__dict__:
            continue
        style = _norm_style(module)
        if style is not None and _on_allowed_device([module.weight], allow_cpu):
            module.forward = types.MethodType(norm_forwards[style], module)
            record.modules.append(module)
            record.norms += 1
        elif _is_fusable_mlp(module) and _on_allowed_device(
                [module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight], allow_cpu):
            module.forward = types.MethodType(mlp_forward, module)
            record.modules.append(module)
            record.mlps += 1
    return record


def uninstall_fused_ops(record: FusedRecord) -> None:
    """Delete the fused forwards again: each module runs its class forward."""
    for module in record.modules:
        forward = module.__dict__.get("forward")
        if forward is not None and getattr(forward, _MARK, False):
            del module.forward
    record.modules.clear()
    record.norms = record.mlps = 0
