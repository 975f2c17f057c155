"""The runner's persistent step buffers against values rebuilt from scratch, after every upload.

The runner keeps state between steps to copy less (a host block table written only where a request appended blocks,
block-table columns zeroed only where a wider step wrote them, `logits_indices` uploaded only when they change, no
token ids uploaded when every token is still on the device). Greedy output alone could hide a stale entry the
attention masks away, so this checks the buffers themselves: every request's row of `block_tables` (its blocks,
zeros after them, zero rows for graph padding), `seq_lens`, `context_lens`, `query_start_loc`, `slot_mapping`,
`logits_indices` and `input_ids` (pending rows: the previous step's tokens), over engines small enough to preempt
and prompts that share prefixes (prefix-cache hits at admission), with and without asynchronous scheduling. The
outputs must also equal stock transformers'.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import PAD_ID, engine_of, fresh_copy, left_pad, make_llama

from hf_accel import accelerate_model
from hf_accel.config import AccelConfig
from hf_accel.engine.runner import ModelRunner


def rebuilt_errors(runner: ModelRunner, rows: list[tuple[int, list[int], int]], inp, prev_tokens,
                   num_seqs_padded: int | None) -> list[str]:
    """What differs between the device buffers and the step rebuilt from (tokens, blocks, computed) per request."""
    b = len(rows)
    bp = num_seqs_padded or b
    bs, width = runner.block_size, runner.max_blocks_per_seq
    table = runner.block_tables.cpu().numpy()
    errors, qsl = [], [0]
    for i, (n, blocks, computed) in enumerate(rows):
        if table[i].tolist() != blocks + [0] * (width - len(blocks)):
            errors.append(f"block_tables row {i}: {table[i].tolist()} for blocks {blocks}")
        qsl.append(qsl[-1] + n)
        if int(runner.seq_lens[i]) != computed + n or int(runner.context_lens[i]) != computed:
            errors.append(f"seq_lens / context_lens of row {i}")
        want = [blocks[p // bs] * bs + p % bs for p in range(computed, computed + n)]
        if runner.slot_mapping[qsl[i] : qsl[i + 1]].tolist() != want:
            errors.append(f"slot_mapping of row {i}")
    if (table[b:bp] != 0).any():
        errors.append("graph-padded rows of block_tables")
    if runner.query_start_loc[: b + 1].tolist() != qsl:
        errors.append(f"query_start_loc {runner.query_start_loc[: b + 1].tolist()} != {qsl}")
    n = len(inp.logits_indices)
    if runner.logits_indices[:n].tolist() != inp.logits_indices.tolist():
        errors.append("logits_indices")
    want_ids = torch.from_numpy(inp.input_ids.copy())
    if inp.pending_rows:
        want_ids[inp.pending_rows] = prev_tokens[inp.pending_src].to(torch.int64)
    if not torch.equal(runner.input_ids[: len(inp.input_ids)], want_ids):
        errors.append("input_ids")
    return errors


@pytest.mark.parametrize("cfg", [
    dict(num_kv_blocks=10, max_num_batched_tokens=40, max_num_seqs=4),  # preempts
    dict(num_kv_blocks=40, max_num_batched_tokens=128, max_num_seqs=8),
    dict(num_kv_blocks=9, max_num_batched_tokens=20, max_num_seqs=5, config=AccelConfig(async_scheduling=False)),
], ids=["small-pool", "roomy", "sync"])
def test_step_buffers_equal_a_rebuild_every_step(monkeypatch, cfg):
    current: dict = {}
    execute, stage = ModelRunner.execute, ModelRunner._stage
    checked, stale = [0], []

    def recording_execute(self, step, prev_tokens=None, prev_rows=None):
        current["rows"] = [(n, list(r.block_ids), r.num_computed_tokens)
                           for r, n in zip(step.requests, step.num_tokens, strict=True)]
        current["prev"] = prev_tokens
        return execute(self, step, prev_tokens, prev_rows)

    def checking_stage(self, inp, num_tokens_padded=None, num_seqs_padded=None):
        meta = stage(self, inp, num_tokens_padded, num_seqs_padded)
        errors = rebuilt_errors(self, current["rows"], inp, current["prev"], num_seqs_padded)
        checked[0] += 1
        if errors:
            stale.append(errors[:3])
        return meta

    monkeypatch.setattr(ModelRunner, "execute", recording_execute)
    monkeypatch.setattr(ModelRunner, "_stage", checking_stage)
    stock = make_llama(0)
    model = accelerate_model(fresh_copy(stock), attention_backend="torch", block_size=16, **cfg)
    rng = random.Random(0)
    shared = [rng.randrange(3, 200) for _ in range(80)]
    for _ in range(4):
        rows = []
        for _ in range(rng.randint(2, 6)):
            prefix = shared[: rng.choice([0, 16, 17, 32, 40])]  # whole shared blocks: prefix-cache hits
            rows.append((prefix + [rng.randrange(3, 200) for _ in range(rng.randint(1, 40))])[:60])
        ids, mask = left_pad(rows)
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=rng.randint(8, 30), do_sample=False,
                  pad_token_id=PAD_ID, eos_token_id=None)
        assert torch.equal(model.generate(**kw), stock.generate(**kw))
    assert checked[0] > 50
    assert not stale, f"{len(stale)} of {checked[0]} steps left stale device buffers, e.g. {stale[0]}"
    if cfg["num_kv_blocks"] == 10:
        engine = engine_of(model)
        assert engine.stats.preemptions > 0 and engine.scheduler.prefix_hit_tokens > 0
