"""The Triton attention backend against the torch reference backend.

Without a GPU the kernels run on CPU tensors in the Triton interpreter (TRITON_INTERPRET=1, set below before
triton is imported), on tiny shapes in fp32/fp16. On a CUDA machine the same tests run compiled on the GPU, and
the `gpu`-marked tests add bf16 at real shapes (head dims 64/128/256, block sizes 16/32/64, contexts up to 32k)
and CUDA-graph capture/replay.

Caches start filled with NaN, so any read of a slot that was never written (null block, unallocated blocks, rows
past a sequence's end) shows up as NaN in the output.
"""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE, ON_GPU, load_kernel_modules

triton = pytest.importorskip("triton")

import dataclasses  # noqa: E402

from hf_accel.attention.backend import AttentionSpec  # noqa: E402
from hf_accel.attention.metadata import StepMetadata  # noqa: E402
from hf_accel.attention.torch_backend import TorchAttentionBackend  # noqa: E402

load_kernel_modules([f"hf_accel.attention.kernels.{n}" for n in ("kv_write", "common", "unified_attention",
                                                                    "split_kv_decode")], "_write_kv_kernel")

from hf_accel.attention.kernels.common import TileConfig  # noqa: E402
from hf_accel.attention.kernels.split_kv_decode import choose_num_splits  # noqa: E402
from hf_accel.attention.triton_backend import TritonAttentionBackend  # noqa: E402

TOL = {torch.float32: 2e-4, torch.float16: 6e-3, torch.bfloat16: 2.5e-2}


@dataclasses.dataclass
class Step:
    meta: StepMetadata
    query: torch.Tensor  # [T_pad, H, D]
    key: torch.Tensor  # [T_pad, Hkv, D] new rows (padded rows hold junk that must not be written)
    value: torch.Tensor
    k_cache: torch.Tensor  # NaN except the cached prefixes
    v_cache: torch.Tensor
    max_blocks_per_seq: int


def make_step(query_lens: list[int], context_lens: list[int], *, num_heads: int = 4, num_kv_heads: int = 2,
              head_dim: int = 16, block_size: int = 16, dtype: torch.dtype = torch.float32, pad_seqs: int = 0,
              pad_tokens: int = 0, seed: int = 0, device: torch.device = DEVICE) -> Step:
    """A step built by hand the way the runner builds one: blocks drawn at random from a pool (never block 0),
    block-table tails pointing at block 0, graph padding as in `ModelRunner.upload` (padded sequences take one
    query token each past the real ones, seq_len 0, slot -1)."""
    gen = torch.Generator().manual_seed(seed)  # block pool (host)
    dgen = torch.Generator(device=device).manual_seed(seed)  # values, drawn where they live (32k contexts on GPU)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=dgen, device=device).to(dtype)

    b, bp = len(query_lens), len(query_lens) + pad_seqs
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    t = sum(query_lens)
    tp = t + pad_tokens
    need = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(need) + 1
    num_blocks = 1 + sum(need) + 3
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(bp, max_blocks, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    slots: list[int] = []
    for i in range(b):
        pos = torch.arange(seq_lens[i])
        blk, row = tables[i, pos // block_size].long(), pos % block_size
        c = context_lens[i]
        k_cache[blk[:c].to(device), row[:c].to(device)] = rnd(c, num_kv_heads, head_dim)
        v_cache[blk[:c].to(device), row[:c].to(device)] = rnd(c, num_kv_heads, head_dim)
        slots += (blk[c:] * block_size + row[c:]).tolist()
    slots += [-1] * (tp - t)

    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    qsl += [min(t + 1 + i, tp) for i in range(pad_seqs)]
    i32 = dict(dtype=torch.int32, device=device)
    meta = StepMetadata(
        num_tokens=t, num_seqs=b, max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=block_size,
        query_start_loc=torch.tensor(qsl, **i32),
        seq_lens=torch.tensor(seq_lens + [0] * pad_seqs, **i32),
        context_lens=torch.tensor(list(context_lens) + [0] * pad_seqs, **i32),
        block_tables=tables.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens,
    )

    return Step(meta, rnd(tp, num_heads, head_dim), rnd(tp, num_kv_heads, head_dim), rnd(tp, num_kv_heads, head_dim),
                k_cache, v_cache, max_blocks)


def spec_of(step: Step) -> AttentionSpec:
    _, h, d = step.query.shape
    return AttentionSpec(num_heads=h, num_kv_heads=step.k_cache.shape[2], head_dim=d, dtype=step.query.dtype)


def make_backend(step: Step, num_kv_splits: int | None = None, decode_block_n: int | None = None,
                 max_num_seqs: int = 8, fused_split_reductions: bool = True) -> TritonAttentionBackend:
    be = TritonAttentionBackend(spec_of(step), step.query.device, step.meta.block_size, max_num_seqs,
                                step.query.shape[0], step.max_blocks_per_seq, num_kv_splits=num_kv_splits)
    be.fused_split_reductions = fused_split_reductions  # as the engine sets it
    if decode_block_n is not None:
        be.decode_config = TileConfig(16, decode_block_n, 4, 2)
    return be


def reference(step: Step, scale: float, window: int, softcap: float) -> torch.Tensor:
    """Torch backend on the same step (NaN cache slots zeroed: the reference gathers whole blocks)."""
    kc, vc = step.k_cache.nan_to_num(0.0), step.v_cache.nan_to_num(0.0)
    be = TorchAttentionBackend(spec_of(step), step.query.device, step.meta.block_size, 8, step.query.shape[0],
                               step.max_blocks_per_seq)
    n = step.meta.num_tokens
    be.write_kv(step.key[:n], step.value[:n], kc, vc, step.meta)
    be.prepare(step.meta)
    out = torch.zeros_like(step.query)
    be.forward(step.query, kc, vc, step.meta, out, scale, window, softcap)
    return out[:n]


def run_triton(step: Step, be: TritonAttentionBackend, scale: float, window: int, softcap: float,
               meta: StepMetadata | None = None, *, separate: bool = False,
               caches: list | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The layer as the attention op runs it (`write_kv_and_forward`), or `separate`ly: `write_kv`, then `forward`.
    Every row is handed over, padded ones included: their slot -1 must be skipped. `caches` receives (k, v).
    `out`: the output to write (default: a fresh one full of NaN)."""
    meta = meta or step.meta
    kc, vc = step.k_cache.clone(), step.v_cache.clone()
    be.prepare(meta)
    out = torch.full_like(step.query, float("nan")) if out is None else out
    if separate:
        be.write_kv(step.key, step.value, kc, vc, meta)
        be.forward(step.query, kc, vc, meta, out, scale, window, softcap)
    else:
        be.write_kv_and_forward(step.query, step.key, step.value, kc, vc, meta, out, scale, window, softcap)
    if caches is not None:
        caches += [kc, vc]
    return out


def check(step: Step, be: TritonAttentionBackend, *, scale: float | None = None, window: int = 0,
          softcap: float = 0.0, meta: StepMetadata | None = None) -> None:
    scale = scale if scale is not None else step.query.shape[-1] ** -0.5
    matches_reference(step, run_triton(step, be, scale, window, softcap, meta), scale, window, softcap)


def matches_reference(step: Step, out: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> None:
    """`out` (the layer's output for `step`) against the reference; graph-padded rows exact zeros."""
    ref = reference(step, scale, window, softcap)
    n = step.meta.num_tokens
    tol = TOL[step.query.dtype]
    torch.testing.assert_close(out[:n].float(), ref.float(), atol=tol, rtol=tol)
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padded rows must be zeros"


DTYPES = [torch.float32, torch.float16]


# -- KV write --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_skips_padded_slots(dtype, block_size):
    step = make_step([5, 1, 9], [3, 20, 0], block_size=block_size, dtype=dtype, pad_seqs=2, pad_tokens=4)
    be = make_backend(step)
    kc, vc = step.k_cache.clone(), step.v_cache.clone()
    be.write_kv(step.key, step.value, kc, vc, step.meta)
    ref_k, ref_v = step.k_cache.clone(), step.v_cache.clone()
    n = step.meta.num_tokens
    slots = step.meta.slot_mapping[:n]
    ref_k.view(-1, *ref_k.shape[2:])[slots] = step.key[:n]
    ref_v.view(-1, *ref_v.shape[2:])[slots] = step.value[:n]
    assert torch.equal(kc.nan_to_num(123.0), ref_k.nan_to_num(123.0))
    assert torch.equal(vc.nan_to_num(123.0), ref_v.nan_to_num(123.0))
    assert torch.isnan(kc[0]).all() and torch.isnan(vc[0]).all(), "null block must stay untouched"


def test_write_kv_head_dim_not_power_of_two():
    step = make_step([3, 4], [0, 5], num_heads=6, num_kv_heads=3, head_dim=24)
    be = make_backend(step)
    kc = step.k_cache.clone()
    be.write_kv(step.key, step.value, kc, step.v_cache.clone(), step.meta)
    slots = step.meta.slot_mapping
    assert torch.equal(kc.view(-1, 3, 24)[slots], step.key)


# -- unified kernel --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_gqa(dtype):
    step = make_step([9, 17], [0, 0], dtype=dtype, head_dim=32, seed=1)
    check(step, make_backend(step))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_chunked_prefill_with_cached_prefix(dtype, block_size):
    step = make_step([8, 20], [19, 70], dtype=dtype, block_size=block_size, seed=2)
    check(step, make_backend(step))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_prefill_and_decode(dtype):
    step = make_step([1, 12, 1, 5], [33, 0, 7, 20], dtype=dtype, seed=3)
    check(step, make_backend(step))


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window(window):
    step = make_step([1, 24, 3], [50, 30, 0], seed=4)
    check(step, make_backend(step), window=window)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_and_scale(dtype):
    step = make_step([6, 1, 10], [10, 40, 0], dtype=dtype, seed=5)
    check(step, make_backend(step), scale=0.9, softcap=3.0)
    check(step, make_backend(step), scale=0.9, softcap=3.0, window=7)


def test_mqa_and_wide_groups():
    step = make_step([4, 1], [9, 30], num_heads=8, num_kv_heads=1, seed=6)
    check(step, make_backend(step))
    step = make_step([4, 1], [9, 30], num_heads=6, num_kv_heads=2, seed=7)  # group 3: padded to 4 rows
    check(step, make_backend(step))


def test_head_dim_padded_to_power_of_two():
    step = make_step([7, 1], [5, 22], head_dim=24, seed=8)
    check(step, make_backend(step), softcap=4.0)


def test_small_query_tiles_cover_long_prefill():
    """Many query tiles per sequence, tiles straddling sequence boundaries in the packed order."""
    step = make_step([13, 6, 1, 21], [3, 0, 17, 12], seed=9)
    be = make_backend(step)
    be.unified_config = TileConfig(16, 16, 4, 1)  # 8 tokens x 2 heads per program
    check(step, be)
    check(step, be, window=6)


@pytest.mark.parametrize("pad_tokens", [2, 6])
def test_graph_padded_rows_unified(pad_tokens):
    step = make_step([1, 7, 1], [12, 3, 40], pad_seqs=3, pad_tokens=pad_tokens, seed=10)
    check(step, make_backend(step))


def test_decode_unified_path():
    step = make_step([1] * 5, [0, 15, 16, 47, 90], seed=11)
    be = make_backend(step, num_kv_splits=0)
    assert be.splits_for_step(step.meta) == 0
    check(step, be)
    check(step, be, window=10, softcap=2.0)


# -- split-KV decode -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [2, 4])
def test_split_kv_decode(dtype, splits):
    # seq 0 has a single key: most of its splits are empty and must not disturb the merge
    step = make_step([1] * 4, [0, 15, 70, 129], dtype=dtype, seed=12)
    be = make_backend(step, num_kv_splits=splits, decode_block_n=16)
    assert be.splits_for_step(step.meta) == splits
    check(step, be)


@pytest.mark.parametrize("window,softcap", [(9, 0.0), (0, 2.5), (33, 5.0)])
def test_split_kv_decode_window_softcap(window, softcap):
    step = make_step([1] * 3, [5, 64, 100], seed=13)
    check(step, make_backend(step, num_kv_splits=4, decode_block_n=16), window=window, softcap=softcap)


@pytest.mark.parametrize("pad_tokens", [3, 5])
def test_split_kv_decode_graph_padded(pad_tokens):
    step = make_step([1] * 3, [20, 3, 77], pad_seqs=3, pad_tokens=pad_tokens, seed=14)
    check(step, make_backend(step, num_kv_splits=4, decode_block_n=16))


@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("pad_seqs", [0, 2])
def test_split_kv_decode_fused_merge_equals_merge_kernel(window, pad_seqs):
    """The merge inside the split kernel (the last split of each sequence and KV head merges) gives the merge
    kernel's result, also when most splits get no keys (context 1 and 12 against 8 splits of 16-key tiles) and on
    graph-padded rows (zeros); its ticket counters are zeros again after every launch, so launch after launch agree.
    The fused merge takes a GQA group's heads in one tile and the merge kernel one head per program, so they may
    add the splits' float32 partials in another order: they agree to float32 rounding (launch after launch, and on
    padded rows, bitwise)."""
    step = make_step([1] * 4, [0, 11, 70, 129], pad_seqs=pad_seqs, pad_tokens=pad_seqs, seed=21)
    fused = make_backend(step, num_kv_splits=8, decode_block_n=16)
    plain = make_backend(step, num_kv_splits=8, decode_block_n=16, fused_split_reductions=False)
    scale = step.query.shape[-1] ** -0.5
    want_caches, got_caches = [], []
    want = run_triton(step, plain, scale, window, 0.0, caches=want_caches)
    first = None
    for _ in range(3):
        got_caches.clear()
        got = run_triton(step, fused, scale, window, 0.0, caches=got_caches)
        _same_merge(got, want)
        assert first is None or torch.equal(got, first), "launch after launch must give the same bits"
        first = got
        assert not fused._merge_counters.any(), "every counter must be back at zero after the launch"
        # the fused launch wrote the new K/V itself: the caches equal the KV write kernel's, NaN (unwritten) included
        for g, w in zip(got_caches, want_caches, strict=True):
            assert torch.equal(g.nan_to_num(123.0), w.nan_to_num(123.0))
    _same_merge(run_triton(step, fused, scale, window, 0.0, separate=True), want)
    check(step, fused, window=window)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,chunk",
                         [(8, 2, 16, 2), (6, 2, 16, 4), (6, 2, 24, 2), (4, 4, 32, 1)])
def test_split_kv_decode_fused_merge_group_and_chunks(monkeypatch, num_heads, num_kv_heads, head_dim, chunk):
    """The fused merge takes a GQA group's heads together (groups of 4, 3 and 1 here) and the splits' partials in
    chunks: with chunks smaller than the splits that got keys (up to 8 of 8 here), its loop over chunks runs several
    times. Against the merge kernel and the reference, with scratch full of stale values (NaN partials, finite lse:
    a split without keys must never be read), a head dim that is not a power of two, and an output view with a gap
    after each row's heads (a store outside the group's heads or the head dim lands there)."""
    from hf_accel.attention.kernels import split_kv_decode as skv

    monkeypatch.setattr(skv, "merge_chunk", lambda num_splits, group, head_dim_pad: chunk)
    step = make_step([1] * 4, [0, 40, 70, 129], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     pad_seqs=1, pad_tokens=1, seed=23)
    fused = make_backend(step, num_kv_splits=8, decode_block_n=16)
    plain = make_backend(step, num_kv_splits=8, decode_block_n=16, fused_split_reductions=False)
    scale = step.query.shape[-1] ** -0.5
    _same_merge(run_triton(step, fused, scale, 0, 0.0), run_triton(step, plain, scale, 0, 0.0))
    assert not fused._merge_counters.any()
    check(step, fused)

    fused._part_out.fill_(float("nan"))
    fused._part_lse.fill_(3.0)
    tokens, heads, dim = step.query.shape
    padded = torch.full((tokens, heads + 2, dim), 7.0, dtype=step.query.dtype, device=step.query.device)
    out = run_triton(step, fused, scale, 0, 0.0, out=padded[:, :heads])
    assert (padded[:, heads:] == 7.0).all(), "a store outside the group's heads or the head dim"
    matches_reference(step, out, scale)


def test_merge_chunk_bounds():
    """At most 4,096 float32 values per chunk, a power of two, never more than the padded split count."""
    from hf_accel.attention.kernels.split_kv_decode import merge_chunk

    assert merge_chunk(64, 4, 64) == 16 and merge_chunk(64, 2, 128) == 16 and merge_chunk(64, 4, 128) == 8
    assert merge_chunk(6, 4, 64) == 8 and merge_chunk(64, 16, 256) == 1 and merge_chunk(64, 3, 64) == 16


def _same_merge(got: torch.Tensor, want: torch.Tensor) -> None:
    """To float32 rounding of a sum over splits taken in another order; padded rows exact zeros."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[want == 0], want[want == 0]), "padded rows must stay exact zeros"


def test_split_kv_decode_fused_kv_write_skips_null_slots():
    """A decode row whose slot is -1 (a token that must not be cached) is not written by the fused launch either:
    its cache row keeps what was there, as with the KV write kernel."""
    step = make_step([1] * 3, [30, 5, 64], seed=23)
    step.meta.slot_mapping[1] = -1
    fused = make_backend(step, num_kv_splits=4, decode_block_n=16)
    plain = make_backend(step, num_kv_splits=4, decode_block_n=16, fused_split_reductions=False)
    scale = step.query.shape[-1] ** -0.5
    want_caches, got_caches = [], []
    want = run_triton(step, plain, scale, 0, 0.0, caches=want_caches)
    got = run_triton(step, fused, scale, 0, 0.0, caches=got_caches)
    _same_merge(got.nan_to_num(7.0), want.nan_to_num(7.0))
    for g, w in zip(got_caches, want_caches, strict=True):
        assert torch.equal(g.nan_to_num(123.0), w.nan_to_num(123.0))


def test_split_kv_decode_fused_merge_only_where_rows_are_sequences():
    """Rows that belong to no sequence (more query rows than sequences, as a piecewise-padded step has) need the
    merge kernel, which zeroes them: the fused path must not run there."""
    step = make_step([1] * 3, [20, 3, 77], pad_seqs=1, pad_tokens=4, seed=22)
    be = make_backend(step, num_kv_splits=4, decode_block_n=16)
    be._merge_counters.fill_(7)  # a fused launch would read these and merge nothing, leaving NaN rows
    check(step, be)
    assert (be._merge_counters == 7).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (9, 0.0), (0, 2.5)])
@pytest.mark.parametrize("pad_seqs", [0, 2])
def test_unsplit_decode_kernel(dtype, window, softcap, pad_seqs):
    """One program per (sequence, KV head), output written directly: against the reference, graph-padded rows zeros,
    and the new K/V it writes itself equal to the KV write kernel's (slot -1 skipped), for either merge setting."""
    step = make_step([1] * 4, [0, 11, 70, 129], pad_seqs=pad_seqs, pad_tokens=pad_seqs, dtype=dtype, seed=31)
    slot = step.meta.slot_mapping[2].item()
    step.meta.slot_mapping[2] = -1  # a token that must not be cached
    scale = step.query.shape[-1] ** -0.5
    for fused in (True, False):
        be = make_backend(step, num_kv_splits=1, decode_block_n=16, fused_split_reductions=fused)
        assert be.splits_for_step(step.meta) == 1
        want_caches, got_caches = [], []
        want = run_triton(step, be, scale, window, softcap, separate=True, caches=want_caches)
        got = run_triton(step, be, scale, window, softcap, caches=got_caches)
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
        for g, w in zip(got_caches, want_caches, strict=True):
            assert torch.equal(g.nan_to_num(123.0), w.nan_to_num(123.0))
        step.meta.slot_mapping[2] = slot  # against the reference, seq 2's own key must be written
        check(step, be, window=window, softcap=softcap)
        step.meta.slot_mapping[2] = -1


@pytest.mark.parametrize("pad_seqs", [0, 3])
def test_unsplit_decode_longest_first(pad_seqs):
    """Unsplit decode launches take the sequences longest first: the order buffer holds the step's sequences by
    descending length (ties in batch order), then the identity (padded rows included). Which program takes which
    sequence changes nothing: the output and the K/V the launch writes are bitwise the batch-order launch's. A
    smaller step after it, already in order, puts the identity back; a step in order on an identity buffer writes
    nothing."""
    step = make_step([1] * 5, [40, 3, 129, 40, 70], pad_seqs=pad_seqs, pad_tokens=pad_seqs, seed=34)
    scale = step.query.shape[-1] ** -0.5
    ordered = make_backend(step, num_kv_splits=1, decode_block_n=16)
    plain = make_backend(step, num_kv_splits=1, decode_block_n=16)
    plain.longest_first = False  # the A/B switch (AccelConfig.decode_longest_first)
    got_caches, want_caches = [], []
    got = run_triton(step, ordered, scale, 0, 0.0, caches=got_caches)
    total = ordered._seq_order.numel()
    assert ordered._seq_order.tolist() == [2, 4, 0, 3, 1] + list(range(5, total))
    want = run_triton(step, plain, scale, 0, 0.0, caches=want_caches)
    assert plain._seq_order.tolist() == list(range(total))  # never written
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    for g, w in zip(got_caches, want_caches, strict=True):
        assert torch.equal(g.nan_to_num(123.0), w.nan_to_num(123.0))
    check(step, ordered)

    # the launch reads the order: with every entry 0 only sequence 0's programs run (the other rows stay NaN)
    ordered.prepare(step.meta)
    ordered._seq_order.fill_(0)
    out = torch.full_like(step.query, float("nan"))
    ordered.forward(step.query, step.k_cache.nan_to_num(0.0), step.v_cache.nan_to_num(0.0), step.meta, out, scale,
                    0, 0.0)
    assert not out[0].isnan().any() and out[1:5].isnan().all()
    # a launch for a step prepare() did not plan takes batch order: a smaller batch never reads the order written
    # for a larger one (it may hold indices past its own sequences)
    ordered.prepare(step.meta)
    small = make_step([1] * 2, [3, 40], seed=36)
    check(small, ordered, meta=small.meta)  # check() prepares; then forward without prepare() below
    ordered.prepare(step.meta)
    out = torch.full_like(small.query, float("nan"))
    kc, vc = small.k_cache.clone(), small.v_cache.clone()
    ordered.write_kv(small.key, small.value, kc, vc, small.meta)
    ordered.forward(small.query, kc, vc, small.meta, out, scale, 0, 0.0)
    matches_reference(small, out, scale)

    in_order = make_step([1] * 3, [90, 41, 2], seed=35)
    check(in_order, ordered)
    assert ordered._seq_order.tolist() == list(range(total)) and ordered._seq_order_identity
    ordered._seq_order.fill_(-1)  # an identity buffer is not rewritten for a step already in order
    run_triton(in_order, ordered, scale, 0, 0.0)
    assert (ordered._seq_order == -1).all()


def split_mixed_backend(step: Step, min_rows: int = 2, **kwargs) -> TritonAttentionBackend:
    be = make_backend(step, **kwargs)
    be.split_mixed = True  # AccelConfig.split_mixed_attention, as the engine sets it
    be.min_split_decode_rows = min_rows  # the real threshold (16) needs more sequences than the interpreter likes
    return be


def recorded_launches(monkeypatch, be: TritonAttentionBackend, calls: list | None = None
                      ) -> list[tuple[str, int, int]]:
    """(kernel, query rows, sequences) of every attention launch `be` makes from now on; `calls` gets (kernel, the
    launch's positional arguments after `seq_lens`)."""
    launches: list[tuple[str, int, int]] = []
    for module, name in ((be._split, "split_kv_decode"), (be._unified, "unified_attention")):
        real = getattr(module, name)

        def record(query, k_cache, v_cache, output, query_start_loc, seq_lens, *args, _real=real, _name=name,
                   **kwargs):
            launches.append((_name, query.shape[0], seq_lens.shape[0]))
            if calls is not None:
                calls.append((_name, args))
            return _real(query, k_cache, v_cache, output, query_start_loc, seq_lens, *args, **kwargs)
        monkeypatch.setattr(module, name, record)
    return launches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_splits", [None, 1, 2, 0])
@pytest.mark.parametrize("pad", [0, 2])
def test_mixed_step_split_into_decode_and_unified_launches(monkeypatch, dtype, num_kv_splits, pad):
    """split_mixed: a mixed step's leading decode rows go to the decode kernel (unsplit, split, or, with no decode
    kernel for the batch, the unified kernel's decode tile) and the rows after them to the unified kernel, each on
    its own slice; the output matches the reference, graph-padded rows are zeros and the step's K/V are written
    once, before both launches."""
    step = make_step([1, 1, 1, 1, 12, 1, 5], [33, 70, 7, 129, 0, 20, 9], dtype=dtype, pad_seqs=pad,
                     pad_tokens=pad + 3, seed=40)
    be = split_mixed_backend(step, num_kv_splits=num_kv_splits)  # default tiles: the split scratch is sized by them
    calls: list = []
    launches = recorded_launches(monkeypatch, be, calls)
    scale = step.query.shape[-1] ** -0.5
    caches: list = []
    out = run_triton(step, be, scale, 0, 0.0, caches=caches)
    assert be._mixed_decode_rows == 4
    rows, seqs = step.query.shape[0], step.meta.seq_lens.shape[0]
    first = "unified_attention" if num_kv_splits == 0 else "split_kv_decode"
    assert launches == [(first, 4, 4), ("unified_attention", rows - 4, seqs - 4)]
    if first == "split_kv_decode":  # the decode rows' K/V go to their launch, as a decode step's do
        new_kv = calls[0][1][10]
        assert new_kv is not None and new_kv[0].shape[0] == 4 and new_kv[2].shape[0] == 4
    assert calls[1][1][4] == step.meta.max_query_len  # the rest: the unified kernel's prefill tile
    matches_reference(step, out, scale)
    plain = make_backend(step, num_kv_splits=num_kv_splits)
    plain_caches: list = []
    run_triton(step, plain, scale, 0, 0.0, caches=plain_caches)
    for g, w in zip(caches, plain_caches, strict=True):  # every new K/V row written, padded slots skipped
        assert torch.equal(g.nan_to_num(123.0), w.nan_to_num(123.0))
    separate = run_triton(step, be, scale, 0, 0.0, separate=True)  # write_kv, then forward: K/V already there
    assert torch.equal(separate.nan_to_num(7.0), out.nan_to_num(7.0))
    check(step, be, window=9, softcap=2.5)
    check(step, be, scale=0.7)


def test_mixed_step_split_threshold_is_inclusive():
    """Exactly `min_split_decode_rows` leading decode rows split; one fewer does not."""
    step = make_step([1, 1, 1, 1, 6], [9, 30, 2, 17, 4], seed=46)
    check(step, be := split_mixed_backend(step, min_rows=4))
    assert be._mixed_decode_rows == 4
    check(step, be := split_mixed_backend(step, min_rows=5))
    assert be._mixed_decode_rows == 0


def test_mixed_step_split_decode_rows_longest_first(monkeypatch):
    """An unsplit decode launch for a split mixed step takes its decode rows longest first, like a decode step's."""
    step = make_step([1, 1, 1, 7, 1], [3, 129, 40, 10, 50], seed=41)
    be = split_mixed_backend(step, num_kv_splits=1, decode_block_n=16)
    check(step, be)
    total = be._seq_order.numel()
    assert be._mixed_decode_rows == 3 and be._seq_order.tolist() == [1, 2, 0] + list(range(3, total))
    # the decode rows' launch reads the order: with every entry 0 only sequence 0's programs run there
    scale = step.query.shape[-1] ** -0.5
    be.prepare(step.meta)
    be._seq_order.fill_(0)
    out = torch.full_like(step.query, float("nan"))
    kc, vc = step.k_cache.nan_to_num(0.0), step.v_cache.nan_to_num(0.0)
    be.write_kv(step.key, step.value, kc, vc, step.meta)
    be.forward(step.query, kc, vc, step.meta, out, scale, 0, 0.0)
    assert not out[0].isnan().any() and out[1:3].isnan().all() and not out[3:].isnan().any()


def test_mixed_step_not_split(monkeypatch):
    """No split: the switch off, fewer leading decode rows than the threshold (16 by default), no leading decode row
    (decodes after a prefill), a uniform decode step (the decode kernel alone), or a launch for a step prepare()
    did not plan (a smaller mixed step after a planned one: the plan's slices are not its own)."""
    from hf_accel.attention.triton_backend import MIXED_SPLIT_MIN_DECODE_ROWS

    mixed = make_step([1, 1, 1, 6, 1], [20, 9, 40, 3, 17], seed=42)
    off = make_backend(mixed)
    assert off.split_mixed is False  # the default (AccelConfig.split_mixed_attention)
    launches = recorded_launches(monkeypatch, off)
    check(mixed, off)
    assert launches[0][0] == "unified_attention" and launches[0][1] == mixed.query.shape[0]

    default_threshold = make_backend(mixed)
    default_threshold.split_mixed = True
    assert default_threshold.min_split_decode_rows == MIXED_SPLIT_MIN_DECODE_ROWS == 16
    check(mixed, default_threshold)
    assert default_threshold._mixed_decode_rows == 0

    prefill_first = make_step([6, 1, 1, 1], [3, 20, 9, 40], seed=43)
    be = split_mixed_backend(prefill_first)
    check(prefill_first, be)
    assert be._mixed_decode_rows == 0

    decode = make_step([1] * 4, [20, 9, 40, 3], seed=44)
    check(decode, be)
    assert be._mixed_decode_rows == 0 and be._planned_splits >= 1

    be.prepare(mixed.meta)
    assert be._mixed_decode_rows == 3
    small = make_step([1, 1, 4], [12, 30, 2], seed=45)
    launches.clear()
    launches += recorded_launches(monkeypatch, be)
    out = torch.full_like(small.query, float("nan"))
    kc, vc = small.k_cache.clone(), small.v_cache.clone()
    be.write_kv(small.key, small.value, kc, vc, small.meta)
    be.forward(small.query, kc, vc, small.meta, out, small.query.shape[-1] ** -0.5, 0, 0.0)
    matches_reference(small, out, small.query.shape[-1] ** -0.5)
    assert [name for name, *_ in launches[-1:]] == ["unified_attention"] and len(launches) == 1


def test_split_kv_decode_one_tile_contexts_write_directly():
    """With the merge fused, a sequence whose keys fit one tile has one split with keys, which writes its output row
    itself (no partial, no ticket): the same result as the merge kernel over its partials, counters untouched."""
    step = make_step([1] * 4, [0, 5, 15, 40], seed=33)  # 1, 6 and 16 keys: one 16-key tile; 41 keys: three
    fused = make_backend(step, num_kv_splits=4, decode_block_n=16)
    plain = make_backend(step, num_kv_splits=4, decode_block_n=16, fused_split_reductions=False)
    # a direct write never takes a ticket, so the one-tile sequences' counters stay 5 (the long sequence's splits do
    # take tickets, which never reach its merge from 5: its row is not compared)
    fused._merge_counters.fill_(5)
    scale = step.query.shape[-1] ** -0.5
    got = run_triton(step, fused, scale, 0, 0.0)
    _same_merge(got[:3], run_triton(step, plain, scale, 0, 0.0)[:3])
    counters = fused._merge_counters.view(-1, 2)  # (sequence, KV head)
    assert (counters[:3] == 5).all()


def test_split_kv_decode_auto_choice_on_small_batch():
    step = make_step([1, 1], [40, 90], seed=15)
    be = make_backend(step, decode_block_n=16)
    assert be.splits_for_step(step.meta) > 1  # 2 seqs x 2 KV heads on 132 SMs: split
    check(step, be)


# -- CUDA-graph safety and path choice --------------------------------------------------------------------------


@pytest.mark.parametrize("splits", [1, 4])
def test_launch_ignores_per_step_host_values(splits):
    """A captured graph replays with stale Python ints: the kernels may only use tensor shapes and contents."""
    step = make_step([1] * 3, [9, 40, 66], pad_seqs=1, pad_tokens=1, seed=16)
    be = make_backend(step, num_kv_splits=splits, decode_block_n=16)
    stale = dataclasses.replace(step.meta, num_tokens=1, num_seqs=1, max_seq_len=2, query_lens_cpu=[1],
                                seq_lens_cpu=[2])
    check(step, be, meta=stale)
    mixed = make_step([3, 1, 6], [9, 40, 0], pad_seqs=1, pad_tokens=2, seed=17)
    stale = dataclasses.replace(mixed.meta, num_tokens=2, num_seqs=1, max_query_len=2, max_seq_len=3)
    check(mixed, make_backend(mixed), meta=stale)


def test_path_choice_depends_on_batch_shape_only():
    step = make_step([1], [10], num_kv_heads=8, num_heads=16, head_dim=16)
    be = TritonAttentionBackend(spec_of(step), DEVICE, 16, 256, 256, 2048, num_sms=132)
    def splits(num_seqs: int, num_rows: int | None = None) -> int:
        return be.splits_for_step(dataclasses.replace(
            step.meta, seq_lens=torch.zeros(num_seqs, dtype=torch.int32),
            slot_mapping=torch.full((num_rows or num_seqs,), -1, dtype=torch.int64)))

    assert all(splits(n) > 1 for n in (1, 4, 16))
    assert all(splits(n) == 1 for n in (64, 256))  # the decode kernel, unsplit
    assert splits(64, 72) == 0  # more query rows than sequences (piecewise padding): the unified kernel zeroes them
    assert be.splits_for_step(dataclasses.replace(step.meta, max_query_len=2)) == 0  # the unified kernel
    be.decode_kernel = False  # the A/B switch: wide decode batches take the unified kernel, small ones still split
    assert all(splits(n) > 1 for n in (1, 4, 16))
    assert all(splits(n) == 0 for n in (64, 256))


def test_full_graph_capture_variant_follows_the_split_count():
    """Full-graph sizes share a warm-up only when their kernels agree: a decode batch's split count picks the merge
    kernel's constants, so it is part of the variant; mixed full graphs are each their own."""
    step = make_step([1], [10], num_kv_heads=8, num_heads=16, head_dim=16)
    be = TritonAttentionBackend(spec_of(step), DEVICE, 16, 256, 256, 2048, num_sms=132)
    sizes = [1, 2, 4, 8, 16, 24, 32, 64, 128, 256]
    for a in sizes:
        for b in sizes:
            same_splits = be._num_splits_for(a) == be._num_splits_for(b)
            assert (be.capture_variant(a, True) == be.capture_variant(b, True)) == same_splits
            assert (be.capture_variant(a, False) == be.capture_variant(b, False)) == (a == b)
    assert len({be.capture_variant(n, True) for n in sizes}) > 2  # several split counts among the sizes
    reference = TorchAttentionBackend(spec_of(step), DEVICE, 16, 256, 256, 2048)
    assert len({reference.capture_variant(n, True) for n in sizes}) == len(sizes)  # the default: every size its own


def test_choose_num_splits():
    assert choose_num_splits(256, 8, 32768, 64, 132) == 1
    for n in (1, 2, 3, 8, 20):
        s = choose_num_splits(n, 8, 32768, 64, 132)
        assert s > 1 and s & (s - 1) == 0 and s <= 64
    assert choose_num_splits(1, 8, 64, 64, 132) == 1  # one KV tile of capacity: nothing to split


def test_unavailable_reasons_on_cpu():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    reasons = TritonAttentionBackend.unavailable_reasons(spec, torch.device("cpu"))
    assert reasons and "triton backend needs a CUDA GPU" in reasons[0]
    assert not any(r.startswith("triton needs a CUDA GPU") for r in reasons)
    odd = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=512, dtype=torch.bfloat16)
    assert any("head_dim 512" in r for r in TritonAttentionBackend.unavailable_reasons(odd, torch.device("cpu")))


# -- GPU: bf16 at real shapes -----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (compiled Triton kernels)")


def _rand_lens(gen: torch.Generator, n: int, lo: int, hi: int) -> list[int]:
    return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("batch,max_ctx", [(1, 32768), (7, 16384), (64, 4096)])
@pytest.mark.parametrize("splits", [None, 0, 1])
def test_gpu_decode_bf16(head_dim, block_size, batch, max_ctx, splits):
    gen = torch.Generator().manual_seed(head_dim + block_size + batch)
    ctx = _rand_lens(gen, batch, 0, max_ctx - 1)
    ctx[0] = max_ctx - 1
    step = make_step([1] * batch, ctx, num_heads=16, num_kv_heads=8, head_dim=head_dim, block_size=block_size,
                     dtype=torch.bfloat16, seed=batch)
    be = make_backend(step, num_kv_splits=splits, max_num_seqs=256)
    check(step, be)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("mix", ["prefill", "chunked_long", "mixed"])
def test_gpu_prefill_and_mixed_bf16(head_dim, block_size, mix):
    if mix == "prefill":
        qlens, ctx = [1000, 37, 2048], [0, 0, 0]
    elif mix == "chunked_long":
        qlens, ctx = [512, 300], [32000 - 512, 7000]
    else:
        qlens, ctx = [1] * 20 + [700, 129], list(range(100, 2100, 100)) + [0, 3000]
    step = make_step(qlens, ctx, num_heads=16, num_kv_heads=8, head_dim=head_dim, block_size=block_size,
                     dtype=torch.bfloat16, pad_seqs=2, pad_tokens=5, seed=head_dim)
    be = make_backend(step, max_num_seqs=256)
    check(step, be)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_mixed_step_split_bf16(head_dim, block_size):
    """split_mixed at a W3-like mix: 20 leading decode rows (past the real threshold of 16), then prefill chunks."""
    qlens, ctx = [1] * 20 + [700, 129], list(range(100, 2100, 100)) + [0, 3000]
    step = make_step(qlens, ctx, num_heads=16, num_kv_heads=8, head_dim=head_dim, block_size=block_size,
                     dtype=torch.bfloat16, pad_seqs=2, pad_tokens=5, seed=head_dim + 1)
    be = make_backend(step, max_num_seqs=256)
    be.split_mixed = True
    check(step, be)
    assert be._mixed_decode_rows == 20
    check(step, be, window=1000, softcap=30.0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("window,softcap", [(4096, 0.0), (0, 50.0), (1000, 30.0)])
def test_gpu_window_softcap_bf16(window, softcap):
    step = make_step([1, 1, 900, 1], [20000, 300, 5000, 9000], num_heads=32, num_kv_heads=8, head_dim=128,
                     dtype=torch.bfloat16, seed=7)
    check(step, make_backend(step, max_num_seqs=256), window=window, softcap=softcap)
    dec = make_step([1] * 3, [20000, 300, 9000], num_heads=32, num_kv_heads=8, head_dim=256,
                    dtype=torch.bfloat16, seed=8)
    check(dec, make_backend(dec, max_num_seqs=256), window=window, softcap=softcap)


def _graph_replay(step_a: Step, step_b: Step, be: TritonAttentionBackend, prepare_b: bool = False) -> torch.Tensor:
    """Capture the layer (write_kv_and_forward) on step A's buffers, load step B into them, replay; B's output.
    `prepare_b`: the backend prepares B before the replay, as the runner does before every replay."""
    meta = step_a.meta
    bufs = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta) if isinstance(getattr(meta, f.name),
                                                                                       torch.Tensor)}
    q, k, v = step_a.query.clone(), step_a.key.clone(), step_a.value.clone()
    kc, vc = step_a.k_cache.clone(), step_a.v_cache.clone()
    out = torch.zeros_like(q)
    scale = q.shape[-1] ** -0.5

    def body():
        be.write_kv_and_forward(q, k, v, kc, vc, meta, out, scale, 0, 0.0)

    be.prepare(meta)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for name, buf in bufs.items():
        buf.copy_(getattr(step_b.meta, name))
    q.copy_(step_b.query)
    k.copy_(step_b.key)
    v.copy_(step_b.value)
    kc.copy_(step_b.k_cache)
    vc.copy_(step_b.v_cache)
    if prepare_b:
        be.prepare(step_b.meta)
    graph.replay()
    torch.cuda.synchronize()
    return out


def _same_buffer_shapes(*steps: Step) -> None:
    """Give steps one block-table width and one cache size, as the runner's persistent buffers have."""
    width = max(s.max_blocks_per_seq for s in steps)
    nblocks = max(s.k_cache.shape[0] for s in steps)
    for s in steps:
        s.meta.block_tables = torch.nn.functional.pad(s.meta.block_tables, (0, width - s.meta.block_tables.shape[1]))
        extra = nblocks - s.k_cache.shape[0]
        s.k_cache = torch.cat([s.k_cache, s.k_cache.new_full((extra, *s.k_cache.shape[1:]), float("nan"))])
        s.v_cache = torch.cat([s.v_cache, s.v_cache.new_full((extra, *s.v_cache.shape[1:]), float("nan"))])
        s.max_blocks_per_seq = width


def _check_replay(a: Step, b: Step, be: TritonAttentionBackend) -> None:
    out = _graph_replay(a, b, be)
    ref = reference(b, b.query.shape[-1] ** -0.5, 0, 0.0)
    n = b.meta.num_tokens
    torch.testing.assert_close(out[:n].float(), ref.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("splits", [None, 0, 1])
def test_gpu_cuda_graph_replay_decode(splits):
    """One graph captured for a padded decode batch of 8 replays correctly with other lengths and real counts."""
    common = dict(num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    a = make_step([1] * 6, [100, 5000, 17, 3000, 64, 900], pad_seqs=2, pad_tokens=2, seed=1, **common)
    b = make_step([1] * 4, [30000, 2, 700, 12000], pad_seqs=4, pad_tokens=4, seed=2, **common)
    _same_buffer_shapes(a, b)
    be = make_backend(a, num_kv_splits=splits, max_num_seqs=8)
    if splits is None:
        assert be.splits_for_step(a.meta) > 1
    _check_replay(a, b, be)


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay_decode_longest_first():
    """The unsplit decode launch captured with one step's order replays correctly after the next step's prepare()
    wrote another order (other lengths, other padding) into the buffer it reads."""
    common = dict(num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    a = make_step([1] * 6, [100, 5000, 17, 3000, 64, 900], pad_seqs=2, pad_tokens=2, seed=5, **common)
    b = make_step([1] * 7, [30, 2, 700, 12000, 12000, 5, 2500], pad_seqs=1, pad_tokens=1, seed=6, **common)
    _same_buffer_shapes(a, b)
    be = make_backend(a, num_kv_splits=1, max_num_seqs=8)
    out = _graph_replay(a, b, be, prepare_b=True)
    assert be._seq_order[:7].tolist() == [3, 4, 6, 2, 0, 5, 1]
    ref = reference(b, b.query.shape[-1] ** -0.5, 0, 0.0)
    n = b.meta.num_tokens
    torch.testing.assert_close(out[:n].float(), ref.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_pdl_decode_chain_in_a_graph(splits):
    """Twelve decode layers captured in one CUDA graph with PDL, each layer's query the previous layer's output (an
    attention-to-attention PDL edge; every third layer a torch op between), all writing their new K/V into one
    cache (the step's metadata read before the PDL wait): the replays give the bits of the same chain run eagerly
    without PDL, and the fused merge's counters are zeros after every replay."""
    from hf_accel.ops import pdl

    if not pdl.supported(DEVICE):
        pytest.skip("PDL needs sm90+ and a triton that exposes it")
    common = dict(num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    lens = [int(x) for x in torch.randint(1, 3000, (60,), generator=torch.Generator().manual_seed(3))]
    step = make_step([1] * 60, lens, pad_seqs=4, pad_tokens=4, seed=7, **common)
    be = make_backend(step, num_kv_splits=splits, max_num_seqs=64)
    scale = 128**-0.5
    outs = [torch.empty_like(step.query) for _ in range(12)]

    def chain(kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        x = step.query
        for i, out in enumerate(outs):
            be.write_kv_and_forward(x, step.key, step.value, kc, vc, step.meta, out, scale, 0, 0.0)
            x = torch.tanh(out) * 2.0 if i % 3 == 2 else out
        return x

    be.prepare(step.meta)
    be.use_pdl = False
    kc_ref, vc_ref = step.k_cache.clone(), step.v_cache.clone()
    want = chain(kc_ref, vc_ref).clone()
    assert not want[:60].isnan().any()
    be.use_pdl = True
    kc, vc = step.k_cache.clone(), step.v_cache.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(kc, vc)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(kc, vc)
    for _ in range(3):
        kc.copy_(step.k_cache)
        vc.copy_(step.v_cache)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want), "the PDL chain changed the output"
        assert torch.equal(kc.nan_to_num(7.0), kc_ref.nan_to_num(7.0))
        assert not be._merge_counters.any()


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay_mixed():
    """CUDAGraphSupport.ALWAYS: a graph captured on one mixed batch replays on another of the same padded shape."""
    common = dict(num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    a = make_step([1, 200, 1, 50], [4000, 0, 30, 100], pad_seqs=2, pad_tokens=9, seed=3, **common)  # 4+2 seqs, 261
    b = make_step([120, 1, 1], [3000, 20000, 5], pad_seqs=3, pad_tokens=139, seed=4, **common)  # 3+3 seqs, 261
    assert a.query.shape == b.query.shape and a.meta.seq_lens.shape == b.meta.seq_lens.shape
    _same_buffer_shapes(a, b)
    _check_replay(a, b, make_backend(a, max_num_seqs=8))
