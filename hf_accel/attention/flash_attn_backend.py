"""flash-attn backend: FA4 (CuTe DSL), FA3 (Hopper build) or FA2, whichever is installed and runs on this GPU.

Variants, tried in this order (each with its own constraints, see `VARIANTS`):
- FA4 `flash_attn.cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q=, max_seqlen_q=, seqused_k=, page_table=, ...)`:
  paged KV on sm90 / sm100 / sm110; any block size (block size == its KV tile, 128, takes the TMA path).
- FA3 `flash_attn_interface.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=, page_table=,
  cu_seqlens_q=, max_seqlen_q=, ...)`: sm90.
- FA2 `flash_attn.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...,
  block_table=)`: sm80+, but paged blocks must be multiples of 256, so the engine's block size becomes 256.
All three read our NHD cache directly (`[num_blocks, block_size, Hkv, D]` with a block table) and take the
causal mask aligned to the end of each sequence's KV, so one varlen call serves decode, prefill and mixed steps.

The engine's block size follows `supported_block_sizes[0]`, which depends on the detected variant. The class
attribute is therefore computed on first access (a metaclass property) instead of importing flash_attn when
this module loads.

CUDA graphs (UNIFORM_DECODE): every tensor a kernel reads lives in buffers allocated once in `__init__`
(cu_seqlens_q, seqused_k / cu_seqlens_k, page table), refilled by `prepare()`. A decode step runs every row of
`seq_lens`, so graph-padded rows (seq_len 0) take part: they get one token in the null block 0.
Mixed batches are not graph-safe: max_seqlen_q is a host scalar that sizes the kernel grid at capture time.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hf_accel.attention.backend import AttentionBackend, AttentionSpec, CUDAGraphSupport, cuda_capability
from hf_accel.attention.metadata import StepMetadata, cumsum0
from hf_accel.attention.registry import module_present


@dataclass(frozen=True)
class FlashAttnVariant:
    name: str  # "FA4" | "FA3" | "FA2"
    module: str
    function: str
    required_params: tuple[str, ...]  # keywords we pass; an install lacking one is too old for us
    block_sizes: tuple[int, ...]  # first = preferred
    gpu_majors: tuple[int, ...]  # compute-capability majors whose paged-KV path exists
    install_hint: str

    def head_dim_reason(self, head_dim: int, major: int | None) -> str | None:
        """Why this variant cannot take `head_dim` on a GPU of this major version (None: it can)."""
        if head_dim % 8 != 0 or not 8 <= head_dim <= 256:
            return f"head_dim {head_dim} unsupported (needs a multiple of 8 in [8, 256])"
        if self.name == "FA4" and major in (10, 11) and not (head_dim <= 128 or head_dim == 256):
            return f"head_dim {head_dim} unsupported on sm{major}x (needs <= 128 or 256)"
        return None


FA4 = FlashAttnVariant(
    "FA4", "flash_attn.cute", "flash_attn_varlen_func",
    ("cu_seqlens_q", "max_seqlen_q", "seqused_k", "page_table", "softmax_scale", "causal", "window_size", "softcap"),
    (128, 64, 32, 16), (9, 10, 11), "pip install flash-attn-4",
)
FA3 = FlashAttnVariant(
    "FA3", "flash_attn_interface", "flash_attn_with_kvcache",
    ("cache_seqlens", "page_table", "cu_seqlens_q", "max_seqlen_q", "softmax_scale", "causal", "window_size",
     "softcap"),
    (16, 32, 64, 128), (9,), "build flash-attention/hopper",
)
FA2 = FlashAttnVariant(
    "FA2", "flash_attn", "flash_attn_varlen_func",
    ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_size",
     "softcap", "block_table"),
    (256,), (8, 9, 10, 12), "pip install flash-attn",
)
VARIANTS = (FA4, FA3, FA2)


def load_variant_function(variant: FlashAttnVariant) -> tuple[Callable[..., Any] | None, str | None]:
    """The variant's attention function, or None and why it is unusable (absent, or too old for our keywords)."""
    try:
        module = importlib.import_module(variant.module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (variant.module + ".").startswith(exc.name + "."):  # its own module is absent
            return None, f"{variant.module} not installed ({variant.install_hint})"
        return None, f"{variant.module} is installed but failed to import: {exc}"
    except Exception as exc:  # ImportError or anything else a broken install raises while it loads
        return None, f"{variant.module} is installed but failed to import ({type(exc).__name__}: {exc})"
    fn = getattr(module, variant.function, None)
    if fn is None and getattr(module, "__file__", None) is None:  # a bare namespace: flash-attn-4's flash_attn/
        return None, f"{variant.module} not installed ({variant.install_hint})"
    if fn is None:
        return None, f"{variant.module} has no {variant.function}"
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn, None  # a builtin without a signature: trust it
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        missing = [name for name in variant.required_params if name not in params]
        if missing:
            return None, f"{variant.module}.{variant.function} lacks {', '.join(missing)} (too old?)"
    return fn, None


@functools.cache
def detect_variant(capability: tuple[int, int] | None) -> tuple[FlashAttnVariant | None, tuple[str, ...]]:
    """The first variant that is installed and runs on a GPU of this capability (None: not checked), and notes
    on each variant skipped before it. Cached; tests that fake modules call `detect_variant.cache_clear()`."""
    notes = []
    for variant in VARIANTS:
        _, err = load_variant_function(variant)
        if err:
            notes.append(f"{variant.name}: {err}")
            continue
        if capability is not None and capability[0] not in variant.gpu_majors:
            majors = "/".join(f"sm{m}x" for m in variant.gpu_majors)
            notes.append(f"{variant.name}: installed, but its paged-KV path needs {majors} "
                         f"(this GPU is sm{capability[0]}{capability[1]})")
            continue
        return variant, tuple(notes)
    return None, tuple(notes)


def _default_capability() -> tuple[int, int] | None:
    try:
        if not torch.cuda.is_available():
            return None
    except Exception:
        return None
    return cuda_capability(torch.device("cuda"))


def _head_dim_reasons(variant: FlashAttnVariant, spec: AttentionSpec | None,
                      capability: tuple[int, int] | None) -> list[str]:
    if spec is None:
        return []
    reason = variant.head_dim_reason(spec.head_dim, capability[0] if capability else None)
    return [f"{variant.name}: {reason}"] if reason else []


class _VariantAwareMeta(type):
    """Makes `FlashAttnBackend.supported_block_sizes` follow the detected variant, looked up on first access."""

    @property
    def supported_block_sizes(cls) -> tuple[int, ...]:
        variant = cls.variant()
        return variant.block_sizes if variant is not None else FA4.block_sizes


@dataclass
class _StepState:
    rows: int  # batch rows of the varlen call (graph-padded decode rows included)
    total_q: int  # query rows the kernel reads
    max_query_len: int
    max_seq_len: int  # FA2's max_seqlen_k


class FlashAttnBackend(AttentionBackend, metaclass=_VariantAwareMeta):
    name = "flash_attn"
    supported_head_dims = None  # per variant and GPU: see unavailable_reasons
    supported_dtypes = (torch.float16, torch.bfloat16)
    supports_softcap = True
    supports_sliding_window = True
    requires_cuda = True
    min_compute_capability = (8, 0)  # FA2's floor; FA3 and FA4 need sm90+ (each variant's gpu_majors)
    cudagraph_support = CUDAGraphSupport.UNIFORM_DECODE

    # instances read the same value as the class (the metaclass property only serves class access)
    supported_block_sizes = property(lambda self: type(self).supported_block_sizes)  # type: ignore[assignment]

    @classmethod
    def variant(cls, device: torch.device | None = None) -> FlashAttnVariant | None:
        """The variant this backend runs on `device` (default: the current CUDA device, if any)."""
        capability = _default_capability() if device is None else cuda_capability(device)
        return detect_variant(capability)[0]

    @classmethod
    def unavailable_reasons(cls, spec: AttentionSpec | None, device: torch.device) -> list[str]:
        reasons = super().unavailable_reasons(spec, device)
        capability = cuda_capability(device) if device.type == "cuda" else None
        variant, notes = detect_variant(capability)
        if variant is None:
            return [*reasons, "no usable flash-attn variant: " + "; ".join(notes)]
        return reasons + _head_dim_reasons(variant, spec, capability)

    @classmethod
    def declaration(cls) -> dict[str, Any]:
        """The base declaration, plus the detected variant (this imports flash_attn) and the GPUs each runs on."""
        variant = cls.variant()
        return {**super().declaration(), "variant": variant.name if variant else None,
                "variant_gpus": {v.name: [f"sm{m}x" for m in v.gpu_majors] for v in VARIANTS}}

    @classmethod
    def probe_reasons(cls, spec: AttentionSpec | None, device: torch.device) -> list[str]:
        """Without importing flash_attn: some variant's module is present and has a paged path on this GPU, and
        it takes this head dim (keyword checks wait for the import, in `unavailable_reasons`)."""
        reasons = cls.declared_reasons(spec, device)
        capability = cuda_capability(device) if device.type == "cuda" else None
        present = [v for v in VARIANTS if module_present(v.module)
                   and (capability is None or capability[0] in v.gpu_majors)]
        if not present:
            return [*reasons, "no flash-attn variant installed for this GPU"]
        return reasons + _head_dim_reasons(present[0], spec, capability)

    def __init__(self, spec: AttentionSpec, device: torch.device, block_size: int, max_num_seqs: int,
                 max_num_tokens: int, max_blocks_per_seq: int) -> None:
        super().__init__(spec, device, block_size, max_num_seqs, max_num_tokens, max_blocks_per_seq)
        variant, notes = detect_variant(cuda_capability(device))
        if variant is None:
            raise RuntimeError("no usable flash-attn variant: " + "; ".join(notes))
        if block_size not in variant.block_sizes:
            raise ValueError(f"flash_attn {variant.name} needs block_size in {variant.block_sizes}, got {block_size}")
        fn, err = load_variant_function(variant)
        if fn is None:
            raise RuntimeError(err)
        self.variant_name = variant.name
        self._fn = fn
        self._captured = False  # once a graph holds our buffers, they must never move
        self._step: _StepState | None = None
        self._alloc_buffers(max_num_seqs)

    def _alloc_buffers(self, capacity: int) -> None:
        self._capacity = capacity
        # one int32 buffer, one host-to-device copy per step: [cu_seqlens_q (cap+1) | cu_seqlens_k (cap+1) | seqused_k]
        self._index_buffer = torch.zeros(3 * capacity + 2, dtype=torch.int32, device=self.device)
        self._cu_seqlens_q = self._index_buffer[: capacity + 1]
        self._cu_seqlens_k = self._index_buffer[capacity + 1 : 2 * capacity + 2]
        self._seqused_k = self._index_buffer[2 * capacity + 2 :]
        self._page_table = torch.zeros(capacity, self.max_blocks_per_seq, dtype=torch.int32, device=self.device)

    def set_cudagraph_batch_sizes(self, sizes: list[int] | tuple[int, ...] | set[int]) -> None:
        """Declare the decode batch sizes that will be captured, so the buffers never move after a capture."""
        largest = max(sizes, default=0)
        if largest > self._capacity:
            if self._captured:
                raise RuntimeError("FlashAttnBackend: declare every CUDA-graph batch size before capturing")
            self._alloc_buffers(largest)

    def prepare(self, meta: StepMetadata) -> None:
        n = meta.num_seqs
        query_lens, seq_lens = meta.host_lens()
        decode = meta.max_query_len == 1
        rows = max(n, int(meta.seq_lens.shape[0])) if decode else n  # graph-padded rows have seq_len 0
        if rows > self._capacity:
            if self._captured:
                raise RuntimeError(f"FlashAttnBackend: {rows} rows exceed the {self._capacity} that captured CUDA "
                                   "graphs were built for")
            self._alloc_buffers(rows)
        pad = rows - n
        cap = self._capacity

        # Graph-padded rows (seq_len 0) read one token of the null block 0, like any real sequence.
        used = [max(s, 1) for s in seq_lens] + [1] * pad
        cu_q = cumsum0(query_lens + [1] * pad)
        cu_k = cumsum0(used)
        host = torch.zeros(3 * cap + 2, dtype=torch.int32)
        host[: rows + 1] = torch.tensor(cu_q, dtype=torch.int32)
        host[cap + 1 : cap + 2 + rows] = torch.tensor(cu_k, dtype=torch.int32)
        host[2 * cap + 2 : 2 * cap + 2 + rows] = torch.tensor(used, dtype=torch.int32)
        self._index_buffer.copy_(host, non_blocking=True)

        width = min(meta.block_tables.shape[1], self.max_blocks_per_seq)
        self._page_table[:n, :width].copy_(meta.block_tables[:n, :width])
        if pad:
            self._page_table[n:rows].zero_()
        # Decode: a static bound keeps FA2's split heuristic the same in every replay of a captured graph.
        max_seq_len = self.max_blocks_per_seq * self.block_size if decode else max(used)
        self._step = _StepState(rows=rows, total_q=cu_q[-1], max_query_len=meta.max_query_len,
                                max_seq_len=max_seq_len)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata,
                output: torch.Tensor, scale: float, sliding_window: int, softcap: float) -> None:
        step = self._step
        if step is None:
            raise RuntimeError("FlashAttnBackend.forward() before prepare()")
        if torch.cuda.is_current_stream_capturing():
            if step.max_query_len != 1:
                raise RuntimeError("FlashAttnBackend supports CUDA graphs of uniform decode batches only "
                                   "(max_seqlen_q sizes the kernel grid at capture time)")
            self._captured = True
        rows, total_q = step.rows, step.total_q
        q = query[:total_q]
        softcap = float(softcap) if softcap > 0 else 0.0
        # transformers' window: q - k < window; flash-attn's left window: q - k <= left.
        if self.variant_name == "FA4":
            window = (int(sliding_window) - 1, 0) if sliding_window > 0 else (None, None)
            result = self._fn(
                q, k_cache, v_cache,
                cu_seqlens_q=self._cu_seqlens_q[: rows + 1],
                max_seqlen_q=step.max_query_len,
                seqused_k=self._seqused_k[:rows],
                page_table=self._page_table[:rows],
                softmax_scale=scale,
                causal=True,
                window_size=window,
                softcap=softcap,
            )
        elif self.variant_name == "FA3":
            window = (int(sliding_window) - 1, 0) if sliding_window > 0 else (-1, -1)
            result = self._fn(
                q, k_cache, v_cache,
                cache_seqlens=self._seqused_k[:rows],
                page_table=self._page_table[:rows],
                cu_seqlens_q=self._cu_seqlens_q[: rows + 1],
                max_seqlen_q=step.max_query_len,
                softmax_scale=scale,
                causal=True,
                window_size=window,
                softcap=softcap,
            )
        else:
            window = (int(sliding_window) - 1, 0) if sliding_window > 0 else (-1, -1)
            result = self._fn(
                q, k_cache, v_cache,
                cu_seqlens_q=self._cu_seqlens_q[: rows + 1],
                cu_seqlens_k=self._cu_seqlens_k[: rows + 1],
                max_seqlen_q=step.max_query_len,
                max_seqlen_k=step.max_seq_len,
                softmax_scale=scale,
                causal=True,
                window_size=window,
                softcap=softcap,
                block_table=self._page_table[:rows],
            )
        out = result[0] if isinstance(result, tuple) else result  # FA4 returns (out, lse)
        output[:total_q].copy_(out.reshape(output[:total_q].shape))
