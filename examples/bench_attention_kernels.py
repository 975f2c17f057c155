"""Attention kernel benchmark: hf_accel's Triton kernels beside flashinfer and flash-attn 4 (CUDA only).

Shapes follow qwen3-0.6b / llama-style GQA: bf16, 16 query heads / 8 KV heads (`--query-heads 32` for
llama-3.1-8b's), head_dim 128, paged KV with block size 16 in the NHD layout every backend shares. Cases:
- decode: 1, 8, 64, 256 sequences at contexts 512, 4k, 32k; time and achieved bandwidth (KV bytes read + q + out)
- prefill: one sequence of 1k, 2k, 4k, 8k tokens, causal; TFLOP/s (4 * H * D * causal pairs)

Each call is captured `--reps` times in one CUDA graph (so host launch overhead is out of the figure) and the
graph is replayed `--samples` times, timed with CUDA events; the median per call is reported. Small decode cases
fit in the 50 MB L2 and show more than HBM bandwidth (marked "L2"). Libraries that are not importable are skipped
with a note. `--sweep` also times a few Triton tile shapes on representative cases (for tuning the defaults).

    python examples/bench_attention_kernels.py [--json out.json] [--sweep] [--only triton]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_accel.attention.backend import AttentionSpec
from hf_accel.attention.metadata import StepMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_BATCHES = (1, 8, 64, 256)
DECODE_CONTEXTS = (512, 4096, 32768)
PREFILL_TOKENS = (1024, 2048, 4096, 8192)
L2_BYTES = 50 * 2**20
DEVICE = "cuda"


@dataclass
class Case:
    kind: str  # "decode" | "prefill"
    batch: int
    ctx: int  # KV length per sequence (decode) / prompt length (prefill)
    query: torch.Tensor  # [T, H, D]
    meta: StepMetadata
    bytes_moved: int
    flops: int


def make_case(kind: str, batch: int, ctx: int, num_blocks: int, gen: torch.Generator) -> Case:
    dev = torch.device(DEVICE)
    q_len = 1 if kind == "decode" else ctx
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    perm = torch.randperm(num_blocks - 1, generator=gen, device="cpu")[: batch * blocks_per_seq] + 1
    tables = perm.view(batch, blocks_per_seq).to(torch.int32).to(dev)
    t = batch * q_len
    meta = StepMetadata(
        num_tokens=t, num_seqs=batch, max_query_len=q_len, max_seq_len=ctx, block_size=BLOCK_SIZE,
        query_start_loc=torch.arange(0, t + 1, q_len, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
        context_lens=torch.full((batch,), ctx - q_len, dtype=torch.int32, device=dev),
        block_tables=tables, slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=dev),
        query_lens_cpu=[q_len] * batch, seq_lens_cpu=[ctx] * batch,
    )
    query = torch.randn(t, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    elem = query.element_size()
    kv_bytes = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2 * elem
    io_bytes = 2 * t * NUM_HEADS * HEAD_DIM * elem
    pairs = batch * (q_len * ctx - q_len * (q_len - 1) // 2)  # causal (query, key) pairs
    return Case(kind, batch, ctx, query, meta, kv_bytes + io_bytes, 4 * pairs * NUM_HEADS * HEAD_DIM)


def capture_graph(fn: Callable[[], object], reps: int) -> tuple[torch.cuda.CUDAGraph, object]:
    """A CUDA graph of `reps` calls of `fn` (after a warm-up call on a side stream) and what the last call
    returned: the tensors a replay writes. The capture is the engine's (`compilation.cuda_graph.capture_graph`)."""
    from hf_accel.compilation.cuda_graph import capture_graph as engine_capture
    from hf_accel.compilation.cuda_graph import capture_stream

    stream = capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return engine_capture(lambda: [fn() for _ in range(reps)][-1], None)


def median_seconds(run: Callable[[], object], samples: int) -> float:
    """Median seconds of `run()` over `samples` runs, timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(samples):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_call(fn: Callable[[], object], reps: int, samples: int) -> tuple[float, str]:
    """Median seconds per call: `reps` calls captured in one CUDA graph, replayed `samples` times.

    Falls back to an eager loop (host overhead included, marked) if the call cannot be captured.
    """
    fn()
    torch.cuda.synchronize()
    try:
        graph, _ = capture_graph(fn, reps)
        return median_seconds(graph.replay, samples) / reps, "graph"
    except Exception:
        torch.cuda.synchronize()

    def eager() -> None:
        for _ in range(reps):
            fn()
    return median_seconds(eager, samples) / reps, "eager"


# -- implementations: each returns a zero-argument callable that writes into `out` ------------------------------


def triton_impl(case: Case, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, max_blocks: int,
                force_splits: int | None = None, unified_config=None, decode_config=None,
                longest_first: bool = False) -> Callable[[], None]:
    """`longest_first`: unsplit decode launches take the sequences longest first (the engine's default); off here
    unless asked, so that the tile and split figures stay comparable with earlier runs."""
    from hf_accel.attention.triton_backend import TritonAttentionBackend

    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE)
    be = TritonAttentionBackend(spec, torch.device(DEVICE), BLOCK_SIZE, 256, 8192, max_blocks,
                                num_kv_splits=force_splits)
    be.unified_config, be.decode_config = unified_config, decode_config
    be.longest_first = longest_first
    be.prepare(case.meta)
    scale = HEAD_DIM**-0.5
    return lambda: be.forward(case.query, k_cache, v_cache, case.meta, out, scale, 0, 0.0)


def triton_path(case: Case, max_blocks: int) -> str:
    from hf_accel.attention.triton_backend import TritonAttentionBackend

    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE)
    be = TritonAttentionBackend(spec, torch.device(DEVICE), BLOCK_SIZE, 256, 8192, max_blocks)
    splits = be.splits_for_step(case.meta)
    return f"split{splits}" if splits > 1 else "decode" if splits == 1 else "unified"


_workspace: torch.Tensor | None = None


def flashinfer_impl(case: Case, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor) -> Callable[[], None]:
    import flashinfer

    global _workspace
    if _workspace is None:
        _workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEVICE)
    m = case.meta
    pages = m.block_tables.shape[1]
    kv_indptr = torch.arange(0, (m.num_seqs + 1) * pages, pages, dtype=torch.int32, device=DEVICE)
    kv_indices = m.block_tables.reshape(-1).contiguous()
    last_page_len = torch.full((m.num_seqs,), (case.ctx - 1) % BLOCK_SIZE + 1, dtype=torch.int32, device=DEVICE)
    opts = dict(pos_encoding_mode="NONE", q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=HEAD_DIM**-0.5)
    if case.kind == "decode":
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace, "NHD")
        wrapper.plan(kv_indptr, kv_indices, last_page_len, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, **opts)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace, "NHD")
        wrapper.plan(m.query_start_loc, kv_indptr, kv_indices, last_page_len, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM,
                     BLOCK_SIZE, causal=True, **opts)
    return lambda: wrapper.run(case.query, (k_cache, v_cache), out=out)


def fa4_impl(case: Case, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    from flash_attn.cute import flash_attn_varlen_func

    m = case.meta

    def call() -> None:
        res = flash_attn_varlen_func(
            case.query, k_cache, v_cache, cu_seqlens_q=m.query_start_loc, max_seqlen_q=m.max_query_len,
            seqused_k=m.seq_lens, page_table=m.block_tables, softmax_scale=HEAD_DIM**-0.5, causal=True,
        )
        out.copy_(res[0] if isinstance(res, tuple) else res)  # FA4 returns (out, lse); the copy is ~q-sized

    return call


LIBRARIES: dict[str, Callable[..., Callable[[], None]]] = {"flashinfer": flashinfer_impl, "fa4": fa4_impl}


def library_available(name: str) -> str | None:
    """None if importable, else why not."""
    try:
        if name == "flashinfer":
            import flashinfer  # noqa: F401
        elif name == "fa4":
            from flash_attn.cute import flash_attn_varlen_func  # noqa: F401
    except Exception as exc:
        return f"{exc.__class__.__name__}: {exc}"
    return None


# -- main --------------------------------------------------------------------------------------------------------


def fmt_row(r: dict) -> str:
    if r["kind"] == "decode":
        perf = f"{r['gbps']:8.0f} GB/s"
    else:
        perf = f"{r['tflops']:8.1f} TF/s"
    diff = "" if r.get("max_abs_diff") is None else f"  diff {r['max_abs_diff']:.1e}"
    note = f"  [{r['note']}]" if r.get("note") else ""
    return (f"{r['kind']:8s} {r['batch']:4d} x {r['ctx']:6d}  {r['impl']:18s} {r['us']:10.1f} us  {perf}"
            f"{diff}{note}")


def set_query_heads(n: int) -> None:
    """Every case and spec of this run gets `n` query heads (the module constant the helpers read)."""
    global NUM_HEADS
    NUM_HEADS = n


def parse_tile_configs(text: str) -> list:
    """'16,32,4,2;16,64,2,2' -> TileConfigs (block_m, block_n, num_warps, num_stages)."""
    from hf_accel.attention.kernels.common import TileConfig

    configs = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        fields = [int(x) for x in item.split(",")]
        if len(fields) != 4 or min(fields) < 1:
            raise argparse.ArgumentTypeError(f"a tile is four positive integers, got {item!r}")
        configs.append(TileConfig(*fields))
    return configs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write all results to this path")
    ap.add_argument("--reps", type=int, default=10, help="calls captured per graph")
    ap.add_argument("--samples", type=int, default=7, help="graph replays timed (median reported)")
    ap.add_argument("--only", nargs="*", help="implementations to run (triton, triton-unified, flashinfer, fa4)")
    ap.add_argument("--sweep", action="store_true", help="also time alternative Triton tile shapes")
    ap.add_argument("--w3-study", action="store_true",
                    help="only W3's decode shape (256 sequences, contexts of prompts uniform in [100, 1024] plus 256 "
                         "decoded tokens): the decode kernel's tiles and split counts")
    ap.add_argument("--layout-study", action="store_true",
                    help="only W3's and W2's decode shapes with the KV cache in two layouts (NHD: a page's rows of "
                         "one head 2 KB apart; HND: each head's page contiguous), beside a plain streaming read of "
                         "the same bytes (the read bandwidth a kernel can reach)")
    ap.add_argument("--decode-study", action="store_true",
                    help="only the W1/W2 decode shapes (batch 1 and 64 at contexts 128-384): the unified kernel, the "
                         "decode kernel unsplit and split, decode tiles")
    ap.add_argument("--query-heads", type=int, default=NUM_HEADS,
                    help=f"query heads per token beside {NUM_KV_HEADS} KV heads (default {NUM_HEADS}, qwen3-0.6b; "
                         "32 for llama-3.1-8b's GQA groups of four)")
    ap.add_argument("--decode-configs", type=parse_tile_configs, default=[],
                    help="--decode-study: more unsplit tiles to time at batch 64, as block_m,block_n,num_warps,"
                         "num_stages separated by ';' (e.g. '16,32,4,2;16,64,2,2')")
    args = ap.parse_args()
    if args.query_heads < 1 or args.query_heads % NUM_KV_HEADS:
        ap.error(f"--query-heads must be a positive multiple of {NUM_KV_HEADS}")
    set_query_heads(args.query_heads)
    if not torch.cuda.is_available():
        print("bench_attention_kernels: needs a CUDA GPU", file=sys.stderr)
        return 1
    t_start = time.time()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)

    wanted = set(args.only or ["triton", "triton-unified", "flashinfer", "fa4"])
    libs = {}
    for name in LIBRARIES:
        if name in wanted:
            why = library_available(name)
            if why:
                print(f"note: {name} skipped ({why})")
            else:
                libs[name] = LIBRARIES[name]

    if args.decode_study:
        return decode_study(args, gen)
    if args.w3_study:
        return w3_study(args)
    if args.layout_study:
        return layout_study(args)
    max_blocks = -(-max(max(DECODE_CONTEXTS), max(PREFILL_TOKENS)) // BLOCK_SIZE)
    num_blocks = max(DECODE_BATCHES) * max_blocks + 1  # block 0 stays the null block
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_()
    v_cache = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_()
    print(f"device: {torch.cuda.get_device_name()}  KV cache {2 * k_cache.numel() * 2 / 2**30:.1f} GiB  "
          f"{DTYPE} H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block={BLOCK_SIZE}")

    cases = [("decode", b, c) for c in DECODE_CONTEXTS for b in DECODE_BATCHES]
    cases += [("prefill", 1, n) for n in PREFILL_TOKENS]
    rows: list[dict] = []
    for kind, batch, ctx in cases:
        case = make_case(kind, batch, ctx, num_blocks, gen)
        rows += run_case(case, k_cache, v_cache, max_blocks, wanted, libs, args)

    if args.sweep:
        rows += sweep(k_cache, v_cache, num_blocks, max_blocks, gen, args)

    print(f"\ntotal {time.time() - t_start:.0f} s")
    print(summary_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
        print(f"wrote {args.json}")
    return 0


def run_case(case: Case, k_cache: torch.Tensor, v_cache: torch.Tensor, max_blocks: int, wanted: set[str],
             libs: dict[str, Callable[..., Callable[[], None]]], args: argparse.Namespace) -> list[dict]:
    """Time every implementation on one case; outputs are compared with triton's (max |diff|)."""
    label = f"{case.kind} {case.batch}x{case.ctx}"
    makers: list[tuple[str, Callable[[torch.Tensor], Callable[[], None]], str]] = []
    path = triton_path(case, max_blocks)
    if "triton" in wanted:
        makers.append(("triton", lambda o: triton_impl(case, k_cache, v_cache, o, max_blocks), path))
    if "triton-unified" in wanted and path != "unified":
        makers.append(("triton-unified",
                       lambda o: triton_impl(case, k_cache, v_cache, o, max_blocks, force_splits=0), ""))
    for name, make in libs.items():
        makers.append((name, lambda o, make=make: make(case, k_cache, v_cache, o), ""))

    rows: list[dict] = []
    ref_out = None
    for name, make, note in makers:
        out = torch.zeros_like(case.query)
        try:
            fn = make(out)
            secs, how = time_call(fn, args.reps, args.samples)
        except Exception as exc:  # a library that cannot run this case: say so, keep going
            print(f"note: {name} failed on {label}: {exc.__class__.__name__}: {exc}")
            continue
        if name == "triton":
            ref_out = out
        diff = None if ref_out is None or out is ref_out else (out.float() - ref_out.float()).abs().max().item()
        small = case.kind == "decode" and case.bytes_moved < L2_BYTES
        notes = [n for n in (note, "" if how == "graph" else how, "L2" if small else "") if n]
        row = dict(kind=case.kind, batch=case.batch, ctx=case.ctx, impl=name, us=secs * 1e6,
                   gbps=case.bytes_moved / secs / 1e9, tflops=case.flops / secs / 1e12, max_abs_diff=diff,
                   note=",".join(notes), timing=how)
        rows.append(row)
        print(fmt_row(row), flush=True)
    return rows


def sweep(k_cache: torch.Tensor, v_cache: torch.Tensor, num_blocks: int, max_blocks: int, gen: torch.Generator,
          args: argparse.Namespace) -> list[dict]:
    """Time alternative tile shapes on a few representative cases (not the defaults' full matrix)."""
    from hf_accel.attention.kernels.common import TileConfig

    rows = []
    print("\nsweep (block_m, block_n, num_warps, num_stages):")
    prefill_cfgs = [TileConfig(128, 64, 8, 2), TileConfig(128, 64, 8, 3), TileConfig(128, 128, 8, 2),
                    TileConfig(64, 64, 4, 3), TileConfig(64, 64, 4, 2), TileConfig(128, 32, 4, 3)]
    decode_cfgs = [TileConfig(16, 64, 4, 3), TileConfig(16, 64, 4, 2), TileConfig(16, 128, 4, 2),
                   TileConfig(16, 128, 8, 3), TileConfig(16, 32, 4, 4), TileConfig(16, 64, 2, 3)]
    long_ctx, mid_ctx = max(DECODE_CONTEXTS), sorted(DECODE_CONTEXTS)[len(DECODE_CONTEXTS) // 2]
    plans = [("prefill", 1, sorted(PREFILL_TOKENS)[len(PREFILL_TOKENS) // 2], None, prefill_cfgs),
             ("decode", max(DECODE_BATCHES), mid_ctx, 0, decode_cfgs),  # unified kernel, decode tiles
             ("decode", sorted(DECODE_BATCHES)[1], long_ctx, None, decode_cfgs),  # split-KV
             ("decode", min(DECODE_BATCHES), long_ctx, None, decode_cfgs)]
    for kind, batch, ctx, force, cfgs in plans:
        case = make_case(kind, batch, ctx, num_blocks, gen)
        for cfg in cfgs:
            out = torch.zeros_like(case.query)
            split = kind == "decode" and force is None
            fn = triton_impl(case, k_cache, v_cache, out, max_blocks, force_splits=force,
                             unified_config=None if split else cfg, decode_config=cfg if split else None)
            try:
                secs, how = time_call(fn, args.reps, args.samples)
            except Exception as exc:  # e.g. out of shared memory for this shape
                print(f"  {kind} {batch}x{ctx} {cfg}: failed ({exc.__class__.__name__})")
                continue
            name = f"sweep{'-split' if split else ''}"
            row = dict(kind=kind, batch=batch, ctx=ctx, impl=name, us=secs * 1e6, gbps=case.bytes_moved / secs / 1e9,
                       tflops=case.flops / secs / 1e12, note=str(tuple(cfg.__dict__.values())), timing=how)
            rows.append(row)
            print("  " + fmt_row(row), flush=True)
    return rows


def decode_study(args: argparse.Namespace, gen: torch.Generator) -> int:
    """The W1 / W2 decode shapes: which kernel, split count and tile serve them best.
    Capacity as in the engine for qwen3-0.6b (40,960 tokens per sequence: the split count is chosen for it)."""
    from hf_accel.attention.kernels.common import TileConfig

    max_blocks = 40960 // BLOCK_SIZE
    num_blocks = 64 * (1024 // BLOCK_SIZE) + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_()
    v_cache = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_()
    print(f"device: {torch.cuda.get_device_name()}  decode study, capacity {max_blocks * BLOCK_SIZE} tokens")
    variants: dict[int, list[tuple[str, dict]]] = {
        1: [("unified", dict(force_splits=0)), ("decode unsplit", dict(force_splits=1))]
        + [(f"decode {s} splits", dict(force_splits=s)) for s in (4, 16, 64)],
        64: [("unified", dict(force_splits=0))]
        + [(f"decode {s} split(s)", dict(force_splits=s)) for s in (1, 2, 4)]
        + [(f"decode unsplit {c}", dict(force_splits=1, decode_config=c))
           for c in (TileConfig(16, 32, 4, 4), TileConfig(16, 128, 4, 2), TileConfig(16, 64, 4, 2),
                     TileConfig(16, 64, 8, 3), TileConfig(16, 64, 2, 3), *args.decode_configs)],
    }
    rows = []
    for batch, ctxs in ((1, (128, 256, 384)), (64, (128, 256, 384))):
        for ctx in ctxs:
            case = make_case("decode", batch, ctx, num_blocks, gen)
            ref = None
            for name, kw in variants[batch]:
                out = torch.zeros_like(case.query)
                try:
                    secs, how = time_call(triton_impl(case, k_cache, v_cache, out, max_blocks, **kw), args.reps,
                                          args.samples)
                except Exception as exc:
                    print(f"  {batch}x{ctx} {name}: failed ({exc.__class__.__name__}: {exc})")
                    continue
                ref = out if ref is None else ref
                diff = (out.float() - ref.float()).abs().max().item()
                row = dict(kind="decode", batch=batch, ctx=ctx, impl=name, us=secs * 1e6,
                           gbps=case.bytes_moved / secs / 1e9, tflops=0.0, max_abs_diff=diff, note=how, timing=how)
                rows.append(row)
                print(f"decode {batch:3d} x {ctx:4d}  {name:60s} {secs * 1e6:8.2f} us  "
                      f"{row['gbps']:6.0f} GB/s  diff {diff:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


def decode_metadata(lengths: list[int], tables: torch.Tensor, device: torch.device) -> StepMetadata:
    """A decode step (one query token each) of sequences with these KV lengths and block tables (no KV written)."""
    batch = len(lengths)
    return StepMetadata(
        num_tokens=batch, num_seqs=batch, max_query_len=1, max_seq_len=max(lengths), block_size=BLOCK_SIZE,
        query_start_loc=torch.arange(0, batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        context_lens=torch.tensor([n - 1 for n in lengths], dtype=torch.int32, device=device),
        block_tables=tables.to(device), slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=device),
        query_lens_cpu=[1] * batch, seq_lens_cpu=list(lengths),
    )


def varied_case(lengths: list[int], num_blocks: int, max_blocks: int, gen: torch.Generator) -> Case:
    """A decode batch whose sequences have these KV lengths (pages drawn at random from the pool)."""
    dev = torch.device(DEVICE)
    batch = len(lengths)
    need = [-(-n // BLOCK_SIZE) for n in lengths]
    perm = (torch.randperm(num_blocks - 1, generator=gen)[: sum(need)] + 1).tolist()
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[at: at + n], dtype=torch.int32)
        at += n
    meta = decode_metadata(lengths, tables, dev)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    kv_bytes = sum(lengths) * NUM_KV_HEADS * HEAD_DIM * 2 * query.element_size()
    return Case("decode", batch, sum(lengths) // batch, query, meta,
                kv_bytes + 2 * batch * NUM_HEADS * HEAD_DIM * query.element_size(), 0)


def w3_study(args: argparse.Namespace) -> int:
    """W3's decode step (and W2's for comparison): tiles and split counts of the decode kernel, GB/s of KV read.
    Capacity as the engine gives qwen3-0.6b (40,960 tokens per sequence)."""
    import random

    from hf_accel.attention.kernels.common import TileConfig

    max_blocks = 40960 // BLOCK_SIZE
    rng = random.Random(0)
    w3 = [rng.randint(100, 1024) + 256 for _ in range(256)]
    shapes = {"W3 256 x U[356, 1280]": w3, "W3 sorted longest first": sorted(w3, reverse=True),
              "W2 64 x 256": [256] * 64, "W2 64 x 384": [384] * 64}
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in w3) + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_()
    v_cache = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_()
    gen = torch.Generator().manual_seed(0)
    tiles = [TileConfig(16, 64, 4, 3), TileConfig(16, 64, 4, 2), TileConfig(16, 64, 4, 4), TileConfig(16, 32, 4, 4),
             TileConfig(16, 32, 2, 4), TileConfig(16, 64, 2, 3), TileConfig(16, 128, 4, 2), TileConfig(16, 128, 8, 2),
             TileConfig(16, 64, 8, 3), TileConfig(16, 128, 4, 3)]
    variants = [("default", {}), ("default, longest first", dict(longest_first=True))]
    variants += [(f"unsplit {tuple(c.__dict__.values())}", dict(force_splits=1, decode_config=c)) for c in tiles]
    variants += [(f"unsplit {tuple(c.__dict__.values())} longest first",
                  dict(force_splits=1, decode_config=c, longest_first=True)) for c in tiles[:4]]
    variants += [(f"{s} splits fused", dict(force_splits=s)) for s in (2, 4)]
    variants += [("unified", dict(force_splits=0))]
    print(f"device: {torch.cuda.get_device_name()}  W3 study, KV pool {2 * k_cache.numel() * 2 / 2**30:.2f} GiB")
    rows = []
    for label, lengths in shapes.items():
        case = varied_case(lengths, num_blocks, max_blocks, gen)
        ref = None
        for name, kw in variants:
            out = torch.zeros_like(case.query)
            try:
                secs, how = time_call(triton_impl(case, k_cache, v_cache, out, max_blocks, **kw), args.reps,
                                      args.samples)
            except Exception as exc:
                print(f"  {label} {name}: failed ({exc.__class__.__name__}: {exc})")
                continue
            ref = out if ref is None else ref
            rows.append(study_row(case, label, name, secs, how, out, ref, width=40))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


def study_row(case: Case, label: str, name: str, secs: float, how: str, out: torch.Tensor, ref: torch.Tensor,
              width: int) -> dict:
    """One timed decode variant of a study: its row (time, GB/s of KV, difference from the first variant's output),
    printed as it comes."""
    diff = (out.float() - ref.float()).abs().max().item()
    row = dict(kind="decode", batch=case.batch, ctx=case.ctx, impl=name, shape=label, us=secs * 1e6,
               gbps=case.bytes_moved / secs / 1e9, tflops=0.0, max_abs_diff=diff, note=how, timing=how)
    print(f"{label:26s} {name:{width}s} {secs * 1e6:8.1f} us  {row['gbps']:6.0f} GB/s  diff {diff:.1e}", flush=True)
    return row


def streaming_read_us(tensors: list[torch.Tensor], args: argparse.Namespace) -> float:
    """Microseconds to read every element of `tensors` once with a plain Triton streaming kernel (a sum per
    program): the read bandwidth a kernel can reach on this GPU, against which the attention's KV read is judged."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, STEP: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(pid * BLOCK, n, STEP):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, 0))

    programs = torch.cuda.get_device_properties(0).multi_processor_count * 8
    block = 4096
    out = torch.empty(programs, dtype=torch.float32, device=DEVICE)

    def call() -> None:
        for t in tensors:
            flat = t.view(-1)
            _read[(programs,)](flat, out, flat.numel(), BLOCK=block, STEP=block * programs, num_warps=8)

    secs, _ = time_call(call, args.reps, args.samples)
    return secs * 1e6


def layout_study(args: argparse.Namespace) -> int:
    """The longest-first decode launch at W3's and W2's shapes with the KV cache in the NHD layout the engine uses
    (`[blocks, block_size, kv_heads, head_dim]`: one head's 16 rows of a page are 256-byte pieces 2 KB apart) and
    in HND (`[blocks, kv_heads, block_size, head_dim]`: each head's page one 4 KB piece), passed to the same kernel
    as a permuted view; and a plain streaming read of the pool (what reading these bytes could cost)."""
    import random

    max_blocks = 40960 // BLOCK_SIZE
    rng = random.Random(0)
    w3 = [rng.randint(100, 1024) + 256 for _ in range(256)]
    shapes = {"W3 256 x U[356, 1280]": w3, "W2 64 x 256": [256] * 64}
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in w3) + 1
    caches = {
        "NHD": [torch.empty((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=DTYPE, device=DEVICE).normal_()
                for _ in range(2)],
        "HND": [torch.empty((num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM), dtype=DTYPE, device=DEVICE)
                .normal_().permute(0, 2, 1, 3) for _ in range(2)],
    }
    pool_bytes = 2 * caches["NHD"][0].numel() * caches["NHD"][0].element_size()
    read_us = streaming_read_us(caches["NHD"], args)
    print(f"device: {torch.cuda.get_device_name()}  layout study, KV pool {pool_bytes / 2**30:.2f} GiB; streaming "
          f"read of the pool {read_us:.1f} us = {pool_bytes / read_us / 1e3:.0f} GB/s", flush=True)
    rows = [dict(kind="read", impl="streaming read", shape="pool", us=read_us, gbps=pool_bytes / read_us / 1e3)]
    gen = torch.Generator().manual_seed(0)
    for label, lengths in shapes.items():
        case = varied_case(lengths, num_blocks, max_blocks, gen)
        ref = None
        for layout, (k_cache, v_cache) in caches.items():
            if layout == "HND":  # the same values as the NHD pool, so outputs compare
                k_cache.copy_(caches["NHD"][0])
                v_cache.copy_(caches["NHD"][1])
            for longest_first in (False, True):
                out = torch.zeros_like(case.query)
                secs, how = time_call(triton_impl(case, k_cache, v_cache, out, max_blocks,
                                                  longest_first=longest_first), args.reps, args.samples)
                ref = out if ref is None else ref
                name = f"{layout}{', longest first' if longest_first else ''}"
                rows.append(study_row(case, label, name, secs, how, out, ref, width=24))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


def summary_table(rows: list[dict]) -> str:
    """Cases down, implementations across: us (and GB/s or TF/s)."""
    impls = [i for i in ("triton", "triton-unified", "flashinfer", "fa4") if any(r["impl"] == i for r in rows)]
    keys = []
    for r in rows:
        k = (r["kind"], r["batch"], r["ctx"])
        if r["impl"] in impls and k not in keys:
            keys.append(k)
    head = f"{'case':22s}" + "".join(f"{i:>26s}" for i in impls)
    lines = [head, "-" * len(head)]
    for k in keys:
        cells = []
        for i in impls:
            r = next((r for r in rows if (r["kind"], r["batch"], r["ctx"]) == k and r["impl"] == i), None)
            if r is None:
                cells.append(f"{'-':>26s}")
            elif k[0] == "decode":
                cells.append(f"{r['us']:9.1f} us {r['gbps']:6.0f} GB/s")
            else:
                cells.append(f"{r['us']:9.1f} us {r['tflops']:6.1f} TF/s")
        lines.append(f"{k[0]:8s}{k[1]:4d} x{k[2]:7d}  " + "".join(f"{c:>26s}" for c in cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
