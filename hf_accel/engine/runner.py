"""The model runner: packs one scheduled step into `[1, T]` tensors, runs the forward, returns sampled logits.

Host-side packing is numpy per sequence (no Python loop over tokens); one host-to-device copy per buffer fills
persistent device buffers, of which StepMetadata holds views, so a captured CUDA graph sees the same addresses on
every replay. Logits are computed only for the last token of each sequence that samples this step, through the
family's own `*ForCausalLM.forward(logits_to_keep=<index tensor>)`, so final-logit softcapping and scaling stay
the family's own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hf_accel.attention.backend import AttentionBackend
from hf_accel.attention.context import ForwardContext, forward_context
from hf_accel.attention.metadata import StepMetadata
from hf_accel.engine.request import PENDING_TOKEN, Request
from hf_accel.engine.scheduler import ScheduledStep

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """Host-side packing of one step."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray  # [B, blocks] (only as wide as this step needs)
    logits_indices: np.ndarray
    sampled: list[Request]
    max_query_len: int
    max_seq_len: int
    # tokens still on the device (asynchronous scheduling): their rows in input_ids, and the requests they belong to
    pending_rows: list[int] = field(default_factory=list)
    pending_reqs: list[Request] = field(default_factory=list)
    # filled by execute(): the previous step's sampled tokens on the device, and the row of each pending token there
    prev_tokens: torch.Tensor | None = None
    pending_src: list[int] = field(default_factory=list)


def engine_forward(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                   logits_indices: torch.Tensor) -> torch.Tensor:
    """The family's `*ForCausalLM.forward` on packed `[1, T]` input, inside an engine step: logits `[1, N, V]`.

    The all-ones attention mask only keeps transformers from inferring packed sequences from the position ids (a
    host sync per forward); the mask function registered under our name returns no mask inside a step anyway.
    """
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    return model(input_ids=input_ids, position_ids=positions, attention_mask=mask, logits_to_keep=logits_indices,
                 use_cache=False).logits


# weights run by plain kernels; integer buffers of quantized linears (GPTQ / AWQ `qweight`, `qzeros`: int32) and
# 8-bit float buffers mark a quantized model, int64 buffers (position ids) and bool masks do not
_PLAIN_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_QUANTIZED_BUFFER_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2)


def capture_warmup_class(model: torch.nn.Module, *, small_m_gemm: bool,
                         tensor_parallel: bool) -> Callable[[int], Hashable]:
    """The warm-up class of a padded capture size (compilation.piecewise / cuda_graph capture with `warmup_key`).

    Sizes that run the same kernels with the same specializations share one warm-up: the small-M linear's M bucket,
    and Triton's integer specializations (1, multiples of 16, others). Every size is its own class where that does
    not hold or is not safe: quantized weights (tensor subclasses, bitsandbytes parameters, 8-bit floats, integer
    buffers such as GPTQ's) run library kernels that may set state up per shape on first use; on a tensor-parallel
    rank, a size retried after a failed capture (warmed up then) on one rank alone would run collectives its peers
    do not; and HF_ACCEL_CAPTURE_WARMUP=every asks for it (an A/B, or a suspected capture bug).
    """
    from hf_accel.ops.linear import m_bucket

    plain_weights = (all(type(p) is torch.nn.Parameter and p.dtype in _PLAIN_WEIGHT_DTYPES for p in model.parameters())
                     and not any(b.dtype in _QUANTIZED_BUFFER_DTYPES for b in model.buffers()))
    if not plain_weights or tensor_parallel or os.environ.get("HF_ACCEL_CAPTURE_WARMUP") == "every":
        return lambda t: ("size", t)
    return lambda t: (m_bucket(t) if small_m_gemm else None, t == 1, t % 16 == 0)


SPLIT_K_COUNTERS = 1 << 15
# tokens of the step the forward is first compiled with. Inductor sizes its generated kernels' launch heuristics by
# this step's token count (the hint of the dynamic dimension) and autotunes each kernel once, on it, so every later
# step shape runs the configurations chosen here. Alone on the H200 (examples/bench_qk_rope.py, 2026-12-06), Qwen3's
# q/k norm + RoPE kernels compiled at 16 tokens took 5.6 us at 256 rows and 111 us at 8,192; compiled at 256, 3.4
# and 48.7. Through the engine the difference is within run-to-run noise (H100, 2026-12-07, qwen3-0.6b, 256 prompts
# of 512 -> 128 tokens, processes alternated 16/256/256/16: medians 1,020.6 and 1,014.6 ms at 16, 1,007.7 and
# 1,018.0 at 256), and a start from a warm cache took 31 s at 256 against 13 s at 16, so 16 stays.
# HF_ACCEL_COMPILE_TOKENS overrides it (part of the compile cache's key).
COMPILE_EXAMPLE_TOKENS = 16


def compile_example_tokens(max_num_tokens: int) -> int:
    """The first compiled step's token count: COMPILE_EXAMPLE_TOKENS (or HF_ACCEL_COMPILE_TOKENS), at least 3 (the
    compiler needs the token count and the number of sequences to differ, both at least 2: a prefill sequence of 2
    and a decode row), at most the step buffers' size."""
    text = os.environ.get("HF_ACCEL_COMPILE_TOKENS", "").strip()
    try:
        wanted = int(text) if text else COMPILE_EXAMPLE_TOKENS
    except ValueError:
        raise ValueError(f"HF_ACCEL_COMPILE_TOKENS={text!r}: expected a whole number of tokens") from None
    return max(1, min(max(3, wanted), max_num_tokens))


class HostBlockTable:
    """The host's block table, kept from step to step so that packing a step writes only what changed.

    Row i mirrors the block list of the request packed in row i the last time (the list object itself, and how many
    of its entries the row holds; the rest of the row is zero). A request's `block_ids` list only ever grows by
    appending, or is replaced by a new list (a release, a preemption, a reset; see `Request.block_ids`), so a row
    that sees the same list again copies only the blocks appended since: in steady decoding a row is written once
    per `block_size` tokens, not every step.
    """

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self.table = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self._lists: list[list[int] | None] = [None] * max_num_seqs
        self._filled = [0] * max_num_seqs
        # blocks each row of the last build holds: `covers` checks a step's positions against them (a row's zeros
        # past its blocks would otherwise map a position past them to the null block without a word)
        self.row_blocks = np.zeros(max_num_seqs, dtype=np.int64)

    def build(self, reqs: list[Request]) -> np.ndarray:
        """The step's block table `[len(reqs), widest block list]`, zero past each request's blocks: a view of the
        kept table, valid until the next build."""
        table, lists, filled = self.table, self._lists, self._filled
        width = 0
        for i, req in enumerate(reqs):
            ids = req.block_ids
            n = len(ids)
            k = filled[i]
            if lists[i] is ids and n >= k:
                if n > k:
                    table[i, k:n] = ids[k:]
            else:  # another request in this row now, or the same one with a new list
                table[i, :n] = ids
                if k > n:
                    table[i, n:k] = 0
                lists[i] = ids
            filled[i] = n
            if n > width:
                width = n
        self.row_blocks[: len(reqs)] = filled[: len(reqs)]
        return table[: len(reqs), :width]

    def covers(self, last_positions: np.ndarray, block_size: int) -> None:
        """Raise unless each row's blocks (of the last build) hold its last position of the step: the scheduler
        gives every request the blocks of the tokens it schedules, and a step must never write past them."""
        past = last_positions // block_size >= self.row_blocks[: len(last_positions)]
        if past.any():
            bad = int(np.argmax(past))
            raise RuntimeError(f"internal error: row {bad} of the step reaches position {int(last_positions[bad])}, "
                               f"past its {int(self.row_blocks[bad])} KV blocks")


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, max_num_seqs: int,
                 max_num_tokens: int, max_blocks_per_seq: int, max_model_len: int | None = None,
                 fused_split_reductions: bool = True, graph_greedy_argmax: bool = True) -> None:
        """`fused_split_reductions`: the step's split-K small-M GEMMs sum their partials in one launch, taking
        tickets from `split_k_counters` (`ForwardContext.split_k_counters`; `AccelConfig.fused_split_reductions`).
        `graph_greedy_argmax`: full decode graphs end with the greedy argmax of their logits (`execute` returns
        those tokens beside the logits; `AccelConfig.graph_greedy_argmax`)."""
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_model_len = max_model_len or max_blocks_per_seq * block_size
        self.device = next(model.parameters()).device
        dev, i32, i64 = self.device, torch.int32, torch.int64
        self.input_ids = torch.zeros(max_num_tokens, dtype=i64, device=dev)
        self.positions = torch.zeros(max_num_tokens, dtype=i64, device=dev)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=i64, device=dev)
        # query_start_loc, seq_lens and context_lens side by side in one buffer: one host-to-device copy fills all
        # three (_put_seq_arrays)
        s = max_num_seqs
        self._seq_arrays = torch.zeros(3 * s + 1, dtype=i32, device=dev)
        self.query_start_loc = self._seq_arrays[: s + 1]
        self.seq_lens = self._seq_arrays[s + 1 : 2 * s + 1]
        self.context_lens = self._seq_arrays[2 * s + 1 :]
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=i32, device=dev)
        self._table_zero_from = 0  # every row of block_tables is zero from this column on (_upload)
        self.logits_indices = torch.zeros(max_num_seqs, dtype=i64, device=dev)
        self._uploaded_logits_indices: np.ndarray | None = None  # what logits_indices holds (_upload skips a repeat)
        self.host_block_table = HostBlockTable(max_num_seqs, max_blocks_per_seq)  # pack() fills it step by step
        # compiled forward and CUDA graphs, set up by enable_compilation() at warm-up
        self.dispatcher = None
        self.piecewise = None
        self.full_graphs = None
        self.compile_cache = None  # CompileCacheInfo: restore() puts TORCHINDUCTOR_CACHE_DIR back through it
        self.decode_logits_indices = torch.arange(max_num_tokens, dtype=i64, device=dev)  # FULL graphs read this
        self.inputs_ready: torch.cuda.Event | None = None  # recorded once a step's inputs are on the device
        self.graph_greedy_argmax = graph_greedy_argmax and dev.type == "cuda"
        self._greedy_argmax = None  # ops.greedy.GreedyArgmax: made at the first full-graph warm-up (its scratch)
        self._pdl = False  # set by enable_compilation
        self._host_mirrors: dict[str, torch.Tensor] = {}  # pinned host copies of the buffers above (_host_copy)
        # one counter per column tile of the widest split-K launch (a 262k vocabulary in 16-column tiles); a launch
        # with more tiles reduces in a second kernel
        self.split_k_counters = (torch.zeros(SPLIT_K_COUNTERS, dtype=i32, device=dev)
                                 if fused_split_reductions and dev.type == "cuda" else None)

    # -- packing -----------------------------------------------------------------------------------------------
    def pack(self, step: ScheduledStep) -> StepInputs:
        # the decode fast path only when every request's token is its last one (so every request samples); a budget
        # smaller than the batch can also schedule one-token prompt chunks from the middle of a prompt
        if step.total_tokens == len(step.requests) and all(
                r.num_computed_tokens + 1 == r.num_tokens for r in step.requests):
            return self._pack_decode(step)
        bs = self.block_size
        table = self.host_block_table.build(step.requests)
        ids, pos, slots, qsl, seq_lens, logits_idx, sampled = [], [], [], [0], [], [], []
        pending_rows, pending_reqs = [], []
        for row, (req, n) in enumerate(zip(step.requests, step.num_tokens)):
            start = req.num_computed_tokens
            end = start + n
            toks = req.prompt_token_ids[start:end]
            if end > req.num_prompt_tokens:
                toks = toks + req.output_token_ids[max(0, start - req.num_prompt_tokens) : end - req.num_prompt_tokens]
            if len(toks) < n:  # the request's last token is still on the device
                pending_rows.extend(range(qsl[-1] + len(toks), qsl[-1] + n))
                pending_reqs.extend([req] * (n - len(toks)))
                toks = toks + [PENDING_TOKEN] * (n - len(toks))
            ids.append(np.asarray(toks, dtype=np.int64))
            p = np.arange(start, end, dtype=np.int64)
            pos.append(p)
            slots.append(table[row, p // bs].astype(np.int64) * bs + p % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            if end == req.num_tokens:  # the prompt (or the last token) is complete: sample the next one
                logits_idx.append(qsl[-1] - 1)
                sampled.append(req)
        self.host_block_table.covers(np.asarray(seq_lens, dtype=np.int64) - 1, bs)
        return StepInputs(
            input_ids=np.concatenate(ids), positions=np.concatenate(pos), slot_mapping=np.concatenate(slots),
            query_start_loc=np.asarray(qsl, dtype=np.int32), seq_lens=np.asarray(seq_lens, dtype=np.int32),
            block_tables=table, logits_indices=np.asarray(logits_idx, dtype=np.int64),
            sampled=sampled, max_query_len=max(step.num_tokens), max_seq_len=max(seq_lens),
            pending_rows=pending_rows, pending_reqs=pending_reqs,
        )

    def _pack_decode(self, step: ScheduledStep) -> StepInputs:
        """All requests decode one token: a few list comprehensions and vector operations, no numpy call per request.
        In steady asynchronous decoding every token is still on the device: no token is looked up at all."""
        bs = self.block_size
        reqs = step.requests
        n = len(reqs)
        positions = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
        table = self.host_block_table.build(reqs)
        self.host_block_table.covers(positions, bs)
        slots = table[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = positions.astype(np.int32) + 1
        if all([r.num_pending_tokens for r in reqs]):  # each one's last token is the previous step's, unread
            ids = np.full(n, PENDING_TOKEN, dtype=np.int64)
            pending_rows = list(range(n))
        else:
            ids = np.array([r.token_at(p) for r, p in zip(reqs, positions.tolist())], dtype=np.int64)
            pending_rows = [i for i, r in enumerate(reqs) if r.num_pending_tokens]
        return StepInputs(
            input_ids=ids, positions=positions, slot_mapping=slots, query_start_loc=np.arange(n + 1, dtype=np.int32),
            seq_lens=seq_lens, block_tables=table, logits_indices=np.arange(n, dtype=np.int64), sampled=list(reqs),
            max_query_len=1, max_seq_len=int(seq_lens.max()), pending_rows=pending_rows,
            pending_reqs=[reqs[i] for i in pending_rows],
        )

    def upload(self, inp: StepInputs, num_tokens_padded: int | None = None,
               num_seqs_padded: int | None = None) -> StepMetadata:
        """Copy the packed step into the persistent buffers; padded tokens/rows get null slots and seq_len 0.

        Marks the stream after its copies (`inputs_ready`), as `_stage` does: the graph warm-ups upload without
        staging, and the next upload must not rewrite a host mirror a pending copy still reads."""
        self._await_mirrors()
        try:
            return self._upload(inp, num_tokens_padded, num_seqs_padded)
        finally:
            self._mark_inputs()

    def _await_mirrors(self) -> None:
        """Wait until the last upload's copies out of the host mirrors are done (long since, in steady decode)."""
        if self.inputs_ready is not None:
            self.inputs_ready.synchronize()

    def _mark_inputs(self) -> None:
        """Record `inputs_ready` after the copies just queued, on this runner's device (an upload cut short by an
        exception too: some of its copies may be queued). CPU copies are synchronous: nothing to mark."""
        if self.device.type == "cuda":
            self.inputs_ready = torch.cuda.Event()
            self.inputs_ready.record(torch.cuda.current_stream(self.device))

    def _upload(self, inp: StepInputs, num_tokens_padded: int | None, num_seqs_padded: int | None) -> StepMetadata:
        """The copies of one step, as few as the step allows: a decode step whose tokens are all still on the device
        sends no token ids (the previous step's tokens are copied on the device), the three per-sequence arrays go
        in one copy, and logits_indices only when they changed (a run of decode steps of one batch size repeats
        them). Steady decoding makes four host-to-device copies."""
        t, b = len(inp.input_ids), len(inp.seq_lens)
        tp, bp = num_tokens_padded or t, num_seqs_padded or b
        nonblocking = self.device.type == "cuda"

        def put(name: str, dst: torch.Tensor, src: np.ndarray) -> None:
            dst.copy_(self._host_copy(name, src) if nonblocking else torch.from_numpy(src), non_blocking=nonblocking)

        if len(inp.pending_rows) < t:
            put("input_ids", self.input_ids[:t], inp.input_ids)
        if inp.pending_rows:
            self._feed_pending(inp)
        put("positions", self.positions[:t], inp.positions)
        put("slot_mapping", self.slot_mapping[:t], inp.slot_mapping)
        if tp > t:
            self.input_ids[t:tp].zero_()
            self.positions[t:tp].zero_()
            self.slot_mapping[t:tp].fill_(-1)
        self._put_seq_arrays(inp.query_start_loc, inp.seq_lens, inp.seq_lens - np.diff(inp.query_start_loc))
        width = inp.block_tables.shape[1]
        put("block_tables", self.block_tables[:b, :width], inp.block_tables)
        if self._table_zero_from > width:  # columns some earlier, wider step wrote: zero them in every row
            self.block_tables[:, width : self._table_zero_from].zero_()
        self._table_zero_from = width
        if bp > b:  # graph-padded rows: one query token each past the real ones, nothing to read
            self.query_start_loc[b + 1 : bp + 1] = torch.arange(t + 1, t + 1 + bp - b, device=self.device,
                                                                 dtype=torch.int32).clamp(max=tp)
            self.seq_lens[b:bp].zero_()
            self.context_lens[b:bp].zero_()
            self.block_tables[b:bp].zero_()
        n = len(inp.logits_indices)
        if n:
            last = self._uploaded_logits_indices
            if last is None or last.shape != inp.logits_indices.shape or not np.array_equal(last, inp.logits_indices):
                self._uploaded_logits_indices = None  # unknown while the copy is being queued
                put("logits_indices", self.logits_indices[:n], inp.logits_indices)
                self._uploaded_logits_indices = inp.logits_indices.copy()
        return StepMetadata(
            num_tokens=t, num_seqs=b, max_query_len=inp.max_query_len, max_seq_len=inp.max_seq_len,
            block_size=self.block_size, query_start_loc=self.query_start_loc[: bp + 1], seq_lens=self.seq_lens[:bp],
            context_lens=self.context_lens[:bp], block_tables=self.block_tables[:bp],
            slot_mapping=self.slot_mapping[:tp],
            query_lens_cpu=np.diff(inp.query_start_loc).tolist(), seq_lens_cpu=inp.seq_lens.tolist(),
        )

    def _put_seq_arrays(self, query_start_loc: np.ndarray, seq_lens: np.ndarray, context_lens: np.ndarray) -> None:
        """query_start_loc, seq_lens and context_lens into their shared device buffer in one copy. On CUDA the copy
        spans from the buffer's start to the last context length: the entries between the three arrays' used parts
        carry whatever the host mirror held there, past the step's sequences, where nothing reads (graph-padded
        rows are set after this copy). On CPU the device buffer is written in place."""
        b, s = len(seq_lens), self.max_num_seqs
        if b > s:  # the three arrays share one buffer: more rows would run into the next one
            raise RuntimeError(f"internal error: a step of {b} sequences, more than max_num_seqs={s}")
        nonblocking = self.device.type == "cuda"
        host = self._mirror("_seq_arrays") if nonblocking else self._seq_arrays
        arr = host.numpy()
        arr[: b + 1] = query_start_loc
        arr[s + 1 : s + 1 + b] = seq_lens
        arr[2 * s + 1 : 2 * s + 1 + b] = context_lens
        if nonblocking:
            end = 2 * s + 1 + b
            self._seq_arrays[:end].copy_(host[:end], non_blocking=True)

    def _mirror(self, name: str) -> torch.Tensor:
        """The pinned host mirror of device buffer `name`, allocated on first use, as large as the buffer. Zeros, not
        empty: `_put_seq_arrays` copies the entries between its three arrays' used parts too (never garbage)."""
        buf = self._host_mirrors.get(name)
        if buf is None:
            dev_buf = getattr(self, name)
            buf = self._host_mirrors[name] = torch.zeros(dev_buf.numel(), dtype=dev_buf.dtype, pin_memory=True)
        return buf

    def _host_copy(self, name: str, src: np.ndarray) -> torch.Tensor:
        """`src` in this buffer's pinned host mirror (allocated once, as large as the device buffer), ready for an
        asynchronous copy: no pinned allocation per step. upload() writes a mirror only after the previous step's
        copies out of it are done (`inputs_ready`)."""
        view = self._mirror(name)[: src.size].view(src.shape)
        np.copyto(view.numpy(), src, casting="same_kind")
        return view

    def _feed_pending(self, inp: StepInputs) -> None:
        """Fill the rows of tokens still on the device from the previous step's sampled tokens (device to device:
        the host never waits for them). The common decode case, same requests in the same order, is one copy."""
        if inp.prev_tokens is None or len(inp.pending_src) != len(inp.pending_rows):
            raise RuntimeError("internal error: a step consumes tokens still on the device but was not given them")
        rows, src = inp.pending_rows, inp.pending_src
        n = len(rows)
        if rows == list(range(n)) and src == rows:
            self.input_ids[:n].copy_(inp.prev_tokens[:n])
            return
        dev = self.device
        rows_t = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
        src_t = torch.tensor(src, dtype=torch.int64).to(dev, non_blocking=True)
        self.input_ids.index_copy_(0, rows_t, inp.prev_tokens.index_select(0, src_t))

    def _stage(self, inp: StepInputs, num_tokens_padded: int | None = None,
               num_seqs_padded: int | None = None) -> StepMetadata:
        """Upload a step and let the backend prepare it, then mark the point in the stream after which this step's
        host staging buffers (ours, and those a backend's plan() reuses) may be written again: the engine waits for
        it before preparing the next step."""
        self._await_mirrors()
        try:
            meta = self._upload(inp, num_tokens_padded, num_seqs_padded)
            self.backend.prepare(meta)
        finally:
            self._mark_inputs()  # after the backend's own host-to-device copies too
        return meta

    # -- forward -----------------------------------------------------------------------------------------------
    def model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      logits_indices: torch.Tensor) -> torch.Tensor:
        """The family's full causal-LM forward on packed input: logits `[N, V]` for the rows in logits_indices."""
        return self.forward_2d(input_ids[None], positions[None], logits_indices)[0]

    def context(self, meta: StepMetadata) -> ForwardContext:
        return ForwardContext(metadata=meta, backend=self.backend, kv_caches=self.kv_caches,
                              split_k_counters=self.split_k_counters)

    def forward_2d(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   logits_indices: torch.Tensor) -> torch.Tensor:
        """The function the compiler traces: `[1, T]` inputs -> logits `[1, N, V]`."""
        return engine_forward(self.model, input_ids, positions, logits_indices)

    # -- compilation and CUDA graphs ----------------------------------------------------------------------------
    def dummy_inputs(self, query_lens: list[int]) -> StepInputs:
        """A step of fake sequences that write nothing (slots -1) and read only the null block."""
        qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        t = int(qsl[-1])
        width = -(-max(query_lens) // self.block_size)
        return StepInputs(
            input_ids=np.zeros(t, dtype=np.int64),
            positions=np.concatenate([np.arange(n) for n in query_lens]).astype(np.int64),
            slot_mapping=np.full(t, -1, dtype=np.int64), query_start_loc=qsl,
            seq_lens=np.asarray(query_lens, dtype=np.int32), block_tables=np.zeros((len(query_lens), width), np.int32),
            logits_indices=(qsl[1:] - 1).astype(np.int64), sampled=[], max_query_len=max(query_lens),
            max_seq_len=max(query_lens))

    @torch.inference_mode()
    def _tune_linears(self, info: dict, phase: Callable, dtype: torch.dtype, pdl: bool,
                      cache_path: Path | None) -> None:
        """Tile decisions for the small-M GEMMs the compile routed: bf16 / fp16 linears (`small_m_gemm`: ours or
        cuBLAS) and torchao int8 weight-only ones (`int8_gemm`: tuned tiles or the tile rule). A tuning failure
        warns and keeps the baseline: it is an optimisation."""
        from hf_accel.compilation.norm_folding import chain_places
        from hf_accel.ops.linear import decisions_for, gated_key_dtype, int8_key_dtype, tune_linears

        stats = self.piecewise.stats
        # the gated shapes after the plain ones: their baseline is the plain linear's decision
        for name, shapes, kind in (("small_m_gemm", stats.routed_linears, "plain"),
                                   ("gated_gemm", stats.gated_linears, "gated"),
                                   ("int8_gemm", stats.int8_weight_linears, "int8")):
            if not shapes:
                continue
            int8, gated = kind == "int8", kind == "gated"
            what = {"plain": "weight shapes", "gated": "gate/up weight shapes", "int8": "int8 weight shapes"}[kind]
            phase(f"tune {'small-M' if kind == 'plain' else kind} GEMMs", f"{len(set(shapes))} {what}; remembered "
                  "in the compile cache")
            try:
                report = tune_linears(shapes, dtype, self.device, use_pdl=pdl, int8=int8, gated=gated,
                                      cache_dir=cache_path,
                                      chain_places=None if int8 else chain_places(stats.chain_pairs, gated))
                report["decisions"] = decisions_for(shapes, self.device, int8_key_dtype(dtype) if int8
                                                    else gated_key_dtype(dtype) if gated else dtype,
                                                    chain_tiles=bool(stats.chained_norms))
            except Exception as exc:
                logger.warning("hf_accel: tuning the %s failed (%s: %s); %s run", what, type(exc).__name__, exc,
                               "the default int8 tiles" if int8 else "the linear and SiLU-and-mul kernels" if gated
                               else "cuBLAS GEMMs")
                report = {"error": f"{type(exc).__name__}: {exc}"[:300], "seconds": 0.0}
            info[name] = report
            info[f"{name}_s"] = report["seconds"]

    def enable_compilation(self, mode, capture_sizes: list[int], compile: bool, cache_dir: str | None,
                           model_config, dtype: torch.dtype, *, pdl: bool = False,
                           small_m_gemm: bool = False, fold_norms: bool = False, gated_gemm: bool = False,
                           combo_kernels: bool = False, chain_residual_norms: bool = False, progress=None, tp=None,
                           reuse_traced_graph: bool = False, mixed_capture_sizes: list[int] | None = None) -> dict:
        """Compile (piecewise, cut at attention) and capture CUDA graphs, all before serving. Returns timings.

        `pdl`: Inductor's kernels use programmatic dependent launch. `small_m_gemm`: linears go through
        `hf_accel::linear`, tuned here (after compiling, before capturing) per weight shape and M bucket;
        `fold_norms`: the RMSNorms before them go into them (compilation/norm_folding.py). `gated_gemm`: a gate/up
        linear and its SiLU-and-mul are one op, tuned here too (compilation/gated_activation.py).
        `chain_residual_norms`: the linear before a folded norm's residual add joins its op (ops/residual_chain.py).
        `combo_kernels`:
        Inductor launches each piece's independent GPU kernels together (compilation/piecewise.inductor_settings).
        `progress`: a `hf_accel.progress.StartupProgress` told when each phase starts. `tp`: the tensor-parallel
        group (engine/tensor_parallel.py); a compile failure on one of its ranks ends the job instead of falling
        back on that rank alone. `reuse_traced_graph`: Dynamo's trace is stored in the compile cache and a later
        start of the same model reads it back instead of tracing (compilation/trace_cache.py).
        `mixed_capture_sizes`: the piecewise graphs' sizes where full graphs serve decode (CUDAGraphDispatcher).
        """
        def phase(name: str, detail: str = "") -> None:
            if progress is not None:
                progress.phase(name, detail)

        import time

        from hf_accel.compilation.cache import setup_compile_cache
        from hf_accel.compilation.cuda_graph import FullCUDAGraphRunner
        from hf_accel.compilation.dispatcher import CUDAGraphDispatcher
        from hf_accel.compilation.piecewise import compile_piecewise
        from hf_accel.patches.quantization import quantizes_activations

        info: dict = {"compile_s": 0.0, "capture_s": 0.0, "graph_pool_bytes": 0, "compile_cache": None}
        self._pdl = pdl
        on_cuda = self.device.type == "cuda"
        # no step holds more tokens than the budget, nor more than max_num_seqs sequences of at most max_model_len
        # tokens each: a larger size would never replay, and its dummy step would not fit the metadata buffers
        most = min(self.max_num_tokens, self.max_num_seqs * self.max_model_len)
        sizes = [s for s in capture_sizes if s <= most]
        mixed = [s for s in mixed_capture_sizes if s <= most] if mixed_capture_sizes else None
        if mixed == []:
            logger.warning("hf_accel: no piecewise_capture_sizes fit %d tokens per step; steps holding a prefill "
                           "chunk run without CUDA graphs", most)
        self.dispatcher = CUDAGraphDispatcher(mode, sizes, self.backend.cudagraph_support,
                                              piecewise_available=compile,
                                              full_capture_sizes=[s for s in sizes if s <= self.max_num_seqs],
                                              mixed_capture_sizes=mixed, backend_name=self.backend.name)
        info["cudagraph_mode"] = self.dispatcher.mode.value
        pool = torch.cuda.graph_pool_handle() if on_cuda and self.dispatcher.mode.value != "none" else None
        if hasattr(self.backend, "set_cudagraph_batch_sizes"):
            self.backend.set_cudagraph_batch_sizes(self.dispatcher.full_sizes)
        before = torch.cuda.memory_reserved(self.device) if on_cuda else 0
        if compile:
            t0 = time.perf_counter()
            phase("compile", "Dynamo trace, split at attention, Inductor; reused from the compile cache when warm")
            example = compile_example_tokens(len(self.input_ids))
            info["eager_precision_casts"] = eager_casts = quantizes_activations(self.model)
            # what else decides the compiled graphs is part of the key: the graph passes' switches, eager precision
            # casts (a torchao model quantized in place leaves the config as it was) and the TP size, so a directory
            # filled under one setting does not report the next start with another as warm
            cache = self.compile_cache = setup_compile_cache(
                cache_dir, model_config, dtype, sizes, extra={
                    "device": str(self.device), "backend": self.backend.name, "compile_tokens": example,
                    "passes": {"small_m_gemm": small_m_gemm and on_cuda, "pdl": pdl, "fold_norms": fold_norms,
                               "gated_gemm": gated_gemm, "combo_kernels": combo_kernels,
                               "chain_residual_norms": chain_residual_norms},
                    "eager_precision_casts": eager_casts, "tp_size": tp.size if tp is not None else 1})
            info["compile_cache"] = {"dir": str(cache.path) if cache.path else None, "warm": cache.warm}
            trace_cache = None
            if reuse_traced_graph and cache.path is not None and tp is None:  # a rank's graph may hold its rank
                from hf_accel.compilation.trace_cache import TraceCache

                trace_cache = TraceCache(cache.path / "traced", self.model)
            self.piecewise = compile_piecewise(self.forward_2d, capture_sizes=self.dispatcher.piecewise_sizes,
                                               use_cudagraph=on_cuda and bool(self.dispatcher.piecewise_sizes),
                                               graph_pool=pool, route_linears=small_m_gemm and on_cuda, pdl=pdl,
                                               eager_casts=eager_casts, trace_cache=trace_cache,
                                               fold_norms=fold_norms, gated_gemm=gated_gemm,
                                               combo_kernels=combo_kernels,
                                               chain_residual_norms=chain_residual_norms)
            query_lens = self.compile_example_lens(example)
            meta = self.upload(self.dummy_inputs(query_lens))
            self.backend.prepare(meta)
            try:
                with forward_context(self.context(meta)):
                    total = sum(query_lens)
                    self.piecewise.compile(self.input_ids[:total][None], self.positions[:total][None],
                                           self.logits_indices[:len(query_lens)])
            except Exception as exc:  # e.g. a model/torch combination that specializes the token count
                if tp is not None:  # the other ranks are already running the compiled forward's collectives:
                    # no quiet fallback on this rank alone; the job ends (its peers' next collective fails)
                    raise RuntimeError(
                        f"hf_accel: torch.compile of the forward failed on tensor-parallel rank {tp.rank} "
                        f"({type(exc).__name__}: {exc}); ranks must all compile or all not: pass compile=False "
                        "on every rank") from exc
                logger.warning("hf_accel: torch.compile of the forward failed (%s: %s); continuing without "
                               "compile: full CUDA graphs of the eager forward for decode, eager otherwise",
                               type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                torch._dynamo.reset()
                self.piecewise = None
                compile = False
                info["compile_error"] = f"{type(exc).__name__}: {exc}"[:500]
                self.dispatcher = CUDAGraphDispatcher(mode, sizes, self.backend.cudagraph_support,
                                                      piecewise_available=False,
                                                      full_capture_sizes=[s for s in sizes if s <= self.max_num_seqs],
                                                      backend_name=self.backend.name)
                info["cudagraph_mode"] = self.dispatcher.mode.value
            info["compile_s"] = time.perf_counter() - t0
            # whether Inductor could combine kernels: asked for, on the GPU (it combines no CPU ones), and at least
            # one compiled piece kept them (a piece Inductor refused with them compiled without: piecewise)
            stats = self.piecewise.stats if self.piecewise is not None else None
            info["combo_kernels"] = bool(combo_kernels and on_cuda and stats is not None
                                         and stats.combo_fallback_pieces < stats.num_compiled)
            if stats is not None and stats.combo_fallback_pieces:
                info["combo_kernels_error"] = (f"{stats.combo_fallback_pieces} compiled piece(s) compiled without "
                                               "combo kernels after Inductor raised with them")
            if self.piecewise is not None:  # where the compile time goes: Dynamo tracing vs split + Inductor
                info["trace_s"] = self.piecewise.stats.trace_seconds
                info["trace_source"] = self.piecewise.stats.trace_source
                info["split_compile_s"] = self.piecewise.stats.compile_seconds
            if self.piecewise is not None and self.piecewise.route_linears:
                self._tune_linears(info, phase, dtype, pdl, cache.path)

        capture_class = capture_warmup_class(self.model, small_m_gemm=small_m_gemm, tensor_parallel=tp is not None)
        metas: dict = {}

        def run_piece(t: int):
            # sequences no longer than the model's context (a piece larger than it is a step of several prompts)
            meta = self.upload(self.dummy_inputs(self.prefill_query_lens(t, self.max_model_len)))
            self.backend.prepare(meta)
            with forward_context(self.context(meta)):
                return self.piecewise(self.input_ids[:t][None], self.positions[:t][None], self.logits_indices[:1])

        def prepare_full(key):
            b = key.num_tokens
            lens = self.full_capture_query_lens(key, self.max_model_len)
            metas[key] = meta = self.upload(self.dummy_inputs(lens), b, b)
            self.backend.prepare(meta)

        def run_full(key):
            b = key.num_tokens
            with forward_context(self.context(metas[key])):
                if self.piecewise is not None:
                    with self.piecewise.graphs_disabled():
                        logits = self.piecewise(self.input_ids[:b][None], self.positions[:b][None],
                                                self.decode_logits_indices[:b])
                else:
                    logits = self.forward_2d(self.input_ids[:b][None], self.positions[:b][None],
                                             self.decode_logits_indices[:b])
            return logits, self._graph_argmax(logits[0])

        def full_warmup_class(key) -> Hashable:
            return capture_class(key.num_tokens), self.backend.capture_variant(key.num_tokens, key.uniform_decode)

        def capture_graphs() -> None:
            from hf_accel.ops.triton_build import build_ahead_enabled

            keys = self.dispatcher.full_capture_keys() if on_cuda else []
            graphs = compile and on_cuda and self.piecewise.use_cudagraph
            piece_sizes = self.dispatcher.piecewise_sizes if graphs else []
            warm_cache = bool((info.get("compile_cache") or {}).get("warm"))
            stats = self.piecewise.stats if self.piecewise is not None else None
            ours = self.backend.builds_triton_kernels or bool(stats and (stats.routed_linears
                                                                         or stats.int8_weight_linears))
            if (piece_sizes or keys) and ours and tp is None and not warm_cache and build_ahead_enabled():
                t0 = time.perf_counter()
                phase("build kernels", "the graph warm-ups' Triton kernels, in parallel")
                try:
                    report = self._build_capture_kernels_ahead(
                        piece_sizes, capture_class, run_piece, keys, full_warmup_class, prepare_full, run_full)
                except Exception as exc:  # an optimisation: the warm-ups build whatever is missing, as before
                    logger.warning("hf_accel: building the graph warm-ups' kernels ahead failed (%s: %s); they "
                                   "build in the warm-ups", type(exc).__name__, exc)
                    report = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                if report.get("failed"):
                    logger.info("hf_accel: %d of the graph warm-ups' kernels (or warm-up forwards) did not build "
                                "ahead; the warm-ups build them", report["failed"])
                info["capture_build_ahead"] = report
                info["capture_s"] += time.perf_counter() - t0
            if compile:
                t0 = time.perf_counter()
                if on_cuda:
                    phase("capture CUDA graphs", f"piecewise: {len(self.dispatcher.piecewise_sizes)} sizes, "
                                                 f"full: {len(keys)} batch shapes")
                    self.piecewise.capture(self.dispatcher.piecewise_sizes, run_piece, warmup_key=capture_class)
                    stats = self.piecewise.stats
                    info["capture_split"] = {"piecewise_s": time.perf_counter() - t0,
                                             "piecewise_warmup_s": stats.capture_warmup_seconds,
                                             "piecewise_record_s": stats.capture_record_seconds,
                                             "piecewise_graphs": len(stats.captured_sizes) * stats.num_graphable,
                                             "piecewise_warmups": stats.capture_warmups,
                                             "piecewise_retries": stats.capture_retries}
                info["capture_s"] += time.perf_counter() - t0
            if keys:
                t0 = time.perf_counter()
                if not (compile and on_cuda):
                    phase("capture CUDA graphs", f"full: {len(keys)} batch shapes")
                # the piecewise graphs' pool: a capture that failed and was retried there moved it to a new handle
                # (a failed capture's pool is not captured into again; compilation/cuda_graph.capture_graph)
                shared = self.piecewise.graph_pool if self.piecewise is not None else None
                self.full_graphs = FullCUDAGraphRunner(shared if shared is not None else pool)
                self.full_graphs.capture(keys, run_full, prepare_fn=prepare_full, sort_key=lambda k: k.num_tokens,
                                         warmup_key=full_warmup_class)
                info.setdefault("capture_split", {}).update(
                    full_s=time.perf_counter() - t0, full_warmup_s=self.full_graphs.warmup_seconds,
                    full_graphs=len(keys), full_warmups=self.full_graphs.warmups, full_retries=self.full_graphs.retries)
                info["capture_s"] += time.perf_counter() - t0

        try:
            capture_graphs()
        except Exception as exc:  # an op that cannot run inside a CUDA graph (a host sync, a data-dependent shape)
            if tp is not None:  # the ranks must replay the same graphs; no quiet fallback on one rank
                raise RuntimeError(
                    f"hf_accel: CUDA graph capture failed on tensor-parallel rank {tp.rank} "
                    f"({type(exc).__name__}: {exc}); pass cudagraph_mode='none' on every rank") from exc
            self.drop_graphs(sizes)
            info["capture_error"] = f"{type(exc).__name__}: {exc}"[:500]
            info["cudagraph_mode"] = self.dispatcher.mode.value
            logger.warning("hf_accel: CUDA graph capture failed (%s: %s); continuing without CUDA graphs (%s)",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "",
                           "compiled forward" if self.piecewise is not None else "eager forward")
            logger.debug("hf_accel: the capture failure's traceback", exc_info=exc)
        if on_cuda:
            torch.cuda.synchronize(self.device)
            info["graph_pool_bytes"] = max(0, torch.cuda.memory_reserved(self.device) - before)
        return info

    def _build_capture_kernels_ahead(self, piece_sizes: list[int], piece_class: Callable[[int], Hashable],
                                     run_piece: Callable[[int], object], full_keys: list,
                                     full_class: Callable[[object], Hashable], prepare_full: Callable[[object], object],
                                     run_full: Callable[[object], object]) -> dict:
        """Build the Triton kernels the capture warm-ups will launch, all at once (ops/triton_build.py: `ahead`).

        One forward per warm-up class (any key of a class runs the same kernels), with the capture's own inputs
        and our kernels' launches compile-only (their outputs zeroed); the builds run in a thread pool meanwhile.
        The warm-ups then find every kernel of ours built instead of building each on its first launch, one after
        another. Inductor's and libraries' kernels run as in any forward. A forward here that fails is counted and
        skipped: its warm-up builds what is missing, as without this step."""
        from hf_accel.compilation.cuda_graph import warmup_representatives
        from hf_accel.ops.triton_build import ahead, build_in_parallel

        def piece(t: int) -> None:
            with self.piecewise.graphs_disabled():
                run_piece(t)

        def full(key) -> None:
            prepare_full(key)
            run_full(key)

        warmups = [ahead(lambda t=t: piece(t)) for t in warmup_representatives(piece_sizes, piece_class)]
        warmups += [ahead(lambda k=k: full(k)) for k in warmup_representatives(full_keys, full_class)]
        report = build_in_parallel(warmups)  # in the grad mode of the captures: no Dynamo guard differs
        torch.cuda.synchronize(self.device)
        report["forwards"] = len(warmups)
        return report

    def drop_graphs(self, sizes: list[int]) -> None:
        """Forget every captured graph; each step then runs the compiled forward (or eager) as it is."""
        from hf_accel.compilation.dispatcher import CUDAGraphDispatcher

        if self.full_graphs is not None:
            self.full_graphs.reset()
        self.full_graphs = None
        if self.piecewise is not None:
            self.piecewise.drop_graphs()
        self.dispatcher = CUDAGraphDispatcher("none", sizes, self.backend.cudagraph_support,
                                              piecewise_available=self.piecewise is not None,
                                              backend_name=self.backend.name)
        if torch.cuda.is_available() and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _graph_argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The greedy tokens of a full graph's logits `[rows, V]`, launched inside the graph (ops/greedy.py); None
        where that is off or cannot run (no triton, logits of another layout): the sampler then takes its own."""
        if not self.graph_greedy_argmax:
            return None
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and self._greedy_argmax is None:  # its scratch (and first launch) belong in a warm-up
            return None
        try:  # an optimisation: a kernel that cannot build or run here leaves the argmax to the sampler
            if self._greedy_argmax is None:
                from hf_accel.ops.greedy import GreedyArgmax

                self._greedy_argmax = GreedyArgmax(max(self.max_num_seqs, logits.shape[0]), logits.shape[-1],
                                                   self.device)
            if not self._greedy_argmax.fits(logits):
                return None
            return self._greedy_argmax(logits, self._pdl)
        except Exception as exc:
            if capturing:  # the capture is broken either way: its own fallback handles it
                raise
            logger.warning("hf_accel: the decode graphs' greedy argmax is off (%s: %s); the sampler takes it",
                           type(exc).__name__, exc)
            self.graph_greedy_argmax, self._greedy_argmax = False, None
            return None

    @staticmethod
    def full_capture_query_lens(key, max_model_len: int) -> list[int]:
        """The dummy step a full graph is captured on (its rows padded to key.num_tokens).

        A uniform-decode graph is captured on a decode step (backends may freeze a decode-only path into it); a
        mixed graph on prefill-shaped sequences (no longer than the model's context), so the path it freezes
        serves any mix of queries.
        """
        b = key.num_tokens
        if key.uniform_decode or b == 1:
            return [1] * b
        return ModelRunner.prefill_query_lens(b, max_model_len)

    def compile_example_lens(self, tokens: int) -> list[int]:
        """The first compiled step: prefill sequences of at most the context and one decode row, `tokens` in all, or
        fewer where the context and `max_num_seqs` allow no more (a single sequence when only one fits)."""
        if self.max_num_seqs < 2:
            return [max(1, min(tokens, self.max_model_len))]
        prefill = min(tokens - 1, (self.max_num_seqs - 1) * self.max_model_len)
        return self.prefill_query_lens(prefill, self.max_model_len) + [1]

    @staticmethod
    def prefill_query_lens(num_tokens: int, max_model_len: int) -> list[int]:
        """A dummy step of `num_tokens` prefill tokens as sequences of at most `max_model_len` tokens each."""
        step = max(1, max_model_len)
        return [min(step, num_tokens - i) for i in range(0, num_tokens, step)]

    def _compiled_forward(self, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Dispatch FULL / PIECEWISE / NONE: (logits, their greedy tokens where a full graph computed them), or
        None when nothing is compiled or captured (plain eager)."""
        if self.dispatcher is None:
            return None
        t, n = len(inp.input_ids), len(inp.logits_indices)
        d = self.dispatcher.dispatch(t, inp.max_query_len == 1)
        if d.mode.value == "full" and self.full_graphs is not None and d.key in self.full_graphs:
            self._stage(inp, d.num_tokens, d.num_tokens)
            logits, greedy = self.full_graphs.replay(d.key)
            logits = logits[0]  # one row per (padded) token
            # every sequence samples one token each (a decode step): row i is sequence i; otherwise the rows of the
            # sampling sequences' last tokens
            rows = slice(0, n) if d.uniform_decode and n == len(inp.seq_lens) else self.logits_indices[:n]
            return logits[rows], greedy[rows] if greedy is not None else None
        if self.piecewise is None:
            return None
        tp = d.num_tokens if d.mode.value == "piecewise" else t
        meta = self._stage(inp, tp)
        with forward_context(self.context(meta)):
            logits = self.piecewise(self.input_ids[:tp][None], self.positions[:tp][None], self.logits_indices[:n])
        return logits[0], None

    @torch.inference_mode()
    def execute(self, step: ScheduledStep, prev_tokens: torch.Tensor | None = None,
                prev_rows: dict[int, int] | None = None) -> tuple[torch.Tensor, list[Request], torch.Tensor | None]:
        """Run one step; returns logits `[N, V]` (the model's dtype) for the requests that sample, those requests,
        and `logits.argmax(dim=-1)` where a full CUDA graph computed it (else None; the sampler's `greedy`).

        `prev_tokens` are the previous step's sampled tokens, still on the device, and `prev_rows` maps
        `id(request)` to its row there: the source of every token this step consumes that the host has not read.
        """
        inp = self.pack(step)
        if inp.pending_rows:
            try:
                inp.pending_src = [prev_rows[id(r)] for r in inp.pending_reqs]
            except (KeyError, TypeError):
                raise RuntimeError("internal error: a pending token was not sampled by the previous step") from None
            inp.prev_tokens = prev_tokens
        out = self._compiled_forward(inp)
        if out is not None:
            return out[0], inp.sampled, out[1]
        meta = self._stage(inp)
        n, t = len(inp.logits_indices), len(inp.input_ids)
        with forward_context(self.context(meta)):
            logits = self.model_forward(self.input_ids[:t], self.positions[:t], self.logits_indices[:n])
        return logits, inp.sampled, None
