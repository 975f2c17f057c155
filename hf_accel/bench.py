"""`hf-accel bench`: the workloads of WORKLOADS.md (W1 latency, W2 batch decode, W3 throughput, startup).

Order inside one process: build the model (random weights from a config, or --model), measure ours, run the
correctness guard (our greedy tokens against the eager torch backend), restore() the model, then measure the
stock-transformers anchors on the same inputs. A speed figure is only a result when the guard passed and every
request produced exactly its token count; otherwise it is marked INVALID (table) and ``"valid": false`` (JSON).

Inputs: token ids uniform in [10, min(10000, vocab)); W3 prompt lengths from ``random.Random(0)``. Each call
(warm-up or timed repeat) gets its own token ids (seeded by the call), the same ones for ours and each anchor,
so that a repeat cannot profit from the prefix cache filled by the previous one.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import enum
import functools
import gc
import importlib
import importlib.metadata
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

WORKLOAD_NAMES = ("w1", "w2", "w3", "startup")
ANCHOR_NAMES = ("eager", "static", "generate_batch")
SHAPE_NAMES = ("tiny", "tiny-llama", "qwen3-0.6b", "llama-3.1-8b")
CUDAGRAPH_MODES = ("none", "piecewise", "full", "full_decode_only", "full_and_piecewise")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer", "flash_attn")
TOKEN_LOW, TOKEN_HIGH = 10, 10000
W3_LENGTH_SEED = 0
# token-id seeds: timed repeat r of a workload uses WORKLOAD_SEED[w] + r, its warm-up call i WORKLOAD_SEED[w] +
# WARMUP_SEED_OFFSET + i, the guard GUARD_SEED_BASE + case; no two calls share a prompt (no prefix-cache gifts)
WORKLOAD_SEED = {"w1": 0, "w2": 1_000, "w3": 2_000}
WARMUP_SEED_OFFSET = 500
GUARD_SEED_BASE = 20_000
GIB = 1 << 30
# a divergence from the reference is a rounding near-tie (accepted, counted) when the reference's top-1 logit leads
# the token we chose by at most GUARD_TIE_ULPS units in the last place of the top logit in the model's dtype:
# kernels that sum in another order (fused vs eager, split-KV vs not) flip such ties in low precision
GUARD_TIE_ULPS = 16
GUARD_TIE_CAP = 0.5  # logits

# WORKLOADS.md targets (tokens/s for w1-w3; seconds and bytes for startup)
TARGETS: dict[str, dict[str, float]] = {
    "qwen3-0.6b": {"w1": 1_000, "w2": 40_000, "w3": 28_000, "graph_pool_bytes": GIB},
    "llama-3.1-8b": {"w1": 240, "w2": 12_000, "startup_cold_s": 45, "startup_warm_s": 15, "graph_pool_bytes": GIB},
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
    api: str  # "generate" or "generate_batch"
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
        "w3": WorkloadSpec("w3", "W3 throughput", "generate_batch", 256, 512, prompt_len_range=(100, 1024)),
    },
    "tiny": {
        "w1": WorkloadSpec("w1", "W1 latency", "generate", 1, 32, prompt_len=16),
        "w2": WorkloadSpec("w2", "W2 batch decode", "generate", 8, 32, prompt_len=16),
        "w3": WorkloadSpec("w3", "W3 throughput", "generate_batch", 16, 32, prompt_len_range=(10, 64)),
    },
}
GUARD_NEW_TOKENS = {"full": 32, "tiny": 8}


def token_high(vocab_size: int) -> int:
    """Upper bound (exclusive) for random token ids: 10000, clipped to the vocabulary."""
    return max(TOKEN_LOW + 1, min(TOKEN_HIGH, vocab_size))


def random_prompts(lengths: Sequence[int], seed: int, vocab_size: int) -> list[list[int]]:
    """Token ids uniform in [10, min(10000, vocab)), one list per request."""
    rng = random.Random(seed)
    hi = token_high(vocab_size)
    return [[rng.randrange(TOKEN_LOW, hi) for _ in range(n)] for n in lengths]


# ----------------------------------------------------------------------------------------------------- roofline
def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every (unique) parameter: what WORKLOADS.md counts as read once per decode step."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K and V bytes one token occupies across all layers (full attention assumed)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def decode_roofline_tokens_per_s(weights: int, kv_per_token: int, prompt_lens: Sequence[int], new_tokens: int,
                                 bandwidth: float, max_batch: int | None = None) -> float:
    """Tokens/s if each decode step only streamed every weight once plus the KV of each running sequence.

    Requests run in waves of `max_batch` (all together when None); within a wave, step s (0-based) reads the
    weights once and, for each sequence, the KV of its prompt plus the s tokens generated so far.
    """
    if new_tokens <= 0 or not prompt_lens or bandwidth <= 0:
        raise ValueError("need new_tokens > 0, at least one request and a positive bandwidth")
    lens = list(prompt_lens)
    wave = max_batch or len(lens)
    total_bytes, tokens = 0.0, 0
    for i in range(0, len(lens), wave):
        chunk = lens[i:i + wave]
        kv_tokens = new_tokens * sum(chunk) + len(chunk) * new_tokens * (new_tokens - 1) / 2
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


# ------------------------------------------------------------------------------------------------- environment
def library_versions() -> dict[str, str]:
    """Versions of the libraries that decide speed; "absent" when not importable."""
    candidates = {
        "torch": ("torch", ("torch",)),
        "transformers": ("transformers", ("transformers",)),
        "triton": ("triton", ("triton",)),
        "flashinfer": ("flashinfer", ("flashinfer-python", "flashinfer")),
        "flash-attn": ("flash_attn", ("flash-attn-4", "flash-attn", "flash_attn")),
        "hf_accel": ("hf_accel", ("hf_accel",)),
    }
    out: dict[str, str] = {}
    for name, (module, dists) in candidates.items():
        try:
            mod = importlib.import_module(module)
        except Exception:
            out[name] = "absent"
            continue
        version = getattr(mod, "__version__", None)
        for dist in dists:
            if version:
                break
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                version = importlib.metadata.version(dist)
        out[name] = str(version or "present (version unknown)")
    out["python"] = platform.python_version()
    out["cuda"] = str(torch.version.cuda) if torch.version.cuda else "absent"
    return out


def _git_revision() -> dict[str, Any] | None:
    root = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except Exception:
        return None
    return {"commit": rev, "dirty": bool(dirty)}


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"versions": library_versions(), "platform": platform.platform(), "device": str(device),
                           "hostname": platform.node(), "git": _git_revision()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu_name"] = props.name
        env["gpu_memory_bytes"] = props.total_memory
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["gpu_count"] = torch.cuda.device_count()
    else:
        env["gpu_name"] = None
    return env


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


def build_model(shape: str | None, model_id: str | None, dtype: torch.dtype, device: torch.device):
    """A causal LM on `device`: random weights from a named shape (seeded), or loaded from an id/path."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if model_id:
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, attn_implementation="sdpa")
        model.to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(shape_config(shape), dtype=dtype, attn_implementation="sdpa")
        model.to(device)
    model.eval()
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
            rec["warmup_s"].append(secs)
            if out.problems:
                rec["reasons"].append("warm-up: " + "; ".join(out.problems))
        for r in range(repeats):
            fn = make_call(random_prompts(lengths, rec["input_seeds"][r], vocab_size))
            with progress.step(f"{spec.name} {method} run {r + 1}/{repeats}"):
                secs, out = timed(fn, device)
            produced = sum(len(t) for t in out.tokens)
            rec["run_s"].append(secs)
            rec["tokens"].append(produced)
            rec["tokens_per_s"].append(produced / secs if secs > 0 else math.inf)
            if out.problems:
                rec["reasons"].append(f"run {r + 1}: " + "; ".join(out.problems))
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


def anchor_warmup(args: argparse.Namespace, anchor: str) -> int:
    """Warm-up calls for an anchor: --anchor-warmup (default --warmup), but never 0 for "static", whose first call
    per batch shape is transformers' torch.compile (tens of seconds), not a generation speed."""
    n = args.anchor_warmup if args.anchor_warmup is not None else args.warmup
    return max(n, 1) if anchor == "static" else n


def make_caller(spec: WorkloadSpec, model, device: torch.device, static: bool = False):
    if spec.api == "generate_batch":
        return lambda prompts: call_generate_batch(model, prompts, spec.new_tokens)
    return lambda prompts: call_generate(model, prompts, spec.new_tokens, device, static=static)


def agreement(a: list[list[int]] | None, b: list[list[int]] | None) -> dict[str, Any] | None:
    """How far two greedy outputs agree: equal rows, first divergence, mean common prefix."""
    if a is None or b is None or len(a) != len(b):
        return None
    prefixes, first_diff = [], None
    for row, (x, y) in enumerate(zip(a, b, strict=True)):
        n = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
        prefixes.append(n)
        if first_diff is None and x != y:
            first_diff = {"row": row, "step": n}
    return {"rows": len(a), "rows_equal": sum(1 for x, y in zip(a, b, strict=True) if x == y),
            "first_divergence": first_diff, "mean_common_prefix": sum(prefixes) / max(1, len(prefixes)),
            "tokens_per_row": max((len(x) for x in a), default=0)}


# ------------------------------------------------------------------------------------------------ the guard
@dataclass
class GuardCase:
    name: str
    api: str
    prompts: list[list[int]]
    new_tokens: int


def guard_cases(specs: dict[str, WorkloadSpec], scale: str, vocab_size: int) -> list[GuardCase]:
    """A few short requests in the batch shapes the selected workloads use (decode graphs differ per size)."""
    n = GUARD_NEW_TOKENS[scale]
    p = SCALES[scale]["w1"].prompt_len or 16
    cases = [
        GuardCase("batch1", "generate", random_prompts([p], GUARD_SEED_BASE, vocab_size), n),
        GuardCase("ragged4", "generate",
                  random_prompts([max(1, p // 8), p // 4 + 3, p // 2 + 1, p], GUARD_SEED_BASE + 1, vocab_size), n),
    ]
    if "w2" in specs:
        w2 = specs["w2"]
        cases.append(GuardCase(f"batch{w2.num_requests}", "generate",
                               random_prompts(w2.prompt_lengths(), GUARD_SEED_BASE + 2, vocab_size), n))
    if "w3" in specs:
        lengths = specs["w3"].prompt_lengths()[:16]
        cases.append(GuardCase("generate_batch", "generate_batch",
                               random_prompts(lengths, GUARD_SEED_BASE + 3, vocab_size), n))
    return cases


def run_guard_cases(model, cases: list[GuardCase], device: torch.device, progress: Progress,
                    tag: str) -> dict[str, list[list[int]] | str]:
    """Tokens per case, or the error text when the call failed."""
    outs: dict[str, list[list[int]] | str] = {}
    for case in cases:
        with progress.step(f"guard {tag} {case.name}"):
            try:
                if case.api == "generate_batch":
                    out = call_generate_batch(model, case.prompts, case.new_tokens)()
                else:
                    out = call_generate(model, case.prompts, case.new_tokens, device)()
                outs[case.name] = out.tokens if not out.problems else "; ".join(out.problems)
            except Exception as exc:
                outs[case.name] = f"{type(exc).__name__}: {exc}"
    return outs


def _divergences(a: list[list[int]], b: list[list[int]]) -> list[dict[str, Any]]:
    """Every row where ours (a) and the reference (b) differ: row, first differing step, our tokens."""
    out = []
    for row, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            step = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
            # a length mismatch is never a near-tie
            out.append({"row": row, "step": step, "ours": x[step] if len(x) == len(y) else -1, "ours_row": list(x)})
    return out


def tie_margin_for(dtype: torch.dtype, top_logit: float) -> float:
    """GUARD_TIE_ULPS units in the last place of `top_logit` in `dtype` (bf16: 8 significant bits), at most
    GUARD_TIE_CAP: large logits (real checkpoints) must not turn a wrong token into a "tie"."""
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}.get(dtype, 23)
    exponent = math.floor(math.log2(max(abs(top_logit), 2.0**-6)))
    return min(GUARD_TIE_ULPS * 2.0 ** (exponent - mantissa_bits), GUARD_TIE_CAP)


def reference_margins(model, case: GuardCase, divergences: list[dict[str, Any]],
                      device: torch.device) -> list[list[tuple[int, float, float]]]:
    """For each divergent row, from its first divergence to its end: (step, lead, top) where lead is the stock
    model's top-1 logit minus its logit for the token we produced at that step, given exactly our tokens before.

    `model` is the stock (restored) model; one teacher-forced forward per case scores all rows and steps, so every
    token we produced after parting ways is checked, not only the first, and nothing drifts.
    """
    rows = [case.prompts[d["row"]] + d["ours_row"] for d in divergences]
    gen = [len(d["ours_row"]) for d in divergences]
    keep = max(gen) + 1  # positions predicting each generated token
    input_ids, attention_mask = left_pad(rows, device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=keep, use_cache=False).logits  # [B, keep, V]
    out = []
    for i, d in enumerate(divergences):
        if d["ours"] < 0:
            out.append([(d["step"], float("inf"), float("nan"))])
            continue
        steps = []
        for s in range(d["step"], gen[i]):
            scores = logits[i, keep - 1 - gen[i] + s].float()  # the position just before generated token s
            top = float(scores.max())
            steps.append((s, top - float(scores[d["ours_row"][s]]), top))
        out.append(steps)
    return out


def compare_guard(cases: list[GuardCase], ours: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Per case: equal or not, with the first divergence and every divergent row (near-ties are judged later)."""
    detail = {}
    passed = True
    for case in cases:
        a, b = ours.get(case.name), ref.get(case.name)
        entry: dict[str, Any] = {"requests": len(case.prompts), "new_tokens": case.new_tokens, "api": case.api,
                                 "prompt_lengths": [len(p) for p in case.prompts]}
        if isinstance(a, str) or isinstance(b, str) or a is None or b is None:
            entry.update(equal=False, ours_error=a if isinstance(a, str) else None,
                         reference_error=b if isinstance(b, str) else None)
        else:
            entry.update(equal=a == b, agreement=agreement(a, b))
            if a != b and len(a) == len(b):
                entry["divergences"] = _divergences(a, b)
        entry["ok"] = bool(entry["equal"])
        passed &= entry["ok"]
        detail[case.name] = entry
    return {"passed": passed, "reference": "accelerate_model(attention_backend='torch', enforce_eager=True)",
            "cases": detail}


def judge_near_ties(guard: dict[str, Any], cases: list[GuardCase], model, device: torch.device,
                    dtype: torch.dtype) -> None:
    """Accept a case whose every divergent row is, at every step from where it parted, the stock model's choice or
    within a rounding near-tie of it (lead <= tie_margin_for); update `passed`. `model` must be the stock one."""
    guard["tie_rule"] = (f"teacher-forced on our tokens, stock transformers' top-1 logit leads each of our tokens "
                         f"after a divergence by <= {GUARD_TIE_ULPS} ulps of that logit ({dtype}), at most "
                         f"{GUARD_TIE_CAP}")
    for case in cases:
        entry = guard["cases"][case.name]
        divs = entry.get("divergences")
        if entry["ok"] or not divs:
            continue
        try:
            per_row = reference_margins(model, case, divs, device)
        except Exception as exc:
            entry["margin_error"] = f"{type(exc).__name__}: {exc}"
            continue
        for d, steps in zip(divs, per_row, strict=True):
            checks = [(s, lead, top, tie_margin_for(dtype, top) if math.isfinite(top) else 0.0)
                      for s, lead, top in steps]
            worst = max(checks, key=lambda c: c[1] - c[3])
            d["reference_lead"], d["reference_top"], d["tie_margin"] = checks[0][1], checks[0][2], checks[0][3]
            d["worst_step"], d["worst_lead"], d["worst_margin"] = worst[0], worst[1], worst[3]
            d["ok"] = all(lead <= margin for _, lead, _, margin in checks)
            d.pop("ours_row", None)  # the tokens are in the record already; keep the JSON small
        entry["near_ties"] = len(divs)
        entry["ok"] = all(d["ok"] for d in divs)
    guard["passed"] = all(c["ok"] for c in guard["cases"].values())
    guard["near_ties"] = sum(c.get("near_ties", 0) for c in guard["cases"].values() if c["ok"])


def run_guard(model, cases: list[GuardCase], kwargs: dict[str, Any], device: torch.device,
              progress: Progress) -> dict[str, Any]:
    """Ours (as accelerated now) vs accelerate_model(torch, enforce_eager) on the same short requests.

    Leaves the model restored (stock), ready for the anchors.
    """
    api = _api()
    ours_out = run_guard_cases(model, cases, device, progress, "ours")
    api.restore(model)
    free_memory(device)
    try:
        ref_kwargs = {k: v for k, v in kwargs.items() if k == "gpu_memory_utilization"}
        api.accelerate_model(model, attention_backend="torch", enforce_eager=True, **ref_kwargs)
        ref_out = run_guard_cases(model, cases, device, progress, "reference")
        guard = compare_guard(cases, ours_out, ref_out)
        api.restore(model)  # near-ties are judged by stock transformers itself
        judge_near_ties(guard, cases, model, device, next(model.parameters()).dtype)
    except Exception as exc:
        guard = {"passed": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    with contextlib.suppress(Exception):
        api.restore(model)
    free_memory(device)
    return guard


# ---------------------------------------------------------------------------------------------- accel options
def accel_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Only the accelerate_model options the user set, so the library's own defaults apply otherwise."""
    kw: dict[str, Any] = {}
    if args.attention_backend != "auto":
        kw["attention_backend"] = args.attention_backend
    if args.cudagraph_mode is not None:
        kw["cudagraph_mode"] = args.cudagraph_mode
    if args.cudagraph_capture_sizes:
        kw["cudagraph_capture_sizes"] = [int(s) for s in args.cudagraph_capture_sizes.split(",") if s.strip()]
    if args.compile is not None:
        kw["compile"] = args.compile
    if args.enforce_eager:
        kw["enforce_eager"] = True
    for name in ("block_size", "num_kv_blocks", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.no_prefix_caching:
        kw["enable_prefix_caching"] = False
    return kw


def _accel_argv(args: argparse.Namespace) -> list[str]:
    """The command-line options that reproduce `args`' model and accelerate_model settings (startup children)."""
    argv = ["--model", args.model] if args.model else ["--shape", args.shape]
    argv += ["--dtype", args.dtype, "--scale", args.scale, "--attention-backend", args.attention_backend]
    if args.device:
        argv += ["--device", args.device]
    if args.cudagraph_mode is not None:
        argv += ["--cudagraph-mode", args.cudagraph_mode]
    if args.cudagraph_capture_sizes:
        argv += ["--cudagraph-capture-sizes", args.cudagraph_capture_sizes]
    if args.compile is not None:
        argv.append("--compile" if args.compile else "--no-compile")
    if args.enforce_eager:
        argv.append("--enforce-eager")
    for name in ("block_size", "num_kv_blocks", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) is not None:
            argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.no_prefix_caching:
        argv.append("--no-prefix-caching")
    return argv


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    if isinstance(obj, torch.dtype | torch.device):
        return str(obj)
    return repr(obj)


def resolved_accel_config(kwargs: dict[str, Any], device: torch.device) -> dict[str, Any] | None:
    """Every AccelConfig field as accelerate_model resolves it on this device."""
    try:
        from hf_accel.config import AccelConfig

        cfg = AccelConfig(**kwargs).resolve_for(device)
        return _jsonable(dataclasses.asdict(cfg))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _api():
    return importlib.import_module("hf_accel.api")


def _engine_info(model) -> dict[str, Any] | None:
    fn = getattr(_api(), "engine_info", None)
    if fn is None:
        return None
    try:
        return _jsonable(fn(model))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


# -------------------------------------------------------------------------------------------------- startup
def measure_startup_once(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                         cache_dir: str) -> dict[str, Any]:
    """Build a fresh model (not timed), then time accelerate_model and the first generated token."""
    from hf_accel.config import AccelConfig

    api = _api()
    model = build_model(args.shape, args.model, dtype, device)
    spec = SCALES[args.scale]["w1"]
    prompts = random_prompts(spec.prompt_lengths(), 0, model.config.get_text_config().vocab_size)
    cfg = AccelConfig(**accel_kwargs(args), compile_cache_dir=cache_dir)
    free_memory(device)
    accel_s, _ = timed(functools.partial(api.accelerate_model, model, config=cfg), device)
    first_s, out = timed(call_generate(model, prompts, 1, device), device)
    info = _engine_info(model) or {}
    rec = {"accelerate_s": accel_s, "first_token_s": first_s, "total_s": accel_s + first_s,
           "engine_startup": info.get("startup"), "compile_cache": info.get("compile_cache"),
           "graph_pool_bytes": info.get("graph_pool_bytes"), "engine_info": info,
           "valid": not out.problems, "reasons": out.problems}
    api.restore(model)
    del model
    free_memory(device)
    return rec


def _startup_child(args: argparse.Namespace) -> int:
    """Entry point of a fresh process measuring one startup (the parent reads its JSON)."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    try:
        rec = measure_startup_once(args, device, dtype, args.compile_cache_dir)
    except Exception as exc:
        rec = {"valid": False, "reasons": [f"{type(exc).__name__}: {exc}"], "traceback": traceback.format_exc()}
    Path(args.startup_out).write_text(json.dumps(_jsonable(rec), indent=1))
    return 0


def run_startup(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                progress: Progress) -> dict[str, Any]:
    """Cold (empty compile caches) then warm (same caches) startup, each on a fresh model object.

    With isolation "process" each phase is a fresh Python process whose Inductor and Triton caches also live
    in the temporary directory, so cold is truly cold and warm is what a second launch of a program sees.
    """
    result: dict[str, Any] = {"isolation": args.startup_isolation}
    with tempfile.TemporaryDirectory(prefix="hf_accel_bench_cache_") as tmp:
        cache_dir = os.path.join(tmp, "hf_accel")
        for phase in ("cold", "warm"):
            with progress.step(f"startup {phase}"):
                if args.startup_isolation == "inline":
                    if phase == "warm":
                        torch._dynamo.reset()
                    try:
                        rec = measure_startup_once(args, device, dtype, cache_dir)
                    except Exception as exc:
                        rec = {"valid": False, "reasons": [f"{type(exc).__name__}: {exc}"],
                               "traceback": traceback.format_exc()}
                else:
                    rec = _startup_subprocess(args, tmp, cache_dir, phase)
            result[phase] = rec
    return result


def _startup_subprocess(args: argparse.Namespace, tmp: str, cache_dir: str, phase: str) -> dict[str, Any]:
    out_path = os.path.join(tmp, f"startup_{phase}.json")
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "hf_accel.bench", *_accel_argv(args), "--startup-child", phase,
           "--startup-out", out_path, "--compile-cache-dir", cache_dir]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.startup_timeout)
    except subprocess.TimeoutExpired:
        return {"valid": False, "reasons": [f"startup process exceeded {args.startup_timeout} s"]}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not os.path.exists(out_path):
        return {"valid": False, "reasons": [f"startup process exited with {proc.returncode}"],
                "stderr_tail": proc.stderr[-4000:]}
    rec = json.loads(Path(out_path).read_text())
    rec["process_wall_s"] = wall
    return rec


# ---------------------------------------------------------------------------------------------- orchestration
def parse_list(value: str, allowed: Sequence[str], what: str, all_value: str | None = None) -> list[str]:
    items = [v.strip().lower() for v in value.split(",") if v.strip()]
    if all_value and all_value in items:
        return list(allowed)
    if items == ["none"]:
        return []
    bad = [v for v in items if v not in allowed]
    if bad:
        raise ValueError(f"unknown {what} {bad}; choose from {list(allowed)}")
    return [v for v in allowed if v in items]


def run_throughput(args: argparse.Namespace, report: dict[str, Any], workloads: list[str], anchors: list[str],
                   device: torch.device, dtype: torch.dtype, progress: Progress) -> None:
    """Ours on every workload, the guard, restore, then the anchors on the same inputs."""
    api = _api()
    specs = {w: SCALES[args.scale][w] for w in workloads}
    build_s, model = timed(lambda: build_model(args.shape, args.model, dtype, device), device)
    text = model.config.get_text_config()
    vocab = text.vocab_size
    kwargs = accel_kwargs(args)
    wbytes, kvtok = weight_bytes(model), kv_bytes_per_token(model.config, dtype)
    report["model"].update(build_s=build_s, weight_bytes=wbytes, kv_bytes_per_token=kvtok,
                           config=_jsonable(model.config.to_dict()), num_parameters=sum(
                               p.numel() for p in model.parameters()))
    bandwidth = None
    if device.type == "cuda":
        bandwidth = measure_copy_bandwidth(device)
        report["env"]["copy_bandwidth_bytes_per_s"] = bandwidth
        for w, spec in specs.items():  # the HBM roofline needs the measured bandwidth: CUDA only
            report["workloads"][w]["roofline_tokens_per_s"] = decode_roofline_tokens_per_s(
                wbytes, kvtok, spec.prompt_lengths(), spec.new_tokens, bandwidth, kwargs.get("max_num_seqs", 256))

    firsts: dict[tuple[str, str], list[list[int]] | None] = {}
    try:
        accel_s, _ = timed(functools.partial(api.accelerate_model, model, **kwargs), device)
    except Exception as exc:  # e.g. an unusable --attention-backend: report it, measure nothing
        error = f"accelerate_model failed: {type(exc).__name__}: {exc}"
        progress.write(error)
        report["accel"].update(error=error, traceback=traceback.format_exc())
        report["guard"] = {"passed": False, "ran": False, "error": error}
        for w in specs:
            report["workloads"][w]["methods"]["ours"] = {
                "method": "ours", "label": METHOD_LABELS["ours"], "valid": False, "reasons": [error],
                "warmup_s": [], "run_s": [], "tokens": [], "tokens_per_s": [], "median_tokens_per_s": None,
                "error": error}
        return
    report["accel"].update(accelerate_s=accel_s, engine_info=_engine_info(model) or {})
    for w, spec in specs.items():
        rec, firsts[(w, "ours")] = measure_method("ours", spec, make_caller(spec, model, device), vocab,
                                                  args.warmup, args.repeats, device, progress)
        report["workloads"][w]["methods"]["ours"] = rec

    guard = run_guard(model, guard_cases(specs, args.scale, vocab), kwargs, device, progress)
    report["guard"] = guard
    if not guard["passed"]:
        for w in specs:
            rec = report["workloads"][w]["methods"]["ours"]
            rec["valid"] = False
            rec["median_tokens_per_s"] = None
            rec["reasons"].append("correctness guard failed: tokens differ from the eager torch backend")

    # stock anchors, after restore(), on the same inputs
    if anchors:
        torch._dynamo.reset()  # a clean slate for transformers' own compile, as in a fresh process
    for w, spec in specs.items():
        for anchor in anchors:
            if (anchor == "generate_batch") != (spec.api == "generate_batch"):
                continue
            caller = make_caller(spec, model, device, static=anchor == "static")
            rec, firsts[(w, anchor)] = measure_method(
                anchor, spec, caller, vocab, anchor_warmup(args, anchor),
                args.anchor_repeats if args.anchor_repeats is not None else args.repeats, device, progress)
            if anchor == "static":
                rec["compiled_by_transformers"] = device.type in ("cuda", "xpu")
                if not rec["compiled_by_transformers"]:
                    rec["label"] = f"stock generate (static cache; no compile on {device.type})"
            report["workloads"][w]["methods"][anchor] = rec
        stock = "generate_batch" if spec.api == "generate_batch" else "eager"
        report["workloads"][w]["agreement_with_stock"] = agreement(firsts.get((w, "ours")), firsts.get((w, stock)))
    del model
    free_memory(device)


def finalize(report: dict[str, Any]) -> None:
    """Ratios ours/anchor and ours/roofline, from valid figures only."""
    for entry in report["workloads"].values():
        methods = entry["methods"]
        ours = methods.get("ours", {}).get("median_tokens_per_s")
        entry["ratios"] = {}
        for name, rec in methods.items():
            if name == "ours":
                continue
            theirs = rec.get("median_tokens_per_s")
            entry["ratios"][f"ours/{name}"] = ours / theirs if ours and theirs else None
        roof = entry.get("roofline_tokens_per_s")
        entry["roofline_ratio"] = {name: (rec.get("median_tokens_per_s") / roof
                                          if roof and rec.get("median_tokens_per_s") else None)
                                   for name, rec in methods.items()}


# ------------------------------------------------------------------------------------------------------ output
def _num(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:,.{digits}f}"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:  # two text columns left-aligned, figures right-aligned
        return "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def format_report(report: dict[str, Any]) -> str:
    """The at-a-glance table: per workload ours, each anchor, ratios, roofline and target; then startup."""
    env, model, accel = report["env"], report["model"], report.get("accel", {})
    info = accel.get("engine_info") or {}
    gpu = env.get("gpu_name")
    head = [f"hf-accel bench  {model.get('name')}  {model.get('dtype')}  on {env.get('device')}"
            + (f" ({gpu})" if gpu else "") + f"  scale={report.get('scale')}"]
    v = env.get("versions", {})
    head.append("versions: " + "  ".join(f"{k} {v.get(k)}" for k in ("torch", "transformers", "triton", "flashinfer",
                                                                       "flash-attn")))
    if info:
        head.append(f"engine: backend={info.get('attention_backend')}  graphs={info.get('cudagraph_mode')}  "
                    f"compile={info.get('compile')}  block_size={info.get('block_size')}  "
                    f"kv_blocks={info.get('num_kv_blocks')}")
        tune = info.get("backend_autotune")
        if tune and tune.get("timings"):
            scores = ", ".join(f"{k} {v['score']:.3f}" if "score" in v else f"{k} failed"
                               for k, v in tune["timings"].items())
            how = ("remembered from an earlier start's timing of" if tune.get("cached")
                   else f"timed in {tune.get('seconds', 0):.1f} s:")
            head.append(f"attention 'auto': {how} {tune.get('candidates')}, chose {tune.get('chosen')} (static "
                        f"order: {tune.get('static_choice')}); score = 4 x decode ms + prefill ms: {scores}")
        elif tune and tune.get("error"):
            head.append(f"attention 'auto': autotune failed ({tune['error']}), static choice {tune.get('chosen')}")
    bw = env.get("copy_bandwidth_bytes_per_s")
    if bw:
        head.append(f"device copy bandwidth: {bw / 1e12:.2f} TB/s (roofline = weights + KV read once per step)")
    guard = report.get("guard")
    if guard is not None:
        if guard.get("ran") is False:
            head.append("correctness guard: not run (accelerate_model failed, see notes) -> no valid figure of ours")
        elif guard.get("passed"):
            n = sum(c["requests"] for c in guard.get("cases", {}).values())
            ties = guard.get("near_ties", 0)
            head.append(f"correctness guard: PASS ({n} requests in {len(guard.get('cases', {}))} batch shapes, "
                        + ("token-for-token equal to the eager torch backend)" if not ties else
                           f"equal to the eager torch backend but for {ties} rounding near-tie(s): "
                           f"{guard.get('tie_rule')})"))
        else:
            bad = []
            for k, c in guard.get("cases", {}).items():
                if c.get("ok", c.get("equal")):
                    continue
                div = (c.get("agreement") or {}).get("first_divergence")
                leads = [d["worst_lead"] for d in c.get("divergences", []) if "worst_lead" in d]
                bad.append(k + (f" at row {div['row']} step {div['step']}" if div else "")
                           + (f", stock lead over our token up to {max(leads):.3g}" if leads else "")
                           + (f" ({c.get('ours_error') or c.get('reference_error')})"
                              if c.get("ours_error") or c.get("reference_error") else ""))
            why = guard.get("error") or "tokens differ: " + "; ".join(bad)
            head.append(f"correctness guard: FAIL ({why}) -> our speed figures are INVALID")
    out = ["\n".join(head)]

    if report["workloads"]:
        rows = []
        for entry in report["workloads"].values():
            spec = entry["spec"]
            title = f"{spec['title']}"
            sub = (f"{spec['num_requests']} x {spec['prompt']} -> {spec['new_tokens']}")
            target = entry.get("target_tokens_per_s")
            ours_ok = entry["methods"].get("ours", {}).get("median_tokens_per_s")
            for i, (name, rec) in enumerate(entry["methods"].items()):
                n = len(rec.get("run_s", []))
                if rec.get("valid") and rec.get("median_tokens_per_s") is not None:
                    fig = _num(rec["median_tokens_per_s"])
                else:
                    fig = "INVALID"
                ratio = "" if name == "ours" else (
                    f"{entry['ratios'].get(f'ours/{name}'):.2f}x" if entry["ratios"].get(f"ours/{name}") else "-")
                roof = entry.get("roofline_ratio", {}).get(name)
                tgt = ""
                if name == "ours" and target:
                    tgt = f">= {_num(target)} " + ("met" if ours_ok and ours_ok >= target else "NOT met")
                rows.append([title if i == 0 else (sub if i == 1 else ""), rec.get("label", name),
                             f"{fig}", f"{n}", ratio, f"{roof:.1%}" if roof else "", tgt])
            if len(entry["methods"]) == 1:
                rows.append([sub, "", "", "", "", "", ""])
            if entry.get("roofline_tokens_per_s"):
                rows.append(["", "HBM roofline", _num(entry["roofline_tokens_per_s"]), "", "", "", ""])
        out.append(_table(rows, ["workload", "method", "tokens/s (median)", "runs", "ours/this", "of roofline",
                                 "target"]))
        notes = []
        for w, entry in report["workloads"].items():
            for name, rec in entry["methods"].items():
                if not rec.get("valid"):
                    notes.append(f"  {w} {rec.get('label', name)}: INVALID: " + "; ".join(rec.get("reasons", []))[:300])
            agree = entry.get("agreement_with_stock")
            if agree:
                notes.append(f"  {w}: ours vs stock (info only, low-precision ties may flip): "
                             f"{agree['rows_equal']}/{agree['rows']} rows equal, mean common prefix "
                             f"{agree['mean_common_prefix']:.1f}/"
                             f"{agree['tokens_per_row']} tokens")
        if notes:
            out.append("notes:\n" + "\n".join(notes))

    st = report.get("startup")
    if st:
        rows = []
        tgt = report.get("targets") or {}
        for phase in ("cold", "warm"):
            rec = st.get(phase) or {}
            es = rec.get("engine_startup") or {}
            cc = rec.get("compile_cache") or {}
            if not rec.get("valid"):
                rows.append([phase, "INVALID: " + "; ".join(rec.get("reasons", []))[:200], *[""] * 9])
                continue
            limit = tgt.get(f"startup_{phase}_s")
            total = rec.get("total_s")
            verdict = (f"<= {limit:.0f} s " + ("met" if total is not None and total <= limit else "NOT met")
                       if limit else "")
            pool = rec.get("graph_pool_bytes")
            if tgt.get("graph_pool_bytes") and isinstance(pool, int | float):
                verdict += f"  pool <= 1 GiB {'met' if pool <= tgt['graph_pool_bytes'] else 'NOT met'}"
            warm = cc.get("warm")
            rows.append([phase, _num(es.get("patch_s"), 2), _num(es.get("autotune_s"), 2),
                         _num(es.get("kv_cache_s"), 2), _num(es.get("compile_s"), 2), _num(es.get("capture_s"), 2),
                         _num(rec.get("accelerate_s"), 2),
                         _num(rec.get("first_token_s"), 2), _num(total, 2),
                         f"{pool / GIB:.2f} GiB" if isinstance(pool, int | float) else "-",
                         (f"engine saw cache warm={warm}  " if warm is not None else "") + verdict])
        out.append(f"startup (accelerate_model -> first token, {st.get('isolation')} isolation), seconds\n" + _table(
            rows, ["cache", "patch", "autotune", "kv cache", "compile", "capture", "accelerate_model", "first token",
                   "total",
                   "graph pool", ""]))
    return "\n\n".join(out)


def write_plot(report: dict[str, Any], path: str) -> None:
    """Bar chart of tokens/s per workload and method (log scale); startup as stacked bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = report["workloads"]
    has_startup = bool(report.get("startup"))
    ncols = max(1, len(workloads) + int(has_startup))
    fig, axes = plt.subplots(1, ncols, figsize=(4.5 * ncols, 4), squeeze=False)
    for ax, entry in zip(axes[0], workloads.values(), strict=False):
        names, vals = [], []
        for name, rec in entry["methods"].items():
            names.append(name + ("" if rec.get("median_tokens_per_s") else "\n(INVALID)"))
            vals.append(rec.get("median_tokens_per_s") or 0)
        bars = ax.bar(names, vals, color=["tab:green" if n == "ours" else "tab:gray" for n in entry["methods"]])
        ax.bar_label(bars, labels=[_num(v) if v else "" for v in vals], fontsize=8)
        if entry.get("roofline_tokens_per_s"):
            ax.axhline(entry["roofline_tokens_per_s"], color="tab:red", ls="--", label="HBM roofline")
            ax.legend()
        shown = [v for v in vals if v] + ([entry["roofline_tokens_per_s"]] if entry.get("roofline_tokens_per_s")
                                          else [])
        if shown and max(shown) / min(shown) > 20:  # anchors and ours can be orders of magnitude apart
            ax.set_yscale("log")
        ax.set_title(entry["spec"]["title"])
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", labelrotation=20)
    if has_startup:
        ax = axes[0][-1]
        parts = ("patch_s", "autotune_s", "kv_cache_s", "compile_s", "capture_s")
        bottoms = [0.0, 0.0]
        for part in (*parts, "first_token_s"):
            vals = []
            for phase in ("cold", "warm"):
                rec = report["startup"].get(phase) or {}
                es = rec.get("engine_startup") or {}
                vals.append(float(rec.get(part) if part == "first_token_s" else es.get(part) or 0) or 0.0)
            ax.bar(["cold", "warm"], vals, bottom=bottoms, label=part[:-2])
            bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
        ax.set_title("startup")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7)
    fig.suptitle(f"hf_accel bench: {report['model'].get('name')} on {report['env'].get('gpu_name') or 'cpu'}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------- the CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `hf-accel bench` (WORKLOADS.md)."""
    g = parser.add_argument_group("what to run")
    g.add_argument("--workload", default="w1",
                   help="w1, w2, w3, startup, all, or a comma list (default: w1)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--shape", choices=SHAPE_NAMES, default="tiny",
                     help="random-weight model shape from WORKLOADS.md (default: tiny)")
    src.add_argument("--model", default=None, metavar="ID_OR_PATH", help="a Hugging Face model id or local path")
    g.add_argument("--scale", choices=("auto", "full", "tiny"), default="auto",
                   help="workload sizes: full (WORKLOADS.md) or tiny (seconds on CPU); auto: tiny for tiny shapes")
    g.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    g.add_argument("--anchors", default="eager,static,generate_batch",
                   help="comma list of eager, static, generate_batch, or none (stock transformers, same process)")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the median is reported")
    g.add_argument("--warmup", type=int, default=1, help="warm-up calls before the timed runs")
    g.add_argument("--anchor-repeats", type=int, default=None, help="timed runs per anchor (default: --repeats)")
    g.add_argument("--anchor-warmup", type=int, default=None, help="warm-up calls per anchor (default: --warmup)")
    g.add_argument("--startup-isolation", choices=("process", "inline"), default="process",
                   help="startup phases in fresh processes (honest cold/warm) or in this one")
    g.add_argument("--startup-timeout", type=int, default=1200, help="seconds allowed per startup process")

    a = parser.add_argument_group("accelerate_model options (unset: the library's defaults)")
    a.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    a.add_argument("--cudagraph-mode", choices=CUDAGRAPH_MODES, default=None)
    a.add_argument("--cudagraph-capture-sizes", default=None, metavar="1,2,4,8", help="comma list of batch sizes")
    a.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    a.add_argument("--enforce-eager", action="store_true")
    a.add_argument("--block-size", type=int, default=None)
    a.add_argument("--num-kv-blocks", type=int, default=None)
    a.add_argument("--gpu-memory-utilization", type=float, default=None)
    a.add_argument("--max-num-seqs", type=int, default=None)
    a.add_argument("--max-num-batched-tokens", type=int, default=None)
    a.add_argument("--no-prefix-caching", action="store_true")

    o = parser.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="PATH", help="write every raw figure here")
    o.add_argument("--plot", default=None, metavar="PATH", help="write a bar chart (needs matplotlib)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")

    # internal: one startup phase in a fresh process
    parser.add_argument("--startup-child", choices=("cold", "warm"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--startup-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--compile-cache-dir", default=None, help=argparse.SUPPRESS)


def _resolve_scale(args: argparse.Namespace) -> None:
    if args.scale == "auto":
        args.scale = "tiny" if (not args.model and args.shape.startswith("tiny")) else "full"


def run(args: argparse.Namespace) -> int:
    """Run the selected workloads; print the table, write JSON/plot. 0: all our figures valid, 1: not, 2: usage."""
    _resolve_scale(args)
    if args.startup_child:
        return _startup_child(args)
    try:
        workloads = parse_list(args.workload, WORKLOAD_NAMES, "workload", all_value="all")
        anchors = parse_list(args.anchors, ANCHOR_NAMES, "anchor")
    except ValueError as exc:
        print(f"hf-accel bench: {exc}", file=sys.stderr)
        return 2
    if not workloads:
        print("hf-accel bench: no workload selected", file=sys.stderr)
        return 2
    if args.repeats < 1 or args.warmup < 0:
        print("hf-accel bench: --repeats must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("hf-accel bench: --plot needs matplotlib, which is not installed "
                  "(pip install matplotlib, or pip install 'hf_accel[plot]'); nothing was run", file=sys.stderr)
            return 2
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    throughput = [w for w in workloads if w != "startup"]
    specs = {w: SCALES[args.scale][w] for w in throughput}
    name = args.model or args.shape
    targets = TARGETS.get(name, {}) if (not args.model and args.scale == "full") else {}
    report: dict[str, Any] = {
        "schema": 1, "tool": "hf-accel bench", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv, "args": _jsonable(vars(args)), "scale": args.scale, "targets": targets,
        "env": environment(device),
        "model": {"name": name, "shape": None if args.model else args.shape, "model_id": args.model,
                  "dtype": str(dtype).removeprefix("torch.")},
        "accel": {"options": _jsonable(accel_kwargs(args)),
                  "config": resolved_accel_config(accel_kwargs(args), device)},
        "inputs": {"token_range": [TOKEN_LOW, TOKEN_HIGH], "w3_length_seed": W3_LENGTH_SEED,
                   "token_seeds": {w: {"timed_run_r": f"{s} + r", "warmup_i": f"{s + WARMUP_SEED_OFFSET} + i"}
                                   for w, s in WORKLOAD_SEED.items()},
                   "guard_seed_base": GUARD_SEED_BASE, "eos": "disabled"},
        "workloads": {}, "guard": None, "startup": None,
    }
    for w, spec in specs.items():
        lengths = spec.prompt_lengths()
        report["workloads"][w] = {
            "spec": {**dataclasses.asdict(spec), "expected_tokens": spec.expected_tokens,
                     "prompt": spec.prompt_len if spec.prompt_len is not None
                     else f"U[{spec.prompt_len_range[0]},{spec.prompt_len_range[1]}]",
                     "mean_prompt_len": sum(lengths) / len(lengths)},
            "target_tokens_per_s": targets.get(w), "methods": {}, "roofline_tokens_per_s": None,
        }

    n_anchor_calls = 0
    for spec in specs.values():
        reps = args.anchor_repeats if args.anchor_repeats is not None else args.repeats
        n_anchor_calls += sum(anchor_warmup(args, a) + reps for a in anchors
                              if (a == "generate_batch") == (spec.api == "generate_batch"))
    n_guard = 2 * (2 + ("w2" in specs) + ("w3" in specs)) if specs else 0
    total = ("startup" in workloads) * 2 + len(specs) * (args.warmup + args.repeats) + n_guard + n_anchor_calls
    progress = Progress(total, enabled=not args.no_progress)
    try:
        # startup first: the child processes then get the GPU to themselves
        if "startup" in workloads:
            report["startup"] = run_startup(args, device, resolve_dtype(args.dtype, device), progress)
        if specs:
            run_throughput(args, report, throughput, anchors, device, dtype, progress)
    finally:
        progress.close()
    finalize(report)
    ours_valid = all(e["methods"].get("ours", {}).get("valid", False) for e in report["workloads"].values())
    startup_valid = all((report["startup"] or {}).get(p, {}).get("valid", False) for p in ("cold", "warm")) \
        if report["startup"] else True
    report["valid"] = ours_valid and startup_valid

    text = format_report(report)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(_jsonable(report), indent=1))
        print(f"\nraw figures: {args.json}")
    if args.plot:
        write_plot(report, args.plot)
        print(f"plot: {args.plot}")
    return 0 if report["valid"] else 1


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (`python -m hf_accel.bench ...`); the CLI uses add_arguments + run."""
    parser = argparse.ArgumentParser(prog="hf-accel bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
