"""The forward context: what the attention op needs that is not a tensor argument.

The runner sets it around each forward (and around graph capture); the opaque op reads it. Keeping the metadata
out of the op's signature is what lets Dynamo see one op call per layer with plain tensor inputs.

The context is per thread, never process-wide: two accelerated models stepping in two threads each see their own
step, and a plain forward (training, evaluation) in one thread while another thread runs an engine step sees no
context, so it runs the stock attention. "Inside an engine step" means exactly: this thread is inside
`forward_context(...)`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hf_accel.attention.backend import AttentionBackend
from hf_accel.attention.metadata import StepMetadata


@dataclass
class ForwardContext:
    metadata: StepMetadata
    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)
    # int32 zeros the step's split-K GEMMs take tickets from to reduce in one launch (ops/skinny_gemm.py); one
    # buffer per runner, used by one step at a time on one stream, so no two launches share a counter at once
    split_k_counters: torch.Tensor | None = None


class _ThreadContext(threading.local):
    current: ForwardContext | None = None


_local = _ThreadContext()


@torch._dynamo.assume_constant_result
def in_engine_step() -> bool:
    """Whether this thread is inside an engine step.

    Python-level dispatch (the attention function, the mask function, fused module forwards) calls this. Under
    Dynamo it is evaluated once at trace time and baked in as a constant: the engine traces its forward inside a
    step (so the compiled graph takes the paged path), while a user's own `torch.compile(model)` traces outside one
    (so their graph is the stock model).
    """
    return _local.current is not None


def get_forward_context() -> ForwardContext:
    ctx = _local.current
    if ctx is None:
        raise RuntimeError(
            "hf_accel attention op was called outside an engine step (internal error: the attention function "
            "dispatches plain forwards to the stock attention implementation)"
        )
    return ctx


def split_k_counters() -> torch.Tensor | None:
    """This thread's step's split-K ticket counters (`ForwardContext.split_k_counters`); None outside a step."""
    ctx = _local.current
    return ctx.split_k_counters if ctx is not None else None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    previous, _local.current = _local.current, ctx
    try:
        yield ctx
    finally:
        _local.current = previous
