"""Workload definitions and the timed calls: shapes, WorkloadSpec, inputs, roofline, model building, measurement.

Everything here is shared by ours and the stock anchors, so that both are timed the same way on the same inputs.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import random
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# in measuring order; "threads" sits beside "w2", whose figure it is compared with
WORKLOAD_NAMES = ("w1", "w2", "threads", "w3", "w5", "startup")
SHAPE_NAMES = ("tiny", "tiny-llama", "qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b")
TOKEN_LOW, TOKEN_HIGH = 10, 10000
W3_LENGTH_SEED = 0
# token-id seeds: timed repeat r of a workload uses WORKLOAD_SEED[w] + r, its warm-up call i WORKLOAD_SEED[w] +
# WARMUP_SEED_OFFSET + i, the guard GUARD_SEED_BASE + case; no two calls share a prompt (no prefix-cache gifts)
WORKLOAD_SEED = {"w1": 0, "w2": 1_000, "w3": 2_000, "threads": 3_000, "w5": 4_000}
WARMUP_SEED_OFFSET = 500
GUARD_SEED_BASE = 20_000
GIB = 1 << 30

# WORKLOADS.md targets (tokens/s for w1-w3; seconds and bytes for startup; threads: a fraction of ours on W2)
TARGETS: dict[str, dict[str, float]] = {
    "qwen3-0.6b": {"w1": 1_000, "w2": 45_000, "w3": 33_000, "startup_cold_s": 45, "graph_pool_bytes": GIB,
                   "threads_vs_w2": 0.9},
    "llama-3.2-1b": {"w1": 1_300, "startup_cold_s": 45, "graph_pool_bytes": GIB},
    "llama-3.1-8b": {"w1": 245, "w2": 12_500, "startup_cold_s": 45, "startup_warm_s": 10, "graph_pool_bytes": GIB,
                     "threads_vs_w2": 0.9},
}

METHOD_LABELS = {
    "ours": "hf_accel",
    "eager": "stock generate (eager, sdpa)",
    "static": "stock generate (static cache + compile)",
    "generate_batch": "stock generate_batch",
}


# ----------------------------------------------------------------------------------------------- shapes & sizes
def shape_config(shape: str):
    """The transformers config of a named shape (WORKLOADS.md, exactly; tiny ones run on CPU in seconds)."""
    from transformers import LlamaConfig, Qwen3Config

    if shape == "qwen3-0.6b":
        cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                          rope_theta=1e6)
    elif shape == "llama-3.2-1b":
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                          rope_theta=500000, max_position_embeddings=131072)
    elif shape == "llama-3.1-8b":
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000)
    elif shape == "tiny":
        cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=1000, tie_word_embeddings=True,
                          rope_theta=1e6)
    elif shape == "tiny-llama":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False, rope_theta=500000)
    else:
        raise ValueError(f"unknown shape {shape!r}; choose one of {SHAPE_NAMES}")
    cfg.eos_token_id = None  # EOS disabled: every request produces exactly its token count
    return cfg


@dataclass(frozen=True)
class WorkloadSpec:
    """One throughput workload: which entry point, how many requests, how long."""

    name: str
    title: str
    api: str  # "generate", "generate_batch", or "threads" (one generate() per request, each on its own thread)
    num_requests: int
    new_tokens: int
    prompt_len: int | None = None  # fixed length (W1, W2)
    prompt_len_range: tuple[int, int] | None = None  # uniform, inclusive (W3)

    def prompt_lengths(self) -> list[int]:
        if self.prompt_len is not None:
            return [self.prompt_len] * self.num_requests
        assert self.prompt_len_range is not None
        rng = random.Random(W3_LENGTH_SEED)
        lo, hi = self.prompt_len_range
        return [rng.randint(lo, hi) for _ in range(self.num_requests)]

    @property
    def expected_tokens(self) -> int:
        return self.num_requests * self.new_tokens


SCALES: dict[str, dict[str, WorkloadSpec]] = {
    "full": {
        "w1": WorkloadSpec("w1", "W1 latency", "generate", 1, 256, prompt_len=128),
        "w2": WorkloadSpec("w2", "W2 batch decode", "generate", 64, 256, prompt_len=128),
        "threads": WorkloadSpec("threads", "threads x generate()", "threads", 64, 256, prompt_len=128),
        "w3": WorkloadSpec("w3", "W3 throughput", "generate_batch", 256, 512, prompt_len_range=(100, 1024)),
    },
    "tiny": {
        "w1": WorkloadSpec("w1", "W1 latency", "generate", 1, 32, prompt_len=16),
        "w2": WorkloadSpec("w2", "W2 batch decode", "generate", 8, 32, prompt_len=16),
        "threads": WorkloadSpec("threads", "threads x generate()", "threads", 8, 32, prompt_len=16),
        "w3": WorkloadSpec("w3", "W3 throughput", "generate_batch", 16, 32, prompt_len_range=(10, 64)),
    },
}


def token_high(vocab_size: int) -> int:
    """Upper bound (exclusive) for random token ids: 10000, clipped to the vocabulary."""
    return max(TOKEN_LOW + 1, min(TOKEN_HIGH, vocab_size))


def random_prompts(lengths: Sequence[int], seed: int, vocab_size: int) -> list[list[int]]:
    """Token ids uniform in [10, min(10000, vocab)), one list per request."""
    rng = random.Random(seed)
    hi = token_high(vocab_size)
    return [[rng.randrange(TOKEN_LOW, hi) for _ in range(n)] for n in lengths]


# ----------------------------------------------------------------------------------------------------- roofline
def _stored_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor really holds: a quantized tensor subclass's inner tensors (packed data, scales), a
    tensor-parallel rank's own shard (what this rank's GPU streams); the prefix-cache digest reads the same parts."""
    from hf_accel.engine.model_state import plain_parts

    return sum(p.numel() * p.element_size() for p in plain_parts(t) or [t])


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every (unique) parameter as stored (quantized ones packed; a tensor-parallel rank's own shards):
    what WORKLOADS.md counts as read once per decode step."""
    return sum(_stored_bytes(p) for p in model.parameters())


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K and V bytes one token occupies across all layers (full attention assumed)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def decode_roofline_tokens_per_s(weights: int, kv_per_token: int, prompt_lens: Sequence[int], new_tokens: int,
                                 bandwidth: float, max_batch: int | None = None) -> float:
    """Tokens/s if each decode step only moved its bytes: every weight read once, each running sequence's KV read
    once and its new token's KV written once, at `bandwidth`.

    Requests run in waves of `max_batch` (all together when None); within a wave, step s (0-based) reads the
    weights once and, for each sequence, the KV of its prompt plus the s tokens generated so far, and writes one
    token's KV per sequence. A measured figure divided by this is the fraction of the bandwidth the run used
    (bytes moved per step / step time / bandwidth): the report's "of bandwidth" column.
    """
    if new_tokens <= 0 or not prompt_lens or bandwidth <= 0:
        raise ValueError("need new_tokens > 0, at least one request and a positive bandwidth")
    lens = list(prompt_lens)
    wave = max_batch or len(lens)
    total_bytes, tokens = 0.0, 0
    for i in range(0, len(lens), wave):
        chunk = lens[i:i + wave]
        kv_tokens = new_tokens * sum(chunk) + len(chunk) * new_tokens * (new_tokens - 1) / 2  # read
        kv_tokens += len(chunk) * new_tokens  # written
        total_bytes += new_tokens * weights + kv_per_token * kv_tokens
        tokens += len(chunk) * new_tokens
    return tokens * bandwidth / total_bytes


def measure_copy_bandwidth(device: torch.device, nbytes: int = GIB, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), timed with CUDA events."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds


# -------------------------------------------------------------------------------------------------- the model
def resolve_device(name: str | None) -> torch.device:
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


# --quantization: how each method is applied. torchao quantizes the built model in place (what TorchAoConfig does at
# load time); the others load it back from a temporary save with transformers' quantization config.
QUANTIZATION_METHODS = ("none", "torchao-int8-weight-only", "torchao-int4-weight-only", "torchao-float8-dynamic",
                        "bnb-nf4", "bnb-int8", "fp8")


def torchao_config(method: str):
    """torchao's quantization config for a `torchao-*` method of QUANTIZATION_METHODS."""
    from torchao import quantization as q

    if method == "torchao-int8-weight-only":
        return q.Int8WeightOnlyConfig()
    if method == "torchao-int4-weight-only":
        # the tile-packed layout runs on core torch's tinygemm kernel (`aten._weight_int4pack_mm`, CUDA sm80+);
        # torchao's default ("plain") needs the separate `mslk` package, which the test machine cannot install
        return q.Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
    if method == "torchao-float8-dynamic":
        # per-row scales (one per token, one per output channel): torchao's default per-tensor activation scale is
        # shared by every token of a forward, so a row's tokens depend on what else is in the batch (padding, other
        # requests, a prefill chunk), in stock generate() as much as here, and no two batchings can be compared;
        # measured 2026-12-01: stock's own greedy tokens strayed past the rounding margin on 62 % of the steps
        return q.Float8DynamicActivationFloat8WeightConfig(granularity=q.PerRow())
    raise ValueError(method)


def _hf_quantization_config(method: str, dtype: torch.dtype):
    from transformers import BitsAndBytesConfig, FineGrainedFP8Config

    if method == "bnb-nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    if method == "bnb-int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    if method == "fp8":
        return FineGrainedFP8Config()
    raise ValueError(method)


def quantize_model(model, method: str, dtype: torch.dtype, device: torch.device):
    """The model quantized with `method` (QUANTIZATION_METHODS); "none" returns it unchanged."""
    if method == "none":
        return model
    if method.startswith("torchao-"):
        from torchao.quantization import quantize_

        quantize_(model, torchao_config(method))
        return model
    import tempfile

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="hf_accel_bench_quant_") as tmp:
        model.save_pretrained(tmp)
        del model
        free_memory(device)
        quantized = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=dtype, attn_implementation="sdpa", device_map=str(device),
            quantization_config=_hf_quantization_config(method, dtype))
    quantized.eval()
    return quantized


def _tensor_parallel_model(shape: str | None, model_id: str | None, dtype: torch.dtype):
    """The model sharded by transformers over the torchrun ranks (`tp_plan="auto"`). A named shape's random weights
    are saved once per host by rank 0 (in the system's temporary directory, reused by later runs) and loaded
    sharded by every rank, as a user's checkpoint would be."""
    import os
    import tempfile

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    path = model_id
    if not model_id:
        path = os.path.join(tempfile.gettempdir(), f"hf_accel_bench_{shape}_{str(dtype).removeprefix('torch.')}")
        done = os.path.join(path, ".complete")
        if dist.get_rank() == 0 and not os.path.exists(done):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(shape_config(shape), dtype=dtype)
            model.save_pretrained(path)
            del model
            open(done, "w").close()
        dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", tp_plan="auto")
    model.eval()
    return model


def build_model(shape: str | None, model_id: str | None, dtype: torch.dtype, device: torch.device,
                quantization: str = "none", tensor_parallel: bool = False):
    """A causal LM on `device`: random weights from a named shape (seeded), or loaded from an id/path; then
    quantized with `quantization` (see QUANTIZATION_METHODS). `tensor_parallel`: sharded over the torchrun ranks
    (`_tensor_parallel_model`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if tensor_parallel:
        if quantization != "none":
            raise ValueError("--quantization and --tensor-parallel together are not supported by the bench")
        model = _tensor_parallel_model(shape, model_id, dtype)
        disable_eos(model)
        return model
    if model_id:
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, attn_implementation="sdpa")
        model.to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(shape_config(shape), dtype=dtype, attn_implementation="sdpa")
        model.to(device)
    model.eval()
    model = quantize_model(model, quantization, dtype, device)
    disable_eos(model)
    return model


def disable_eos(model) -> None:
    """No EOS anywhere, greedy by default: every request produces exactly the tokens it asks for.

    The model's generation config is replaced outright, because transformers fills unset fields of a passed
    config from it (a checkpoint's do_sample=True or eos ids would otherwise leak in).
    """
    from transformers import GenerationConfig

    for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        cfg.eos_token_id = None
    pad = getattr(model.config, "pad_token_id", None)
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None,
                                               pad_token_id=0 if pad is None else pad)


def _generation_config(new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)


# ---------------------------------------------------------------------------------------------- timing & calls
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Wall seconds of fn() with the device drained before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def left_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask, left padded with 0 (the usual layout for batched causal LM prompts)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@dataclass
class CallOutput:
    """New tokens per request (in input order) and what was wrong with them, if anything."""

    tokens: list[list[int]]
    problems: list[str] = field(default_factory=list)
    seconds: float | None = None  # the call's own timing, when the caller's wall clock would count set-up too


def call_generate(model, prompts: list[list[int]], new_tokens: int, device: torch.device,
                  static: bool = False) -> Callable[[], CallOutput]:
    """A generate() call over left-padded prompts; checks the prompt is echoed and the length is exact."""
    input_ids, attention_mask = left_pad(prompts, device)
    extra = {"cache_implementation": "static"} if static else {}

    def fn() -> CallOutput:
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                             do_sample=False, **extra)
        seqs = out.sequences if hasattr(out, "sequences") else out
        width = input_ids.shape[1]
        problems = []
        if seqs.shape[0] != len(prompts):
            problems.append(f"{seqs.shape[0]} rows returned for {len(prompts)} prompts")
        if seqs.shape[1] != width + new_tokens:
            problems.append(f"{seqs.shape[1] - width} new tokens per row instead of {new_tokens}")
        if not torch.equal(seqs[:, :width].to(input_ids.device), input_ids):
            problems.append("returned sequences do not start with the prompt")
        return CallOutput(seqs[:, width:].tolist(), problems)

    return fn


def run_concurrently(calls: Sequence[Callable[[], CallOutput]], device: torch.device,
                     ) -> tuple[float, list[CallOutput | None], list[str | None]]:
    """Each call on its own thread, all released together by a barrier; (seconds, outputs, errors) in call order.

    The time runs from the barrier's release to the last join, so thread start-up is not counted.
    """
    n = len(calls)
    barrier = threading.Barrier(n + 1)
    outs: list[CallOutput | None] = [None] * n
    errors: list[str | None] = [None] * n

    def worker(i: int) -> None:
        try:
            barrier.wait()
            outs[i] = calls[i]()
        except Exception as exc:
            errors[i] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=worker, args=(i,), name=f"hf-accel-bench-{i}", daemon=True)
               for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    synchronize(device)
    return time.perf_counter() - t0, outs, errors


def _thread_problems(outs: Sequence[CallOutput | None], errors: Sequence[str | None], what: str,
                     max_problems: int) -> list[str]:
    problems: list[str] = []
    for i, (out, err) in enumerate(zip(outs, errors, strict=True)):
        if err is not None:
            problems.append(f"{what} {i}: {err}")
        elif out is None:
            problems.append(f"{what} {i}: no output")
        else:
            problems += [f"{what} {i}: {p}" for p in out.problems]
    if len(problems) > max_problems:  # 64 copies of one error say nothing more than the first few
        problems = [*problems[:max_problems], f"... and {len(problems) - max_problems} more"]
    return problems


def call_threads(model, prompts: list[list[int]], new_tokens: int, device: torch.device,
                 max_problems: int = 5) -> Callable[[], CallOutput]:
    """One generate() per prompt, each on its own thread, all started together (see run_concurrently).

    WORKLOADS.md's concurrency figure: what many independent callers of generate() get out of one model. Input
    copies are made before, so only the generation is timed.
    """
    calls = [call_generate(model, [p], new_tokens, device) for p in prompts]

    def fn() -> CallOutput:
        seconds, outs, errors = run_concurrently(calls, device)
        tokens = [out.tokens[0] if out is not None and out.tokens else [] for out in outs]
        return CallOutput(tokens, _thread_problems(outs, errors, "thread", max_problems), seconds)

    return fn


def call_grouped_generate_batch(model, prompts: list[list[int]], max_new_tokens: Sequence[int],
                                device: torch.device, max_problems: int = 5) -> Callable[[], CallOutput]:
    """Requests with their own token counts through generate_batch(), which takes one count per call: one call
    per distinct count, all started together from threads (concurrent calls share the engine's batch)."""
    groups: dict[int, list[int]] = {}
    for i, m in enumerate(max_new_tokens):
        groups.setdefault(m, []).append(i)
    calls = [call_generate_batch(model, [prompts[i] for i in idx], m) for m, idx in groups.items()]

    def fn() -> CallOutput:
        seconds, outs, errors = run_concurrently(calls, device)
        tokens: list[list[int]] = [[] for _ in prompts]
        for idx, out in zip(groups.values(), outs, strict=True):
            for i, row in zip(idx, out.tokens if out is not None else [], strict=False):
                tokens[i] = row
        return CallOutput(tokens, _thread_problems(outs, errors, "generate_batch call", max_problems), seconds)

    return fn


def _ordered_results(results: dict[str, Any]) -> list[Any]:
    keys = list(results)
    if keys and all(k.startswith("req_") and k[4:].isdigit() for k in keys):
        keys.sort(key=lambda k: int(k[4:]))
    return [results[k] for k in keys]


def call_generate_batch(model, prompts: list[list[int]], new_tokens: int) -> Callable[[], CallOutput]:
    """A generate_batch() call; checks every request came back, in order, with exactly its token count."""
    base = _generation_config(new_tokens)

    def fn() -> CallOutput:
        # stock generate_batch writes into the config it is given (eos -1), so each call gets its own copy
        results = model.generate_batch(prompts, generation_config=copy.deepcopy(base), progress_bar=False)
        outs = _ordered_results(results)
        problems = []
        if len(outs) != len(prompts):
            problems.append(f"{len(outs)} results for {len(prompts)} requests")
        tokens = [list(getattr(o, "generated_tokens", [])) for o in outs]
        short = sum(1 for t in tokens if len(t) != new_tokens)
        if short:
            got = sum(len(t) for t in tokens)
            problems.append(f"{short} requests without exactly {new_tokens} tokens "
                            f"({got} of {len(prompts) * new_tokens} tokens returned)")
        for i, (o, p) in enumerate(zip(outs, prompts, strict=False)):
            pid = getattr(o, "prompt_ids", None)
            if pid is not None and list(pid) != list(p):
                problems.append(f"result {i} is not for request {i} (prompt ids differ)")
                break
        return CallOutput(tokens, problems)

    return fn


# ---------------------------------------------------------------------------------------------------- progress
class Progress:
    """A tqdm bar over the planned calls (stderr); falls back to nothing when disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="call", desc="hf-accel bench", file=sys.stderr, dynamic_ncols=True)

    @contextlib.contextmanager
    def step(self, desc: str) -> Iterator[None]:
        if self.bar is not None:
            self.bar.set_description(desc)
        try:
            yield
        finally:
            if self.bar is not None:
                self.bar.update(1)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------------------------ measurement
def record_run(rec: dict[str, Any], r: int, secs: float, out: CallOutput) -> None:
    """One timed run into a method's record: seconds (the call's own figure when it measured one), tokens, tokens/s
    and any problem it reported."""
    secs = out.seconds if out.seconds is not None else secs
    produced = sum(len(t) for t in out.tokens)
    rec["run_s"].append(secs)
    rec["tokens"].append(produced)
    rec["tokens_per_s"].append(produced / secs if secs > 0 else math.inf)
    if out.problems:
        rec["reasons"].append(f"run {r + 1}: " + "; ".join(out.problems))


def measure_method(method: str, spec: WorkloadSpec, make_call: Callable[[list[list[int]]], Callable[[], CallOutput]],
                   vocab_size: int, warmup: int, repeats: int, device: torch.device,
                   progress: Progress) -> tuple[dict[str, Any], list[list[int]] | None]:
    """Warm-up calls, then timed repeats; returns the raw record and the tokens of the first timed run."""
    lengths = spec.prompt_lengths()
    seed0 = WORKLOAD_SEED[spec.name]
    rec: dict[str, Any] = {"method": method, "label": METHOD_LABELS.get(method, method), "valid": True,
                           "reasons": [], "warmup_s": [], "run_s": [], "tokens": [], "tokens_per_s": [],
                           "expected_tokens": spec.expected_tokens,
                           "input_seeds": [seed0 + r for r in range(repeats)],
                           "warmup_input_seeds": [seed0 + WARMUP_SEED_OFFSET + w for w in range(warmup)],
                           "peak_memory_bytes": None, "error": None}
    first: list[list[int]] | None = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        for w in range(warmup):
            fn = make_call(random_prompts(lengths, rec["warmup_input_seeds"][w], vocab_size))
            with progress.step(f"{spec.name} {method} warm-up"):
                secs, out = timed(fn, device)
            rec["warmup_s"].append(secs if out.seconds is None else out.seconds)
            if out.problems:
                rec["reasons"].append("warm-up: " + "; ".join(out.problems))
        for r in range(repeats):
            fn = make_call(random_prompts(lengths, rec["input_seeds"][r], vocab_size))
            with progress.step(f"{spec.name} {method} run {r + 1}/{repeats}"):
                secs, out = timed(fn, device)
            record_run(rec, r, secs, out)
            if first is None:
                first = out.tokens
    except Exception as exc:  # an anchor running out of memory must not end the benchmark
        rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["traceback"] = traceback.format_exc()
        rec["reasons"].append(rec["error"])
        progress.write(f"[{spec.name} {method}] failed: {rec['error']}")
    if device.type == "cuda":
        rec["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    if rec["reasons"] or len(rec["run_s"]) < repeats:
        rec["valid"] = False
    rec["median_tokens_per_s"] = statistics.median(rec["tokens_per_s"]) if rec["valid"] and repeats else None
    free_memory(device)
    return rec, first



def make_caller(spec: WorkloadSpec, model, device: torch.device, static: bool = False):
    if spec.api == "generate_batch":
        return lambda prompts: call_generate_batch(model, prompts, spec.new_tokens)
    if spec.api == "threads":
        return lambda prompts: call_threads(model, prompts, spec.new_tokens, device)
    return lambda prompts: call_generate(model, prompts, spec.new_tokens, device, static=static)


