"""Quantization methods' quirks: quantized linear modules that torch.compile or CUDA graphs cannot take, and why.

Matched by class name (and a per-module check), whatever the model's family. Every other quantized linear measured
on the H200 (torchao int8 weight-only and float8 dynamic, bitsandbytes nf4) compiles and captures as it is; the
linear-packing and small-M GEMM passes already leave quantized weights alone (`linear_packing.is_dense`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedLinearQuirk:
    """What such a module supports (`compiles`: torch.compile takes it without recompiling per batch; `captures`: a
    CUDA graph can capture it); accelerate_model turns off what it does not. `applies` says whether a given module of
    the class has the quirk."""

    method: str
    compiles: bool
    captures: bool
    why: str
    applies: Callable[[torch.nn.Module], bool] = lambda module: True


def _has_outlier_threshold(module: torch.nn.Module) -> bool:
    return float(getattr(getattr(module, "state", None), "threshold", 0.0) or 0.0) > 0.0


QUIRKS: dict[str, QuantizedLinearQuirk] = {
    # bitsandbytes 0.50 `MatMul8bitLt`: with an outlier threshold (the default 6.0) each call finds the activation
    # columns above it (a data-dependent shape, read on the host). Dynamo recompiles the forward for new batches
    # (seen on the H200: one ~30 s Inductor compile per recompile) and a CUDA graph capture fails on the host read.
    "Linear8bitLt": QuantizedLinearQuirk(
        method="bitsandbytes 8-bit (LLM.int8() outlier decomposition)", compiles=False, captures=False,
        why="its outlier decomposition reads the activations on the host every call (data-dependent shapes): "
            "Dynamo would recompile per batch and a CUDA graph cannot capture the read",
        applies=_has_outlier_threshold),
}


def quantization_quirks(model: torch.nn.Module) -> list[QuantizedLinearQuirk]:
    """The quirks of the quantized modules `model` holds, one per kind."""
    found: dict[str, QuantizedLinearQuirk] = {}
    for module in model.modules():
        quirk = QUIRKS.get(type(module).__name__)
        if quirk is not None and type(module).__name__ not in found and quirk.applies(module):
            found[type(module).__name__] = quirk
    return list(found.values())


def int8_weight_only_parts(weight: object) -> tuple[str, str] | None:
    """For a torchao int8 weight-only weight (`Int8WeightOnlyConfig`: `Int8Tensor` with no activation quantization,
    one scale per output row or one per tensor), the names of its int8 data and scale attributes; else None.

    Why: under torch.compile, Inductor rewrites the dequantize-then-matmul such a weight desugars into to
    `aten._weight_int8pack_mm`, whose CUDA kernel is far slower than the bf16 GEMM at decode and prefill sizes (seen
    on the H200, torch 2.11: 258 ms per W2 step for 4 llama-3.1-8b layers). The compile pass
    `compilation.small_m_linear.route_int8_weight_only_linears` sends these linears to `hf_accel::int8_weight_linear`
    instead: the small-M GEMM reading the int8 weight directly, torchao's own arithmetic above it."""
    if type(weight).__name__ != "Int8Tensor" or not isinstance(weight, torch.Tensor):
        return None
    qdata, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if getattr(weight, "act_quant_kwargs", None) is not None or getattr(weight, "act_pre_scale", None) is not None:
        return None
    if not isinstance(qdata, torch.Tensor) or not isinstance(scale, torch.Tensor):
        return None
    block = getattr(weight, "block_size", None)
    if qdata.dtype != torch.int8 or qdata.dim() != 2 or not block or int(block[-1]) != int(qdata.shape[-1]):
        return None  # per-group scales: torchao dequantizes the whole weight; left to it
    if scale.numel() not in (1, int(qdata.shape[0])):
        return None
    return "qdata", "scale"
