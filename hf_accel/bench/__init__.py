"""`hf-accel bench`: the workloads of WORKLOADS.md (W1, W2, threads, W3, W5 serving, startup).

Order inside one process: build the model (random weights from a config, or --model), measure ours, run the
correctness guard (our greedy tokens against the eager torch backend), restore() the model, then measure the
stock-transformers anchors on the same inputs. A speed figure is only a result when the guard passed and every
request produced exactly its token count; otherwise it is marked INVALID (table) and ``"valid": false`` (JSON).

Inputs: token ids uniform in [10, min(10000, vocab)); W3 prompt lengths from ``random.Random(0)``. Each call
(warm-up or timed repeat) gets its own token ids (seeded by the call), the same ones for ours and each anchor,
so that a repeat cannot profit from the prefix cache filled by the previous one.

The threads workload runs W2-sized requests as one generate() per thread; W5 runs last, against `hf-accel serve` in
its own process, then the same requests offline in this one (see ``serving``).

Modules: ``workloads`` (shapes, inputs, the timed calls), ``anchors`` (stock transformers), ``guard`` (token
agreement), ``report`` (ratios, table, plot), ``startup``, ``serving`` (W5), ``cli`` (options and orchestration).
The names below are re-exported so that ``from hf_accel import bench; bench.add_arguments(...); bench.run(...)``
keeps working.
"""

from __future__ import annotations

from .anchors import ANCHOR_NAMES, anchor_calls, anchor_warmup, anchors_for, measure_anchors
from .cli import (
                  ATTENTION_BACKENDS,
                  CUDAGRAPH_MODES,
                  add_arguments,
                  main,
                  parse_list,
                  run,
                  run_throughput,
                  workload_specs,
)
from .environment import accel_kwargs, environment, library_versions, resolved_accel_config
from .guard import (
                  GUARD_NEW_TOKENS,
                  GUARD_TIE_CAP,
                  GUARD_TIE_ULPS,
                  GuardCase,
                  agreement,
                  compare_guard,
                  guard_cases,
                  judge_near_ties,
                  reference_margins,
                  run_guard,
                  run_guard_cases,
                  stock_self_noise,
                  tie_margin_for,
                  within_stock_spread,
)
from .report import finalize, format_report, format_w5, write_plot
from .serving import SERVING_SCALES, ServingSpec, run_w5
from .startup import measure_startup_once, run_startup
from .workloads import (
                  GIB,
                  GUARD_SEED_BASE,
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
                  CallOutput,
                  Progress,
                  WorkloadSpec,
                  build_model,
                  call_generate,
                  call_generate_batch,
                  call_threads,
                  decode_roofline_tokens_per_s,
                  disable_eos,
                  free_memory,
                  kv_bytes_per_token,
                  left_pad,
                  make_caller,
                  measure_copy_bandwidth,
                  measure_method,
                  random_prompts,
                  resolve_device,
                  resolve_dtype,
                  shape_config,
                  synchronize,
                  timed,
                  token_high,
                  weight_bytes,
)

__all__ = [
    "ANCHOR_NAMES", "ATTENTION_BACKENDS", "CUDAGRAPH_MODES", "GIB", "GUARD_NEW_TOKENS", "GUARD_SEED_BASE",
    "GUARD_TIE_CAP", "GUARD_TIE_ULPS", "METHOD_LABELS", "QUANTIZATION_METHODS", "SCALES", "SERVING_SCALES",
    "SHAPE_NAMES", "TARGETS",
    "TOKEN_HIGH", "TOKEN_LOW", "W3_LENGTH_SEED", "WARMUP_SEED_OFFSET", "WORKLOAD_NAMES", "WORKLOAD_SEED", "CallOutput",
    "GuardCase", "Progress", "ServingSpec", "WorkloadSpec", "accel_kwargs", "add_arguments", "agreement",
    "anchor_calls", "anchor_warmup", "anchors_for", "build_model", "call_generate", "call_generate_batch",
    "call_threads", "compare_guard", "decode_roofline_tokens_per_s", "disable_eos", "environment", "finalize",
    "format_report", "format_w5", "free_memory", "guard_cases", "judge_near_ties", "kv_bytes_per_token", "left_pad",
    "library_versions", "main", "make_caller", "measure_anchors", "measure_copy_bandwidth", "measure_method",
    "measure_startup_once", "parse_list", "random_prompts", "reference_margins", "resolve_device", "resolve_dtype",
    "resolved_accel_config", "run", "run_guard", "run_guard_cases", "run_startup", "run_throughput", "run_w5",
    "shape_config", "stock_self_noise", "synchronize", "tie_margin_for", "timed", "token_high", "weight_bytes",
    "within_stock_spread", "workload_specs", "write_plot",
]
