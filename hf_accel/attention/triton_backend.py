"""The Triton backend: our own paged-attention kernels, no third-party attention library needed.

Three kernels (hf_accel/attention/kernels/): a KV write that skips padded slots, a unified varlen kernel that runs
prefill chunks, decodes and mixed batches in one launch, and a decode kernel for uniform decode steps (one program
per sequence and KV head, writing the new K/V and the output itself), which splits each sequence's keys over more
programs (plus a merge) where the batch alone would leave SMs idle. Every launch grid comes from tensor shapes and
launch constants picked from the batch shape, never from per-step lengths, and all scratch is allocated in
`__init__`, so any step can be captured in a CUDA graph and replayed with other lengths.

A mixed step (prefill chunks beside decodes) runs the unified kernel with its prefill tile: 64 query tokens per
program, so a decode row uses 1/64 of its program's rows and reads its whole context that way. With `split_mixed`
(AccelConfig.split_mixed_attention) the step's leading run of one-token rows, where the scheduler puts running
decodes, goes to the decode kernel and only the rows after it to the unified kernel: two launches, each on its own
slice of the step. That plan depends on the step's query lengths, so it is only made for steps whose attention runs
outside a captured graph (piecewise graphs are cut at attention; the engine leaves it off when mixed steps are
captured whole).

Triton itself is imported lazily (in `__init__`): this module imports without it, so the registry can report
"triton is not installed" instead of failing, and tests can switch on `TRITON_INTERPRET=1` before the kernels are
defined, which lets the class run on CPU tensors in the interpreter.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np
import torch

from hf_accel.attention.backend import AttentionBackend, AttentionSpec, CUDAGraphSupport
from hf_accel.attention.metadata import StepMetadata

if TYPE_CHECKING:
    from hf_accel.attention.kernels.common import TileConfig

DEFAULT_NUM_SMS = 132  # H100/H200; used when the device is not a CUDA GPU (interpreter runs)
# fewest leading decode rows for which a mixed step's attention is split into two launches (`split_mixed`): below
# it the decode rows' programs are a small part of the unified launch and the second launch would cost more
MIXED_SPLIT_MIN_DECODE_ROWS = 16


def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken install must not break backend listing either
        return f"triton is not installed or failed to import ({exc.__class__.__name__}: {exc}); pip install triton"
    return None


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supported_block_sizes = (16, 32, 64, 128)
    supported_head_dims = tuple(range(16, 257, 8))  # padded to a power of two in-kernel (masked)
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    supports_softcap = True
    supports_sliding_window = True
    requires_cuda = True
    cudagraph_support = CUDAGraphSupport.ALWAYS
    builds_triton_kernels = True
    splits_mixed_steps = True

    @classmethod
    def unavailable_reasons(cls, spec: AttentionSpec | None, device: torch.device) -> list[str]:
        generic_cuda = f"{cls.name} needs a CUDA GPU (device is {device.type})"
        reasons = [r for r in super().unavailable_reasons(spec, device) if r != generic_cuda]
        err = _triton_import_error()
        if err is not None:
            reasons.insert(0, err)
        if device.type != "cuda":
            reasons.insert(0, f"triton backend needs a CUDA GPU (device is {device.type}); "
                              "its kernels run on CPU only in the Triton interpreter (TRITON_INTERPRET=1, tests)")
        elif not torch.cuda.is_available():
            reasons.insert(0, "triton backend needs a CUDA GPU (torch.cuda.is_available() is False)")
        elif spec is not None and spec.dtype == torch.bfloat16:
            try:
                if torch.cuda.get_device_capability(device) < (8, 0):
                    reasons.append("bfloat16 Triton kernels need compute capability >= 8.0 (Ampere or newer)")
            except Exception:  # never raise from here
                pass
        return reasons

    def __init__(self, spec: AttentionSpec, device: torch.device, block_size: int, max_num_seqs: int,
                 max_num_tokens: int, max_blocks_per_seq: int, *, num_sms: int | None = None,
                 num_kv_splits: int | None = None) -> None:
        """`num_sms` overrides the SM count used to size split-KV decode; `num_kv_splits` forces the split count
        for every decode batch (testing and tuning; 1: the decode kernel without splitting, 0: the unified kernel).
        With `fused_split_reductions` (the base class's flag, set by the engine) split-KV decode merges its partials
        and writes the new K/V in the same launch (kernels/split_kv_decode.py); without, a KV write and a merge
        kernel run beside it. With `decode_kernel` (the base class's flag, set by the engine) every uniform decode
        step runs the decode kernel, unsplit where the batch fills the GPU; without, those run the unified kernel."""
        super().__init__(spec, device, block_size, max_num_seqs, max_num_tokens, max_blocks_per_seq)
        from hf_accel.attention.kernels import kv_write, split_kv_decode, unified_attention

        self._kv_write = kv_write
        self._split = split_kv_decode
        self._unified = unified_attention
        if num_sms is None:
            on_gpu = torch.device(device).type == "cuda"
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else DEFAULT_NUM_SMS
        self.num_sms = num_sms
        self.forced_num_splits = num_kv_splits
        # Tile overrides (None: the kernels' defaults); the benchmark's sweep and the tests set these.
        self.unified_config: TileConfig | None = None
        self.decode_config: TileConfig | None = None

        # Scratch for split-KV partials, sized for the largest (padded batch x splits) any decode batch can use.
        self._split_rows = max((s * self._num_splits_for(s) for s in range(1, max_num_seqs + 1)
                                if self._num_splits_for(s) > 1), default=0)
        h, d = spec.num_heads, spec.head_dim
        self._part_out = torch.zeros(max(self._split_rows, 1) * h * d, dtype=torch.float32, device=device)
        self._part_lse = torch.zeros(max(self._split_rows, 1) * h, dtype=torch.float32, device=device)
        # one ticket counter per (sequence, KV head); the last split of each sets its counter back to zero
        self._merge_counters = torch.zeros(max_num_seqs * spec.num_kv_heads if self._split_rows else 1,
                                           dtype=torch.int32, device=device)
        self._planned_meta: StepMetadata | None = None
        self._planned_splits = 0
        # unsplit decode launches take their sequences in this order (longest first; `_order_longest_first`),
        # written by prepare() for the step it plans: the step's sequences, then the identity. Only a launch for
        # the planned step reads it (a smaller batch could find indices past its own there); any other launch
        # takes batch order
        self._seq_order = torch.arange(max(max_num_seqs, 1), dtype=torch.int32, device=device)
        self._identity_order = np.arange(self._seq_order.numel(), dtype=np.int32)
        self._seq_order_host: torch.Tensor | None = None  # pinned staging buffer (CUDA), allocated on first use
        self._seq_order_copied: torch.cuda.Event | None = None  # the last copy out of the staging buffer
        self._seq_order_identity = True  # what the device buffer holds now
        # the planned step's split (`split_mixed`): its leading decode rows, their decode-kernel split count, and
        # the rest's query_start_loc rebased to its first row (0: no split)
        self.min_split_decode_rows = MIXED_SPLIT_MIN_DECODE_ROWS
        self._mixed_decode_rows = 0
        self._mixed_decode_splits = 0
        self._mixed_rest_starts: torch.Tensor | None = None

    def _num_splits_for(self, num_seqs: int) -> int:
        """Split count for a decode batch of `num_seqs` (padded) sequences: >= 1 the decode kernel with that many
        splits, 0 the unified kernel."""
        if self.forced_num_splits is not None:
            return max(0, self.forced_num_splits)
        cfg = self.decode_config or self._split.decode_tile_config(self.spec.head_dim,
                                                                   self.spec.num_heads // self.spec.num_kv_heads)
        splits = self._split.choose_num_splits(num_seqs, self.spec.num_kv_heads,
                                               self.max_blocks_per_seq * self.block_size, cfg.block_n, self.num_sms)
        return splits if splits > 1 or self.decode_kernel else 0

    def capture_variant(self, num_seqs: int, uniform_decode: bool) -> Hashable:
        """A uniform-decode graph's kernels follow its split count (the merge kernel's split constants); the split-KV
        scratch is allocated at construction and the path chosen in prepare(). Mixed full graphs (mode "full") pick
        their tile from the step's query lengths: each size its own."""
        return ("splits", self._num_splits_for(num_seqs)) if uniform_decode else ("size", num_seqs)

    def splits_for_step(self, meta: StepMetadata) -> int:
        """KV splits this step will use in the decode kernel (1: one program per sequence and KV head), or 0: the
        unified kernel (steps with longer queries, and decode steps the decode kernel cannot take)."""
        if meta.max_query_len != 1:
            return 0
        num_seqs = meta.seq_lens.shape[0]
        splits = self._num_splits_for(num_seqs)
        if splits > 1 and num_seqs * splits > self._split_rows:
            return 0  # a batch larger than max_num_seqs: no scratch for it, the unified kernel is always right
        if splits == 1 and meta.slot_mapping.shape[0] != num_seqs:
            return 0  # query rows that belong to no sequence (a piecewise-padded step): the unified kernel zeroes them
        return splits

    def prepare(self, meta: StepMetadata) -> None:
        """Pick the path for this step (`splits_for_step`): the decode kernel for uniform-decode batches, split
        where the batch is small, the unified kernel otherwise.

        The choice depends only on `max_query_len == 1`, the padded batch size and the query rows, so a graph
        captured for a decode batch size replays correctly for any decode batch of that size.
        """
        self._planned_meta = meta
        self._planned_splits = self.splits_for_step(meta)
        self._plan_mixed_split(meta)
        if self.longest_first and (self._planned_splits == 1 or self._mixed_decode_splits == 1):
            n = self._mixed_decode_rows or meta.num_seqs
            self._order_longest_first(meta.seq_lens_cpu[:n])

    def _plan_mixed_split(self, meta: StepMetadata) -> None:
        """With `split_mixed`: for a mixed step (longer queries beside decodes) with at least
        `min_split_decode_rows` leading one-token rows, plan the decode kernel for those rows and the unified kernel
        for the rest. Needs the host's query lengths (the runner always sends them)."""
        self._mixed_decode_rows = self._mixed_decode_splits = 0
        self._mixed_rest_starts = None
        if not self.split_mixed or meta.max_query_len == 1 or self._planned_splits != 0:
            return
        query_lens = meta.query_lens_cpu
        if len(query_lens) < meta.num_seqs:
            return
        rows = next((i for i, q in enumerate(query_lens[: meta.num_seqs]) if q != 1), meta.num_seqs)
        if rows < max(self.min_split_decode_rows, 1) or rows >= meta.num_seqs:
            return  # few decode rows, or no longer query after them (then max_query_len would be 1)
        splits = self._num_splits_for(rows)
        if splits > 1 and rows * splits > self._split_rows:
            return  # only after a tile override changed the split counts the scratch was sized for
        self._mixed_decode_rows, self._mixed_decode_splits = rows, splits
        self._mixed_rest_starts = meta.query_start_loc[rows:] - rows

    def _order_longest_first(self, seq_lens: list[int]) -> None:
        """Write the order in which the unsplit decode launch takes the sequences of `seq_lens` (the step's, or its
        leading decode rows'): longest first, padded rows last. A wide decode batch runs several waves of programs;
        launched in batch order, the longest contexts may start in the last wave and run while the rest of the GPU
        idles. Already in that order (equal lengths, as in a batch of one prompt length): the identity, written only
        if the buffer holds something else."""
        lens = np.asarray(seq_lens, dtype=np.int64)
        n = len(lens)
        identity = bool((lens[1:] <= lens[:-1]).all())  # already longest first
        if identity and self._seq_order_identity:
            return
        on_cuda = self._seq_order.device.type == "cuda"
        if on_cuda:
            if self._seq_order_host is None:
                self._seq_order_host = torch.empty(self._seq_order.numel(), dtype=torch.int32, pin_memory=True)
            elif self._seq_order_copied is not None:
                self._seq_order_copied.synchronize()  # the previous copy has left the staging buffer (long since)
        target = (self._seq_order_host if on_cuda else self._seq_order).numpy()
        target[:] = self._identity_order  # past the step's sequences (padded rows included): the identity
        if not identity:
            target[:n] = np.argsort(-lens, kind="stable")  # stable: ties keep batch order
        if on_cuda:
            self._seq_order.copy_(self._seq_order_host, non_blocking=True)
            self._seq_order_copied = torch.cuda.Event()
            self._seq_order_copied.record(torch.cuda.current_stream(self._seq_order.device))
        self._seq_order_identity = identity

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: StepMetadata) -> None:
        self._kv_write.write_kv(key, value, k_cache, v_cache, meta.slot_mapping, self.use_pdl)

    def write_kv_and_forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata, output: torch.Tensor,
                             scale: float, sliding_window: int, softcap: float) -> None:
        """A decode-kernel launch takes its rows' new K/V and writes them itself when it is unsplit or its merge is
        fused (no KV write kernel); every other row's K/V are written first, then the step attends. In a split
        mixed step that means the rows after the decode rows are written here and the decode rows by their launch."""
        splits = self._splits(meta)
        d = self._split_decode_rows(meta)
        if d:
            self._kv_write.write_kv(key[d:], value[d:], k_cache, v_cache, meta.slot_mapping[d:], self.use_pdl)
            new_kv = (key[:d], value[:d], meta.slot_mapping[:d])
        elif splits == 0:
            self.write_kv(key, value, k_cache, v_cache, meta)
            new_kv = None
        else:
            new_kv = (key, value, meta.slot_mapping)
        self._attend(query, k_cache, v_cache, meta, output, scale, sliding_window, softcap, splits, new_kv)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata,
                output: torch.Tensor, scale: float, sliding_window: int, softcap: float) -> None:
        """Writes every row of `output`: rows of padded sequences or past the last sequence become zeros."""
        self._attend(query, k_cache, v_cache, meta, output, scale, sliding_window, softcap, self._splits(meta), None)

    def _splits(self, meta: StepMetadata) -> int:
        return self._planned_splits if self._planned_meta is meta else self.splits_for_step(meta)

    def _split_decode_rows(self, meta: StepMetadata) -> int:
        """Leading decode rows of a split mixed step (`_plan_mixed_split`); 0 for any step prepare() did not plan."""
        return self._mixed_decode_rows if self._planned_meta is meta else 0

    def _attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata,
                output: torch.Tensor, scale: float, sliding_window: int, softcap: float, splits: int,
                new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
        """The step's launch, or for a split mixed step two: its leading decode rows through the decode kernel
        (`new_kv`: those rows' K/V), every row after them through the unified kernel, each on its own slices."""
        d = self._split_decode_rows(meta)
        starts, lens, tables = meta.query_start_loc, meta.seq_lens, meta.block_tables
        if not d:
            self._launch(query, k_cache, v_cache, output, starts, lens, tables, scale, sliding_window, softcap,
                         splits, meta.max_query_len, new_kv, ordered=self._planned_meta is meta)
            return
        self._launch(query[:d], k_cache, v_cache, output[:d], starts[: d + 1], lens[:d], tables[:d], scale,
                     sliding_window, softcap, self._mixed_decode_splits, 1, new_kv, ordered=True)
        self._launch(query[d:], k_cache, v_cache, output[d:], self._mixed_rest_starts, lens[d:], tables[d:], scale,
                     sliding_window, softcap, 0, meta.max_query_len, None, ordered=False)

    def _launch(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, output: torch.Tensor,
                starts: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                sliding_window: int, softcap: float, splits: int, max_query_len: int,
                new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, ordered: bool) -> None:
        """One launch over these rows: the decode kernel with `splits` (`new_kv`: their new K/V, written by it; an
        unsplit launch takes the longest-first order where `ordered`), or with `splits` 0 the unified kernel (its
        tile picked by `max_query_len`; `new_kv` written first)."""
        if splits >= 1:
            self._split.split_kv_decode(
                query, k_cache, v_cache, output, starts, seq_lens, block_tables, scale, sliding_window, softcap,
                splits, self._part_out, self._part_lse, self.decode_config, self.use_pdl,
                self._merge_counters if self.fused_split_reductions else None, new_kv,
                self._seq_order if splits == 1 and self.longest_first and ordered else None,
            )
            return
        if new_kv is not None:
            self._kv_write.write_kv(*new_kv[:2], k_cache, v_cache, new_kv[2], self.use_pdl)
        self._unified.unified_attention(
            query, k_cache, v_cache, output, starts, seq_lens, block_tables, scale, sliding_window, softcap,
            max_query_len, self.unified_config, self.use_pdl,
        )
