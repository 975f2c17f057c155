"""The reference backend: plain torch ops over the paged cache, on any device.

It gathers each sequence's KV blocks through the block table, pads the step's queries into `[B, Qmax]`, and runs
masked attention in float32. The index tensors that do this are built once per step in `prepare()`, so the per-layer
path is a handful of batched tensor ops with no Python loop over sequences. It is the correctness yardstick for the
faster backends, not a fast path: memory grows with `num_seqs * max_query_len * max_seq_len`.
"""

from __future__ import annotations

import torch

from hf_accel.attention.backend import AttentionBackend, CUDAGraphSupport
from hf_accel.attention.metadata import StepMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supported_block_sizes = (16, 32, 64, 128, 256)
    cudagraph_support = CUDAGraphSupport.NEVER  # host-built index tensors and per-step shapes

    def prepare(self, meta: StepMetadata) -> None:
        qlens = meta.query_lens_cpu
        num_seqs, qmax = meta.num_seqs, meta.max_query_len
        starts = meta.query_start_loc[:num_seqs].to(torch.long)
        j = torch.arange(qmax, device=self.device)
        qlens_t = meta.query_start_loc[1 : num_seqs + 1].to(torch.long) - starts
        self._q_valid = j[None, :] < qlens_t[:, None]  # [B, Qmax]
        self._q_index = torch.where(self._q_valid, starts[:, None] + j[None, :], 0)  # [B, Qmax] -> token row
        # valid rows of the padded [B * Qmax] output, in packed token order
        self._out_rows = torch.cat([torch.arange(i * qmax, i * qmax + n) for i, n in enumerate(qlens)]).to(self.device)
        num_kv_blocks = -(-meta.max_seq_len // meta.block_size)
        self._kv_blocks = meta.block_tables[:num_seqs, :num_kv_blocks].to(torch.long)
        kv_pos = torch.arange(num_kv_blocks * meta.block_size, device=self.device)
        q_pos = meta.context_lens[:num_seqs, None].to(torch.long) + j[None, :]  # [B, Qmax]
        self._q_pos = q_pos
        self._kv_pos = kv_pos
        # slots past a sequence's length hold whatever an earlier owner of the block left: zeroed in V below, since a
        # zero attention weight times a stale NaN is still NaN (one request's NaN would reach the next user of its
        # blocks)
        self._kv_valid = kv_pos[None, :] < meta.seq_lens[:num_seqs, None].to(torch.long)  # [B, L]
        self._base_mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & self._kv_valid[:, None, :]  # [B, Qmax, L]
        self._window_masks: dict[int, torch.Tensor] = {}

    def _mask(self, sliding_window: int) -> torch.Tensor:
        if sliding_window <= 0:
            return self._base_mask
        mask = self._window_masks.get(sliding_window)
        if mask is None:
            in_window = (self._q_pos[:, :, None] - self._kv_pos[None, None, :]) < sliding_window
            mask = self._window_masks[sliding_window] = self._base_mask & in_window
        return mask

    def forward(self, query, k_cache, v_cache, meta, output, scale, sliding_window, softcap) -> None:
        num_seqs, qmax = meta.num_seqs, meta.max_query_len
        _, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        # [B, L, Hkv, D] straight from the paged cache
        k = k_cache[self._kv_blocks].flatten(1, 2).float()
        v = v_cache[self._kv_blocks].flatten(1, 2).float()
        v = torch.where(self._kv_valid[:, :, None, None], v, 0.0)
        q = query[self._q_index].float().view(num_seqs, qmax, num_kv_heads, group, head_dim)
        scores = torch.einsum("bqhgd,blhd->bhgql", q, k) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~self._mask(sliding_window)[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgql,blhd->bqhgd", probs, v).reshape(num_seqs * qmax, num_heads, head_dim)
        output[: meta.num_tokens] = out.index_select(0, self._out_rows).to(output.dtype)
