"""Per-step attention metadata, built once per engine step (never per layer).

Every backend reads the same `StepMetadata`; a backend that needs more (plan() calls, index buffers) builds it in
`AttentionBackend.prepare(meta)` and keeps it on the side. For CUDA graphs the runner slices these tensors out of
persistent buffers, so a captured graph sees the same addresses at every replay.

Conventions (all backends):
- Tokens of the step are packed: sequence `i` owns query rows `query_start_loc[i]:query_start_loc[i+1]`.
- `seq_lens[i]` is the KV length of sequence `i` *after* this step's tokens are written; the first
  `context_lens[i] = seq_lens[i] - query_len[i]` tokens were already in the cache. Query token `j` of sequence `i`
  sits at position `context_lens[i] + j` and attends causally to KV positions `<= context_lens[i] + j`.
- KV cache of one layer: `k_cache`, `v_cache`, each `[num_blocks, block_size, num_kv_heads, head_dim]` ("NHD").
  Position `p` of sequence `i` lives at block `block_tables[i, p // block_size]`, row `p % block_size`;
  `slot_mapping[t] = block * block_size + row` for the token `t`, `-1` for padded tokens (never written).
- Block 0 is the null block: never handed to a sequence; padded block-table entries point at it.
- Rows padded in for CUDA graphs (sequence index >= num_seqs) have `seq_lens == 0`; backends must not read KV for them
  and must not write anywhere but their own output rows.
- `sliding_window` follows transformers: a query at position q sees keys at positions k with q - k < sliding_window.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


@dataclass
class StepMetadata:
    num_tokens: int  # real tokens in this step (rows of query beyond it are padding)
    num_seqs: int  # real sequences in this step
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    context_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int64 [num_tokens_padded]
    # host copies, for backends whose planning runs on the CPU (never read on the per-layer path)
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)

    def host_lens(self) -> tuple[list[int], list[int]]:
        """Per-sequence query and KV lengths on the host: the host copies, or one sync when they are absent."""
        n = self.num_seqs
        if len(self.query_lens_cpu) >= n and len(self.seq_lens_cpu) >= n:
            return list(self.query_lens_cpu[:n]), list(self.seq_lens_cpu[:n])
        starts = self.query_start_loc[: n + 1].tolist()
        return [b - a for a, b in itertools.pairwise(starts)], self.seq_lens[:n].tolist()

    @property
    def is_uniform_decode(self) -> bool:
        return self.max_query_len == 1

    @property
    def num_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]


def cumsum0(values: list[int]) -> list[int]:
    """[0, v0, v0+v1, ...]: an indptr array built on the host."""
    return [0, *itertools.accumulate(values)]
