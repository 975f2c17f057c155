"""Which graph runs a step: FULL, PIECEWISE or NONE, and the token count it is padded to.

- FULL (one launch for the whole forward) for uniform decode batches up to the largest full capture size, padded up
  to the next captured size; also for mixed batches when the mode is "full" and the attention backend can live in
  any graph (CUDAGraphSupport.ALWAYS).
- PIECEWISE (compiled pieces replayed as graphs, attention eager) for other batches up to the largest captured token
  count, padded likewise.
- NONE above that: the compiled (or eager) forward at the exact token count.

A requested mode the attention backend (or a forward without piecewise compilation) cannot serve is downgraded once,
at construction, with one log line saying why.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from hf_accel.attention.backend import CUDAGraphSupport
from hf_accel.compilation.cuda_graph import pad_to_capture_size
from hf_accel.config import CUDAGraphMode

logger = logging.getLogger(__name__)


class RuntimeMode(str, enum.Enum):
    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"


@dataclass(frozen=True, order=True)
class BatchKey:
    """Identifies one full graph: padded token count and whether the batch is uniform decode (1 token/seq)."""

    num_tokens: int
    uniform_decode: bool


@dataclass(frozen=True)
class Dispatch:
    mode: RuntimeMode
    num_tokens: int  # padded token count to run (the exact count for NONE)
    uniform_decode: bool

    @property
    def key(self) -> BatchKey:
        return BatchKey(self.num_tokens, self.uniform_decode)


def resolve_cudagraph_mode(mode: CUDAGraphMode | str, support: CUDAGraphSupport, *, piecewise_available: bool = True,
                           has_capture_sizes: bool = True) -> tuple[CUDAGraphMode, str | None]:
    """The mode that can actually run, and why it differs from the requested one (None when it does not)."""
    requested = CUDAGraphMode(mode)
    if requested == CUDAGraphMode.NONE:
        return requested, None
    if not has_capture_sizes:
        return CUDAGraphMode.NONE, "no CUDA graph capture sizes"
    reasons: list[str] = []
    full_decode = requested.has_full and support >= CUDAGraphSupport.UNIFORM_DECODE
    full_mixed = requested == CUDAGraphMode.FULL and support >= CUDAGraphSupport.ALWAYS
    piecewise = requested.has_piecewise and piecewise_available
    if requested.has_full and support == CUDAGraphSupport.NEVER:
        reasons.append("the attention backend cannot run inside a CUDA graph")
    if requested == CUDAGraphMode.FULL and support == CUDAGraphSupport.UNIFORM_DECODE:
        reasons.append("the attention backend supports full graphs for uniform decode batches only")
    if requested.has_piecewise and not piecewise_available:
        reasons.append("piecewise graphs need the compiled forward (compile is off)")
    # what "full" cannot cover falls back to piecewise graphs when they exist
    if requested == CUDAGraphMode.FULL and not full_mixed and piecewise_available:
        piecewise = True
    if full_mixed:
        resolved = CUDAGraphMode.FULL
    elif full_decode:
        resolved = CUDAGraphMode.FULL_AND_PIECEWISE if piecewise else CUDAGraphMode.FULL_DECODE_ONLY
    else:
        resolved = CUDAGraphMode.PIECEWISE if piecewise else CUDAGraphMode.NONE
    if resolved == requested:
        return resolved, None
    return resolved, "; ".join(reasons) or "unsupported combination"


class CUDAGraphDispatcher:
    """Decides the runtime mode and padded size of each step; lists what the runner must capture at warm-up."""

    def __init__(self, mode: CUDAGraphMode | str, capture_sizes: Iterable[int], support: CUDAGraphSupport, *,
                 piecewise_available: bool = True, full_capture_sizes: Iterable[int] | None = None,
                 mixed_capture_sizes: Iterable[int] | None = None,
                 backend_name: str = "the attention backend") -> None:
        """`capture_sizes`: the token counts captured as piecewise graphs; `full_capture_sizes`: as full graphs
        (default: the same); `mixed_capture_sizes`: the piecewise ones instead, when full graphs serve uniform decode
        batches, so that piecewise graphs only meet steps holding a prefill chunk (None: `capture_sizes`)."""
        sizes = sorted({int(s) for s in capture_sizes})
        full_sizes = sorted({int(s) for s in full_capture_sizes}) if full_capture_sizes is not None else sizes
        self.requested_mode = CUDAGraphMode(mode)
        self.support = CUDAGraphSupport(support)
        self.mode, self.downgrade_reason = resolve_cudagraph_mode(
            self.requested_mode, self.support, piecewise_available=piecewise_available,
            has_capture_sizes=bool(sizes or full_sizes))
        if self.downgrade_reason is not None:
            logger.warning("cudagraph_mode %r downgraded to %r: %s (%s)", self.requested_mode.value, self.mode.value,
                           self.downgrade_reason, backend_name)
        self.full_sizes = full_sizes if self.mode.has_full else []
        if mixed_capture_sizes is not None and self.full_sizes:
            sizes = sorted({int(s) for s in mixed_capture_sizes})
        self.piecewise_sizes = sizes if self.mode.has_piecewise else []
        self.full_mixed = self.mode == CUDAGraphMode.FULL  # full graphs also for non-uniform batches

    @property
    def max_piecewise_size(self) -> int:
        return self.piecewise_sizes[-1] if self.piecewise_sizes else 0

    @property
    def max_full_size(self) -> int:
        return self.full_sizes[-1] if self.full_sizes else 0

    def full_capture_keys(self) -> list[BatchKey]:
        """Every full graph to capture: uniform decode per size, plus mixed per size in "full" mode."""
        keys = [BatchKey(s, True) for s in self.full_sizes]
        if self.full_mixed:
            keys += [BatchKey(s, False) for s in self.full_sizes]
        return keys

    def dispatch(self, num_tokens: int, uniform_decode: bool) -> Dispatch:
        """The graph for a step of `num_tokens` tokens (`uniform_decode`: every sequence has exactly one)."""
        if num_tokens < 1:
            raise ValueError(f"a step needs at least one token, got {num_tokens}")
        if self.full_sizes and (uniform_decode or self.full_mixed):
            padded = pad_to_capture_size(num_tokens, self.full_sizes)
            if padded is not None:
                return Dispatch(RuntimeMode.FULL, padded, uniform_decode)
        if self.piecewise_sizes:
            padded = pad_to_capture_size(num_tokens, self.piecewise_sizes)
            if padded is not None:
                return Dispatch(RuntimeMode.PIECEWISE, padded, uniform_decode)
        return Dispatch(RuntimeMode.NONE, num_tokens, uniform_decode)
