"""FlashInfer backend (flashinfer-python >= 0.6.12): paged decode and prefill kernels over our NHD cache.

How it maps onto FlashInfer:
- FlashInfer splits attention into a host-side `plan()` (work partitioning, index copies) and a device-side
  `run()`. `plan()` runs in `prepare()`, once per step and outside any graph capture; `forward()` only calls `run()`.
- `plan()` fixes sm_scale, window and softcap, but layers may differ (gemma2 alternates sliding and full layers).
  So each distinct (window, softcap, scale) gets its own wrapper, planned once per step. A combination first seen
  in `forward()` is planned there (eagerly) and in every later `prepare()`; the runner's warm-up forward meets them
  all before any graph is captured.
- Decode steps (max_query_len == 1) use `BatchDecodeWithPagedKVCacheWrapper`; prefill and mixed steps use
  `BatchPrefillWithPagedKVCacheWrapper` with causal=True, which aligns each query block with the end of its KV,
  so queries attend to the cached prefix as well.
- The KV cache is passed as the (k_cache, v_cache) tuple, each [num_blocks, block_size, Hkv, D] ("NHD").

CUDA graphs (UNIFORM_DECODE): a captured decode graph bakes in the wrapper's device buffers, so each captured batch
size B has its own wrapper built with use_cuda_graph=True over index buffers we own (indptr, indices,
last_page_len). The runner declares the sizes with `set_cudagraph_batch_sizes()`; a uniform-decode step whose
metadata has B rows (`seq_lens`/`block_tables` of B rows, the padded ones with seq_len 0, as
`ModelRunner.upload(num_seqs_padded=B)` builds them) is then planned on that wrapper, so replaying the graph after
`prepare()` sees the new plan. Padded rows get one page, the null block 0,
with one token; their output rows hold garbage that nobody reads.

Memory: one float workspace shared by all wrappers (kernels run one at a time on one stream) and one int
workspace per (window, softcap, scale): wrappers of one combination are never used in the same step, and each
step re-plans the one it uses, so they can share it.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hf_accel.attention.backend import AttentionBackend, AttentionSpec, CUDAGraphSupport
from hf_accel.attention.metadata import StepMetadata, cumsum0
from hf_accel.attention.registry import module_present

MIN_VERSION = (0, 6, 12)
FLOAT_WORKSPACE_BYTES = 256 * 1024 * 1024  # split-KV partial results; FlashInfer recommends >= 128 MiB
INT_WORKSPACE_BYTES = 8 * 1024 * 1024  # the size FlashInfer's wrappers allocate for themselves

# (window_left, logits_soft_cap, sm_scale): what one plan() fixes. window_left -1 and softcap 0.0 mean "off".
PlanKey = tuple[int, float, float]


def _version_tuple(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        return ()
    return tuple(int(part) for part in match.groups(default="0"))


def import_flashinfer() -> tuple[Any | None, str | None]:
    """The flashinfer module, or None and why it cannot be used."""
    try:
        module = importlib.import_module("flashinfer")
    except ModuleNotFoundError as exc:
        if exc.name != "flashinfer":  # flashinfer is there, one of its own imports is not
            return None, f"flashinfer is installed but failed to import: {exc}"
        return None, "flashinfer is not installed (pip install 'flashinfer-python>=0.6.12')"
    except Exception as exc:  # ImportError or anything else a broken install raises while it loads
        return None, f"flashinfer is installed but failed to import ({type(exc).__name__}: {exc})"
    version = str(getattr(module, "__version__", "0"))
    if _version_tuple(version) < MIN_VERSION:
        wanted = ".".join(map(str, MIN_VERSION))
        return None, f"flashinfer {version} is too old (need >= {wanted})"
    return module, None


@dataclass
class _StepPlan:
    """Everything plan() needs for this step, kept so a combination first met in forward() can be planned late."""

    decode: bool
    rows: int  # batch rows planned: num_seqs, or the captured batch size B for a graph-padded decode step
    graph_size: int | None  # B when the step runs on a CUDA-graph decode wrapper
    num_tokens: int
    page_size: int
    qo_indptr: torch.Tensor | None  # host int32 [rows + 1], prefill/mixed only
    kv_indptr: torch.Tensor  # host int32 [rows + 1]
    kv_indices: torch.Tensor  # device int32 [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # host int32 [rows]


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    supported_block_sizes = (16, 32, 64, 128)
    supported_head_dims = (64, 128, 256)
    supported_dtypes = (torch.float16, torch.bfloat16)
    supports_softcap = True
    supports_sliding_window = True
    requires_cuda = True
    min_compute_capability = (8, 0)
    cudagraph_support = CUDAGraphSupport.UNIFORM_DECODE

    @classmethod
    def unavailable_reasons(cls, spec: AttentionSpec | None, device: torch.device) -> list[str]:
        reasons = super().unavailable_reasons(spec, device)
        _, err = import_flashinfer()
        if err:
            reasons.append(err)
        return reasons

    builds_on_first_use = True  # its kernels are JIT-compiled per head dim / dtype / variant on each machine

    @classmethod
    def library_version(cls) -> str | None:
        from hf_accel.compilation.cache import _package_version

        return _package_version("flashinfer-python")

    @classmethod
    def library_cache_dir(cls) -> str | None:
        # flashinfer.jit.env: FLASHINFER_WORKSPACE_BASE (default: the home directory) / .cache / flashinfer
        base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or os.path.expanduser("~")
        return os.path.join(base, ".cache", "flashinfer")

    @classmethod
    def has_prebuilt_kernels(cls) -> bool:
        return module_present("flashinfer_jit_cache")  # the ahead-of-time kernel package

    @classmethod
    def probe_reasons(cls, spec: AttentionSpec | None, device: torch.device) -> list[str]:
        reasons = cls.declared_reasons(spec, device)
        if not module_present("flashinfer"):
            reasons.append("flashinfer is not installed")
        return reasons

    def __init__(self, spec: AttentionSpec, device: torch.device, block_size: int, max_num_seqs: int,
                 max_num_tokens: int, max_blocks_per_seq: int) -> None:
        super().__init__(spec, device, block_size, max_num_seqs, max_num_tokens, max_blocks_per_seq)
        flashinfer, err = import_flashinfer()
        if flashinfer is None:
            raise RuntimeError(err)
        self._fi = flashinfer
        self._float_workspace = torch.zeros(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # The CUDA-core decode kernel only handles GQA group sizes 1-4 and 8; tensor cores handle any, and win for
        # large groups anyway.
        self._decode_tensor_cores = spec.num_heads // spec.num_kv_heads > 4
        self._plan_keys: list[PlanKey] = []  # every combination seen so far, planned in each prepare()
        self._int_workspaces: dict[PlanKey, torch.Tensor] = {}
        self._prefill_wrappers: dict[PlanKey, Any] = {}
        self._decode_wrappers: dict[PlanKey, Any] = {}
        self._graph_wrappers: dict[tuple[int, PlanKey], Any] = {}
        self._graph_sizes: set[int] = set()
        self._alloc_graph_buffers(max_num_seqs)
        self._step: _StepPlan | None = None
        self._planned: dict[PlanKey, Any] = {}  # this step's wrapper per combination

    # ---- CUDA graphs -------------------------------------------------------------------------------------------

    def _alloc_graph_buffers(self, capacity: int) -> None:
        """Index buffers shared by all graph wrappers (only one batch size runs per step; contents match)."""
        self._graph_capacity = capacity
        self._graph_kv_indptr = torch.zeros(capacity + 1, dtype=torch.int32, device=self.device)
        self._graph_kv_indices = torch.zeros(capacity * self.max_blocks_per_seq, dtype=torch.int32,
                                             device=self.device)
        self._graph_kv_last_page_len = torch.ones(capacity, dtype=torch.int32, device=self.device)

    def set_cudagraph_batch_sizes(self, sizes: list[int] | tuple[int, ...] | set[int]) -> None:
        """Declare the decode batch sizes that will be captured; call before capturing any of them."""
        sizes = sorted({int(s) for s in sizes})
        if sizes and sizes[-1] > self._graph_capacity:
            if self._graph_wrappers:
                raise RuntimeError(
                    "FlashInferBackend: declare every CUDA-graph batch size before capturing (buffer growth would "
                    "move addresses that captured graphs hold)"
                )
            self._alloc_graph_buffers(sizes[-1])
        self._graph_sizes.update(sizes)

    def get_decode_wrapper_for(self, batch_size: int, sliding_window: int = 0, softcap: float = 0.0,
                               scale: float | None = None) -> Any:
        """The CUDA-graph decode wrapper of one captured batch size and layer combination (created on demand).

        `prepare()` picks it by itself for a decode step with `batch_size` rows; this accessor is for runners that
        want to create wrappers up front or inspect them.
        """
        if batch_size not in self._graph_sizes:
            self.set_cudagraph_batch_sizes([batch_size])
        key = self._plan_key(sliding_window, softcap, self.spec.head_dim**-0.5 if scale is None else scale)
        self._register_key(key)
        return self._graph_wrapper(batch_size, key)

    # ---- wrappers ----------------------------------------------------------------------------------------------

    @staticmethod
    def _plan_key(sliding_window: int, softcap: float, scale: float) -> PlanKey:
        # transformers' window: q - k < window; FlashInfer's window_left: q - k <= window_left.
        window_left = int(sliding_window) - 1 if sliding_window > 0 else -1
        return window_left, float(softcap) if softcap > 0 else 0.0, float(scale)

    def _register_key(self, key: PlanKey) -> None:
        if key not in self._int_workspaces:
            self._int_workspaces[key] = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            self._plan_keys.append(key)

    def _share_workspaces(self, wrapper: Any, key: PlanKey) -> Any:
        wrapper.reset_workspace_buffer(self._float_workspace, self._int_workspaces[key])
        return wrapper

    def _prefill_wrapper(self, key: PlanKey) -> Any:
        wrapper = self._prefill_wrappers.get(key)
        if wrapper is None:
            wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._float_workspace, kv_layout="NHD")
            wrapper = self._prefill_wrappers[key] = self._share_workspaces(wrapper, key)
        return wrapper

    def _decode_wrapper(self, key: PlanKey) -> Any:
        wrapper = self._decode_wrappers.get(key)
        if wrapper is None:
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._float_workspace, kv_layout="NHD", use_tensor_cores=self._decode_tensor_cores
            )
            wrapper = self._decode_wrappers[key] = self._share_workspaces(wrapper, key)
        return wrapper

    def _graph_wrapper(self, batch_size: int, key: PlanKey) -> Any:
        wrapper = self._graph_wrappers.get((batch_size, key))
        if wrapper is None:
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._float_workspace,
                kv_layout="NHD",
                use_cuda_graph=True,
                use_tensor_cores=self._decode_tensor_cores,
                paged_kv_indptr_buffer=self._graph_kv_indptr[: batch_size + 1],
                paged_kv_indices_buffer=self._graph_kv_indices,
                paged_kv_last_page_len_buffer=self._graph_kv_last_page_len[:batch_size],
            )
            wrapper = self._graph_wrappers[(batch_size, key)] = self._share_workspaces(wrapper, key)
        return wrapper

    # ---- per step ----------------------------------------------------------------------------------------------

    def _gather_pages(self, block_tables: torch.Tensor, pages: list[int]) -> torch.Tensor:
        """Concatenate each sequence's first `pages[i]` block-table entries, on the device, without a sync.

        The flat indices are built with numpy, not torch CPU ops: torch's CPU repeat_interleave opens an OpenMP
        region over every core even for a few elements, which took ~16 ms per step when other processes kept the
        cores busy (measured on the H200 host: flashinfer W2 fell from 26k to 4k tok/s)."""
        counts = np.asarray(pages, dtype=np.int64)
        width = block_tables.shape[1]
        row_base = np.repeat(np.arange(len(pages), dtype=np.int64) * width - (np.cumsum(counts) - counts), counts)
        flat = torch.from_numpy(np.arange(int(counts.sum()), dtype=np.int64) + row_base)
        return block_tables.reshape(-1)[flat.to(self.device, non_blocking=True)].to(torch.int32)

    def prepare(self, meta: StepMetadata) -> None:
        n = meta.num_seqs
        page_size = meta.block_size
        query_lens, seq_lens = meta.host_lens()
        decode = meta.max_query_len == 1
        padded_rows = int(meta.seq_lens.shape[0])  # the runner pads graph batches' rows with seq_len 0
        graph_size = padded_rows if decode and padded_rows >= n and padded_rows in self._graph_sizes else None
        rows = graph_size or n
        pad = rows - n

        # Rows with seq_len 0 (graph padding) get one page, the null block 0 (their block-table entries point at
        # it), holding one token: every kernel sees a well-formed sequence and nobody reads the result.
        pages = [max(1, -(-s // page_size)) for s in seq_lens]
        last_page_len = [s - (p - 1) * page_size if s > 0 else 1 for s, p in zip(seq_lens, pages, strict=True)]
        kv_indices = self._gather_pages(meta.block_tables, pages)
        if pad:
            kv_indices = torch.cat([kv_indices, kv_indices.new_zeros(pad)])

        self._step = _StepPlan(
            decode=decode,
            rows=rows,
            graph_size=graph_size,
            num_tokens=meta.num_tokens,
            page_size=page_size,
            qo_indptr=None if decode else torch.tensor(cumsum0(query_lens), dtype=torch.int32),
            kv_indptr=torch.tensor(cumsum0(pages + [1] * pad), dtype=torch.int32),
            kv_indices=kv_indices,
            kv_last_page_len=torch.tensor(last_page_len + [1] * pad, dtype=torch.int32),
        )
        self._planned = {}
        for key in self._plan_keys:
            self._plan(key)

    def _plan(self, key: PlanKey) -> Any:
        step = self._step
        if step is None:
            raise RuntimeError("FlashInferBackend.forward() before prepare()")
        window_left, softcap, scale = key
        spec = self.spec
        options = dict(
            pos_encoding_mode="NONE",
            window_left=window_left,
            logits_soft_cap=softcap if softcap > 0 else None,
            q_data_type=spec.dtype,
            kv_data_type=spec.dtype,
            sm_scale=scale,
        )
        if step.decode:
            wrapper = self._graph_wrapper(step.graph_size, key) if step.graph_size else self._decode_wrapper(key)
            wrapper.plan(step.kv_indptr, step.kv_indices, step.kv_last_page_len, spec.num_heads, spec.num_kv_heads,
                         spec.head_dim, step.page_size, **options)
        else:
            wrapper = self._prefill_wrapper(key)
            wrapper.plan(step.qo_indptr, step.kv_indptr, step.kv_indices, step.kv_last_page_len, spec.num_heads,
                         spec.num_kv_heads, spec.head_dim, step.page_size, causal=True, **options)
        self._planned[key] = wrapper
        return wrapper

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata,
                output: torch.Tensor, scale: float, sliding_window: int, softcap: float) -> None:
        step = self._step
        if step is None:
            raise RuntimeError("FlashInferBackend.forward() before prepare()")
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and step.graph_size is None:
            raise RuntimeError(
                "FlashInferBackend: CUDA graph capture of a step that is not a uniform decode batch of a declared "
                "size; call set_cudagraph_batch_sizes(sizes) before capturing (the wrapper of an undeclared size "
                "reallocates its index buffers at every plan)"
            )
        key = self._plan_key(sliding_window, softcap, scale)
        wrapper = self._planned.get(key)
        if wrapper is None:
            if capturing:
                raise RuntimeError(
                    f"FlashInferBackend: layer parameters {key} (window_left, softcap, scale) first seen during CUDA "
                    "graph capture; plan() cannot run there. Run one eager forward before capturing."
                )
            self._register_key(key)
            wrapper = self._plan(key)
        rows = step.rows if step.decode else step.num_tokens
        wrapper.run(query[:rows], (k_cache, v_cache), out=output[:rows])
