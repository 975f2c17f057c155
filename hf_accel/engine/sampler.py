"""Batched sampling with per-request parameters, in the order stock transformers applies its processors.

Order: repetition penalty, min_new_tokens (EOS masked), then for sampling rows temperature, top-k, top-p, min-p.
Greedy rows take the argmax of the processed scores, which is exactly what `generate()` does. Sampling uses a
counter-based RNG (a hash of the request's seed, its step and the vocabulary index) and the exponential-race trick,
so a request draws the same tokens whatever batch it lands in, preemption and chunking included, and
`torch.manual_seed(s)` before a generate() call makes the whole call reproducible.
"""

from __future__ import annotations

import torch

from hf_accel.engine.request import Request

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) noise `[N, vocab]` from splitmix64 over (seed, step, token id); deterministic on any device."""
    base = seeds * _GOLDEN + steps * 1000003
    z = base[:, None] * 40503 + torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    z = z + _GOLDEN
    z = (z ^ (z >> 30)) * _MIX1
    z = (z ^ (z >> 27)) * _MIX2
    z = z ^ (z >> 31)
    return (((z >> 40) & 0xFFFFFF).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


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
    penalized = torch.where(scores < 0, scores * p, scores / p)
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
    """Temperature, top-k, top-p, min-p for sampling rows (greedy rows get neutral values)."""
    device = scores.device
    sp = [r.sampling for r in reqs]
    temps = [s.temperature if s.do_sample else 1.0 for s in sp]
    if any(t != 1.0 for t in temps):
        scores = scores / torch.tensor(temps, device=device, dtype=scores.dtype)[:, None]
    top_k = [min(s.top_k, scores.shape[-1]) if s.do_sample and s.top_k > 0 else 0 for s in sp]
    top_p = [s.top_p if s.do_sample else 1.0 for s in sp]
    min_p = [s.min_p if s.do_sample else 0.0 for s in sp]
    neg_inf = float("-inf")
    if any(k > 0 for k in top_k):
        k = torch.tensor(top_k, device=device)
        sorted_desc = torch.sort(scores, dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k.clamp(min=1) - 1)[:, None])
        remove = (scores < kth) & (k > 0)[:, None]
        scores = scores.masked_fill(remove, neg_inf)
    if any(p < 1.0 for p in top_p):
        p = torch.tensor(top_p, device=device, dtype=scores.dtype)
        sorted_asc, idx = torch.sort(scores, dim=-1)
        cum = sorted_asc.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - p)[:, None]
        remove_sorted[:, -1] = False  # keep at least one token
        remove = torch.zeros_like(remove_sorted).scatter(1, idx, remove_sorted)
        scores = scores.masked_fill(remove & (p < 1.0)[:, None], neg_inf)
    if any(m > 0.0 for m in min_p):
        m = torch.tensor(min_p, device=device, dtype=scores.dtype)
        probs = scores.softmax(dim=-1)
        top = probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill((probs < m[:, None] * top) & (m > 0)[:, None], neg_inf)
    return scores


class Sampler:
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """logits `[N, V]` for the requests that sample this step -> (token ids `[N]`, scores `[N, V]` float32).

        Scores are the processed logits that stock `generate()` reports as `scores`. Plain greedy steps take the
        argmax of the logits as they come (exact in any dtype) and skip the float32 copy unless a request keeps
        its scores or logits.
        """
        plain = all(
            r.sampling.is_greedy and r.sampling.repetition_penalty == 1.0 and r.logits_hook is None
            and r.num_generated >= r.sampling.min_new_tokens
            for r in reqs
        )
        if plain:  # argmax is exact in any dtype: the float32 copy only where scores or logits are kept
            if any(r.want_scores or r.want_logits for r in reqs):
                logits = logits.float()
            return logits.argmax(dim=-1), logits
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
                scores[i] = reqs[i].logits_hook(reqs[i], logits[i : i + 1])[0]
        tokens = scores.argmax(dim=-1)
        sampling_rows = [i for i, r in enumerate(reqs) if r.sampling.do_sample]
        if sampling_rows:
            rows = torch.tensor(sampling_rows, device=logits.device)
            sub_scores = scores[rows]
            seeds = torch.tensor([reqs[i].sampling.seed for i in sampling_rows], device=logits.device)
            steps = torch.tensor([reqs[i].num_generated for i in sampling_rows], device=logits.device)
            probs = sub_scores.softmax(dim=-1)
            noise = -torch.log(_uniform(seeds, steps, scores.shape[-1]))
            tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens, scores
