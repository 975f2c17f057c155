"""The forward context: what the attention op needs that is not a tensor argument.

The runner sets it around each forward (and around graph capture); the opaque op reads it. Keeping the metadata
out of the op's signature is what lets Dynamo see one op call per layer with plain tensor inputs.
"""

from __future__ import annotations

import contextlib
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


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError(
            "hf_accel attention was called outside an engine step. The model is patched by accelerate_model(); "
            "call model.generate() (or restore(model) to use the plain forward)."
        )
    return _current


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous
