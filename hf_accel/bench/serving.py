"""W5 serving: `hf-accel serve` under streamed OpenAI-client load, against the same requests offline.

The model (random weights, EOS disabled) is saved with a tokenizer built here: a WordLevel vocabulary "t0".."tN"
that covers every token id, without EOS, so the server has no end-of-sequence token to stop at and every request
produces exactly its `max_tokens`; its text maps back to token ids ("t123" is id 123). The server runs in its own
process with the same accelerate_model options as the offline twin, which runs in this process once the server
has stopped: the same requests through our generate_batch(), one call per distinct `max_tokens`, all started
together from threads. Each Poisson rate (and "all at once") and each timed repeat gets its own token ids (the same
lengths and `max_tokens`), so the server's prefix cache never holds an earlier run's prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import inspect
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .environment import _api, accel_kwargs
from .guard import agreement
from .workloads import (
    WARMUP_SEED_OFFSET,
    WORKLOAD_SEED,
    CallOutput,
    Progress,
    _generation_config,
    build_model,
    call_generate_batch,
    call_grouped_generate_batch,
    free_memory,
    random_prompts,
    record_run,
    timed,
)

W5_LENGTH_SEED = 5  # per request a prompt length then a max_tokens, from random.Random(5) (WORKLOADS.md)
W5_ARRIVAL_SEED = 50  # Poisson gaps of rate index k from random.Random(50 + k)
W5_RATE_SEED_STRIDE = 100  # token ids of rate index k, timed run r: WORKLOAD_SEED["w5"] + 100 k + r
W5_TARGET_SERVER_VS_OFFLINE = 0.9  # WORKLOADS.md: server >= 90 % of the same requests offline
SERVE_EXTRA = ("fastapi", "uvicorn", "openai")
_TOKEN_RE = re.compile(r"t(\d+)")
# accelerate_model options and the `hf-accel serve` flag that sets each (compile=False is --no-compile)
SERVER_FLAGS = {"attention_backend": "--attention-backend", "max_num_seqs": "--max-num-seqs",
                "max_num_batched_tokens": "--max-num-batched-tokens",
                "gpu_memory_utilization": "--gpu-memory-utilization", "num_kv_blocks": "--num-kv-blocks",
                "block_size": "--block-size", "cudagraph_mode": "--cudagraph-mode"}


@dataclass(frozen=True)
class ServingSpec:
    """W5's requests: how many, prompt lengths and max_tokens (uniform, inclusive), arrival rates (inf: at once)."""

    num_requests: int
    prompt_len_range: tuple[int, int]
    max_tokens_range: tuple[int, int]
    rates: tuple[float, ...] = (8.0, 32.0, 128.0, math.inf)

    def draws(self) -> tuple[list[int], list[int]]:
        """Prompt lengths and max_tokens from random.Random(W5_LENGTH_SEED), drawn request by request (length,
        then max_tokens), so that fewer requests (--w5-requests) are the first ones of the full list."""
        rng = random.Random(W5_LENGTH_SEED)
        pairs = [(rng.randint(*self.prompt_len_range), rng.randint(*self.max_tokens_range))
                 for _ in range(self.num_requests)]
        return [p for p, _ in pairs], [m for _, m in pairs]


SERVING_SCALES = {
    "full": ServingSpec(512, (100, 1024), (64, 512)),
    "tiny": ServingSpec(16, (10, 64), (4, 24)),
}


def rate_key(rate: float) -> str:
    return "all" if math.isinf(rate) else f"{rate:g}"


def parse_rates(value: str) -> tuple[float, ...]:
    """"8,32,128,all" -> (8.0, 32.0, 128.0, inf); "all" (or "inf") sends every request at once."""
    rates = []
    for item in (v.strip().lower() for v in value.split(",") if v.strip()):
        rate = math.inf if item in ("all", "inf") else float(item)
        if not rate > 0:
            raise ValueError(f"--w5-rates: a rate must be > 0 requests/s, got {item!r}")
        rates.append(rate)
    if not rates:
        raise ValueError("--w5-rates: no rate given")
    return tuple(dict.fromkeys(rates))


def headline_rate(rates: Sequence[float]) -> float:
    """The rate WORKLOADS.md's server-vs-offline target is read at: the highest Poisson rate (all at once if none)."""
    finite = [r for r in rates if math.isfinite(r)]
    return max(finite) if finite else math.inf


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds after the first) of a Poisson process at `rate`; all zero for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def token_seed(rate_index: int, run: int) -> int:
    return WORKLOAD_SEED["w5"] + W5_RATE_SEED_STRIDE * rate_index + run


def warmup_seed(i: int) -> int:
    return WORKLOAD_SEED["w5"] + WARMUP_SEED_OFFSET + i


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks; None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def missing_serve_extra() -> list[str]:
    """The W5 client and server packages that are not importable."""
    import importlib.util

    return [m for m in SERVE_EXTRA if importlib.util.find_spec(m) is None]


# -------------------------------------------------------------------------------------- the model directory
def save_serving_model(model, path: str) -> None:
    """save_pretrained plus a WordLevel tokenizer over "t0".."t{V-1}" with no special tokens (so no EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = model.config.get_text_config().vocab_size
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)


def text_to_ids(text: str) -> list[int]:
    """Token ids back from the served text of the WordLevel tokenizer ("t5 t17" -> [5, 17])."""
    return [int(m) for m in _TOKEN_RE.findall(text)]


# --------------------------------------------------------------------------------------------- the server
def server_accel_options(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The accelerate_model options the server gets (the offline twin gets exactly these) and the bench options
    that `hf-accel serve` has no flag for (they apply to neither, so both sides stay alike)."""
    from hf_accel.config import AccelConfig

    defaults = {f.name: f.default for f in dataclasses.fields(AccelConfig)}
    wanted = accel_kwargs(args)
    # the engine limits are passed explicitly, so that server and offline do not depend on two default tables
    opts: dict[str, Any] = {k: wanted.get(k, defaults[k])
                            for k in ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization")}
    dropped = []
    for key, value in wanted.items():
        if key in SERVER_FLAGS or (key == "enforce_eager" and value) or (key == "compile" and value is False):
            opts[key] = value
        elif key not in opts:
            dropped.append(key)
    return opts, dropped


def server_argv(model_dir: str, port: int, dtype: torch.dtype, device: torch.device,
                opts: dict[str, Any]) -> list[str]:
    argv = [sys.executable, "-m", "hf_accel.cli", "serve", model_dir, "--port", str(port), "--host", "127.0.0.1",
            "--served-model-name", "w5", "--dtype", str(dtype).removeprefix("torch."), "--device", str(device),
            "--log-level", "warning"]
    for key, value in opts.items():
        if key in SERVER_FLAGS:
            argv += [SERVER_FLAGS[key], str(value)]
        elif key == "enforce_eager" and value:
            argv.append("--enforce-eager")
        elif key == "compile" and value is False:
            argv.append("--no-compile")
    return argv


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`hf-accel serve` in a child process: started, waited for (GET /health), stopped with SIGTERM."""

    def __init__(self, argv: list[str], port: int, log_path: str) -> None:
        self.argv, self.port, self.log_path = argv, port, log_path
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hf-accel serve exited with {self.proc.returncode} before it was ready")
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    f"http://127.0.0.1:{self.port}/health", timeout=2) as resp:
                if resp.status == 200:
                    break
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"hf-accel serve was not ready after {timeout:.0f} s")
            time.sleep(0.25)
        self.startup_s = time.perf_counter() - t0

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM (the server aborts what is in flight and shuts down), SIGKILL if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=30)

    def log_tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return Path(self.log_path).read_text(errors="replace")[-chars:]
        return ""


# --------------------------------------------------------------------------------------------- the client
@dataclass
class RequestResult:
    """One streamed request, times from time.perf_counter()."""

    sent: float
    first: float | None = None
    end: float | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None


async def _send_all(base_url: str, prompts: list[list[int]], max_tokens: list[int], offsets: list[float],
                    timeout: float) -> list[RequestResult]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=timeout) as client:
        start = time.perf_counter()

        async def one(i: int) -> RequestResult:
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            res = RequestResult(sent=time.perf_counter())
            pieces: list[str] = []
            try:
                stream = await client.completions.create(
                    model="w5", prompt=prompts[i], max_tokens=max_tokens[i], temperature=0, stream=True,
                    stream_options={"include_usage": True})
                async for chunk in stream:
                    if chunk.choices:
                        choice = chunk.choices[0]
                        if choice.text:
                            if res.first is None:
                                res.first = time.perf_counter()
                            pieces.append(choice.text)
                        if choice.finish_reason:
                            res.finish_reason = choice.finish_reason
                    if chunk.usage is not None:
                        res.completion_tokens = chunk.usage.completion_tokens
                res.end = time.perf_counter()
            except Exception as exc:
                res.error = f"{type(exc).__name__}: {exc}"
            res.text = "".join(pieces)
            return res

        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def summarize_run(results: list[RequestResult], max_tokens: list[int], max_problems: int = 5) -> dict[str, Any]:
    """Output tokens/s (first send to last response end), TTFT and TPOT percentiles, and what went wrong."""
    problems: list[str] = []
    ttft, tpot = [], []
    tokens = 0
    for i, (res, want) in enumerate(zip(results, max_tokens, strict=True)):
        got = res.completion_tokens
        if res.error is not None:
            problems.append(f"request {i}: {res.error}")
            continue
        if got != want:
            problems.append(f"request {i}: {got} completion tokens instead of {want}")
        elif res.finish_reason != "length":
            problems.append(f"request {i}: finish_reason {res.finish_reason!r} instead of 'length'")
        tokens += got or 0
        if res.first is None:
            problems.append(f"request {i}: no content chunk")
            continue
        ttft.append(res.first - res.sent)
        if got and got > 1 and res.end is not None:
            tpot.append((res.end - res.first) / (got - 1))
    ends = [r.end for r in results if r.end is not None]
    seconds = max(ends) - min(r.sent for r in results) if ends else None
    if len(problems) > max_problems:
        problems = [*problems[:max_problems], f"... and {len(problems) - max_problems} more"]
    return {"requests": len(results), "tokens": tokens, "expected_tokens": sum(max_tokens), "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99), "problems": problems}


def run_load(base_url: str, prompts: list[list[int]], max_tokens: list[int], offsets: list[float],
             timeout: float) -> tuple[dict[str, Any], list[list[int]]]:
    """One load run against the server: its summary and the token ids each request got back."""
    cpu0, t0 = time.process_time(), time.perf_counter()
    results = asyncio.run(_send_all(base_url, prompts, max_tokens, offsets, timeout))
    summary = summarize_run(results, max_tokens)
    # the client shares this process: near 1.0 means it may be what limits the figure
    summary["client_cpu_fraction"] = (time.process_time() - cpu0) / max(time.perf_counter() - t0, 1e-9)
    return summary, [text_to_ids(r.text) for r in results]


_RUN_METRICS = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")


def _medians(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in _RUN_METRICS:
        vals = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(vals) if vals else None
    return out


# ---------------------------------------------------------------------------------------- offline & stock
def stock_per_request_max_tokens(model) -> bool:
    """Whether this transformers' ContinuousBatchingManager takes max_new_tokens per add_request()."""
    if getattr(model, "continuous_batching_context_manager", None) is None:
        return False
    try:
        from transformers.generation.continuous_batching import ContinuousBatchingManager
    except ImportError:
        return False
    return "max_new_tokens" in inspect.signature(ContinuousBatchingManager.add_request).parameters


def stock_route(model) -> str:
    return ("ContinuousBatchingManager, max_new_tokens per request" if stock_per_request_max_tokens(model)
            else "generate_batch per distinct max_tokens, one after another")


def call_stock_per_request(model, prompts: list[list[int]], max_tokens: list[int]) -> Callable[[], CallOutput]:
    """Stock continuous batching with each request's own max_new_tokens.

    transformers' ContinuousBatchingManager takes max_new_tokens per add_request(); the manager (and its warm-up)
    is set up before the clock starts, as our server's start-up is not in its figure either. Without per-request
    max_new_tokens in this transformers, one stock generate_batch() per distinct count, one after another.
    """

    def via_manager() -> CallOutput:
        manager_cm = model.continuous_batching_context_manager
        params = inspect.signature(manager_cm).parameters
        wanted = {"generation_config": _generation_config(max(max_tokens)), "block": True, "timeout": 5,
                  "workload_hints": _workload_hints(prompts, max_tokens)}  # sized as generate_batch sizes it
        with manager_cm(**{k: v for k, v in wanted.items() if k in params and v is not None}) as manager:
            t0 = time.perf_counter()
            ids = [manager.add_request(p, request_id=f"w5_{i}", max_new_tokens=m)
                   for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
            pending = {rid for rid in ids if rid is not None}  # None: the manager refused the request
            results: dict[str, Any] = {}
            last_progress = time.perf_counter()
            while pending:
                res = manager.get_result(timeout=1)
                if res is not None and res.is_finished() and res.request_id in pending:
                    pending.discard(res.request_id)
                    results[res.request_id] = res
                    last_progress = time.perf_counter()
                elif res is None and (not manager.is_running() or time.perf_counter() - last_progress > 600):
                    break
            seconds = time.perf_counter() - t0
        tokens = [list(getattr(results.get(rid), "generated_tokens", None) or []) for rid in ids]
        return CallOutput(tokens, _count_problems(tokens, max_tokens), seconds)

    def via_groups() -> CallOutput:
        tokens: list[list[int]] = [[] for _ in prompts]
        problems: list[str] = []
        seconds = 0.0
        groups: dict[int, list[int]] = {}
        for i, m in enumerate(max_tokens):
            groups.setdefault(m, []).append(i)
        for m, idx in groups.items():
            t0 = time.perf_counter()
            out = call_generate_batch(model, [prompts[i] for i in idx], m)()
            seconds += time.perf_counter() - t0
            problems += out.problems
            for i, row in zip(idx, out.tokens, strict=False):
                tokens[i] = row
        return CallOutput(tokens, problems[:5], seconds)

    return via_manager if stock_per_request_max_tokens(model) else via_groups


def _workload_hints(prompts: list[list[int]], max_tokens: list[int]) -> Any:
    """transformers' WorkloadHints for these requests where it has them (as its generate_batch passes), else None."""
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return None
    try:
        return WorkloadHints(max_prompt_length=max(len(p) for p in prompts), max_generated_length=max(max_tokens),
                             num_requests=len(prompts))
    except TypeError:
        return None


def _count_problems(tokens: list[list[int]], max_tokens: list[int], max_problems: int = 5) -> list[str]:
    bad = [i for i, (t, m) in enumerate(zip(tokens, max_tokens, strict=True)) if len(t) != m]
    if not bad:
        return []
    return [f"{len(bad)} of {len(tokens)} requests without exactly their max_tokens (first: {bad[:max_problems]})"]


def _measure_calls(label: str, make_call: Callable[[int], Callable[[], CallOutput]], warmup_seeds: list[int],
                   run_seeds: list[int], device: torch.device, progress: Progress, tag: str) -> dict[str, Any]:
    """make_call(token seed) -> a call; warm-ups first, then the timed runs. Tokens/s from each call's own timing
    where it has one (the concurrent calls), else from the wall clock around it."""
    rec: dict[str, Any] = {"label": label, "valid": True, "reasons": [], "warmup_s": [], "run_s": [], "tokens": [],
                           "tokens_per_s": [], "median_tokens_per_s": None, "error": None,
                           "input_seeds": run_seeds, "warmup_input_seeds": warmup_seeds}
    first: list[list[int]] | None = None
    try:
        for seed in warmup_seeds:
            with progress.step(f"w5 {tag} warm-up"):
                secs, out = timed(make_call(seed), device)
            rec["warmup_s"].append(out.seconds if out.seconds is not None else secs)
            if out.problems:
                rec["reasons"].append("warm-up: " + "; ".join(out.problems))
        for r, seed in enumerate(run_seeds):
            with progress.step(f"w5 {tag} run {r + 1}/{len(run_seeds)}"):
                secs, out = timed(make_call(seed), device)
            record_run(rec, r, secs, out)
            if first is None:
                first = out.tokens
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["traceback"] = traceback.format_exc()
        rec["reasons"].append(rec["error"])
        progress.write(f"[w5 {tag}] failed: {rec['error']}")
    if rec["reasons"] or len(rec["run_s"]) < len(run_seeds):
        rec["valid"] = False
    rec["median_tokens_per_s"] = statistics.median(rec["tokens_per_s"]) if rec["valid"] and run_seeds else None
    rec["first_run_tokens"] = first
    return rec


# ---------------------------------------------------------------------------------------------- the workload
def w5_spec(args: argparse.Namespace) -> ServingSpec:
    spec = SERVING_SCALES[args.scale]
    if args.w5_requests:
        spec = dataclasses.replace(spec, num_requests=args.w5_requests)
    return dataclasses.replace(spec, rates=parse_rates(args.w5_rates))


def w5_repeats(args: argparse.Namespace) -> int:
    return args.w5_repeats if args.w5_repeats is not None else args.repeats


def w5_calls(args: argparse.Namespace, spec: ServingSpec, stock: bool) -> int:
    """Progress-bar steps W5 will take."""
    reps = w5_repeats(args)
    steps = 1 + args.warmup + reps * len(spec.rates) + args.warmup + reps  # server start, load runs, offline
    if stock and args.w5_stock_requests > 0:
        a_reps = args.anchor_repeats if args.anchor_repeats is not None else reps
        steps += (args.anchor_warmup if args.anchor_warmup is not None else args.warmup) + a_reps
    return steps


@dataclass
class _Requests:
    """W5's requests without their token ids (those depend on the run): lengths, max_tokens, vocabulary size."""

    lengths: list[int]
    max_tokens: list[int]
    vocab: int

    def prompts(self, seed: int, n: int | None = None) -> list[list[int]]:
        return random_prompts(self.lengths, seed, self.vocab)[:n]


def run_w5(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, stock: bool,
           progress: Progress) -> dict[str, Any]:
    """Server under load at each rate, then the offline twin (ours), then stock on a subset."""
    stock = stock and args.w5_stock_requests > 0
    spec = w5_spec(args)
    lengths, max_tokens = spec.draws()
    opts, dropped = server_accel_options(args)
    head = headline_rate(spec.rates)
    out: dict[str, Any] = {
        "spec": {"num_requests": spec.num_requests, "prompt_len_range": list(spec.prompt_len_range),
                 "max_tokens_range": list(spec.max_tokens_range), "rates": [rate_key(r) for r in spec.rates],
                 "length_seed": W5_LENGTH_SEED, "arrival_seed": f"{W5_ARRIVAL_SEED} + rate index",
                 "token_seed": f"{WORKLOAD_SEED['w5']} + {W5_RATE_SEED_STRIDE} x rate index + run",
                 "warmup_token_seed": f"{WORKLOAD_SEED['w5'] + WARMUP_SEED_OFFSET} + i",
                 "expected_tokens": sum(max_tokens), "mean_prompt_len": sum(lengths) / len(lengths),
                 "stock_requests": min(args.w5_stock_requests, spec.num_requests) if stock else 0},
        "server": {"accel_options": opts, "not_forwarded": dropped}, "rates": {}, "offline": None, "stock": None,
        "headline_rate": rate_key(head), "server_vs_offline": None, "server_vs_offline_by_rate": {},
        "target_server_vs_offline": W5_TARGET_SERVER_VS_OFFLINE if args.scale == "full" else None,
        "agreement_with_offline": None, "valid": False, "reasons": [],
    }
    with tempfile.TemporaryDirectory(prefix="hf_accel_bench_w5_") as tmp:
        model_dir = os.path.join(tmp, "model")
        model = build_model(args.shape, args.model, dtype, device)
        reqs = _Requests(lengths, max_tokens, model.config.get_text_config().vocab_size)
        save_serving_model(model, model_dir)
        del model
        free_memory(device)
        server_tokens = _serve_under_load(args, out, spec, reqs, model_dir, tmp, opts, dtype, device, progress)
        offline_tokens = _offline_and_stock(args, out, spec, reqs, model_dir, opts, stock, dtype, device, progress)
        free_memory(device)
    finish_w5(out)
    out["agreement_with_offline"] = agreement(server_tokens, offline_tokens)
    return out


def _serve_under_load(args: argparse.Namespace, out: dict[str, Any], spec: ServingSpec, reqs: _Requests,
                      model_dir: str, tmp: str, opts: dict[str, Any], dtype: torch.dtype, device: torch.device,
                      progress: Progress) -> list[list[int]] | None:
    """Start the server, warm it up, load it at every rate, stop it; the headline rate's first-run tokens."""
    reps = w5_repeats(args)
    head_index = spec.rates.index(headline_rate(spec.rates))
    server_tokens = None
    port = _free_port()
    server = ServerProcess(server_argv(model_dir, port, dtype, device, opts), port, os.path.join(tmp, "serve.log"))
    out["server"]["argv"] = server.argv[1:]
    try:
        with progress.step("w5 server start"):
            server.start(args.w5_server_timeout)
        out["server"]["startup_s"] = server.startup_s
        for w in range(args.warmup):  # every request at once, token ids of their own
            with progress.step("w5 server warm-up"):
                summary, _ = run_load(server.base_url, reqs.prompts(warmup_seed(w)), reqs.max_tokens,
                                      [0.0] * spec.num_requests, args.w5_request_timeout)
            out["server"].setdefault("warmup", []).append(summary)
        for k, rate in enumerate(spec.rates):
            offsets = arrival_offsets(spec.num_requests, rate, W5_ARRIVAL_SEED + k)
            entry: dict[str, Any] = {"rate": rate, "runs": [], "valid": True, "reasons": [],
                                     "input_seeds": [token_seed(k, r) for r in range(reps)]}
            for r in range(reps):
                with progress.step(f"w5 {rate_key(rate)}/s run {r + 1}/{reps}"):
                    summary, got = run_load(server.base_url, reqs.prompts(token_seed(k, r)), reqs.max_tokens,
                                            offsets, args.w5_request_timeout)
                entry["runs"].append(summary)
                if summary["problems"]:
                    entry["valid"] = False
                    entry["reasons"].append(f"run {r + 1}: " + "; ".join(summary["problems"]))
                if k == head_index and r == 0:
                    server_tokens = got
            entry["median"] = _medians(entry["runs"]) if entry["valid"] else {m: None for m in _RUN_METRICS}
            out["rates"][rate_key(rate)] = entry
    except Exception as exc:
        out["server"]["error"] = f"{type(exc).__name__}: {exc}"
        out["reasons"].append(out["server"]["error"])
        progress.write(f"[w5 server] failed: {out['server']['error']}")
    finally:
        out["server"]["exit_code"] = server.stop()
        out["server"]["log_tail"] = server.log_tail()
    return server_tokens


def _offline_and_stock(args: argparse.Namespace, out: dict[str, Any], spec: ServingSpec, reqs: _Requests,
                       model_dir: str, opts: dict[str, Any], stock: bool, dtype: torch.dtype, device: torch.device,
                       progress: Progress) -> list[list[int]] | None:
    """The offline twin (the saved weights, the server's options, the headline rate's requests), then stock on
    the first --w5-stock-requests of them; the offline first-run tokens."""
    api = _api()
    reps = w5_repeats(args)
    head_index = spec.rates.index(headline_rate(spec.rates))
    label = "hf_accel generate_batch (offline, same requests)"
    offline_tokens = None
    try:
        model = build_model(None, model_dir, dtype, device)
    except Exception as exc:
        out["offline"] = {"label": label, "valid": False, "reasons": [f"{type(exc).__name__}: {exc}"],
                          "median_tokens_per_s": None, "traceback": traceback.format_exc()}
        return None
    try:
        api.accelerate_model(model, **opts)
        offline = _measure_calls(
            label, lambda seed: call_grouped_generate_batch(model, reqs.prompts(seed), reqs.max_tokens, device),
            [warmup_seed(w) for w in range(args.warmup)], [token_seed(head_index, r) for r in range(reps)],
            device, progress, "offline")
        offline["calls_per_run"] = len(set(reqs.max_tokens))
        offline_tokens = offline.pop("first_run_tokens", None)
    except Exception as exc:
        offline = {"label": label, "valid": False, "reasons": [f"{type(exc).__name__}: {exc}"],
                   "median_tokens_per_s": None, "traceback": traceback.format_exc()}
    with contextlib.suppress(Exception):
        api.restore(model)
    out["offline"] = offline
    free_memory(device)

    if stock:
        n = out["spec"]["stock_requests"]
        torch._dynamo.reset()
        route = stock_route(model)
        a_warm = args.anchor_warmup if args.anchor_warmup is not None else args.warmup
        a_reps = args.anchor_repeats if args.anchor_repeats is not None else reps
        rec = _measure_calls(  # the first n of the headline rate's requests, token ids included
            f"stock {route} ({n} requests)",
            lambda seed: call_stock_per_request(model, reqs.prompts(seed, n), reqs.max_tokens[:n]),
            [warmup_seed(w) for w in range(a_warm)], [token_seed(head_index, r) for r in range(a_reps)],
            device, progress, "stock")
        rec.pop("first_run_tokens", None)
        rec["route"] = route
        out["stock"] = rec
    return offline_tokens


def finish_w5(out: dict[str, Any]) -> None:
    """server_vs_offline per rate and at the headline rate; validity of ours (server runs and offline)."""
    offline = (out.get("offline") or {}).get("median_tokens_per_s")
    for key, entry in out["rates"].items():
        ours = entry["median"].get("tokens_per_s")
        out["server_vs_offline_by_rate"][key] = ours / offline if ours and offline else None
    out["server_vs_offline"] = out["server_vs_offline_by_rate"].get(out["headline_rate"])
    reasons = list(out["reasons"])
    reasons += [f"{k}/s: " + "; ".join(e["reasons"]) for k, e in out["rates"].items() if not e["valid"]]
    if len(out["rates"]) < len(out["spec"]["rates"]):
        reasons.append("not every rate was measured")
    if not (out.get("offline") or {}).get("valid"):
        reasons.append("offline: " + "; ".join((out.get("offline") or {}).get("reasons", ["not run"])))
    out["reasons"] = reasons
    out["valid"] = not reasons
