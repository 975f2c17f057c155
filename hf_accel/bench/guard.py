"""The correctness guard: our greedy tokens against the eager torch backend, with rounding near-ties judged by
stock transformers teacher-forced on our tokens. A speed figure of ours only counts when the guard passed.

A near-tie is a lead of at most a few units in the last place of the model's dtype. Methods that quantize the
activations (torchao float8 dynamic: e4m3 keeps 3 mantissa bits, per-tensor scales shared by every token of a
forward) are noisier than that on their own: stock transformers' generate() and its own teacher-forced scoring of
the same tokens already disagree by more. Where a divergent row exceeds the dtype's margin, the guard judges stock's
own greedy tokens for the same rows the same way and accepts a row of ours only if it strays beyond the margin no
more often and by no more than stock's do (`stock_self_noise`, `within_stock_spread`). For bf16 and weight-only
models stock's own tokens stay within the margin, so the rule stays as strict as before.
"""

from __future__ import annotations

import contextlib
import math
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from .environment import _api
from .workloads import (
    GUARD_SEED_BASE,
    SCALES,
    Progress,
    WorkloadSpec,
    call_generate,
    call_generate_batch,
    call_threads,
    free_memory,
    left_pad,
    random_prompts,
)

# a divergence from the reference is a rounding near-tie (accepted, counted) when the reference's top-1 logit leads
# the token we chose by at most GUARD_TIE_ULPS units in the last place of the top logit in the model's dtype:
# kernels that sum in another order (fused vs eager, split-KV vs not) flip such ties in low precision
GUARD_TIE_ULPS = 16
GUARD_TIE_CAP = 0.5  # logits
GUARD_NEW_TOKENS = {"full": 32, "tiny": 8}


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
    if "threads" in specs:  # ours: one generate() per thread; the reference: one batched call of the same prompts
        th = specs["threads"]
        cases.append(GuardCase(f"threads{th.num_requests}", "threads",
                               random_prompts(th.prompt_lengths(), GUARD_SEED_BASE + 4, vocab_size), n))
    return cases


def run_guard_cases(model, cases: list[GuardCase], device: torch.device, progress: Progress,
                    tag: str, threads_as_one_call: bool = False) -> dict[str, list[list[int]] | str]:
    """Tokens per case, or the error text when the call failed. `threads_as_one_call` (the reference) runs a
    "threads" case as one batched generate(), so ours is checked against what a single call gives."""
    outs: dict[str, list[list[int]] | str] = {}
    for case in cases:
        with progress.step(f"guard {tag} {case.name}"):
            try:
                if case.api == "generate_batch":
                    out = call_generate_batch(model, case.prompts, case.new_tokens)()
                elif case.api == "threads" and not threads_as_one_call:
                    out = call_threads(model, case.prompts, case.new_tokens, device)()
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
        all_checks = []
        for d, steps in zip(divs, per_row, strict=True):
            checks = [(s, lead, top, tie_margin_for(dtype, top) if math.isfinite(top) else 0.0)
                      for s, lead, top in steps]
            worst = max(checks, key=lambda c: c[1] - c[3])
            d["reference_lead"], d["reference_top"], d["tie_margin"] = checks[0][1], checks[0][2], checks[0][3]
            d["worst_step"], d["worst_lead"], d["worst_margin"] = worst[0], worst[1], worst[3]
            d["ok"] = all(lead <= margin for _, lead, _, margin in checks)
            all_checks.append(checks)
        if not all(d["ok"] for d in divs) and all(d["ours"] >= 0 for d in divs):
            # beyond the dtype's rounding: does stock, judged the same way, stray as often and as far by itself?
            try:
                own = stock_self_noise(model, case, [d["row"] for d in divs], device)
            except Exception as exc:
                entry["noise_error"] = f"{type(exc).__name__}: {exc}"
            else:
                ours_rows = [[(lead, margin) for _, lead, _, margin in checks] for checks in all_checks]
                spread = within_stock_spread(ours_rows, _stock_checks(own, dtype))
                spread["source"] = "decoding vs scoring"
                other = _other_attention(model)
                if other is not None:
                    # ours runs another attention kernel on every token, prompt included, and a model that
                    # quantizes its activations turns a last-bit change there into whole quantization steps: measure
                    # what a change of kernel does to stock's own tokens, and hold ours to the noisier of the two
                    # (a bf16 or weight-only model stays within its margin either way and keeps the strict rule)
                    try:
                        alt = within_stock_spread(ours_rows, _stock_checks(
                            stock_self_noise(model, case, [d["row"] for d in divs], device, attention=other), dtype))
                    except Exception as exc:
                        entry["kernel_noise_error"] = f"{type(exc).__name__}: {exc}"
                    else:
                        alt["source"] = f"{other} attention vs {model.config._attn_implementation}"
                        rate = lambda x: x["stock_beyond_margin"] / max(1, x["stock_steps"])  # noqa: E731
                        if rate(alt) > rate(spread):
                            spread = alt
                entry["stock_self_spread"] = spread
                entry["stock_self_noise"] = spread["stock_max_excess"]
                for d, within in zip(divs, spread["rows_within"], strict=True):
                    if not d["ok"] and within:
                        d["ok"] = d["within_stock_self_noise"] = True
        for d in divs:
            d.pop("ours_row", None)  # the tokens are in the record already; keep the JSON small
        entry["near_ties"] = len(divs)
        entry["ok"] = all(d["ok"] for d in divs)
    guard["passed"] = all(c["ok"] for c in guard["cases"].values())
    guard["near_ties"] = sum(c.get("near_ties", 0) for c in guard["cases"].values() if c["ok"])
    floors = [c["stock_self_noise"] for c in guard["cases"].values() if c["ok"] and "stock_self_noise" in c]
    if floors:
        guard["within_stock_self_noise"] = sum(bool(d.get("within_stock_self_noise"))
                                               for c in guard["cases"].values() if c["ok"]
                                               for d in c.get("divergences", []))
        guard["stock_self_noise"] = max(floors)
        guard["stock_self_noise_sources"] = sorted({c["stock_self_spread"].get("source", "") for c in
                                                    guard["cases"].values() if c["ok"] and "stock_self_spread" in c})
        guard["tie_rule"] += ("; where a row strays beyond that, no more often (two binomial standard deviations "
                              "and one step, besides the step where it parted) and by no more than stock's own greedy "
                              "tokens for the same rows, judged the same way")


def _stock_checks(own: list[list[tuple[int, float, float]]], dtype: torch.dtype) -> list[tuple[float, float]]:
    """(lead, margin) for every step of stock's own tokens (`stock_self_noise`)."""
    return [(lead, tie_margin_for(dtype, top) if math.isfinite(top) else math.nan)
            for steps in own for _, lead, top in steps]


def _other_attention(model) -> str | None:
    """Another of transformers' attention implementations for `model` (eager for sdpa and the rest, sdpa for eager),
    or None where the model cannot switch."""
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if current is None or not hasattr(model, "set_attn_implementation"):
        return None
    return "sdpa" if current == "eager" else "eager"


def _excess(lead: float, margin: float) -> float:
    """How far a lead passes its rounding margin (<= 0: within it); +inf where either is not finite (NaN logits)."""
    return lead - margin if math.isfinite(lead) and math.isfinite(margin) else math.inf


def within_stock_spread(ours_rows: list[list[tuple[float, float]]],
                        own: list[tuple[float, float]]) -> dict[str, Any]:
    """Per divergent row of ours (its (lead, margin) steps from where it parted): whether it strays from stock's top-1
    no more often and by no more than stock's own tokens do (`own`, every step of stock's greedy tokens for the same
    rows, judged the same way).

    - How far: no step of the row may pass its margin by more than stock's steps pass theirs (so with stock clean,
      nothing beyond the margin: the strict rule), and a non-finite lead never passes.
    - How often: the row's steps beyond their margin, the step where it parted left out (it is there because it
      was contested), may exceed stock's share by two binomial standard deviations plus one step. Judged per row,
      so a row that keeps choosing the runner-up fails however clean the others are.
    """
    own_excess = [_excess(lead, margin) for lead, margin in own]
    k_own = sum(1 for e in own_excess if e > 0)
    p = k_own / max(1, len(own))
    cap = max([0.0] + [e for e in own_excess if math.isfinite(e)])
    rows_within, n_total, k_total = [], 0, 0
    for steps in ours_rows:
        excess = [_excess(lead, margin) for lead, margin in steps]
        counted = excess[1:]
        n, k = len(counted), sum(1 for e in counted if e > 0)
        n_total, k_total = n_total + n, k_total + k
        allowed = n * p + 2.0 * math.sqrt(n * p * (1.0 - p)) + 1.0
        rows_within.append(k <= allowed and max(excess, default=0.0) <= cap)
    return {"ours_steps": n_total, "ours_beyond_margin": k_total, "stock_steps": len(own),
            "stock_beyond_margin": k_own, "stock_max_excess": cap, "rows_within": rows_within,
            "within": all(rows_within)}


def stock_self_noise(model, case: GuardCase, rows: list[int], device: torch.device,
                     attention: str | None = None) -> list[list[tuple[int, float, float]]]:
    """(step, lead, top) for every token stock's own greedy generate() produced for `rows` of `case`, scored by
    stock's own teacher-forced forward: how far stock transformers strays from itself between decoding (one token
    per step, KV cache) and scoring (one forward over the whole sequence) of the very same tokens. With
    `attention` (a transformers attention implementation: "eager", "sdpa"), stock decodes with that one and scores
    with its own: how far a mere change of attention kernel moves stock's tokens.

    In bf16 this is rounding-sized. With quantized activations it is not: a per-tensor scale is shared by every
    token of a forward, so the same token is rounded differently when decoded alone and when scored with the whole
    sequence, and the 3 mantissa bits of e4m3 turn that into logit moves of whole units over many layers. Our
    tokens cannot be judged more finely than stock judges its own. `model` is the stock (restored) model, with EOS
    off (as the bench runs it): tokens after an EOS would be padding, not choices.
    """
    own_attention = getattr(model.config, "_attn_implementation", None)
    switch = attention is not None and attention != own_attention
    if switch:
        model.set_attn_implementation(attention)
    try:
        out = call_generate(model, [case.prompts[r] for r in rows], case.new_tokens, device)()
    finally:
        if switch:
            model.set_attn_implementation(own_attention)
    if out.problems:
        raise RuntimeError("; ".join(out.problems))
    own = [{"row": r, "step": 0, "ours": toks[0], "ours_row": list(toks)}
           for r, toks in zip(rows, out.tokens, strict=True)]
    return reference_margins(model, case, own, device)


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
        ref_out = run_guard_cases(model, cases, device, progress, "reference", threads_as_one_call=True)
        guard = compare_guard(cases, ours_out, ref_out)
        api.restore(model)  # near-ties are judged by stock transformers itself
        judge_near_ties(guard, cases, model, device, next(model.parameters()).dtype)
    except Exception as exc:
        guard = {"passed": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    with contextlib.suppress(Exception):
        api.restore(model)
    free_memory(device)
    return guard


