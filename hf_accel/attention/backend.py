"""The attention backend interface: what each backend declares and the two calls the engine makes.

Split the vLLM way: `prepare()` runs once per step on the metadata (the "metadata builder"), `forward()` runs once
per layer inside the opaque attention op (the "implementation"). Every backend reads and writes the same paged KV
layout (`KVLayout.NHD`, see metadata.py), so the engine's block size is the only thing that follows the backend.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hf_accel.attention.metadata import StepMetadata


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, or None when it cannot be queried (no GPU, CPU-only torch)."""
    if device.type != "cuda":
        return None
    try:
        major, minor = torch.cuda.get_device_capability(device)
    except Exception:
        return None
    return int(major), int(minor)


class KVLayout(str, enum.Enum):
    """How a backend reads the paged KV cache. The engine allocates this one layout; a backend declaring another
    is refused at engine construction."""

    NHD = "NHD"  # K and V apart, each [num_blocks, block_size, num_kv_heads, head_dim], found through a block table


class CUDAGraphSupport(enum.IntEnum):
    """How much of a CUDA graph a backend can live inside."""

    NEVER = 0  # attention must run eagerly (piecewise graphs only)
    UNIFORM_DECODE = 1  # full graphs for decode-only batches
    ALWAYS = 2  # full graphs for any batch


@dataclass(frozen=True)
class AttentionSpec:
    """The attention shape of one model, as the backends need it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    uses_softcap: bool = False
    uses_sliding_window: bool = False


class AttentionBackend:
    name: ClassVar[str] = "base"
    supported_block_sizes: ClassVar[tuple[int, ...]] = (16,)  # first entry is the preferred one
    supported_head_dims: ClassVar[tuple[int, ...] | None] = None  # None: any
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32)
    supports_softcap: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = True
    requires_cuda: ClassVar[bool] = False
    min_compute_capability: ClassVar[tuple[int, int] | None] = None  # oldest CUDA GPU it runs on (None: any)
    kv_layout: ClassVar[KVLayout] = KVLayout.NHD
    cudagraph_support: ClassVar[CUDAGraphSupport] = CUDAGraphSupport.NEVER
    # its kernels are our Triton ones, launched through ops.triton_build.launcher: a first step can be built
    # ahead, compile-only, in parallel (the autotune's first calls)
    builds_triton_kernels: ClassVar[bool] = False
    # it can run a mixed step's leading decode rows through a decode kernel of its own (`split_mixed`)
    splits_mixed_steps: ClassVar[bool] = False

    def capture_variant(self, num_seqs: int, uniform_decode: bool) -> Hashable:
        """What, besides the padded size's warm-up class, picks this backend's kernels and state in a full CUDA graph
        of `num_seqs` (padded) sequences: full-graph sizes with equal variants share one warm-up run
        (engine/runner.capture_warmup_class). The default makes every size its own: a library's first run at a batch
        shape may set things up lazily (plans, workspaces), which must happen outside the capture. A backend whose
        per-shape state is all built at construction or by `prepare`, and whose kernels only compile on first use,
        returns what selects its kernel variants."""
        return ("size", num_seqs, uniform_decode)

    @classmethod
    def unavailable_reasons(cls, spec: AttentionSpec | None, device: torch.device) -> list[str]:
        """Why this backend cannot run this model here; empty when it can. Never raises. A backend with a library or
        a GPU check of its own adds those to `declared_reasons`."""
        return cls.declared_reasons(spec, device)

    @classmethod
    def declared_reasons(cls, spec: AttentionSpec | None, device: torch.device) -> list[str]:
        """The reasons that follow from the class declarations alone (device, GPU, head dim, dtype, soft-cap,
        window): no import, no library call."""
        reasons = []
        if cls.requires_cuda and device.type != "cuda":
            reasons.append(f"{cls.name} needs a CUDA GPU (device is {device.type})")
        if device.type == "cuda" and cls.min_compute_capability is not None:
            capability = cuda_capability(device)
            oldest = cls.min_compute_capability
            if capability is None:
                reasons.append("cannot query the GPU's compute capability")
            elif capability < oldest:
                reasons.append(f"{cls.name} needs an sm{oldest[0]}{oldest[1]}+ GPU "
                               f"(this one is sm{capability[0]}{capability[1]})")
        if spec is not None:
            if cls.supported_head_dims is not None and spec.head_dim not in cls.supported_head_dims:
                reasons.append(f"head_dim {spec.head_dim} not in supported {cls.supported_head_dims}")
            if spec.dtype not in cls.supported_dtypes:
                reasons.append(f"dtype {spec.dtype} not supported (supports {cls.supported_dtypes})")
            if spec.uses_softcap and not cls.supports_softcap:
                reasons.append("model uses attention logit softcapping, which this backend does not support")
            if spec.uses_sliding_window and not cls.supports_sliding_window:
                reasons.append("model uses sliding-window attention, which this backend does not support")
        return reasons

    @classmethod
    def declaration(cls) -> dict[str, Any]:
        """What this backend declares it can run (the inputs of `unavailable_reasons`), for logs and reports."""
        return {
            "kv_layout": cls.kv_layout.value, "block_sizes": list(cls.supported_block_sizes),
            "head_dims": None if cls.supported_head_dims is None else list(cls.supported_head_dims),
            "dtypes": [str(d).removeprefix("torch.") for d in cls.supported_dtypes],
            "requires_cuda": cls.requires_cuda,
            "min_compute_capability": None if cls.min_compute_capability is None
            else "sm{}{}".format(*cls.min_compute_capability),
            "softcap": cls.supports_softcap, "sliding_window": cls.supports_sliding_window,
            "cudagraph_support": cls.cudagraph_support.name,
        }

    # -- first-use builds (attention/prebuild.py): a library that JIT-compiles its kernels per shape on first use
    builds_on_first_use: ClassVar[bool] = False

    @classmethod
    def library_version(cls) -> str | None:
        """Version of the library whose kernels are built on first use (part of the build marker's key)."""
        return None

    @classmethod
    def library_cache_dir(cls) -> str | None:
        """Where that library keeps what it built (a marker counts only while this directory exists)."""
        return None

    @classmethod
    def has_prebuilt_kernels(cls) -> bool:
        """The library's ahead-of-time kernels are installed (nothing to build on first use)."""
        return False

    @classmethod
    def build_marker(cls, spec: AttentionSpec, device: torch.device, cache_dir: str | None = None):
        """The marker file saying this backend's kernels are built here for `spec` (None: no first-use build, or
        `cache_dir=""`: nothing is written to disk, so no marker, no background build, and "auto" never picks a
        library whose first use would build)."""
        cache = cls.library_cache_dir()
        if not cls.builds_on_first_use or cache is None or (cache_dir is not None and str(cache_dir) == ""):
            return None
        from hf_accel.attention import prebuild

        return prebuild.marker_path(cls.name, spec, device, cls.library_version(), cache, cache_dir)

    @classmethod
    def pending_build(cls, spec: AttentionSpec, device: torch.device, cache_dir: str | None = None) -> str | None:
        """Why this backend's first use here would stall on a long JIT build; None when its kernels are ready
        (built before, per the marker; prebuilt), or when it builds nothing worth avoiding. Imports no library."""
        if not cls.builds_on_first_use or cls.has_prebuilt_kernels() or cls.library_cache_dir() is None:
            return None
        if cache_dir is not None and str(cache_dir) == "":
            return (f"{cls.name} would JIT-compile its kernels on first use, and with the on-disk cache disabled "
                    "(compile_cache_dir='') hf_accel cannot tell whether it did before")
        from hf_accel.attention import prebuild

        if prebuild.is_built(cls.build_marker(spec, device, cache_dir)):
            return None
        return (f"{cls.name} would JIT-compile its kernels for this attention shape on first use here "
                f"(about 75-90 s per head dim on an H200)")

    @classmethod
    def probe_reasons(cls, spec: AttentionSpec | None, device: torch.device) -> list[str]:
        """`unavailable_reasons` without importing an optional library (a backend whose check imports one overrides
        this with a cheaper look: library present on disk). Used to key a remembered autotune answer."""
        return cls.unavailable_reasons(spec, device)

    def __init__(self, spec: AttentionSpec, device: torch.device, block_size: int, max_num_seqs: int,
                 max_num_tokens: int, max_blocks_per_seq: int) -> None:
        self.spec = spec
        self.device = device
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        # launch our own kernels with programmatic dependent launch (hf_accel.ops.pdl); the engine sets it
        self.use_pdl = False
        # kernels that split work reduce it in the same launch where they can (AccelConfig.fused_split_reductions;
        # the engine sets it)
        self.fused_split_reductions = True
        # uniform decode steps of any batch size run a decode-only kernel where the backend has one
        # (AccelConfig.decode_attention_kernel; the engine sets it)
        self.decode_kernel = True
        # a wide decode batch's attention programs start with the longest contexts, where the backend can order
        # them (AccelConfig.decode_longest_first; the engine sets it)
        self.longest_first = True
        # a mixed step's leading decode rows run the decode kernel and the rest the prefill-shaped kernel, where the
        # backend has both and the step's attention runs outside a full CUDA graph (AccelConfig.
        # split_mixed_attention; the engine sets it, and leaves it off when mixed steps are captured whole)
        self.split_mixed = False

    def prepare(self, meta: StepMetadata) -> None:
        """Once per step, before the forward (and outside any CUDA graph capture): build backend state."""

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: StepMetadata) -> None:
        """Write this step's K/V rows `[T, Hkv, D]` into the paged cache at `meta.slot_mapping` (skipping -1)."""
        # -1 (padding) lands in the null block 0, which nobody reads
        slots = meta.slot_mapping[: key.shape[0]].clamp(min=0)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata,
                output: torch.Tensor, scale: float, sliding_window: int, softcap: float) -> None:
        """Attention for query `[T, H, D]` into the preallocated `output` `[T, H, D]`.

        `sliding_window <= 0` means no window; `softcap <= 0` means no softcapping.
        """
        raise NotImplementedError

    def write_kv_and_forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata, output: torch.Tensor,
                             scale: float, sliding_window: int, softcap: float) -> None:
        """One layer of the step, what the attention op runs: `write_kv`, then `forward`. A backend whose kernels
        can write the new K/V themselves overrides this (the Triton backend's fused decode launch)."""
        self.write_kv(key, value, k_cache, v_cache, meta)
        self.forward(query, k_cache, v_cache, meta, output, scale, sliding_window, softcap)
