"""`hf_accel::linear`: the compiled forward's linear, routed per row count to cuBLAS or our small-M GEMM.

The compile pass `compilation.small_m_linear.route_small_m_linears` replaces the linears of the traced forward with
this op. At run time it looks at M (the rows of this step, a plain int by then) and the weight's shape: for M above
`skinny_gemm.MAX_M`, or where nothing has been tuned, it is `F.linear` (cuBLAS), exactly as before; for a tuned
(shape, M bucket) it runs the configuration that won at warm-up, which may still be cuBLAS. Inside captured CUDA
graphs the choice is made once, at capture, so replay costs nothing extra.

Tuning (`tune_linears`, called by the runner after compiling and before capturing) times cuBLAS and a few tile
configurations of the Triton kernel (at M = 1 also of its one-row kernel) for every weight shape of the model at
M = 1, 16 and 64, each in a CUDA graph of
repeated calls over enough weight copies that L2 cannot hold them (HBM-bound, as in a real step). A candidate must
beat cuBLAS by `MIN_GAIN` (per bucket) to be kept. Decisions are remembered in memory per device and shape, and on
disk in the compile cache directory, so a warm start tunes nothing.

Numerics: the Triton kernel accumulates in float32 like cuBLAS, in a different order (and with split-K, a fixed
order of partial sums), so results may differ from cuBLAS in the last bit of bf16, never more; the GPU A/B judges
greedy outputs against a float32 model, as for every other kernel choice.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hf_accel.attention.context import split_k_counters
from hf_accel.ops.pdl import gemm_pdl_form

logger = logging.getLogger(__name__)

# Tuned at these row counts; a step of M rows uses the decision of the smallest bucket >= M.
M_BUCKETS = (1, 16, 64)
# keep our kernel only where it is at least this much faster than cuBLAS. Larger for the M = 17-64 bucket: there the
# stand-alone gains were small (2-8 % on the 8B shapes) and the 8B W2 figure of the first H200 run with them fell
# (not yet A/B-tested in one run), so only clear wins (qwen3-0.6b's narrow o/down projections: 12-25 %) are taken
MIN_GAIN = {1: 0.03, 16: 0.03, 64: 0.10}
# for each bucket of 2+ rows of a shape that takes a place in a residual chain (`ops.residual_chain`), the tuner
# times every tensor-core tile that can take that place as the chain launches it (`_time_chain_tiles`: with the
# residual epilogue, or normalizing its input) and keeps the fastest as the place's "chain tile" when it is at most
# CHAIN_SLACK and at most CHAIN_MAX_LOSS_S slower than the plain baseline, whatever the decision (a tile that won
# plain may spill in the chain). A chain runs only where both of its linears have a chain tile, and chaining saves a
# whole add + RMSNorm kernel and its wait (about 1.5 us at one row on the H200, more at 64 rows), which a tile that
# gives away less than that repays (qwen3-0.6b's q/k/v at 64 rows on the H100: our tile 8.5 % faster than cuBLAS,
# under MIN_GAIN[64], so that chain did not run). The absolute cap keeps a large weight (an 8B gate/up: 10 % is
# ~7 us) from trading more than the kernel saves. A shape keeps one tile per place: the first linear's epilogue
# takes at most `skinny_gemm.MAX_SS_TILES` column tiles and splits K only with counters, the second linear takes any
# tensor-core tile (an 8B gate/up's narrow tiles have more column tiles than the first may). A split-K first tile
# needs the runner's counters: with AccelConfig(fused_split_reductions=False) it does not chain
CHAIN_SLACK = 0.10
CHAIN_MAX_LOSS_S = 1e-6
TUNE_FILE = "small_m_gemm.json"
# part of every stored key: decisions of older candidate sets or thresholds are not reused (bump it when the
# candidates, MIN_GAIN, CHAIN_SLACK / CHAIN_MAX_LOSS_S, the int8 tile rule `quantized_linear.default_config` or what
# is timed change; 3: split-K candidates are timed with their reduction in the same launch, as engine steps run them)
TUNE_VERSION = 5  # 4: the one-row kernel among the M = 1 candidates; 5: chain tiles stored beside decisions
# part of gated keys only (`gated_key_dtype`); 3: one-row candidates only at one row
GATED_TUNE_VERSION = 3
# the one-row (GEMV) kernel of `skinny_gemm` among the M = 1 candidates; HF_ACCEL_ONE_ROW_GEMM=0 leaves it out (the
# A/B switch; read once per process, and part of the stored key, so either setting keeps its own decisions)
ONE_ROW_GEMM = os.environ.get("HF_ACCEL_ONE_ROW_GEMM", "1").strip().lower() not in ("0", "false", "no", "off")
# (rows per program, K tile) of the one-row candidates, K not split: on the H200 (2026-12-02, every decode linear of
# the three bench shapes at M = 1) each shape's best one-row configuration had one split, at 2-16 rows per program
ONE_ROW_TILES = ((2, 1024), (4, 512), (4, 1024), (8, 512), (16, 256), (16, 512))

# a chain's places (`ops.residual_chain`): its first linear (the epilogue adds the residual and stores partial sums of
# squares) and its second (it normalizes its input from them)
CHAIN_PLACES = ("first", "second")
# (device index, dtype, n, k, has_bias, bucket) -> SkinnyConfig | None (None: cuBLAS); on disk the device is named
_decisions: dict[tuple, object] = {}
# the same keys -> {place: the chain tile timed for it (`_time_chain_tiles`), None where no tile qualified}, the timed
# places only; each update a new dict, so a lock-free reader sees one whole. On disk under the decision's key +
# CHAIN_SUFFIX, as {"first": config dict or None, ...} (its own version: tiles timed plain, "|chain", are not read)
_chain_tiles: dict[tuple, dict[str, object]] = {}
CHAIN_SUFFIX = "|chain-timed"
OLD_CHAIN_SUFFIXES = ("|chain",)  # dropped from the stored file when it is written
_lock = threading.Lock()


def m_bucket(m: int) -> int | None:
    """The tuned M bucket a step of `m` rows uses (None above the largest: cuBLAS)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return None


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _key(device: torch.device, dtype: torch.dtype | tuple, n: int, k: int, has_bias: bool, bucket: int) -> tuple:
    """The in-memory key: cheap to build, since the op builds one per call of a step that is not replayed."""
    return (device_index(device), dtype, n, k, has_bias, bucket)


def _stored_key(device: torch.device, dtype: torch.dtype | tuple, n: int, k: int, has_bias: bool, bucket: int,
                use_pdl: bool) -> str:
    """The on-disk key: the GPU by name (the cache directory may move between machines), the tuning version."""
    name = torch.cuda.get_device_name(device_index(device))
    # only a key whose candidates depend on the switch says which set was timed
    rows1 = f"|rows1={int(ONE_ROW_GEMM)}" if _one_row_bucket(bucket, is_int8_key(dtype)) else ""
    # under PDL each trigger form keeps decisions of its own; "late" (the form before it had a name) and keys without
    # PDL, where the trigger compiles to nothing, keep the plain key
    form = gemm_pdl_form()
    form = f"|pdlform={form}" if use_pdl and form != "late" else ""
    gated = f"|gated=v{GATED_TUNE_VERSION}" if is_gated_key(dtype) else ""
    return f"{name}|{dtype}|{n}|{k}|{has_bias}|{bucket}|pdl={int(use_pdl)}{rows1}{form}{gated}|v{TUNE_VERSION}"


_skinny_linear = None  # hf_accel.ops.skinny_gemm.skinny_linear, imported on first use (it imports triton)


@torch.library.custom_op("hf_accel::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, use_pdl: bool) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; small-M steps on CUDA may run the tuned Triton GEMM instead (see module doc)."""
    return run_linear(x, weight, bias, use_pdl)


def run_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, use_pdl: bool) -> torch.Tensor:
    """What `hf_accel::linear` runs, for code already inside an op of ours (`ops.norm_linear`): calling the op there
    would go through the dispatcher a second time, about 56 extra dispatches in an uncaptured prefill step."""
    if kernel_operands(x, weight, bias):
        m = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if m > 0:
            cfg = tuned_config(x.device, x.dtype, weight.shape[0], weight.shape[1], bias is not None, m)
            if cfg is not None:
                global _skinny_linear
                if _skinny_linear is None:
                    from hf_accel.ops.skinny_gemm import skinny_linear as _skinny_linear
                return _skinny_linear(x, weight, bias, cfg, use_pdl, counters=split_k_counters())
    return F.linear(x, weight, bias)


def kernel_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether our GEMM kernels can take these operands: on CUDA, the weight's rows contiguous, one dtype (the
    bias, if any, contiguous too). Anything else runs `F.linear`."""
    return (x.is_cuda and weight.stride(-1) == 1 and weight.dtype == x.dtype
            and (bias is None or (bias.stride(0) == 1 and bias.dtype == x.dtype)))


@linear.register_fake
def _(x, weight, bias, use_pdl):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def tuned_config(device: torch.device, dtype: torch.dtype | tuple, n: int, k: int, has_bias: bool, m: int,
                 chain: str = ""):
    """The tuned tile config for a step of `m` rows (the decision of the smallest bucket >= m), or None: not tuned,
    more rows than any bucket, or the baseline won. `dtype`: as in `decisions_for`. `chain` ("first" or "second"):
    for that linear of a residual chain, the chain tile timed for that place (`CHAIN_SLACK`), or None: none
    qualified, or the place was never timed as a chain (its timing failed, or is still to come), and the chain does
    not run."""
    bucket = m_bucket(m)
    if bucket is None:
        return None
    key = _key(device, dtype, n, k, has_bias, bucket)
    if chain:
        return _chain_tiles.get(key, {}).get(chain)
    return _decisions.get(key)


def clear_decisions() -> None:
    """Forget every tuning decision (tests; a process that changes GPUs)."""
    with _lock:
        _chain_tiles.clear()
        _decisions.clear()


def decisions_for(shapes: Iterable[tuple[int, int, bool]], device: torch.device,
                  dtype: torch.dtype | tuple, chain_tiles: bool = False) -> dict:
    """The current decision per (n, k, bias, bucket): a config dict, or "cublas" for the baseline (missing: never
    tuned); with `chain_tiles` (a model with residual chains), also under the same name + ":chain-first" /
    ":chain-second" the chain tile timed for that place ("none": none qualified). `dtype`: the activations' dtype, or
    `int8_key_dtype(dtype)` for int8 weights (baseline: the tile rule)."""
    out = {}
    for n, k, has_bias in shapes:
        for b in M_BUCKETS:
            key = _key(device, dtype, n, k, has_bias, b)
            if key in _decisions:
                cfg = _decisions[key]
                name = f"{n}x{k}{'+b' if has_bias else ''}@m{b}"
                out[name] = asdict(cfg) if cfg is not None else _baseline_name(dtype)
                tiles = _chain_tiles.get(key, {}) if chain_tiles else {}
                for place in CHAIN_PLACES:
                    if place in tiles:
                        out[f"{name}:chain-{place}"] = asdict(tiles[place]) if tiles[place] is not None else "none"
    return out


# ------------------------------------------------------------------------------------------------------------ tuning
def _candidates(bucket: int, int8: bool = False) -> list:
    """Tile shapes to time. An int8 weight tile holds twice the K of a bf16 one in the same bytes, so its K tiles are
    longer (a config that does not fit shared memory fails to compile and is skipped)."""
    from hf_accel.ops.skinny_gemm import SkinnyConfig

    if bucket <= 16:
        tiles = (((32, 512), (64, 256), (128, 256), (32, 1024)) if int8
                 else ((32, 256), (64, 128), (128, 128), (16, 512)))
        block_m = 16
    else:
        tiles = ((32, 256), (64, 128), (128, 128), (128, 64)) if int8 else ((32, 128), (64, 64), (64, 128), (128, 64))
        block_m = 64
    # stages: 2 for the 1024-long int8 K tile, whose 4-stage buffers would pass 228 KB of shared memory wherever
    # triton pipelines these loads
    out = [SkinnyConfig(block_m, bn, bk, split, 4, 2 if bk >= 1024 else 4)
           for bn, bk in tiles for split in (1, 2, 4, 8)]
    if ONE_ROW_GEMM and _one_row_bucket(bucket, int8):
        out += [SkinnyConfig(1, bn, bk, 1, 4, 4, gemv=True) for bn, bk in ONE_ROW_TILES]
    return out


def _one_row_bucket(bucket: int, int8: bool) -> bool:
    """Whether this bucket's candidates include the one-row kernel (when ONE_ROW_GEMM is on): one row, bf16 / fp16."""
    return bucket == 1 and not int8


def int8_key_dtype(dtype: torch.dtype) -> tuple:
    """The dtype slot of a decision key for an int8 weight with `dtype` activations (hf_accel::int8_weight_linear)."""
    return (torch.int8, dtype)


def gated_key_dtype(dtype: torch.dtype) -> tuple:
    """The dtype slot of a decision key for a gated MLP's gate/up linear with the SiLU gate in its epilogue
    (`ops.gated_linear`): the same weight shape as the plain linear, decided apart from it."""
    return ("silu_mul", dtype)


def is_int8_key(dtype: torch.dtype | tuple) -> bool:
    return isinstance(dtype, tuple) and dtype[0] is torch.int8


def is_gated_key(dtype: torch.dtype | tuple) -> bool:
    return isinstance(dtype, tuple) and dtype[0] == "silu_mul"


def _baseline_name(dtype: torch.dtype | tuple) -> str:
    """What a decision of None runs, by key kind (reports)."""
    return "tile rule" if is_int8_key(dtype) else "linear + silu_mul" if is_gated_key(dtype) else "cublas"


def time_in_graph(fn, reps: int = 16, samples: int = 5) -> float:
    """Median seconds per call of `fn`, `reps` calls captured in one CUDA graph (launch overhead excluded).

    Each call's output is dropped at once, so a graph's private pool holds about one output (keeping them all, for
    a large lm_head and many candidates, added up to gigabytes); the pool goes with the graph.
    """
    from hf_accel.compilation.cuda_graph import capture_graph

    def body() -> None:
        for _ in range(reps):
            fn()

    fn()
    torch.cuda.synchronize()
    graph, _ = capture_graph(body, None)
    graph.replay()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    del graph
    return statistics.median(times)


class _Bench(NamedTuple):
    """Scratch operands for timing one weight shape at one bucket (`_bench`): `copies` weights, so that L2 cannot
    hold them and every timed call streams its weight from HBM, as in a real step."""

    weights: list
    scale: torch.Tensor | None
    bias: torch.Tensor | None
    x: torch.Tensor
    counters: torch.Tensor
    baseline: object  # a zero-argument call of what runs without a decision (`cycling`)
    rows: int  # output columns checked against the float32 reference
    out_n: int  # output columns (gated: half the weight's rows)
    use_pdl: bool
    gated: bool

    def launch(self, cfg, w: torch.Tensor) -> torch.Tensor:
        """Our kernel with tile `cfg` as a plain (or gated) linear of x and weight `w`."""
        from hf_accel.ops.skinny_gemm import skinny_linear

        return skinny_linear(self.x, w, self.bias, cfg, self.use_pdl, scale=self.scale, counters=self.counters,
                             gated=self.gated)

    def cycling(self, call):
        """A zero-argument call of `call(weight)` that takes the next weight copy each time."""
        state = {"i": 0}

        def fn():
            w = self.weights[state["i"] % len(self.weights)]
            state["i"] += 1
            return call(w)
        return fn


def _bench(n: int, k: int, has_bias: bool, bucket: int, dtype: torch.dtype, device: torch.device, use_pdl: bool,
           scratch_bytes: int, candidates: list, int8: bool = False, gated: bool = False) -> _Bench:
    """The operands and the baseline call `_tune_one` and `_time_chain_tiles` time against. bf16 / fp16 weights: the
    baseline is cuBLAS. int8 weights (one scale per row): `quantized_linear.default_config`'s tile rule, since no
    cuBLAS path reads int8 weights with bf16 activations. `gated` (a gate/up weight, `n` its rows): what
    `ops.gated_linear` runs without a decision, the plain linear's decision, then the SiLU-and-mul kernel."""
    from hf_accel.ops.skinny_gemm import skinny_linear

    wdtype = torch.int8 if int8 else dtype
    nbytes = n * k * torch.empty((), dtype=wdtype).element_size()
    copies = max(1, min(16, -(-scratch_bytes // nbytes)))
    if int8:
        weights = [torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8) for _ in range(copies)]
        scale = torch.rand(n, device=device, dtype=dtype) * 2e-3 + 1e-4
    else:
        weights = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(copies)]
        scale = None
    bias = torch.randn(n, device=device, dtype=dtype) if has_bias else None
    # products of about unit size, like the bias (and a chain's residual): a kernel that drops one of them fails the
    # check, and fp16's SiLU(gate) * up does not overflow at wide K
    x = torch.randn(bucket, k, device=device, dtype=dtype) * k ** -0.5
    out_n = n // 2 if gated else n
    # split-K candidates reduce in the same launch, as in an engine step (whose runner holds such counters): one
    # counter per column tile of the narrowest candidate (fewer would time the reduce kernel instead), and enough
    # for the gated baseline's plain linear over all n rows
    plain_cfg = _decisions.get(_key(device, dtype, n, k, False, bucket)) if gated else None
    tiles = max(-(-out_n // min((c.block_n for c in candidates), default=out_n)),
                -(-n // plain_cfg.block_n) if plain_cfg else 0)
    counters = torch.zeros(tiles, dtype=torch.int32, device=device)
    bench = _Bench(weights, scale, bias, x, counters, None, min(out_n, 512), out_n, use_pdl, gated)
    if int8:
        from hf_accel.ops.quantized_linear import default_config

        base = default_config(bucket, n, k, device)
        baseline = bench.cycling(lambda w: skinny_linear(x, w, bias, base, use_pdl, scale=scale, counters=counters))
    elif gated:
        from hf_accel.ops.fused_kernels import silu_and_mul

        def gate_after(w: torch.Tensor) -> torch.Tensor:  # the plain decision is tuned before the gated shapes
            y = (skinny_linear(x, w, None, plain_cfg, use_pdl, counters=counters) if plain_cfg is not None
                 else F.linear(x, w))
            return silu_and_mul(y[:, :out_n], y[:, out_n:], use_pdl)
        baseline = bench.cycling(gate_after)
    else:
        baseline = bench.cycling(lambda w: F.linear(x, w, bias))
    return bench._replace(baseline=baseline)


def _reference(b: _Bench, x: torch.Tensor, int8: bool = False, gated: bool = False,
               rows: int | None = None) -> torch.Tensor:
    """float32 `F.linear` of `x` with the first weight copy over the first `rows` (default `b.rows`) output columns,
    from float32 copies of at most 512 weight rows at a time (of a whole lm_head that would cost gigabytes);
    `gated`: silu(gate) * up of those columns."""
    w0, rows = b.weights[0], b.rows if rows is None else rows
    parts = []
    for lo in range(0, rows, 512):
        hi = min(rows, lo + 512)
        w_ref = w0[lo:hi].float() * (b.scale[lo:hi, None].float() if int8 else 1.0)
        ref = F.linear(x.float(), w_ref, b.bias[lo:hi].float() if b.bias is not None else None)
        if gated:
            ref = F.silu(ref) * F.linear(x.float(), w0[b.out_n + lo:b.out_n + hi].float())
        parts.append(ref)
    return torch.cat(parts, dim=-1)


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """The tuner's sanity check of a candidate's output (a broken config must never win; NaN fails it)."""
    return bool((out.float() - ref).abs().max().item() <= 0.05 * ref.abs().max().item() + 1e-3)


def _tune_one(n: int, k: int, has_bias: bool, bucket: int, dtype: torch.dtype, device: torch.device,
              use_pdl: bool, scratch_bytes: int, int8: bool = False, gated: bool = False):
    """Time the baseline (`_bench`) and the candidates for one weight shape at M = bucket: (the winner's config or
    None (the baseline), the baseline's seconds, the best candidate's seconds)."""
    candidates = _gated_candidates(bucket, k) if gated else _candidates_for(bucket, k, int8)
    if not candidates:  # e.g. gated at one row with the one-row kernel switched off: the baseline
        return None, 0.0, 0.0
    b = _bench(n, k, has_bias, bucket, dtype, device, use_pdl, scratch_bytes, candidates, int8, gated)
    ref = _reference(b, b.x, int8, gated)
    best_cfg, best_t = None, time_in_graph(b.baseline)
    base_t = best_t
    for cfg in candidates:
        try:
            if not _close(b.launch(cfg, b.weights[0])[:, :b.rows], ref):
                logger.warning("hf_accel: small-M GEMM config %s gave a wrong result on %dx%d; skipped", cfg, n, k)
                continue
            t = time_in_graph(b.cycling(lambda w, c=cfg: b.launch(c, w)))
        except Exception as exc:  # a config that does not compile on this GPU / triton
            logger.debug("small-M GEMM config %s failed: %s", cfg, exc)
            continue
        if t < best_t:
            best_cfg, best_t = cfg, t
    if best_cfg is not None and best_t > base_t * (1.0 - MIN_GAIN[bucket]):
        best_cfg = None
    return best_cfg, base_t, best_t


def chain_ss_tiles(k: int, bucket: int) -> int:
    """The partial sums of squares a chain's second linear over a hidden size of `k` is timed with
    (`_time_chain_tiles`): the most any first linear's tile of the bucket can store (the narrowest tile that may
    lead a chain), so that the variant timed is the one with the largest block of them in registers; a launch with
    fewer builds its own variant when it first runs."""
    from hf_accel.ops.skinny_gemm import MAX_SS_TILES

    counts = [-(-k // c.block_n) for c in _candidates(bucket) if not c.gemv]
    return max([t for t in counts if t <= MAX_SS_TILES], default=1)


def _tile_sums_of_squares(h: torch.Tensor, block_n: int) -> torch.Tensor:
    """float32 `[column tiles, rows]`: each `block_n`-wide column tile's sums of squares of the rows of h, as the
    first linear of a chain stores them (`skinny_gemm.linear_add_residual`)."""
    m, n = h.shape
    tiles = -(-n // block_n)
    padded = torch.zeros(m, tiles * block_n, device=h.device, dtype=torch.float32)
    padded[:, :n] = h.float()
    return padded.view(m, tiles, block_n).pow(2).sum(-1).t().contiguous()


def _chain_calls(b: _Bench, place: str, bucket: int, k: int, dtype: torch.dtype, device: torch.device,
                 use_pdl: bool, gated: bool):
    """(call(cfg, weight), check(cfg) -> bool) for one place in a chain: the first linear with its residual epilogue
    (`skinny_gemm.linear_add_residual`), or the second normalizing its input from partial sums of squares
    (`skinny_gemm.norm_partials_linear`), on scratch operands; `check` compares a launch with a float32 reference."""
    from hf_accel.ops.skinny_gemm import linear_add_residual, norm_partials_linear

    if place == "first":  # every column of h (the hidden size) and each tile's sums of squares of it
        residual = torch.randn(bucket, b.out_n, device=device, dtype=dtype)
        ref_h = _reference(b, b.x, rows=b.out_n) + residual.float()

        def call(cfg, w):
            return linear_add_residual(b.x, w, b.bias, residual, cfg, use_pdl, counters=b.counters)

        def check(cfg) -> bool:
            h, ss = call(cfg, b.weights[0])
            want = _tile_sums_of_squares(h, cfg.block_n)  # of the h stored: only the sums' order may differ
            return (_close(h, ref_h) and ss.shape == want.shape
                    and bool(((ss - want).abs() <= 1e-3 * want + 1e-6).all().item()))
        return call, check
    # rows of h 2^-3 to 2^3 in size, so that a kernel normalizing wrongly (or not at all) gives a wrong product
    row_scale = 2.0 ** torch.linspace(-3, 3, bucket, device=device)[:, None]
    h = (torch.randn(bucket, k, device=device) * row_scale).to(dtype)
    tiles = chain_ss_tiles(k, bucket)
    ss = _tile_sums_of_squares(h, -(-k // tiles))  # spread over the tiles, as a first linear stores them
    ss = torch.cat([ss, ss.new_zeros(tiles - ss.shape[0], bucket)]) if ss.shape[0] < tiles else ss
    g = (torch.rand(k, device=device) + 0.5).mul(k ** -0.5).to(dtype)  # products of about unit size
    eps = 1e-6
    normed = g * (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    ref = _reference(b, normed, gated=gated)

    def call(cfg, w):
        return norm_partials_linear(h, ss, g, eps, w, b.bias, cfg, use_pdl, counters=b.counters, gated=gated)

    def check(cfg) -> bool:
        out = call(cfg, b.weights[0])[:, :b.rows].float()
        # and each row's scale against the reference's: a row normalized from some of the partial sums only (one
        # lost of 64) is a few thousandths off as a whole, under the element-wise tolerance
        scale = (out * ref).sum(-1) / (ref * ref).sum(-1).clamp_min(1e-30)
        return _close(out, ref) and bool(((scale - 1).abs() <= 4e-3).all().item())
    return call, check


def _time_chain_tiles(n: int, k: int, has_bias: bool, bucket: int, dtype: torch.dtype, device: torch.device,
                      use_pdl: bool, scratch_bytes: int, places: Iterable[str], gated: bool = False,
                      decision=None) -> dict:
    """{place: the fastest tile of that place's chained launch, or None} (`CHAIN_SLACK`): each tensor-core candidate
    that can take the place is built and timed as the chain runs it (the residual epilogue, or the normalizing K
    loop), against what the linear runs unchained: the baseline, or `decision` (the shape's tuned tile, if ours).
    A chained launch does more than the plain linear (it replaces the add + RMSNorm kernel between them), and some
    tiles need more registers in it than plain (examples/kernel_registers.py): a tile timed plain, even the
    decision, may spill in the chain."""
    from hf_accel.ops.skinny_gemm import can_chain
    from hf_accel.ops.triton_build import ahead, build_in_parallel

    places = tuple(places)
    candidates = [c for c in (_gated_candidates(bucket, k) if gated else _candidates_for(bucket, k, False))
                  if not c.gemv]
    b = _bench(n, k, has_bias, bucket, dtype, device, use_pdl, scratch_bytes, candidates, gated=gated)
    runs = {}
    for place in places:
        call, check = _chain_calls(b, place, bucket, k, dtype, device, use_pdl, gated)
        runs[place] = (call, check, [c for c in candidates
                                     if can_chain(c, bucket, k, b.out_n, b.counters, residual=place == "first")])
    # every chained variant built side by side first: at a fresh start the builds are most of the time
    build_in_parallel([ahead(lambda call=call, c=c: call(c, b.weights[0]))
                       for call, _, cands in runs.values() for c in cands])
    base_t = time_in_graph(b.baseline if decision is None else b.cycling(lambda w: b.launch(decision, w)))
    limit = min(base_t * (1.0 + CHAIN_SLACK), base_t + CHAIN_MAX_LOSS_S)
    out = {}
    for place, (call, check, cands) in runs.items():
        best, best_t = None, limit
        for cfg in cands:
            try:
                if not check(cfg):
                    logger.warning("hf_accel: chained small-M GEMM config %s (%s) gave a wrong result on %dx%d; "
                                   "skipped", cfg, place, n, k)
                    continue
                t = time_in_graph(b.cycling(lambda w, c=cfg, call=call: call(c, w)))
            except Exception as exc:  # a config that does not compile on this GPU / triton
                logger.debug("chained small-M GEMM config %s (%s) failed: %s", cfg, place, exc)
                continue
            if t <= best_t:
                best, best_t = cfg, t
        out[place] = best
        logger.debug("chain tile %dx%d%s m<=%d %s: baseline %.2f us -> %s", n, k, " gated" if gated else "",
                     bucket, place, base_t * 1e6, best)
    return out


def _candidates_for(bucket: int, k: int, int8: bool, one_row_only: bool = False) -> list:
    """The candidates timed for this K (a split-K tile needs at least one whole tile per split); `one_row_only`:
    only the one-row kernel's (`_gated_candidates`)."""
    return [c for c in _candidates(bucket, int8) if (c.split_k == 1 or k // (c.split_k * c.block_k) >= 1)
            and (c.gemv or not one_row_only)]


def _gated_candidates(bucket: int, k: int) -> list:
    """The gated candidates of a gate/up shape: at one row the one-row kernel's only, elsewhere all of them.

    At one row the gated form must be the one-row kernel, the kernel that can also apply the RMSNorm before the
    linear (`compilation.norm_folding`): the timing here sees neither that norm nor how a tensor-core tile overlaps
    the kernels around it in a step. On the H200, llama-3.2-1b's tensor-core gated tile won its timing at one row
    and lost in the step (W1 987 and 963 tok/s against 1,001 and 986 without the gated GEMM, two leases), while
    qwen3-0.6b's one-row gated kernel won both (W1 1,143 against 1,093, same lease)."""
    return _candidates_for(bucket, k, False, one_row_only=bucket == 1)


def build_candidates(todo: Iterable[tuple[int, int, bool, int]], dtype: torch.dtype, use_pdl: bool, int8: bool,
                     device: torch.device, gated: bool = False) -> dict:
    """Compile every kernel `_tune_one` will time for these (n, k, has_bias, bucket), side by side in a thread pool
    (`ops.triton_build`): at a fresh start the builds, not the timings, are most of the tuning. A report."""
    from hf_accel.ops.quantized_linear import default_config
    from hf_accel.ops.skinny_gemm import build_skinny_linear
    from hf_accel.ops.triton_build import build_in_parallel

    wdtype = torch.int8 if int8 else dtype
    warmups = []
    with torch.cuda.device(device):
        for n, k, has_bias, bucket in todo:
            # int8: the tile rule is the baseline, timed beside the candidates
            baseline = [default_config(bucket, n, k, device)] if int8 else []
            cands = _gated_candidates(bucket, k) if gated else _candidates_for(bucket, k, int8)
            for cfg in cands + baseline:
                warmups.append(lambda n=n, k=k, b=has_bias, m=bucket, c=cfg: build_skinny_linear(
                    m, n, k, dtype, wdtype, b, int8, c, use_pdl, gated=gated))
        return build_in_parallel(warmups)


def tune_linears(shapes: Iterable[tuple[int, int, bool]], dtype: torch.dtype, device: torch.device, *,
                 use_pdl: bool, cache_dir: str | os.PathLike | None = None,
                 scratch_bytes: int = 128 << 20, int8: bool = False, gated: bool = False,
                 chain_places: Mapping[tuple[int, int, bool], Iterable[str]] | None = None) -> dict:
    """Decide cuBLAS vs small-M GEMM for each weight shape and M bucket (see the module docstring); returns a report.

    `cache_dir`: where decisions are remembered across processes (the compile cache directory); None: memory only.
    `int8`: the shapes are int8 weights with `dtype` activations (torchao int8 weight-only, `quantized_linear`):
    the small-M GEMM's tile rule against the candidates, decisions under `int8_key_dtype(dtype)`.
    `gated`: the shapes are gated MLPs' gate/up weights (`ops.gated_linear`): the gated kernel against the plain
    linear's decision (tune the plain shapes first) and the SiLU-and-mul kernel, decisions under
    `gated_key_dtype(dtype)`.
    `chain_places`: {(n, k, has_bias): the places ("first", "second") that shape takes in the model's residual chains
    (`compilation.norm_folding.chain_residual_norms`)}: at each bucket of 2+ rows, each place's chain tile is timed
    as the chain launches it (`_time_chain_tiles`), once per place, and remembered like the decisions.
    """
    if int8 and gated:
        raise ValueError("tune_linears: int8 weights have no gated form")
    key_dtype = int8_key_dtype(dtype) if int8 else gated_key_dtype(dtype) if gated else dtype
    t0 = time.perf_counter()
    shapes = sorted(set(shapes))
    path = Path(cache_dir) / TUNE_FILE if cache_dir else None
    stored: dict = {}
    if path is not None and path.is_file():
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            stored = {}
    from hf_accel.ops.skinny_gemm import SkinnyConfig

    tuned = chain_timed = 0
    chain_tried = False
    baseline = _baseline_name(key_dtype)
    report: dict = {"tuned": 0, "from_cache": 0, "ours": 0, baseline: 0}
    try:
        with _lock:
            # decisions already made (this process, or stored by an earlier one), and what is left to time
            pending = []
            for n, k, has_bias in shapes:
                for bucket in M_BUCKETS:
                    key = _key(device, key_dtype, n, k, has_bias, bucket)
                    skey = _stored_key(device, key_dtype, n, k, has_bias, bucket, use_pdl)
                    if key in _decisions:
                        cfg = _decisions[key]
                    elif skey in stored:
                        entry = stored[skey]
                        cfg = _decisions[key] = SkinnyConfig(**entry) if isinstance(entry, dict) else None
                        entry = stored.get(skey + CHAIN_SUFFIX)
                        if isinstance(entry, dict) and entry.keys() & set(CHAIN_PLACES):
                            _chain_tiles[key] = {p: SkinnyConfig(**c) if isinstance(c, dict) else None
                                                 for p, c in entry.items() if p in CHAIN_PLACES}
                        report["from_cache"] += 1
                    else:
                        pending.append((n, k, has_bias, bucket))
                        continue
                    report["ours" if cfg is not None else baseline] += 1
            if pending:
                report["build"] = build_candidates(pending, dtype, use_pdl, int8, device, gated)
            for n, k, has_bias, bucket in pending:
                cfg, base_t, best_t = _tune_one(n, k, has_bias, bucket, dtype, device, use_pdl, scratch_bytes, int8,
                                                gated)
                skey = _stored_key(device, key_dtype, n, k, has_bias, bucket, use_pdl)
                stored[skey] = asdict(cfg) if cfg is not None else None
                stored.pop(skey + CHAIN_SUFFIX, None)  # chain tiles timed beside an older decision
                _decisions[_key(device, key_dtype, n, k, has_bias, bucket)] = cfg
                tuned += 1
                report["ours" if cfg is not None else baseline] += 1
                logger.debug("small-M GEMM %dx%d%s m<=%d: %s %.2f us, best %.2f us -> %s", n, k,
                             " int8" if int8 else " gated" if gated else "", bucket, baseline, base_t * 1e6,
                             best_t * 1e6, cfg or baseline)
            # the chain tiles of the shapes in chains, each bucket of 2+ rows, for the places not yet timed
            for (n, k, has_bias), places in (chain_places or {}).items() if not int8 else ():
                wanted = frozenset([places] if isinstance(places, str) else places)
                if not wanted <= set(CHAIN_PLACES):
                    raise ValueError(f"tune_linears: unknown chain places {sorted(wanted - set(CHAIN_PLACES))}")
                for bucket in M_BUCKETS[1:]:
                    key = _key(device, key_dtype, n, k, has_bias, bucket)
                    missing = [p for p in CHAIN_PLACES if p in wanted and p not in _chain_tiles.get(key, {})]
                    if key not in _decisions or not missing:
                        continue
                    chain_tried = True
                    try:
                        found = _time_chain_tiles(n, k, has_bias, bucket, dtype, device, use_pdl, scratch_bytes,
                                                  missing, gated, decision=_decisions[key])
                    except Exception as exc:  # these places stay untimed (no chain), and are tried again next start
                        logger.warning("hf_accel: timing the chain tiles of %dx%d at %d rows failed (%s: %s); those "
                                       "chains do not run", n, k, bucket, type(exc).__name__, exc)
                        report["chain_errors"] = report.get("chain_errors", 0) + 1
                        continue
                    _chain_tiles[key] = {**_chain_tiles.get(key, {}), **found}
                    skey = _stored_key(device, key_dtype, n, k, has_bias, bucket, use_pdl) + CHAIN_SUFFIX
                    entry = stored.get(skey) if isinstance(stored.get(skey), dict) else {}
                    stored[skey] = {**entry, **{p: asdict(c) if c is not None else None for p, c in found.items()}}
                    chain_timed += len(found)
    finally:  # what was decided is kept even when a later shape fails, and the scratch memory goes back
        report["tuned"] = tuned
        report["chain_places_timed"] = chain_timed
        if (tuned or chain_timed) and path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                for old in [key for key in stored if key.endswith(OLD_CHAIN_SUFFIXES)]:
                    del stored[old]
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
                tmp.replace(path)
            except OSError as exc:  # a read-only cache is not an error
                logger.debug("could not store small-M GEMM decisions: %s", exc)
        if tuned or chain_tried:  # the scratch weights and the tuning graphs' pool go back before anything is sized
            try:
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
            except RuntimeError as exc:  # a failed kernel's error surfaces from the tuning itself
                logger.debug("could not release the tuning memory: %s", exc)
    report["seconds"] = time.perf_counter() - t0
    return report
