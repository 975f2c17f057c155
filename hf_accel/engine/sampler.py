"""Batched sampling with per-request parameters, in the order stock transformers applies its processors.

Order: repetition penalty, min_new_tokens (EOS masked), then for sampling rows temperature, top-k, top-p, min-p.
Each step reproduces transformers' own processor arithmetic (same float32 operations, same thresholds), so the
processed scores are bit-identical to stock on CPU. On CUDA stock divides by a Python-float temperature or penalty
through a multiplication by its float32 reciprocal; we do the same there. Greedy rows take the argmax of the processed
scores, which is exactly what `generate()` does.

Sampling: the exponential race. With E_i ~ Exp(1) independent, argmax_i p_i / E_i is token i with probability p_i
exactly (the minimum of independent Exp(p_i) variables E_i / p_i is the i-th one with probability p_i / sum p).
The noise comes from a counter-based generator: a splitmix64 stream (64-bit finalizer `_mix`, logical shifts emulated
on torch.int64) keyed in stages by the request's seed, its step (tokens generated so far, pending ones included) and
the vocabulary index, i.e. u[seed, step, i] = hash(hash(hash(seed) + G*(step+1)) + G*(i+1)). Why this instead of
a torch.Generator (Philox) per request:
- batch-composition independence: a request's noise is a pure function of (seed, step, token id), so it draws the
  same tokens alone or in any batch, at any row, after preemption and recompute, with chunked prefill, and with
  asynchronous steps (the step index is known before the previous token is read back); a stateful generator would
  have to be advanced exactly once per draw and checkpointed across preemption.
- one batched computation (a handful of elementwise int64 kernels over [rows, V]) for all sampling rows, each with
  its own seed and step, instead of a Python loop with one `torch.multinomial(..., generator=g)` launch per row;
  no generator state to keep per request or move between devices, and the same integers on CPU and CUDA
  (two's-complement int64 arithmetic wraps identically).
- `torch.manual_seed(s)` before generate() reproduces the call: generate() takes each request's seed from the global
  RNG.

Resolution: u = (2k + 1) * 2^-41 from the 40 high bits k of the hash, rounded once to float32 and capped at
1 - 2^-24 (the largest float32 below 1), so u lies strictly inside (0, 1), in steps of 2^-41 near 0 and of float32's
2^-24 near 1. The race uses E = -log1p(-u), so a small E (which is how a rare token wins) comes from a small u, where
the grid is fine: E carries a relative error of about 2^-24 (rounding of u, log1p and the ratio) for every E up to a
few units; only large E (u near 1: relative error 2^-25 * e^E / E) and the cap E <= 24 ln 2 are coarser, and they
rarely decide a draw. Bias bound: a relative perturbation e of the E_i changes the winner only when the two smallest
E_i / p_i lie within a factor 1 + e of each other, which has probability <= e (the smallest is Exp(1), the gap above
it Exp(1 - p_win)); integrated over the smallest ratio this gives a total variation distance to exact sampling from
the float32 probabilities of a few 2^-24 (under 1e-6), whatever the vocabulary size; tokens with p below about 2^-40
feel the 2^-41 grid, at most V * 2^-41 of mass. A plain 24-bit uniform with E = -log(u) would put the coarse grid at
small E and under-sample every token with p below about 2^-24 (up to V * 2^-24 of mass, about 1% at V = 150k). The
float32 softmax itself (relative error ~1e-7 per probability) is the same as stock transformers'.
"""

from __future__ import annotations

import torch

from hf_accel.engine.request import Request

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64 (splitmix64's increment, odd)
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9 (splitmix64 / Stafford mix13 multipliers)
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_U_MAX = 1.0 - 2.0**-24  # the largest float32 below 1


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: it copies the sign bit)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's 64-bit finalizer (Stafford mix13): a bijection of int64 with full avalanche."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def _keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One 64-bit stream key per (seed, step): the step-th splitmix64 output of the stream seeded by hash(seed)."""
    return _mix(_mix(seeds.to(torch.int64)) + (steps.to(torch.int64) + 1) * _GOLDEN)


def _hash64(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64 `[N, vocab]`: outputs 1..vocab of the splitmix64 stream keyed by (seed, step) of each row."""
    keys = _keys(seeds, steps)
    idx = torch.arange(1, vocab + 1, device=keys.device, dtype=torch.int64) * _GOLDEN
    return _mix(keys[:, None] + idx[None, :])


def _uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 uniform noise `[N, vocab]` strictly inside (0, 1), a pure function of (seed, step, token id).

    u = (2k + 1) * 2^-41 from the 40 high bits k of the hash (one rounding to float32, exact scaling), capped at
    1 - 2^-24. Bit-identical on CPU and CUDA.
    """
    k = _shr(_hash64(seeds, steps, vocab), 24)  # 40 high bits, as a non-negative int64
    return ((2 * k + 1).to(torch.float32) * 2.0**-41).clamp_(max=_U_MAX)


def _exponential(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise `[N, vocab]`, finite and > 0, fine-grained where it is small (see the module docstring)."""
    return torch.log1p(-_uniform(seeds, steps, vocab)).neg_()


def _as_int64(seed: int) -> int:
    """Any Python int as the int64 with the same low 64 bits (seeds are hashed; only their bits matter)."""
    return ((int(seed) + 2**63) % 2**64) - 2**63


def _divide(scores: torch.Tensor, divisors: list[float]) -> torch.Tensor:
    """scores / d per row, rounded as stock's `scores / python_float` is on this device.

    CPU divides in float32 by float32(d); CUDA multiplies by the float32 reciprocal of float32(d) (ATen's
    div_true_kernel_cuda does that for a CPU scalar divisor), which can differ from the quotient by one ulp.
    """
    d = torch.tensor(divisors, dtype=torch.float32)
    if scores.is_cuda:
        return scores * d.reciprocal().to(device=scores.device, dtype=scores.dtype)[:, None]
    return scores / d.to(device=scores.device, dtype=scores.dtype)[:, None]


def apply_repetition_penalty(scores: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    penalties = [r.sampling.repetition_penalty for r in reqs]
    if all(p == 1.0 for p in penalties):
        return scores
    rows, cols = [], []
    for i, r in enumerate(reqs):
        if penalties[i] != 1.0:
            ids = set(r.all_token_ids) | set(r.extra_penalty_tokens)
            rows.extend([i] * len(ids))
            cols.extend(ids)
    device = scores.device
    seen = torch.zeros_like(scores, dtype=torch.bool)
    seen[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = True
    p = torch.tensor(penalties, device=device, dtype=scores.dtype)[:, None]
    penalized = torch.where(scores < 0, scores * p, _divide(scores, penalties))
    return torch.where(seen, penalized, scores)


def apply_min_new_tokens(scores: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    rows, cols = [], []
    for i, r in enumerate(reqs):
        if r.num_generated < r.sampling.min_new_tokens:
            for e in r.eos_token_ids:
                rows.append(i)
                cols.append(e)
    if rows:
        scores = scores.clone()
        scores[torch.tensor(rows, device=scores.device), torch.tensor(cols, device=scores.device)] = float("-inf")
    return scores


def apply_warpers(scores: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p for sampling rows (greedy rows get neutral values).

    Each mirrors its transformers warper's arithmetic: TemperatureLogitsWarper (`scores / t`), TopKLogitsWarper
    (drop scores below the k-th largest), TopPLogitsWarper (ascending sort, float32 softmax cumsum compared with
    float32(1 - top_p) where 1 - top_p is computed in double as Python does, the largest token always kept),
    MinPLogitsWarper (drop probs < float32(min_p) * max prob; the top token always survives that test).
    """
    device = scores.device
    sp = [r.sampling for r in reqs]
    temps = [s.temperature if s.do_sample else 1.0 for s in sp]
    if any(t != 1.0 for t in temps):
        scores = _divide(scores, temps)
    top_k = [min(s.top_k, scores.shape[-1]) if s.do_sample and s.top_k > 0 else 0 for s in sp]
    top_p = [s.top_p if s.do_sample else 1.0 for s in sp]
    min_p = [s.min_p if s.do_sample else 0.0 for s in sp]
    neg_inf = float("-inf")
    if any(k > 0 for k in top_k):
        k = torch.tensor(top_k, device=device)
        kth = torch.topk(scores, max(top_k), dim=-1).values.gather(1, (k.clamp(min=1) - 1)[:, None])
        remove = (scores < kth) & (k > 0)[:, None]
        scores = scores.masked_fill(remove, neg_inf)
    if any(p < 1.0 for p in top_p):
        use = torch.tensor([p < 1.0 for p in top_p], device=device)
        threshold = torch.tensor([1 - p for p in top_p], device=device, dtype=scores.dtype)  # 1 - p in double
        sorted_asc, idx = torch.sort(scores, dim=-1)
        cum = sorted_asc.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= threshold[:, None]
        remove_sorted[:, -1] = False  # keep at least one token
        remove = remove_sorted.scatter(1, idx, remove_sorted)
        scores = scores.masked_fill(remove & use[:, None], neg_inf)
    if any(m > 0.0 for m in min_p):
        m = torch.tensor(min_p, device=device, dtype=scores.dtype)
        probs = scores.softmax(dim=-1)
        top = probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill((probs < m[:, None] * top) & (m > 0)[:, None], neg_inf)
    return scores


class Sampler:
    """Batched sampling for one step's rows. A request's own logits hook (transformers processors) that raises does
    not stop the step: its error is kept in `hook_errors` for the engine loop, which fails that request's call."""

    def __init__(self) -> None:
        self.hook_errors: list[tuple[Request, BaseException]] = []
        # rows of the last call whose distribution was not one (see __call__); None when no row sampled
        self.invalid: torch.Tensor | None = None

    def _run_hook(self, req: Request, logits: torch.Tensor) -> torch.Tensor:
        try:
            out = req.logits_hook(req, logits)
            if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
                # processors run once per row here (README): one that returns another shape (state kept for the
                # whole batch, a narrowed vocabulary) would otherwise broadcast or crash far from its cause
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(
                    f"a logits processor returned scores of shape {shape} for scores of shape {tuple(logits.shape)}; "
                    "under hf_accel each processor is called once per row with [1, vocab] scores and must return "
                    "that shape (a processor that keeps per-batch state cannot run per row: call restore(model) "
                    "to use it with stock generate())")
            return out[0]
        except BaseException as exc:  # noqa: BLE001 - the call's own error (even KeyboardInterrupt): its call fails
            self.hook_errors.append((req, exc))
            return logits[0]

    def __call__(self, logits: torch.Tensor, reqs: list[Request],
                 greedy: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits `[N, V]` for the requests that sample this step -> (token ids `[N]`, scores `[N, V]` float32).

        `greedy`: `logits.argmax(dim=-1)` computed already (the end of a full decode graph, ops/greedy.py), taken
        as the tokens when every row is plain greedy.

        Scores are the processed logits that stock `generate()` reports as `scores`. Plain greedy steps take the
        argmax of the logits as they come (exact in any dtype) and skip the float32 copy unless a request keeps
        its scores or logits.

        A sampling row whose probabilities are not a distribution (a NaN or +inf score, or every score -inf: NaN
        after the softmax) is where stock's `torch.multinomial` raises. Its token stays a valid id (a step may
        already feed it to the next forward) and `self.invalid` (bool `[N]`, on the device) marks it; the engine
        reads it back with the tokens and fails that request's call with stock's error.
        """
        self.invalid = None
        plain = all(
            r.sampling.is_greedy and r.sampling.repetition_penalty == 1.0 and r.logits_hook is None
            and r.num_generated >= r.sampling.min_new_tokens
            for r in reqs
        )
        if plain:  # argmax is exact in any dtype: the float32 copy only where scores or logits are kept
            if any(r.want_scores or r.want_logits for r in reqs):
                logits = logits.float()
            return (greedy if greedy is not None else logits.argmax(dim=-1)), logits
        logits = logits.float()
        hooked = [i for i, r in enumerate(reqs) if r.logits_hook is not None]
        fast = [i for i, r in enumerate(reqs) if r.logits_hook is None]
        scores = logits
        if fast:
            sub = [reqs[i] for i in fast]
            part = logits if len(fast) == len(reqs) else logits[fast]
            part = apply_warpers(apply_min_new_tokens(apply_repetition_penalty(part, sub), sub), sub)
            scores = part if len(fast) == len(reqs) else scores.index_copy(
                0, torch.tensor(fast, device=logits.device), part)
        if hooked:
            scores = scores.clone() if scores is logits else scores
            for i in hooked:  # slow path: the request's own transformers logits processors
                scores[i] = self._run_hook(reqs[i], logits[i : i + 1])
        tokens = scores.argmax(dim=-1)
        sampling_rows = [i for i, r in enumerate(reqs) if r.sampling.do_sample]
        if sampling_rows:
            device = logits.device
            all_rows = len(sampling_rows) == len(reqs)
            rows = None if all_rows else torch.tensor(sampling_rows, device=device)
            sub_scores = scores if all_rows else scores[rows]
            seeds = torch.tensor([_as_int64(reqs[i].sampling.seed) for i in sampling_rows], dtype=torch.int64)
            steps = torch.tensor([reqs[i].num_generated for i in sampling_rows], dtype=torch.int64)
            # the exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i
            noise = _exponential(seeds.to(device), steps.to(device), scores.shape[-1])
            probs = sub_scores.softmax(dim=-1)
            drawn = (probs / noise).argmax(dim=-1)
            invalid = probs.isnan().any(dim=-1)  # the softmax of finite scores, not all -inf, has no NaN
            if all_rows:
                tokens, self.invalid = drawn, invalid
            else:
                tokens[rows] = drawn
                self.invalid = torch.zeros(len(reqs), dtype=torch.bool, device=device)
                self.invalid[rows] = invalid
        return tokens, scores
