"""Greedy token choice inside the decode CUDA graph: `torch.argmax(logits, dim=-1)` as one Triton launch.

A greedy decode step's last operation is an argmax over each row's logits. torch's reduction runs it in one block
per row for a handful of rows, about 26-35 us over Llama's 128,256 logits at batch 1 on an H200 (9 us over Qwen3's
151,936), which is 3 % of a 1B model's step. Here each row is split into `CHUNK`-value slices, one program each, so
the whole GPU reads the logits (about 3 us at one row); each program writes its slice's maximum and index, takes a
ticket from its row's counter, and the program that draws the last ticket reduces the row's slices (so one launch,
no second kernel) and sets the counter back to zero for the next launch.

Launched from the host after the graph it did not pay (its Python launch cost more host time than torch's), so the
runner captures it at the end of every full decode graph (`AccelConfig.graph_greedy_argmax`) and the sampler takes
its tokens where every request of the step is plain greedy (`engine/sampler.py`).

Exactly `torch.argmax`: the first index of the largest value, where NaN counts as larger than everything (the first
NaN wins), -0.0 equals 0.0, and a row of -inf gives index 0. The values are compared in float32, which holds every
bf16 / fp16 value exactly.

This module imports triton at the top; callers import it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.ops.pdl import launch_kwargs
from hf_accel.ops.triton_build import launcher, settle_cache_keys

CHUNK = 4096  # logits per program: 32 per thread at 4 warps
# the dtypes whose every value float32 holds exactly (a float64 row would compare rounded values)
_EXACT_IN_FLOAT32 = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _first_max(values, index, ok):
    """(largest value, its first index) of a block, NaN counting as the largest (as torch.argmax); `ok` marks the
    entries that count."""
    is_nan = ok & (values != values)
    first_nan = tl.min(tl.where(is_nan, index, 2147483647), axis=0)
    finite = tl.where(ok & (values == values), values, float("-inf"))
    top = tl.max(finite, axis=0)
    first_top = tl.min(tl.where(ok & (finite == top), index, 2147483647), axis=0)
    has_nan = first_nan < 2147483647
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, first_nan, first_top)


@triton.jit
def _greedy_argmax_kernel(logits_ptr, stride_row, out_ptr, part_val_ptr, part_idx_ptr, counters_ptr, V,
                          NUM_CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    if USE_PDL:  # the logits are the previous kernel's output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=ok, other=float("-inf")).to(tl.float32)
    value, index = _first_max(x, offs, ok)
    if NUM_CHUNKS == 1:
        tl.store(out_ptr + row, index.to(tl.int64))
    else:
        slot = row * NUM_CHUNKS + chunk
        tl.store(part_val_ptr + slot, value)
        tl.store(part_idx_ptr + slot, index)
        # the stores come before the ticket (release); the last ticket (acquire) then sees every slice's result.
        # The loads below bypass L1 (.cg), which holds nothing stale of them
        tl.debug_barrier()
        ticket = tl.atomic_add(counters_ptr + row, 1, sem="acq_rel", scope="gpu")
        if ticket == NUM_CHUNKS - 1:
            tl.atomic_xchg(counters_ptr + row, 0, sem="relaxed", scope="gpu")  # ready for the next launch
            c = tl.arange(0, CHUNKS_PAD)
            c_ok = c < NUM_CHUNKS
            vals = tl.load(part_val_ptr + row * NUM_CHUNKS + c, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
            idxs = tl.load(part_idx_ptr + row * NUM_CHUNKS + c, mask=c_ok, other=2147483647, cache_modifier=".cg")
            # slices hold increasing index ranges: the first index among the slices' winners is the first overall
            _, best = _first_max(vals, idxs, c_ok)
            tl.store(out_ptr + row, best.to(tl.int64))


class GreedyArgmax:
    """`argmax(logits, dim=-1)` for up to `max_rows` rows of `vocab` logits, with scratch of fixed addresses (a
    CUDA graph replays the launch): per-slice results and one ticket counter per row, kept at zero between launches.
    Owned by one runner; its launches are stream-ordered, so the scratch is never used by two at once."""

    def __init__(self, max_rows: int, vocab: int, device: torch.device) -> None:
        self.max_rows, self.vocab = max_rows, vocab
        self.num_chunks = triton.cdiv(vocab, CHUNK)
        self.part_val = torch.empty(max_rows * self.num_chunks, dtype=torch.float32, device=device)
        self.part_idx = torch.empty(max_rows * self.num_chunks, dtype=torch.int32, device=device)
        self.counters = torch.zeros(max_rows, dtype=torch.int32, device=device)

    def fits(self, logits: torch.Tensor) -> bool:
        return (logits.dim() == 2 and logits.shape[0] <= self.max_rows and logits.shape[1] == self.vocab
                and logits.stride(1) == 1 and logits.dtype in _EXACT_IN_FLOAT32)

    def __call__(self, logits: torch.Tensor, use_pdl: bool = False) -> torch.Tensor:
        """int64 `[rows]`: the index of each row's largest logit, exactly as `logits.argmax(dim=-1)`."""
        if not self.fits(logits):
            raise ValueError(f"GreedyArgmax for {self.max_rows} rows of {self.vocab} logits got "
                             f"{tuple(logits.shape)} (strides {logits.stride()}, {logits.dtype})")
        rows = logits.shape[0]
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
        if rows == 0:
            return out
        grid = (self.num_chunks, rows)
        launch = launcher(_greedy_argmax_kernel, grid, writes=(out,))
        launch(logits, logits.stride(0), out, self.part_val, self.part_idx, self.counters, self.vocab,
               NUM_CHUNKS=self.num_chunks, CHUNKS_PAD=triton.next_power_of_2(self.num_chunks), BLOCK=CHUNK,
               USE_PDL=use_pdl, num_warps=4, **launch_kwargs(use_pdl))
        return out


# keys that do not depend on which kernel a process launches first (ops/triton_build.py)
settle_cache_keys(globals())
