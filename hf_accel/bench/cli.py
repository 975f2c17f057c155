"""`hf-accel bench` options and orchestration: which workloads run, in which order, and what the exit code is."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hf_accel.config import add_switch_arguments

from .anchors import ANCHOR_NAMES, anchor_calls, measure_anchors
from .environment import _api, _engine_info, _jsonable, accel_kwargs, environment, resolved_accel_config
from .guard import GUARD_SEED_BASE, guard_cases, run_guard
from .report import finalize, format_report, write_plot
from .serving import missing_serve_extra, parse_rates, run_w5, w5_calls, w5_spec
from .startup import _startup_child, run_startup
from .workloads import (
    METHOD_LABELS,
    QUANTIZATION_METHODS,
    SCALES,
    SHAPE_NAMES,
    TARGETS,
    TOKEN_HIGH,
    TOKEN_LOW,
    W3_LENGTH_SEED,
    WARMUP_SEED_OFFSET,
    WORKLOAD_NAMES,
    WORKLOAD_SEED,
    Progress,
    WorkloadSpec,
    build_model,
    decode_roofline_tokens_per_s,
    free_memory,
    kv_bytes_per_token,
    make_caller,
    measure_copy_bandwidth,
    measure_method,
    resolve_device,
    resolve_dtype,
    timed,
    weight_bytes,
)

CUDAGRAPH_MODES = ("none", "piecewise", "full", "full_decode_only", "full_and_piecewise")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer", "flash_attn")


# ---------------------------------------------------------------------------------------------- orchestration
def parse_list(value: str, allowed: Sequence[str], what: str, all_value: str | None = None,
               all_items: Sequence[str] | None = None) -> list[str]:
    """Comma list -> the allowed items it names, in `allowed` order; `all_value` means `all_items` (default all)."""
    items = [v.strip().lower() for v in value.split(",") if v.strip()]
    if all_value and all_value in items:
        return list(allowed if all_items is None else all_items)
    if items == ["none"]:
        return []
    bad = [v for v in items if v not in allowed]
    if bad:
        raise ValueError(f"unknown {what} {bad}; choose from {list(allowed)}")
    return [v for v in allowed if v in items]


def workload_specs(args: argparse.Namespace, names: Sequence[str]) -> dict[str, WorkloadSpec]:
    """The throughput workloads at the chosen scale; --threads sets how many callers the "threads" one has."""
    specs = {w: SCALES[args.scale][w] for w in names}
    if "threads" in specs and getattr(args, "threads", None):
        specs["threads"] = dataclasses.replace(specs["threads"], num_requests=args.threads)
    return specs


def run_throughput(args: argparse.Namespace, report: dict[str, Any], workloads: list[str], anchors: list[str],
                   device: torch.device, dtype: torch.dtype, progress: Progress) -> None:
    """Ours on every workload, the guard, restore, then the anchors on the same inputs."""
    api = _api()
    specs = workload_specs(args, workloads)
    build_s, model = timed(lambda: build_model(args.shape, args.model, dtype, device, args.quantization,
                                               tensor_parallel=args.tensor_parallel), device)
    text = model.config.get_text_config()
    vocab = text.vocab_size
    kwargs = accel_kwargs(args)
    wbytes, kvtok = weight_bytes(model), kv_bytes_per_token(model.config, dtype)
    report["model"].update(build_s=build_s, weight_bytes=wbytes, kv_bytes_per_token=kvtok,
                           quantization=args.quantization,
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
    measure_anchors(args, report, specs, anchors, model, vocab, device, progress, firsts)
    del model
    free_memory(device)


# ----------------------------------------------------------------------------------------------------- the CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `hf-accel bench` (WORKLOADS.md)."""
    g = parser.add_argument_group("what to run")
    g.add_argument("--workload", default="w1",
                   help="w1, w2, threads, w3, w5, startup, all (every one but w5, which starts a server), or a "
                        "comma list (default: w1)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--shape", choices=SHAPE_NAMES, default="tiny",
                     help="random-weight model shape from WORKLOADS.md (default: tiny)")
    src.add_argument("--model", default=None, metavar="ID_OR_PATH", help="a Hugging Face model id or local path")
    g.add_argument("--scale", choices=("auto", "full", "tiny"), default="auto",
                   help="workload sizes: full (WORKLOADS.md) or tiny (seconds on CPU); auto: tiny for tiny shapes")
    g.add_argument("--tensor-parallel", action="store_true",
                   help="run under torchrun: the model is sharded over the ranks with tp_plan='auto' (every rank "
                        "runs the same calls; rank 0 prints the report and writes the JSON)")
    g.add_argument("--quantization", choices=QUANTIZATION_METHODS, default="none",
                   help="quantize the model before measuring (ours and the stock anchors alike); torchao methods "
                        "in place, the others through a save and a load with transformers' quantization config")
    g.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    g.add_argument("--anchors", default="eager,static,generate_batch",
                   help="comma list of eager, static, generate_batch, or none (stock transformers, same process)")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the median is reported")
    g.add_argument("--warmup", type=int, default=1, help="warm-up calls before the timed runs")
    g.add_argument("--anchor-repeats", type=int, default=None, help="timed runs per anchor (default: --repeats)")
    g.add_argument("--anchor-warmup", type=int, default=None, help="warm-up calls per anchor (default: --warmup)")
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="threads workload: N threads, each one generate() on one W2-sized prompt, started together "
                        "(default: W2's batch size, 64 at full scale)")
    g.add_argument("--w5-rates", default="8,32,128,all", metavar="8,32,128,all",
                   help="w5: Poisson arrival rates in requests/s; 'all' sends every request at once")
    g.add_argument("--w5-requests", type=int, default=None, metavar="N",
                   help="w5: number of requests (default: 512 at full scale, 16 at tiny)")
    g.add_argument("--w5-repeats", type=int, default=None, metavar="N",
                   help="w5: timed runs per rate and offline (default: --repeats)")
    g.add_argument("--w5-stock-requests", type=int, default=64, metavar="N",
                   help="w5: the first N requests go through stock continuous batching (anchor generate_batch)")
    g.add_argument("--w5-server-timeout", type=float, default=1200,
                   help="w5: seconds allowed for `hf-accel serve` to load, accelerate and answer /health")
    g.add_argument("--w5-request-timeout", type=float, default=600,
                   help="w5: client timeout per request, seconds")
    g.add_argument("--startup-isolation", choices=("process", "inline"), default="process",
                   help="startup phases in fresh processes (honest cold/warm) or in this one")
    g.add_argument("--startup-timeout", type=int, default=1200, help="seconds allowed per startup process")

    a = parser.add_argument_group("accelerate_model options (unset: the library's defaults)")
    a.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    a.add_argument("--cudagraph-mode", choices=CUDAGRAPH_MODES, default=None)
    a.add_argument("--cudagraph-capture-sizes", default=None, metavar="1,2,4,8", help="comma list of batch sizes")
    a.add_argument("--piecewise-capture-sizes", default=None, metavar="1,2,4,8",
                   help="comma list of piecewise graph sizes beside full decode graphs (default: the capture sizes "
                        "thinned to 12.5 %% spacing); the old default for the A/B: 1,2,4,8,16,...,512 every 8")
    a.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    a.add_argument("--enforce-eager", action="store_true")
    a.add_argument("--block-size", type=int, default=None)
    a.add_argument("--num-kv-blocks", type=int, default=None)
    a.add_argument("--gpu-memory-utilization", type=float, default=None)
    a.add_argument("--max-num-seqs", type=int, default=None)
    a.add_argument("--max-num-batched-tokens", type=int, default=None)
    a.add_argument("--no-prefix-caching", action="store_true")
    add_switch_arguments(a)  # --[no-]pdl, --[no-]small-m-gemm, ... (config.CLI_SWITCHES)

    o = parser.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="PATH", help="write every raw figure here")
    o.add_argument("--plot", default=None, metavar="PATH", help="write a bar chart (needs matplotlib)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--startup-profile", default=None, metavar="DIR",
                   help="startup workload: profile each start's accelerate_model with cProfile into DIR "
                        "(startup-cold/warm.pstats and .txt; the timings then include the profiler's overhead)")

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
        workloads = parse_list(args.workload, WORKLOAD_NAMES, "workload", all_value="all",
                               all_items=[w for w in WORKLOAD_NAMES if w != "w5"])
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
    if args.threads is not None and args.threads < 1:
        print("hf-accel bench: --threads must be >= 1", file=sys.stderr)
        return 2
    if "w5" in workloads:
        problem = _w5_usage_problem(args)
        if problem:
            print(f"hf-accel bench: {problem}", file=sys.stderr)
            return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("hf-accel bench: --plot needs matplotlib, which is not installed "
                  "(pip install matplotlib, or pip install 'hf_accel[plot]'); nothing was run", file=sys.stderr)
            return 2
    rank = 0
    if args.tensor_parallel:
        problem = _tensor_parallel_setup(args, workloads)
        if problem:
            print(f"hf-accel bench: {problem}", file=sys.stderr)
            return 2
        import torch.distributed as dist

        rank = dist.get_rank()
        args.no_progress = args.no_progress or rank != 0
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    throughput = [w for w in workloads if w not in ("startup", "w5")]
    specs = workload_specs(args, throughput)
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
        "workloads": {}, "guard": None, "startup": None, "w5": None,
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
        if spec.api == "threads":
            report["workloads"][w].update(
                target_threads_vs_w2=targets.get("threads_vs_w2"), threads_vs_w2=None,
                anchors_note="stock anchors not measured: stock generate() has no batching across calls, so "
                             f"{spec.num_requests} threads would only run {spec.num_requests} batch-1 loops side "
                             "by side")

    n_anchor_calls = anchor_calls(args, specs, anchors)
    n_guard = 2 * (2 + ("w2" in specs) + ("w3" in specs) + ("threads" in specs)) if specs else 0
    total = ("startup" in workloads) * 2 + len(specs) * (args.warmup + args.repeats) + n_guard + n_anchor_calls
    if "w5" in workloads:
        total += w5_calls(args, w5_spec(args), "generate_batch" in anchors)
    progress = Progress(total, enabled=not args.no_progress)
    try:
        # startup first: the child processes then get the GPU to themselves
        if "startup" in workloads:
            report["startup"] = run_startup(args, device, resolve_dtype(args.dtype, device), progress)
        if specs:
            run_throughput(args, report, throughput, anchors, device, dtype, progress)
        # last: the server process wants the device to itself, and this process holds no model by now
        if "w5" in workloads:
            report["w5"] = run_w5(args, device, dtype, "generate_batch" in anchors, progress)
    finally:
        progress.close()
    finalize(report)
    ours_valid = all(e["methods"].get("ours", {}).get("valid", False) for e in report["workloads"].values())
    startup_valid = all((report["startup"] or {}).get(p, {}).get("valid", False) for p in ("cold", "warm")) \
        if report["startup"] else True
    w5_valid = report["w5"]["valid"] if report["w5"] else True
    report["valid"] = ours_valid and startup_valid and w5_valid

    if rank != 0:  # every rank measured the same calls; rank 0 reports them
        return 0 if report["valid"] else 1
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


def _tensor_parallel_setup(args: argparse.Namespace, workloads: list[str]) -> str | None:
    """Join the torchrun job (NCCL on GPUs, gloo on CPU) and pin this rank's GPU; or say why it cannot run."""
    import os

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return "--tensor-parallel runs under torchrun with at least 2 processes (torchrun --nproc-per-node N ...)"
    unsupported = [w for w in workloads if w in ("startup", "w5", "threads")]
    if unsupported:
        return f"--tensor-parallel does not run the {', '.join(unsupported)} workload(s)"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = torch.cuda.is_available() and (args.device is None or args.device.startswith("cuda"))
    if on_gpu:
        torch.cuda.set_device(local)
        args.device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if on_gpu else "gloo")
    return None


def _w5_usage_problem(args: argparse.Namespace) -> str | None:
    """Why the w5 options cannot run, or None."""
    missing = missing_serve_extra()
    if missing:
        return (f"w5 needs {', '.join(missing)} (pip install 'hf_accel[serve]' openai); nothing was run")
    try:
        rates = parse_rates(args.w5_rates)
    except ValueError as exc:
        return str(exc)
    if len(rates) > 5:  # token seeds of rate k run r are 4000 + 100 k + r, below the warm-up ones (4500 + i)
        return "--w5-rates: at most 5 rates per run"
    if args.w5_requests is not None and args.w5_requests < 1:
        return "--w5-requests must be >= 1"
    if args.w5_repeats is not None and not 1 <= args.w5_repeats < 100:
        return "--w5-repeats must be between 1 and 99"
    if args.w5_stock_requests < 0:
        return "--w5-stock-requests must be >= 0"
    return None


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (`python -m hf_accel.bench ...`); the CLI uses add_arguments + run."""
    parser = argparse.ArgumentParser(prog="hf-accel bench", description=_package_doc().split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _package_doc() -> str:
    """The package docstring (the description of `python -m hf_accel.bench --help`)."""
    return importlib.import_module(__package__).__doc__ or ""
