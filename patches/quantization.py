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


def quantizes_activations(model: torch.nn.Module) -> bool:
    """Whether some weight of `model` quantizes its activations on every call (torchao's dynamic-activation
    configs: float8 or int8 activations, recognised by the weight's `act_quant_kwargs`).

    Why: the compiled forward must then round as eager PyTorch does. Inductor fuses the activation's scale and cast
    into one kernel and keeps the intermediate in float32 where eager rounds it to bf16 first, and the e4m3 / int8
    cast turns that half-ulp into a whole quantization step. Measured on the H200 (llama-3.1-8b, float8 per-row):
    our compiled tokens strayed beyond the rounding margin from the eager path on 57 % of W2's steps, stock's
    tokens on 6 %; on the CPU, Inductor's `emulate_precision_casts` makes a compiled float8 linear equal to eager
    exactly. The pieces hf_accel compiles switch it on for such models (`compilation.piecewise.inductor_settings`)."""
    return any(getattr(p, "act_quant_kwargs", None) is not None for p in model.parameters())


def decompress_packed_weights(model: torch.nn.Module) -> str | None:
    """Bring a compressed-tensors model to the dense form stock runs it in, now, before hf_accel packs, compiles and
    sizes the KV cache.

    Why: transformers loads a compressed-tensors model (the format llm-compressor writes for GPTQ / AWQ-style W4A16
    and W8A16 weights) with its weights packed (`weight_packed` + `weight_scale`, no `weight`) and a forward
    pre-hook on the model that decompresses every such linear to a dense weight of the model's dtype on the first
    forward; from then on stock runs it dense (transformers has no kernel for the packed form). hf_accel's forwards
    need not pass through that hook, so the decompression happens here. What compressed-tensors leaves on the
    modules afterwards (its offloading wrapper, the quantized forward) is judged from the modules themselves, so a
    model stock has already run is handled the same. The change is the one stock's first forward makes and stays
    if accelerate_model fails later or on restore(). Returns a note for `engine_info` (None: not such a model)."""
    decompressed = False
    if getattr(model, "ct_decompress_hook", None) is not None:
        compressor = getattr(getattr(model, "hf_quantizer", None), "compressor", None)
        if compressor is not None and hasattr(compressor, "decompress_model"):
            compressor.decompress_model(model)  # removes the hook
        else:  # another transformers / compressed-tensors layout: let the hook itself run on a one-token forward
            device = next(model.parameters()).device
            with torch.inference_mode():
                model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
        if getattr(model, "ct_decompress_hook", None) is not None:
            raise RuntimeError("hf_accel: compressed-tensors weights could not be decompressed before accelerating")
        decompressed = True
    _drop_inert_offload_wrappers(model)
    _drop_no_op_quantized_forwards(model)
    if not decompressed and not any(_status(m) == "decompressed" for m in model.modules()):
        return None
    dtypes = sorted({str(p.dtype).replace("torch.", "") for n, p in model.named_parameters() if n.endswith(".weight")
                     and p.dtype.is_floating_point})
    return (f"compressed-tensors weights decompressed to dense {'/'.join(dtypes)}, as transformers does on the first "
            "forward (it has no kernel for the packed form): memory and speed are those of the dense model")


def _status(module: torch.nn.Module) -> str | None:
    status = getattr(module, "quantization_status", None)
    return getattr(status, "value", status)


def _drop_inert_offload_wrappers(model: torch.nn.Module) -> None:
    """compressed-tensors' decompression converts the model to its own offloading (`from_accelerate`): every module's
    parameters sit in an `OffloadCache` and its forward first sends its inputs to the onload device, comparing data
    pointers, which Dynamo cannot trace (the compile fell back to eager on it). Where nothing is offloaded (onload
    and offload device the same, the case for a model loaded onto one device) the wrapper moves nothing, so it is
    removed and the module gets its plain parameters and forward back. A model truly offloaded (to the CPU or
    disk) is refused: hf_accel runs every weight on the GPU. A module whose forward is no longer that wrapper (the
    user patched it after loading) is left as it is: removing the offloading would put the pre-patch forward back."""
    wrapped = [m for m in model.modules() if type(m._parameters).__module__.startswith("compressed_tensors.")]
    if not wrapped:  # not such a model: nothing imported, nothing touched
        return
    from compressed_tensors.offload.cache.base import OffloadCache
    from compressed_tensors.offload.module import remove_module_offload

    for module in wrapped:
        cache = module._parameters
        if not isinstance(cache, OffloadCache) or not _is_offload_forward(module):
            continue
        if str(cache.offload_device) != str(cache.onload_device):
            raise ValueError(f"hf_accel: this compressed-tensors model offloads weights to {cache.offload_device} "
                             f"(onload device {cache.onload_device}); accelerate_model needs every weight on the "
                             "device it runs on: load it without offloading (device_map to one device)")
        remove_module_offload(module, onload_tensors=False)
        # it puts back a bound copy of the class forward as an instance attribute; hf_accel's fused ops (and anyone
        # else) treat an instance forward as a patched module, so drop it when it is just the class's
        forward = module.__dict__.get("forward")
        if getattr(forward, "__func__", None) is type(module).forward:
            del module.forward


def _instance_forward_code(module: torch.nn.Module):
    """The code object of a forward set on the module itself (None: it runs its class's forward)."""
    forward = module.__dict__.get("forward")
    return getattr(getattr(forward, "__func__", forward), "__code__", None)


def _is_offload_forward(module: torch.nn.Module) -> bool:
    """Whether the module's own forward is compressed-tensors' offloading wrapper (`offload/module.py`)."""
    code = _instance_forward_code(module)
    return code is not None and code.co_filename.replace("\\", "/").endswith("compressed_tensors/offload/module.py")


def _drop_no_op_quantized_forwards(model: torch.nn.Module) -> None:
    """compressed-tensors also gives each quantized linear a forward that fake-quantizes what its scheme says and
    calls the class forward with the weight's `.data` patched, which Dynamo cannot trace. For a weight-only scheme
    (no input or output activations quantized: W4A16, W8A16, GPTQ / AWQ-style) whose weights are already
    decompressed, that forward skips the weight's fake quantization and patches `.data` with itself, so it computes
    exactly the class forward: the instance's wrapper is removed. A scheme that quantizes activations keeps its
    forward (the compiled forward then falls back to eager with one warning)."""
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        code = _instance_forward_code(module)
        if scheme is None or code is None or code.co_name != "quantized_forward":  # named so under functools.wraps
            continue
        if scheme.input_activations is not None or scheme.output_activations is not None:
            continue
        if _status(module) not in ("compressed", "decompressed"):
            continue  # before compression the wrapper fake-quantizes the weight: real work
        del module.forward


# ------------------------------------------------------------------------------------------------ bitsandbytes state
_BNB_NAMES = frozenset({"quant_state", "CB", "SCB"})


def side_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Tensors a quantized linear computes with that are neither its parameters nor its buffers, in a fixed order:
    bitsandbytes keeps its scales as plain attributes, a 4-bit weight's in `weight.quant_state` (absmax, code,
    offset, and the nested state of double quantization) and an 8-bit weight's row scales in `weight.SCB`, moved to
    `module.state.SCB` on the first forward (with the int8 data, `CB`, when that is not the weight's own storage).

    Why: an in-place edit of one of them changes what the model computes without touching a parameter, so the
    prefix cache's key must read them (`engine.model_state.take_snapshot`), and replacing one must rebuild the
    compiled code that holds it."""
    weight = module.__dict__.get("_parameters", {}).get("weight")
    if weight is None:
        return []
    # bitsandbytes sets its state as instance attributes: a plain parameter without them, on a module without a
    # `state` attribute of its own, has nothing here (checked first: this runs for every module at every call)
    lt_state = module.__dict__.get("state")
    if lt_state is None:
        cls = type(module)
        if hasattr(cls, "state") or cls.__getattr__ is not torch.nn.Module.__getattr__:
            lt_state = getattr(module, "state", None)  # a property, a class attribute, a forwarded name
    if type(weight) is torch.nn.Parameter and lt_state is None and _BNB_NAMES.isdisjoint(weight.__dict__):
        return []
    out: list[torch.Tensor] = []
    state = getattr(weight, "quant_state", None)
    for _ in range(4):  # QuantState, then its nested `state2`
        if state is None or type(state).__name__ != "QuantState":
            break
        out.extend(t for t in (state.absmax, state.code, state.offset) if isinstance(t, torch.Tensor))
        state = state.state2
    holders = [weight] + ([lt_state] if type(lt_state).__name__ == "MatmulLtState" else [])
    for holder in holders:
        for name in ("CB", "SCB"):
            t = getattr(holder, name, None)
            if isinstance(t, torch.Tensor) and not (name == "CB" and t.data_ptr() == weight.data_ptr()):
                out.append(t)
    return out


def settle_lazy_quantized_state(model: torch.nn.Module) -> int:
    """Run each bitsandbytes linear once on a zero row of the model's activation dtype (its input embeddings'), as
    stock's first forward would, before hf_accel traces or steps the model; returns how many ran.

    Why: bitsandbytes finishes some weights on their first forward. On the CPU a 4-bit weight is repacked there
    (`weight.data` replaced), a 4-bit module without a compute dtype takes its input's, and an 8-bit module moves
    its int8 data and scales to `module.state`. hf_accel's steps run under `torch.inference_mode()`, so a repack
    inside one made the weights inference tensors (the next call's weight check raised with DoRA adapters), and one
    inside the compile trace failed it (the compile fell back to eager). Done once here, under no_grad, with the
    dtype stock's forward passes, it happens as in stock."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32
    ran = 0
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ not in ("Linear4bit", "Linear8bitLt"):
                continue
            weight = module.__dict__.get("_parameters", {}).get("weight")
            if weight is None or weight.device.type == "meta":
                continue
            module(torch.zeros(1, module.in_features, dtype=dtype, device=weight.device))
            ran += 1
    return ran
