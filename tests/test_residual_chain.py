"""The residual chain (ops.residual_chain): a linear, the residual add, the RMSNorm and the next linear as two GEMM
launches, the first adding the residual and summing squares in its epilogue, the second normalizing its input.

On CPU the kernels run in the Triton interpreter (fp16 / fp32), the op takes its unchained path (torch's ops, the
stock rounding) and the compile pass runs on Dynamo-traced tiny models. On a GPU the same kernel tests run compiled,
and the `gpu`-marked ones add bf16 at qwen3-0.6b's decode shapes, the op's choice of the chained launches, and PDL
inside a CUDA graph.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import graph_replays_with_and_without_pdl, stand_in_tuner_gpu, tiny_pass_model
from triton_mode import DEVICE, ON_GPU, load_kernel_modules

triton = pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import hf_accel.ops.residual_chain as chain_op  # noqa: E402
from hf_accel.compilation.gated_activation import fuse_silu_mul_into_linears  # noqa: E402
from hf_accel.compilation.linear_packing import merge_packed_linears, pack_sibling_linears  # noqa: E402
from hf_accel.compilation.norm_folding import chain_residual_norms, fold_norms_into_linears  # noqa: E402
from hf_accel.compilation.small_m_linear import route_small_m_linears  # noqa: E402
from hf_accel.ops import linear as linear_op  # noqa: E402
from hf_accel.ops import pdl  # noqa: E402
from hf_accel.ops.linear import m_bucket  # noqa: E402

(G,) = load_kernel_modules(["hf_accel.ops.skinny_gemm"], "_skinny_gemm_kernel")
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (compiled Triton kernels)")
EPS = 1e-6
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def rnd(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def stock_norm_formula(h: torch.Tensor, g: torch.Tensor, rstd: torch.Tensor | None = None) -> torch.Tensor:
    """LlamaRMSNorm's forward, optionally with the row scale given (to compare bits independent of the sum order)."""
    h32 = h.float()
    if rstd is None:
        rstd = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)
    return g * (h32 * rstd).to(h.dtype)


def silu_mul(both: torch.Tensor, inter: int, dtype) -> torch.Tensor:
    """The gated epilogue's formula on float32 sums: each half rounded, SiLU rounded, one rounded product."""
    gate, up = both[..., :inter].to(dtype).float(), both[..., inter:].to(dtype).float()
    return (F.silu(gate).to(dtype).float() * up).to(dtype)


# ------------------------------------------------------------------------------------------------------ the kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n1", "k1", "n2", "block_n1", "split1", "split2", "bias", "gated"), [
    (2, 64, 96, 80, 32, 1, 1, False, False),
    (5, 96, 64, 48, 32, 2, 1, True, False),     # split first GEMM: the epilogue in the launch that reduces
    (16, 64, 128, 64, 16, 4, 2, False, True),   # gated second GEMM, split both
    (13, 80, 64, 40, 32, 1, 3, True, False),    # hidden not a multiple of the column tile: a partial last tile
    (7, 96, 80, 32, 32, 3, 1, True, True),      # uneven K in the first GEMM's fused three-way split
    (4, 40, 64, 24, 64, 1, 1, False, False),    # one column tile: one partial sum per row
    (2, 2048, 32, 16, 16, 1, 1, False, False),  # MAX_SS_TILES (128) partial sums per row, a 2,048-column h
])
def test_chained_launches_give_the_residual_and_the_normed_product(dtype, m, n1, k1, n2, block_n1, split1, split2,
                                                                   bias, gated):
    """`linear_add_residual` stores h = linear + residual with the bits of the two torch ops after the same GEMM, and
    per-tile sums of squares that add up to h's; `norm_partials_linear` equals the GEMM of the stock-normalized h
    (with the row scale from those sums, bit for bit; with the stock sum order, within a rounding)."""
    x = rnd(m, k1, dtype=dtype, seed=1)
    w1 = rnd(n1, k1, dtype=dtype, seed=2, scale=0.1)
    b1 = rnd(n1, dtype=dtype, seed=3) if bias else None
    r = rnd(m, n1, dtype=dtype, seed=4)
    g = (torch.rand(n1, generator=torch.Generator().manual_seed(5)) + 0.5).to(DEVICE, dtype)
    w2 = rnd(2 * n2 if gated else n2, n1, dtype=dtype, seed=6, scale=0.1)
    b2 = None if gated else rnd(n2, dtype=dtype, seed=7) if bias else None
    cfg1 = G.SkinnyConfig(16 if m <= 16 else 32, block_n1, 32, split1, 4, 2)
    cfg2 = G.SkinnyConfig(16 if m <= 16 else 32, 16, 32, split2, 4, 2)
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)

    h, ss = G.linear_add_residual(x, w1, b1, r, cfg1, counters=counters)
    a = G.skinny_linear(x, w1, b1, cfg1, counters=counters)  # the same GEMM, its output stored
    assert torch.equal(h, a + r)
    assert ss.shape == (triton.cdiv(n1, block_n1), m) and ss.dtype == torch.float32
    torch.testing.assert_close(ss.sum(0), h.float().pow(2).sum(-1), rtol=1e-5, atol=1e-5)

    y = G.norm_partials_linear(h, ss, g, EPS, w2, b2, cfg2, counters=counters, gated=gated)
    rstd = torch.rsqrt(ss.sum(0, keepdim=True).T * (1.0 / n1) + EPS)  # as the kernel scales the sum
    normed = stock_norm_formula(h, g, rstd).to(dtype)
    if gated:
        want = silu_mul(F.linear(normed.float(), w2.float()), n2, dtype)
        ref = G.skinny_linear(normed, w2, None, cfg2, counters=counters, gated=True)
    else:
        want = F.linear(normed.float(), w2.float(), b2.float() if b2 is not None else None).to(dtype)
        ref = G.skinny_linear(normed, w2, b2, cfg2, counters=counters)
    assert y.shape == (m, n2) and y.dtype == dtype
    if ss.shape[0] <= 8:  # the normalization inside the K loop gives the bits of the normalized input
        assert torch.equal(y, ref)
    else:  # the kernel sums many partials in an order of its own (a tree on the GPU): the row scale may move a bit
        torch.testing.assert_close(y.float(), ref.float(), rtol=4 * torch.finfo(dtype).eps,
                                   atol=4 * torch.finfo(dtype).eps * ref.abs().max().item())
    stock = stock_norm_formula(h, g).to(dtype)
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}[dtype]
    torch.testing.assert_close(y.float(), want.float(), rtol=tol, atol=tol * (1 + want.abs().max().item()))
    ulp = torch.finfo(dtype).eps  # the sum order moves the normalized input by at most a last bit
    torch.testing.assert_close(normed.float(), stock.float(), rtol=2 * ulp, atol=2 * ulp)
    assert not counters.any()


def test_chained_launch_refuses_what_it_cannot_compute():
    x = rnd(3, 64, dtype=torch.float16, seed=1)
    w = rnd(32, 64, dtype=torch.float16, seed=2)
    r = rnd(3, 32, dtype=torch.float16, seed=3)
    with pytest.raises(AssertionError, match="chainable"):  # split-K without counters: a second kernel would reduce
        G.linear_add_residual(x, w, None, r, G.SkinnyConfig(16, 16, 32, 2))
    with pytest.raises(AssertionError, match="chainable"):  # the one-row kernel has no such epilogue
        G.linear_add_residual(x[:1], w, None, r[:1], G.SkinnyConfig(1, 8, 64, 1, gemv=True))
    wide = G.SkinnyConfig(16, 16, 32, 1)  # more column tiles than the second GEMM reads partial sums of
    n = 16 * (G.MAX_SS_TILES + 1)
    assert G.can_chain(wide, 3, 64, n - 16, None, residual=True)
    assert not G.can_chain(wide, 3, 64, n, None, residual=True)
    assert G.can_chain(wide, 3, n, 64, None, residual=False)  # as the second linear, any width
    with pytest.raises(AssertionError, match="chainable"):
        G.linear_add_residual(x, rnd(n, 64, dtype=torch.float16, seed=4), None,
                              rnd(3, n, dtype=torch.float16, seed=5), wide)


# ------------------------------------------------------------------------------------------------------------ the op
@pytest.mark.parametrize("gated", [False, True])
def test_op_on_cpu_is_the_stock_formula(gated):
    """Off CUDA the op runs the linear, the add, the stock norm and the second linear (and the SiLU-and-mul): the
    stock modules' bits."""
    k1, n1, n2 = 40, 48, 24
    x, r = torch.randn(2, 3, k1).to(torch.bfloat16), torch.randn(2, 3, n1).to(torch.bfloat16)
    w1, w2 = torch.randn(n1, k1).to(torch.bfloat16), torch.randn(2 * n2 if gated else n2, n1).to(torch.bfloat16)
    g = (torch.rand(n1) + 0.5).to(torch.bfloat16)
    y, h = torch.ops.hf_accel.linear_add_rms_norm_linear(x, w1, None, r, g, EPS, w2, None, gated, False)
    h_want = F.linear(x, w1) + r
    assert torch.equal(h, h_want)
    both = F.linear(stock_norm_formula(h_want, g), w2)
    assert torch.equal(y, F.silu(both[..., :n2]) * both[..., n2:] if gated else both)


def test_op_chains_only_where_both_decisions_are_tensor_core_tiles(monkeypatch):
    """The op takes the two chained launches when both linears' tuned decisions for the step's rows are tensor-core
    tiles, and otherwise the unchained path: one row (the one-row kernel normalizes itself), a cuBLAS decision, or a
    split-K first GEMM without counters. Checked on CPU by letting the op treat CPU tensors as kernel operands (the
    interpreter runs the kernels)."""
    decisions = {}

    def decided(dev, key, n, k, bias, m, chain=""):
        # a chain's linears take the chain tile of their place where the baseline won
        assert chain == ("first" if n == n1 else "second"), (n, chain)
        return decisions.get((n, m_bucket(m)))

    monkeypatch.setattr(chain_op, "kernel_operands", lambda x, w, b: True)
    monkeypatch.setattr(chain_op, "tuned_config", decided)
    launches = []
    real = G.linear_add_residual
    monkeypatch.setattr(G, "linear_add_residual", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    k1, n1, n2 = 64, 96, 32
    x, r = rnd(4, k1, dtype=torch.float16, seed=1), rnd(4, n1, dtype=torch.float16, seed=2)
    w1, w2 = rnd(n1, k1, dtype=torch.float16, seed=3, scale=0.1), rnd(n2, n1, dtype=torch.float16, seed=4, scale=0.1)
    g = torch.ones(n1, dtype=torch.float16)

    def run(rows=4):
        launches.clear()
        return chain_op.run_chain(x[:rows], w1, None, r[:rows], g, EPS, w2, None, False, False)

    tile = G.SkinnyConfig(16, 32, 32, 1)
    decisions.update({(n1, 16): tile, (n2, 16): tile})
    y, h = run()
    assert launches == [1]
    torch.testing.assert_close(h.float(), (F.linear(x.float(), w1.float()).half() + r).float(), rtol=2e-3, atol=2e-3)
    decisions[(n2, 16)] = None  # the second linear's decision is cuBLAS: unchained (not run on CPU: F.linear)
    monkeypatch.setattr(chain_op, "run_linear", lambda a, w, b, p: F.linear(a, w, b))
    monkeypatch.setattr(chain_op, "run_norm_linear", lambda a, res, gw, eps, w, b, p: (
        F.linear(stock_norm_formula(a + res, gw), w, b), a + res))
    y2, h2 = run()
    assert launches == []
    torch.testing.assert_close(y2.float(), y.float(), rtol=2e-2, atol=2e-2)
    decisions[(n2, 16)] = tile
    decisions[(n1, 16)] = G.SkinnyConfig(16, 32, 32, 2)  # split-K, and on CPU no counters
    run()
    assert launches == []
    decisions[(n1, 1)] = decisions[(n2, 1)] = tile
    run(rows=1)
    assert launches == []


# ----------------------------------------------------------------------------------------------------- chain tiles
def _script_chain_timings(monkeypatch, times: dict, base: float, wrong: dict | None = None) -> list:
    """Fake the chained launches and the tuner's clock (CPU, no graphs): the chained launch of `cfg` in `place` takes
    `times[(place, cfg)]` seconds (twice the baseline's `base` when absent), the baseline `base`, a plain launch of
    our kernel `times[("plain", cfg)]`; a (place, cfg) in `wrong` computes wrongly, in the way named: "result" (its
    output), "no-bias" (the bias left out), "no-residual" (the first adds none), "lost-tile" (the first drops its
    last column tile's sums of squares), "first-sum-only" / "one-sum-lost" (the second reads only the first tile's
    sums / all but the last), "no-norm" (the second does not normalize), "row0-scale" (every row normalized by the
    first row's scale). The builds are recorded in the list returned."""
    last, built, wrong = {}, [], wrong or {}

    def fake_first(x, w, bias, residual, cfg, use_pdl, counters=None):
        last["run"] = ("first", cfg)
        fault = wrong.get(("first", cfg))
        h = (F.linear(x, w, None if fault == "no-bias" else bias) + (0 if fault == "no-residual" else residual))
        h = h * (2 if fault == "result" else 1)
        ss = linear_op._tile_sums_of_squares(h, cfg.block_n)
        if fault == "lost-tile":
            ss[-1] = 0
        return h, ss

    def fake_second(h, ss, g, eps, w, bias, cfg, use_pdl, counters=None, gated=False):
        last["run"] = ("second", cfg)
        fault = wrong.get(("second", cfg))
        sums = ss[0] if fault == "first-sum-only" else ss[:-1].sum(0) if fault == "one-sum-lost" else ss.sum(0)
        rstd = torch.rsqrt(sums[:, None] / h.shape[-1] + eps)
        if fault == "row0-scale":
            rstd = rstd[:1].expand_as(rstd)
        normed = g * h if fault == "no-norm" else stock_norm_formula(h, g, rstd)
        y = F.linear(normed, w, None if fault == "no-bias" else bias)
        y = F.silu(y[..., : y.shape[-1] // 2]) * y[..., y.shape[-1] // 2:] if gated else y
        return -y if fault == "result" else y

    def fake_plain(x, w, bias, cfg, use_pdl, scale=None, counters=None, gated=False):
        last["run"] = ("plain", cfg)
        y = F.linear(x, w.float() * scale[:, None].float() if scale is not None else w, bias)
        return F.silu(y[..., : y.shape[-1] // 2]) * y[..., y.shape[-1] // 2:] if gated else y

    def fake_time(fn):
        last["run"] = None
        fn()
        return times.get(last["run"], 2 * base) if last["run"] is not None else base

    def fake_build(warmups):
        built.extend(warmups)
        return {"kernels": len(built)}

    monkeypatch.setattr(G, "linear_add_residual", fake_first)
    monkeypatch.setattr(G, "norm_partials_linear", fake_second)
    monkeypatch.setattr(G, "skinny_linear", fake_plain)
    monkeypatch.setattr(linear_op, "time_in_graph", fake_time)
    monkeypatch.setattr("hf_accel.ops.triton_build.build_in_parallel", fake_build)
    monkeypatch.setattr("hf_accel.ops.fused_kernels.silu_and_mul", lambda g, u, p: F.silu(g) * u)
    monkeypatch.setattr(linear_op, "device_index", lambda device: 0)  # the gated baseline looks up the plain decision
    return built


def _chain_tiles(n, k, bucket, places=("first", "second"), gated=False, bias=False, decision=None):
    return linear_op._time_chain_tiles(n, k, bias, bucket, torch.float32, torch.device("cpu"), False, 1 << 16,
                                       places, gated, decision=decision)


@pytest.mark.parametrize(("base_us", "ratio", "kept"), [
    (10, 0.95, True),    # faster chained than the baseline plain: kept
    (10, 1.05, True),    # slower, within CHAIN_SLACK and CHAIN_MAX_LOSS_S: kept
    (100, 1.05, False),  # within the slack, but 5 us slower: more than a norm kernel saves
    (10, 1.25, False),   # slower than the slack
])
@pytest.mark.parametrize("bucket", [16, 64])
def test_chain_tile_is_the_fastest_chained_launch_within_the_slack(monkeypatch, bucket, base_us, ratio, kept):
    """`_time_chain_tiles` with its timings scripted: each place keeps the tile whose chained launch (residual
    epilogue, or normalizing K loop) is fastest, if it is at most CHAIN_SLACK and CHAIN_MAX_LOSS_S slower than the
    plain baseline; every chainable tile of each place was built ahead first."""
    n, k = 64, 128
    tiles = [c for c in linear_op._candidates_for(bucket, k, False) if not c.gemv]
    fast, other = tiles[len(tiles) // 2], tiles[1]
    base = base_us * 1e-6
    times = {("first", fast): ratio * base, ("second", other): ratio * base,
             ("first", other): 1.01 * ratio * base, ("second", fast): 1.01 * ratio * base}
    built = _script_chain_timings(monkeypatch, times, base)
    found = _chain_tiles(n, k, bucket)
    assert found == ({"first": fast, "second": other} if kept else {"first": None, "second": None})
    assert len(built) == 2 * len(tiles)  # every candidate is chainable at this size, in both places


def test_a_tile_fast_plain_but_slow_chained_is_not_the_chain_tile(monkeypatch):
    """The chain tile is chosen by its chained launch, not by the plain linear's timing: a tile whose chained
    variant is slow (a variant that spills registers the plain one does not: examples/kernel_registers.py) loses to
    one that is slower plain but faster chained. A chained launch that gives a wrong result is never kept."""
    bucket, k = 64, 128
    tiles = [c for c in linear_op._candidates_for(bucket, k, False) if not c.gemv]
    spills, steady, broken = tiles[0], tiles[1], tiles[2]
    base = 10e-6
    _script_chain_timings(monkeypatch, {("plain", spills): 0.8 * base, ("plain", steady): 0.95 * base}, base)
    assert linear_op._tune_one(64, k, False, bucket, torch.float32, torch.device("cpu"), False, 1 << 16)[0] == spills
    times = {("second", spills): 1.3 * base, ("second", steady): 1.02 * base, ("second", broken): 0.5 * base}
    _script_chain_timings(monkeypatch, times, base, wrong={("second", broken): "result"})
    assert _chain_tiles(64, k, bucket, places=("second",)) == {"second": steady}


@pytest.mark.parametrize(("place", "fault"), [
    ("first", "result"), ("first", "no-bias"), ("first", "no-residual"), ("first", "lost-tile"),
    ("second", "result"), ("second", "no-bias"), ("second", "first-sum-only"), ("second", "one-sum-lost"),
    ("second", "no-norm"), ("second", "row0-scale"),
])
def test_a_chained_launch_that_computes_wrongly_is_never_the_chain_tile(monkeypatch, place, fault):
    """The tuner checks each chained launch before it times it: a wrong product, a bias or residual left out, a first
    linear that loses one column tile's sums of squares (of 32: a small part of the row's sum), a second linear
    that reads only some of the partial sums (all but one of 32: each row 1.6 % off as a whole), does not normalize,
    or normalizes every row by one row's scale, is skipped however fast it is, and the next tile within the slack is
    kept."""
    bucket, n, k = 64, 1024, 1024
    tiles = [c for c in linear_op._candidates_for(bucket, k, False) if not c.gemv and c.block_n == 32]
    broken, steady = tiles[0], tiles[1]
    base = 10e-6
    times = {(place, broken): 0.5 * base, (place, steady): 1.02 * base}
    _script_chain_timings(monkeypatch, times, base, wrong={(place, broken): fault})
    assert _chain_tiles(n, k, bucket, places=(place,), bias=True) == {place: steady}
    assert linear_op.chain_ss_tiles(k, bucket) == 32  # the second is timed with the most partial sums a first stores


def test_chain_tile_slack_is_measured_from_what_runs_unchained(monkeypatch):
    """Where our tile won the plain decision, a chained launch must come within the slack of that tile's time, not
    of cuBLAS's: a chain slower than the unchained decision plus the slack does not run."""
    bucket, k = 64, 128
    tiles = [c for c in linear_op._candidates_for(bucket, k, False) if not c.gemv]
    decision, chained = tiles[0], tiles[1]
    base = 10e-6  # cuBLAS
    times = {("plain", decision): 0.8 * base, ("first", chained): 0.85 * base, ("second", chained): 0.95 * base}
    _script_chain_timings(monkeypatch, times, base)
    assert _chain_tiles(64, k, bucket, decision=decision) == {"first": chained, "second": None}
    assert _chain_tiles(64, k, bucket) == {"first": chained, "second": chained}  # against cuBLAS: both


@pytest.mark.parametrize(("n", "gated"), [(6144, False), (28672, True)])  # llama-3.1-8b q/k/v and gate/up
def test_a_tile_too_narrow_to_lead_a_chain_is_kept_for_the_second_place(monkeypatch, n, gated):
    """A tile with more column tiles than the first linear's epilogue may store partial sums for
    (`skinny_gemm.MAX_SS_TILES`) can still be a chain's second linear (q/k/v, gate/up): it is timed and kept for
    that place only, and a wider tile, slower but within the slack, for the first."""
    bucket, k = 16, 128
    cands = linear_op._gated_candidates(bucket, k) if gated else linear_op._candidates_for(bucket, k, False)
    out_n = n // 2 if gated else n
    narrow = next(c for c in cands if not c.gemv and c.split_k == 1 and -(-out_n // c.block_n) > G.MAX_SS_TILES)
    wide = next(c for c in cands if not c.gemv and c.split_k == 1 and -(-out_n // c.block_n) <= G.MAX_SS_TILES)
    base = 10e-6
    times = {(p, c): t * base for p in CHAIN_PLACES for c, t in ((narrow, 1.02), (wide, 1.06))}
    built = _script_chain_timings(monkeypatch, times, base)
    places = ("second",) if gated else ("first", "second")
    assert _chain_tiles(n, k, bucket, places, gated) == (
        {"second": narrow} if gated else {"first": wide, "second": narrow})
    firsts = sum(G.can_chain(c, bucket, k, out_n, torch.zeros(4096, dtype=torch.int32), residual=True)
                 for c in cands if not c.gemv)
    seconds = sum(not c.gemv for c in cands)
    assert len(built) == (seconds if gated else firsts + seconds) and firsts < seconds
    assert G.can_chain(narrow, bucket, k, out_n, None, residual=False)
    assert not G.can_chain(narrow, bucket, k, out_n, torch.zeros(4096, dtype=torch.int32), residual=True)


CHAIN_PLACES = linear_op.CHAIN_PLACES


def test_chain_tiles_are_timed_once_per_place_stored_and_asked_for_by_chains_only(monkeypatch, tmp_path):
    """Chain tiles beside the decisions (timing faked): timed only for the places the model's chains give a shape,
    at every bucket of 2+ rows whatever its decision, once per place (a place added later is timed alone, a new
    process reads them back), reported under ":chain-first" / ":chain-second" ("none": timed, no tile qualified),
    and given only to a caller that asks for a chain's linear: the tile timed for its place, none where none
    qualified (even where our tile won plain) or the place was never timed (its timing failed: retried later)."""
    cuda = stand_in_tuner_gpu(monkeypatch)
    tile, narrow = G.SkinnyConfig(64, 64, 128, 1), G.SkinnyConfig(64, 16, 128, 1)
    won = G.SkinnyConfig(16, 32, 128, 1)
    monkeypatch.setattr(linear_op, "_tune_one", lambda n, k, b, bucket, *a: (
        won if (n, bucket) == (32, 16) else None, 2e-6, 1.9e-6))
    timed = []

    def fake_chain(n, k, b, bucket, dtype, device, use_pdl, scratch, places, gated=False, decision=None):
        timed.append((n, bucket, tuple(places)))
        assert decision == (won if (n, bucket) == (32, 16) else None)  # the slack is measured from what runs
        return {p: (tile if p == "first" else narrow) if bucket == 64 else None for p in places}

    monkeypatch.setattr(linear_op, "_time_chain_tiles", fake_chain)
    shapes = [(64, 128, False), (32, 64, False)]
    linear_op.clear_decisions()

    def tune(places):
        return linear_op.tune_linears(shapes, torch.bfloat16, cuda, use_pdl=False, cache_dir=tmp_path,
                                      chain_places=places)

    def asked(n, k, m, chain=""):
        return linear_op.tuned_config(cuda, torch.bfloat16, n, k, False, m, chain=chain)
    try:
        report = tune({(64, 128, False): ("second",), (32, 64, False): "first"})
        # buckets 16 and 64 of each chained shape (the one our tile won too), never one row
        assert sorted(timed) == [(32, 16, ("first",)), (32, 64, ("first",)), (64, 16, ("second",)),
                                 (64, 64, ("second",))]
        assert report["chain_places_timed"] == 4
        assert asked(64, 128, 40, "second") == narrow and asked(64, 128, 40, "first") is None
        assert asked(32, 64, 16) == won and asked(32, 64, 16, "first") is None  # won plain; no chained tile
        assert asked(32, 64, 16, "second") is None  # a place never timed (not one this shape takes)
        assert asked(32, 64, 1, "first") is None
        timed.clear()
        assert tune({(64, 128, False): ("second",)})["chain_places_timed"] == 0 and not timed  # in memory
        report = tune({(64, 128, False): ("first", "second")})  # a place not yet timed: alone
        assert sorted(timed) == [(64, 16, ("first",)), (64, 64, ("first",))] and report["tuned"] == 0
        with pytest.raises(ValueError, match="unknown chain places"):
            tune({(64, 128, False): ("third",)})
        for _ in range(2):  # as tuned, then (a new process) read back from the file
            assert asked(64, 128, 40) is None
            assert asked(64, 128, 40, "first") == tile and asked(64, 128, 40, "second") == narrow
            assert asked(64, 128, 16, "first") is None
            report = linear_op.decisions_for([(64, 128, False)], cuda, torch.bfloat16, chain_tiles=True)
            assert report["64x128@m64"] == "cublas" and report["64x128@m64:chain-first"]["block_n"] == 64
            assert report["64x128@m64:chain-second"]["block_n"] == 16
            assert report["64x128@m16:chain-first"] == report["64x128@m16:chain-second"] == "none"
            assert not any(k.startswith("64x128@m1:chain") for k in report)
            # a model without chains reports the decisions only
            assert linear_op.decisions_for([(64, 128, False)], cuda, torch.bfloat16) == {
                k: v for k, v in report.items() if ":chain" not in k}
            linear_op.clear_decisions()
            timed.clear()
            assert tune({(64, 128, False): ("first", "second"), (32, 64, False): ("first",)})["tuned"] == 0
            assert not timed
        # int8 weights never chain
        linear_op.tune_linears(shapes, torch.bfloat16, cuda, use_pdl=False, int8=True,
                               chain_places={(64, 128, False): ("first",)})
        assert not timed
        # a decision timed again drops the chain tiles timed beside the old one; tiles timed plain by an older
        # version ("|chain") are dropped from the file, not read
        stored = json.loads((tmp_path / linear_op.TUNE_FILE).read_text())
        skey = next(k for k in stored if k.endswith(linear_op.CHAIN_SUFFIX) and "|64|128|" in k and "|64|pdl" in k)
        del stored[skey[: -len(linear_op.CHAIN_SUFFIX)]]
        old = skey[: -len(linear_op.CHAIN_SUFFIX)].replace("|128|", "|256|") + "|chain"
        stored[old] = {"first": G.SkinnyConfig(64, 32, 128, 1).__dict__, "second": None}
        (tmp_path / linear_op.TUNE_FILE).write_text(json.dumps(stored))
        linear_op.clear_decisions()
        tune({})
        assert asked(64, 128, 40, "first") is None
        after = json.loads((tmp_path / linear_op.TUNE_FILE).read_text())
        assert skey not in after and old not in after
    finally:
        linear_op.clear_decisions()


def test_a_chain_timing_failure_leaves_those_chains_off_until_timed(monkeypatch, caplog):
    """A failure while timing a shape's chain tiles (out of memory, a kernel that does not build) warns, counts in the
    report and leaves the decisions in force, but no chain runs with a tile never timed chained, even where our tile
    won plain; the scratch memory still goes back, and the next tuning tries those places again."""
    cuda = stand_in_tuner_gpu(monkeypatch)
    won = G.SkinnyConfig(64, 32, 128, 1)
    monkeypatch.setattr(linear_op, "_tune_one", lambda n, k, b, bucket, *a: (won if bucket > 1 else None, 2e-6, 1e-6))
    released = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(1))

    def boom(*a, **kw):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(linear_op, "_time_chain_tiles", boom)
    linear_op.clear_decisions()

    def tune():
        return linear_op.tune_linears([(64, 128, False)], torch.bfloat16, cuda, use_pdl=False,
                                      chain_places={(64, 128, False): ("first",)})
    try:
        for _ in range(2):  # tuned and failed; then decided (in memory), tried again and failed again
            released.clear()
            with caplog.at_level("WARNING", logger="hf_accel.ops.linear"):
                report = tune()
            assert report["chain_errors"] == 2 and report["chain_places_timed"] == 0 and released
            assert "those chains do not run" in caplog.text
            assert linear_op.tuned_config(cuda, torch.bfloat16, 64, 128, False, 40) == won
            assert linear_op.tuned_config(cuda, torch.bfloat16, 64, 128, False, 40, chain="first") is None
        monkeypatch.setattr(linear_op, "_time_chain_tiles", lambda *a, **kw: {"first": won})
        assert tune()["chain_places_timed"] == 2
        assert linear_op.tuned_config(cuda, torch.bfloat16, 64, 128, False, 40, chain="first") == won
    finally:
        linear_op.clear_decisions()


def test_chain_places_of_the_pairs():
    """Which places each weight shape takes, among the plain decisions and the gated ones."""
    from hf_accel.compilation.norm_folding import ChainedPair, chain_places

    o, down, qkv, gu = (64, 128, False), (64, 256, False), (192, 64, False), (512, 64, False)
    pairs = [ChainedPair(o, gu, True), ChainedPair(down, qkv, False), ChainedPair(o, gu, True),
             ChainedPair(qkv, qkv, False)]
    assert chain_places(pairs, gated=False) == {o: ("first",), down: ("first",), qkv: ("second", "first")}
    assert chain_places(pairs, gated=True) == {gu: ("second",)}
    assert chain_places([], gated=False) == {}


# ----------------------------------------------------------------------------------------------------------- the pass
_model = tiny_pass_model


@pytest.mark.parametrize(("family", "gated", "wide"), [
    ("llama", False, False), ("llama", True, False), ("qwen3", False, False), ("qwen3", True, False),
    ("llama", True, True),  # rows wider than MAX_FOLD_K: folded for the chain (any_width), chained the same
])
def test_pass_chains_both_residual_norms_of_every_layer(monkeypatch, family, gated, wide):
    """Every folded norm with a residual add (each layer's post-attention norm, every input norm after the first)
    takes the linear whose output it adds (o_proj, the previous layer's down_proj), with the gate/up op fused or not;
    the first layer's input norm (no add) and the final norm stay as they were. The chained forward gives the stock
    forward's bits (on CPU the op computes the stock formula)."""
    if wide:
        import hf_accel.compilation.norm_folding as folding

        monkeypatch.setattr(folding, "MAX_FOLD_K", 32)  # the tiny models' rows have 64 columns
    model = _model(family)
    pack_sibling_linears(model)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 200, (1, 9))
    seen: dict = {}

    def backend(gm, example_inputs):
        merge_packed_linears(gm, example_inputs)
        route_small_m_linears(gm, use_pdl=False, allow_cpu=True)
        fold_norms_into_linears(gm, any_width=wide)
        if gated:
            fuse_silu_mul_into_linears(gm)
        seen["pairs"] = chain_residual_norms(gm)
        seen["chained"] = len(seen["pairs"])
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        seen["ops"] = targets.count(torch.ops.hf_accel.linear_add_rms_norm_linear.default)
        seen["left"] = (targets.count(torch.ops.hf_accel.add_rms_norm_linear.default)
                        + targets.count(torch.ops.hf_accel.add_rms_norm_silu_mul_linear.default))
        seen["linears"] = targets.count(torch.ops.hf_accel.linear.default)
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            out = torch.compile(model, backend=backend)(ids, logits_to_keep=ids.shape[1]).logits
    finally:
        torch._dynamo.reset()
    assert seen["chained"] == seen["ops"] == 2 * layers - 1 and seen["left"] == 0
    # the weight shapes of each chain's linears: what the tuner times chain tiles for
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    hidden, q_out, inter = c.hidden_size, c.num_attention_heads * head_dim, c.intermediate_size
    qkv = q_out + 2 * c.num_key_value_heads * head_dim
    mlp = ((hidden, q_out, False), (2 * inter, hidden, False), gated)
    attn = ((hidden, inter, False), (qkv, hidden, False), False)
    assert sorted(tuple(p) for p in seen["pairs"]) == sorted([mlp] * layers + [attn] * (layers - 1))
    with torch.no_grad():
        eager = model(ids).logits
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------------------ the GPU
QWEN = dict(hidden=1024, q_out=2048, qkv=4096, inter=3072)  # qwen3-0.6b's decode shapes


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 17, 64])
def test_gpu_chain_at_qwen3_shapes_in_a_graph_with_and_without_pdl(m):
    """o_proj -> add + norm -> gate/up (gated) -> down -> add + norm -> q/k/v, chained, bf16 at qwen3-0.6b's shapes,
    captured in a CUDA graph: the same bits with PDL as without, replay after replay, the same bits as the chained
    launches run eagerly, and within bf16 rounding of the unchained ops (the stock formula)."""
    if not pdl.supported(DEVICE):
        pytest.skip("PDL needs sm90+ and a triton that exposes it")
    d, q, qkv, inter = QWEN["hidden"], QWEN["q_out"], QWEN["qkv"], QWEN["inter"]
    bf = torch.bfloat16
    w_o, w_gu = rnd(d, q, dtype=bf, seed=1, scale=0.03), rnd(2 * inter, d, dtype=bf, seed=2, scale=0.03)
    w_down, w_qkv = rnd(d, inter, dtype=bf, seed=3, scale=0.03), rnd(qkv, d, dtype=bf, seed=4, scale=0.03)
    g1 = (torch.rand(d, generator=torch.Generator().manual_seed(5)) + 0.5).to(DEVICE, bf)
    g2 = (torch.rand(d, generator=torch.Generator().manual_seed(6)) + 0.5).to(DEVICE, bf)
    attn, r0 = rnd(m, q, dtype=bf, seed=7), rnd(m, d, dtype=bf, seed=8)
    split = G.SkinnyConfig(64, 32, 128, 4, 4, 4)  # o / down: split-K 4, as tuned on the H100 at 64 rows
    wide = G.SkinnyConfig(64, 64, 128, 1, 4, 4)
    counters = torch.zeros(4096, dtype=torch.int32, device=DEVICE)

    def layer(use_pdl: bool):
        h1, ss1 = G.linear_add_residual(attn, w_o, None, r0, split, use_pdl, counters)
        act = G.norm_partials_linear(h1, ss1, g1, EPS, w_gu, None, wide, use_pdl, counters, gated=True)
        h2, ss2 = G.linear_add_residual(act, w_down, None, h1, split, use_pdl, counters)
        out = G.norm_partials_linear(h2, ss2, g2, EPS, w_qkv, None, wide, use_pdl, counters)
        return out, h2

    eager = [t.clone() for t in layer(False)]
    outs = graph_replays_with_and_without_pdl(layer)
    for a, b, c in zip(eager, outs[False], outs[True], strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)
    assert not counters.any()
    # the unchained ops: linear, add, stock norm, linear (float32 products rounded as cuBLAS's)
    h1 = (F.linear(attn.float(), w_o.float()).to(bf) + r0)
    both = F.linear(stock_norm_formula(h1, g1).float(), w_gu.float())
    act = silu_mul(both, inter, bf)
    h2 = (F.linear(act.float(), w_down.float()).to(bf) + h1)
    want = F.linear(stock_norm_formula(h2, g2).float(), w_qkv.float()).to(bf)
    got, got_h2 = eager
    torch.testing.assert_close(got_h2.float(), h2.float(), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=5e-2)
    assert (got != want).float().mean().item() < 0.05


@gpu
@pytest.mark.gpu
def test_gpu_chain_tiles_are_timed_as_chains_at_qwen3_shapes(caplog):
    """`_time_chain_tiles` with the real kernels at qwen3-0.6b's 64-row shapes (o_proj first, gate/up gated second,
    q/k/v second): every chainable tile of each place builds, passes the tuner's float32 check and is timed; a place
    keeps a tile or none."""
    import logging

    d, q, qkv, inter = QWEN["hidden"], QWEN["q_out"], QWEN["qkv"], QWEN["inter"]
    use_pdl = pdl.supported(DEVICE)
    with caplog.at_level(logging.DEBUG, logger="hf_accel.ops.linear"):
        found = [linear_op._time_chain_tiles(n, k, False, 64, torch.bfloat16, DEVICE, use_pdl, 64 << 20, places, gated)
                 for n, k, places, gated in ((d, q, ("first",), False), (2 * inter, d, ("second",), True),
                                             (qkv, d, ("second",), False))]
    assert [list(f) for f in found] == [["first"], ["second"], ["second"]]
    bad = [r.getMessage() for r in caplog.records if "wrong result" in r.getMessage()]
    assert not bad, bad
    for f in found:
        assert all(c is None or (not c.gemv and c.block_m == 64) for c in f.values())


def test_pass_leaves_a_linear_added_to_itself():
    """`h = lin(x) + lin(x)` of one linear node: the add reads it twice, so the linear stays its own op (taking it
    into the chain would erase a node the new op still reads)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.o, self.norm, self.up = nn.Linear(32, 32, bias=False), LlamaRMSNorm(32, eps=EPS), nn.Linear(32, 16)

        def forward(self, x):
            y = self.o(x)
            h = y + y
            return self.up(self.norm(h)), h

    block = Block().eval().to(torch.bfloat16)
    x = torch.randn(1, 3, 32).to(torch.bfloat16)
    seen: dict = {}

    def backend(gm, example_inputs):
        route_small_m_linears(gm, use_pdl=False, allow_cpu=True)
        seen["folded"] = fold_norms_into_linears(gm)
        seen["chained"] = len(chain_residual_norms(gm))
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            out, h = torch.compile(block, backend=backend)(x)
            want, want_h = block(x)
    finally:
        torch._dynamo.reset()
    assert seen == {"folded": 1, "chained": 0}
    assert torch.equal(out, want) and torch.equal(h, want_h)
