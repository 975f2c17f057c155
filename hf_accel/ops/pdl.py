"""Programmatic dependent launch (PDL): let a kernel start while its predecessor in the stream is finishing.

On Hopper and newer, a kernel launched with the programmatic-stream-serialization attribute may be scheduled as soon
as every block of the kernel before it has either exited or executed `griddepcontrol.launch_dependents`; it must
execute `griddepcontrol.wait` before it touches anything its predecessor writes (or reads: a write-after-read
hazard is a hazard too). The wait returns once the predecessor has completed and its memory is visible. What
overlaps is the launch, block scheduling and whatever prologue comes before the wait: about a microsecond per kernel
boundary, which at batch 1 (hundreds of 2-5 us kernels per step) is a large share of a decode step. The attribute
is recorded in CUDA graphs, so replayed graphs keep the overlap.

The rule every kernel of ours that is launched with PDL follows: `gdc_wait()` before its first load of an activation
and before its first store; reads of weights and of the step's metadata (sequence lengths, query offsets, block
tables, slot mapping, launch order) may come earlier. That metadata is written by host-to-device copies queued
before the step's first kernel (and, for a graph's padded rows, fills followed by the graph's launch), never by a
kernel of the step; a copy or a graph launch is a full dependency for whatever the stream runs after it, so every
kernel of the step starts after those writes completed, whatever its predecessors do about their own PDL waits.
Kernels launched without the attribute (cuBLAS, torch's own) wait for full completion as before, so mixing is safe.

`supported(device)` says whether PDL can run here (triton exposes it, the device is sm90+, not the interpreter).
Whether it is used is decided once per model (`AccelConfig(pdl=...)`, default on where supported) and handed to
each user as a plain flag: the attention backend's `use_pdl`, the `use_pdl` argument of the linear op, Inductor's
`triton.enable_pdl` for the compiled pieces.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

# when the small-M GEMMs (ops/skinny_gemm.py) let their successor launch; read once per process and part of the
# tuner's stored key (ops/linear.py). `early` (default): right after the GEMM's own wait, so the successor's launch,
# block scheduling and the weight loads it makes before its wait overlap the GEMM's whole K loop. `late`: only after
# the K loop (the form before session 20), kept as the A/B switch. On the H200 the early form gave W1 llama-3.2-1b
# 957 against 926 tok/s and W2 qwen3-0.6b 35,687 against 32,998 (one lease, medians of 3)
_GEMM_TRIGGER = os.environ.get("HF_ACCEL_GEMM_TRIGGER", "early").strip().lower()
if _GEMM_TRIGGER not in ("early", "late"):
    logging.getLogger(__name__).warning("hf_accel: HF_ACCEL_GEMM_TRIGGER=%r is neither 'early' nor 'late'; using "
                                        "'early'", _GEMM_TRIGGER)
GEMM_EARLY_TRIGGER = _GEMM_TRIGGER != "late"


def gemm_pdl_form() -> str:
    """The GEMM PDL trigger as a short tag (the tuner's stored key)."""
    return "early" if GEMM_EARLY_TRIGGER else "late"


@functools.cache
def triton_supports_pdl() -> bool:
    """Whether the installed triton can launch with PDL and exposes the griddepcontrol intrinsics."""
    try:
        import triton.language as tl
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return "launch_pdl" in fields and hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def supported(device: torch.device | str | None = None) -> bool:
    """PDL can be used for kernels on `device` (CUDA, sm90+, triton support, not the interpreter)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        return False
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _device_supports_pdl(index) and triton_supports_pdl()


def launch_kwargs(use_pdl: bool) -> dict:
    """Extra launch keyword arguments for a triton kernel call (empty when PDL is off, so old triton still works)."""
    return {"launch_pdl": True} if use_pdl else {}
