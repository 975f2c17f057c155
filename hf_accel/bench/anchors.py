"""Stock-transformers anchors: eager `generate()`, static cache + compile, `generate_batch()`.

Measured after `restore()`, in the same process and on the same inputs as ours, so a ratio compares like with like.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from .guard import agreement
from .workloads import Progress, WorkloadSpec, make_caller, measure_method

ANCHOR_NAMES = ("eager", "static", "generate_batch")


def anchor_warmup(args: argparse.Namespace, anchor: str) -> int:
    """Warm-up calls for an anchor: --anchor-warmup (default --warmup), but never 0 for "static", whose first call
    per batch shape is transformers' torch.compile (tens of seconds), not a generation speed."""
    n = args.anchor_warmup if args.anchor_warmup is not None else args.warmup
    return max(n, 1) if anchor == "static" else n


def anchors_for(spec: WorkloadSpec, anchors: list[str]) -> list[str]:
    """The anchors that share the workload's entry point. None for "threads": stock generate() has no batching
    across calls, so N threads would only run N batch-1 loops side by side (known slow, not worth the time)."""
    if spec.api == "threads":
        return []
    return [a for a in anchors if (a == "generate_batch") == (spec.api == "generate_batch")]


def anchor_calls(args: argparse.Namespace, specs: dict[str, WorkloadSpec], anchors: list[str]) -> int:
    """How many calls the anchors will make (for the progress bar)."""
    n_anchor_calls = 0
    for spec in specs.values():
        reps = args.anchor_repeats if args.anchor_repeats is not None else args.repeats
        n_anchor_calls += sum(anchor_warmup(args, a) + reps for a in anchors_for(spec, anchors))
    return n_anchor_calls


def measure_anchors(args: argparse.Namespace, report: dict[str, Any], specs: dict[str, WorkloadSpec],
                    anchors: list[str], model, vocab: int, device: torch.device, progress: Progress,
                    firsts: dict[tuple[str, str], list[list[int]] | None]) -> None:
    """Each anchor on each workload whose entry point it shares; `model` must be restored (stock) already."""
    if anchors:
        torch._dynamo.reset()  # a clean slate for transformers' own compile, as in a fresh process
    for w, spec in specs.items():
        for anchor in anchors_for(spec, anchors):
            caller = make_caller(spec, model, device, static=anchor == "static")
            rec, firsts[(w, anchor)] = measure_method(
                anchor, spec, caller, vocab, anchor_warmup(args, anchor),
                args.anchor_repeats if args.anchor_repeats is not None else args.repeats, device, progress)
            if anchor == "static":
                rec["compiled_by_transformers"] = device.type in ("cuda", "xpu")
                if not rec["compiled_by_transformers"]:
                    rec["label"] = f"stock generate (static cache; no compile on {device.type})"
            report["workloads"][w]["methods"][anchor] = rec
        if spec.api == "threads":
            report["workloads"][w]["agreement_with_stock"] = None  # no stock run to agree with
            continue
        stock = "generate_batch" if spec.api == "generate_batch" else "eager"
        report["workloads"][w]["agreement_with_stock"] = agreement(firsts.get((w, "ours")), firsts.get((w, stock)))
