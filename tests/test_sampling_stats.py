"""Sampling draws from the right distribution (issue 12): exact processors, chi-square on draws, sound noise.

(a) our batched processors give bit-identical scores to transformers' own LogitsProcessorList, per request;
(b) the Sampler's draws over tens of thousands of rows (distinct seeds) follow softmax(stock-processed scores);
(c) the counter-based noise is splitmix64, uniform strictly inside (0, 1), balanced and uncorrelated;
(d) end to end through generate(num_return_sequences=N) on a tiny float32 Llama, against the stock model's softmax.

Statistical tests are deterministic (fixed seeds) and use bounds 5 to 6 standard deviations wide, so they do not
flake; the broken generator (a "uniform" on (0, 0.5]) fails them with chi-square statistics in the thousands.
Run with `-s` to see the figures.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import PAD_ID, PROMPTS, assert_engine_idle, engine_steps, fresh_copy, make_llama, stock_processors

from hf_accel import accelerate_model
from hf_accel.engine import sampler as S
from hf_accel.engine.request import Request, SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
SP = SamplingParams
BASE_SEED = 0x2545F4914F6CDD1D  # any seed; generate() spaces a call's requests 7919 apart, so do we


# -- helpers -----------------------------------------------------------------------------------------------------------
def stock_scores(row: torch.Tensor, req: Request) -> torch.Tensor:
    """Stock-processed float32 scores of one request's logits row."""
    procs = stock_processors(req.sampling, req.num_prompt_tokens, tuple(sorted(req.eos_token_ids)), row.device)
    ids = torch.tensor([req.all_token_ids], device=row.device)
    return procs(ids, row.float()[None].clone())[0]


def our_scores(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    x = logits.float().clone()
    return S.apply_warpers(S.apply_min_new_tokens(S.apply_repetition_penalty(x, reqs), reqs), reqs)


def make_req(i: int, sp: SamplingParams, prompt=(5, 17, 42), output=(), eos=(), step: int = 0) -> Request:
    r = Request(request_id=i, prompt_token_ids=list(prompt), max_new_tokens=64, sampling=sp,
                eos_token_ids=frozenset(eos))
    r.output_token_ids = list(output)
    r.num_pending_tokens = step  # the sampler's step index is num_generated (pending tokens included)
    return r


def seeded(params: list[SamplingParams], n: int, step: int = 0, base: int = BASE_SEED) -> list[Request]:
    """n requests cycling through `params`, each with its own seed, spaced as generate() spaces them."""
    return [make_req(i, dataclasses.replace(params[i % len(params)], seed=base + 7919 * i), step=step)
            for i in range(n)]


def expected_probs(row: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """float64 softmax of the stock-processed scores (what torch.multinomial would sample from)."""
    return stock_scores(row.float().cpu(), make_req(0, sp)).double().softmax(-1)


def fit(counts: torch.Tensor, probs: torch.Tensor, label: str) -> tuple[float, float]:
    """Chi-square and total-variation distance of a token histogram against `probs`; asserts both bounds.

    Bins with expected count < 5 are pooled (the pool joins the smallest bin if it is itself < 5). The chi-square
    bound is its 5-sigma quantile (`chi2_quantile`); the TV bound is E[TV] + 6 sd with E[TV] <= 1/2 sum sqrt(p(1-p)/n)
    (Jensen) and sd <= 1/(2 sqrt(n)) (one draw moves TV by at most 1/n). Filtered tokens (p = 0) must never be drawn.
    """
    counts = counts.double().cpu()
    probs = probs.double().cpu()
    n = float(counts.sum())
    assert counts[probs == 0].sum() == 0, f"{label}: drew {int(counts[probs == 0].sum())} filtered-out tokens"
    exp = probs * n
    big = exp >= 5
    obs_b, exp_b = counts[big].tolist(), exp[big].tolist()
    rest_o, rest_e = float(counts[~big & (probs > 0)].sum()), float(exp[~big].sum())
    if rest_e >= 5 or not exp_b:
        obs_b.append(rest_o)
        exp_b.append(rest_e)
    elif rest_e > 0:
        j = min(range(len(exp_b)), key=exp_b.__getitem__)
        obs_b[j] += rest_o
        exp_b[j] += rest_e
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs_b, exp_b))
    dof = max(len(exp_b) - 1, 1)
    chi2_bound = chi2_quantile(dof)
    tv = 0.5 * float((counts / n - probs).abs().sum())
    tv_bound = 0.5 * float((probs * (1 - probs) / n).sqrt().sum()) + 3 / math.sqrt(n)
    print(f"\n  {label:<44} n={int(n):>6} bins={len(exp_b):>3} chi2={chi2:8.1f} (bound {chi2_bound:6.1f}) "
          f"TV={tv:.4f} (bound {tv_bound:.4f})")
    assert chi2 < chi2_bound, f"{label}: chi-square {chi2:.1f} over {dof} dof exceeds {chi2_bound:.1f}"
    assert tv < tv_bound, f"{label}: total variation {tv:.4f} exceeds {tv_bound:.4f}"
    return chi2, tv


def chi2_quantile(dof: int, z: float = 5.0) -> float:
    """Upper quantile of chi-square(dof) at a normal z-score (Wilson-Hilferty; z=5: tail ~3e-7, a little
    conservative for small dof; about dof + 5 sqrt(2 dof) for large dof). No scipy needed."""
    a = 2 / (9 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


def histogram(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.cpu(), minlength=vocab)


def corr(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().flatten(), y.double().flatten()
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / (x.norm() * y.norm()))


def logits_row(vocab: int = 200, scale: float = 1.5, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * scale


# -- (a) processors: bit-identical to transformers ---------------------------------------------------------------------
PROC_CASES = [
    SP(do_sample=True, temperature=0.7),
    SP(do_sample=True, temperature=1.3),
    SP(do_sample=True, top_k=1),
    SP(do_sample=True, top_k=5),
    SP(do_sample=True, top_k=50),
    SP(do_sample=True, top_k=10_000),  # larger than the vocabulary
    SP(do_sample=True, top_p=0.9),
    SP(do_sample=True, top_p=0.5),
    SP(do_sample=True, top_p=0.95),
    SP(do_sample=True, min_p=0.05),
    SP(do_sample=True, min_p=0.3),
    SP(do_sample=False, repetition_penalty=1.3),
    SP(do_sample=True, repetition_penalty=0.8),
    SP(do_sample=True, temperature=0.7, top_k=50, top_p=0.9),
    SP(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2),
    SP(do_sample=True, temperature=1.5, top_p=0.7, min_p=0.1, repetition_penalty=1.1, min_new_tokens=3),
    SP(do_sample=False, repetition_penalty=1.5, min_new_tokens=2),
]


def _proc_batch(params: list[SamplingParams], vocab: int, seed: int) -> tuple[torch.Tensor, list[Request]]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), vocab, generator=g) * 4
    logits[1::3] = (logits[1::3] * 2).round() / 2  # many exact ties (top-k / top-p / min-p boundaries)
    reqs = []
    for i, sp in enumerate(params):
        prompt = torch.randint(0, vocab, (12,), generator=g).tolist()
        output = torch.randint(0, vocab, (i % 4,), generator=g).tolist()
        reqs.append(make_req(i, sp, prompt=prompt, output=output, eos=(2, 7)))
    return logits, reqs


def _assert_matches_stock(logits: torch.Tensor, reqs: list[Request]) -> None:
    got = our_scores(logits, reqs)
    for i, r in enumerate(reqs):
        want = stock_scores(logits[i], r)
        assert torch.equal(got[i], want), (
            f"{r.sampling}: kept {int(torch.isfinite(got[i]).sum())} tokens (stock {int(torch.isfinite(want).sum())}),"
            f" max diff {float((got[i] - want).nan_to_num().abs().max()):.3g}")
        assert torch.equal(got[i].softmax(-1), want.softmax(-1))


@pytest.mark.parametrize("sp", PROC_CASES, ids=lambda sp: ",".join(
    f"{f.name}={getattr(sp, f.name)}" for f in dataclasses.fields(sp) if getattr(sp, f.name) != f.default))
def test_processors_equal_stock(sp):
    """One parameter set on 24 rows of random logits (ties included): scores bit-identical to stock."""
    logits, reqs = _proc_batch([sp] * 24, vocab=512, seed=PROC_CASES.index(sp))
    _assert_matches_stock(logits, reqs)


def test_processors_equal_stock_per_request_parameters():
    """Every parameter set, several times, shuffled into one batch: each row is processed with its own values."""
    params = PROC_CASES * 3
    perm = torch.randperm(len(params), generator=torch.Generator().manual_seed(3)).tolist()
    logits, reqs = _proc_batch([params[j] for j in perm], vocab=1000, seed=11)
    _assert_matches_stock(logits, reqs)


def test_top_p_threshold_is_stock_float32_of_double():
    """top_p values placed within a few ulps of the cumulative probabilities: the keep/drop decision at the edge
    follows stock (cumsum <= float32(1 - top_p computed in double)), not 1 - float32(top_p)."""
    logits = logits_row(64, 2.0, seed=5)
    cum = logits.sort().values.softmax(-1).cumsum(-1)
    params = []
    for c in cum[8:56:4].tolist():
        for d in range(-6, 7):
            p = 1.0 - c + d * 2.0**-27
            if 0.0 < p < 1.0:
                params.append(SP(do_sample=True, top_p=p))
    reqs = [make_req(i, sp) for i, sp in enumerate(params)]
    _assert_matches_stock(logits.expand(len(reqs), -1), reqs)


# -- (b) the Sampler's draws follow the processed distribution ---------------------------------------------------------
N_DRAWS = 40_000
SINGLE_CASES = {
    "temperature 1, top_k=0": SP(do_sample=True),
    "temperature 0.7": SP(do_sample=True, temperature=0.7),
    "temperature 1.8": SP(do_sample=True, temperature=1.8),
    "top_k=8": SP(do_sample=True, top_k=8),
    "top_p=0.8": SP(do_sample=True, top_p=0.8),
    "min_p=0.1": SP(do_sample=True, min_p=0.1),
    "t=0.8 top_k=40 top_p=0.9 min_p=0.02": SP(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, min_p=0.02),
    "t=1.2 top_p=0.95 rep=1.3": SP(do_sample=True, temperature=1.2, top_p=0.95, repetition_penalty=1.3),
}


def _draw(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    tokens, _ = S.Sampler()(logits.expand(len(reqs), -1).contiguous(), reqs)
    return tokens


@pytest.mark.parametrize("label", list(SINGLE_CASES))
def test_sampler_draws_match_processed_softmax(label):
    sp = SINGLE_CASES[label]
    row = logits_row()
    tokens = _draw(row, seeded([sp], N_DRAWS))
    fit(histogram(tokens, row.numel()), expected_probs(row, sp), f"sampler: {label}")


def test_sampler_draws_per_request_parameters_in_one_batch():
    """Four parameter sets interleaved row by row in one call: each group follows its own distribution."""
    params = [SP(do_sample=True, temperature=0.6), SP(do_sample=True, top_k=12, temperature=1.4),
              SP(do_sample=True, top_p=0.7), SP(do_sample=True, min_p=0.15, temperature=1.2)]
    row = logits_row()
    tokens = _draw(row, seeded(params, N_DRAWS))
    for g, sp in enumerate(params):
        fit(histogram(tokens[g :: len(params)], row.numel()), expected_probs(row, sp), f"sampler mixed batch #{g}")
    # a request draws the same token whatever batch it is in (here: alone, in a sub-batch, in reverse order)
    reqs = seeded(params, 64)
    alone = torch.stack([_draw(row, [r])[0] for r in reqs[:8]])
    assert torch.equal(alone, tokens[:8])
    assert torch.equal(_draw(row, reqs[::-1]).flip(0), tokens[:64])


def test_sampler_consecutive_steps_are_independent():
    """The same seeds at steps 0..3: each step's histogram fits, and the joint of two steps factorises."""
    sp = SP(do_sample=True, top_k=6)
    row = logits_row(200, 0.5, seed=7)  # flat enough that all 36 joint cells are well filled
    probs = expected_probs(row, sp)
    n = 20_000
    per_step = []
    for step in range(4):
        tokens = _draw(row, seeded([sp], n, step=step))
        fit(histogram(tokens, row.numel()), probs, f"sampler step {step}")
        per_step.append(tokens)
    kept = probs.nonzero().flatten()
    pos = torch.full((row.numel(),), -1, dtype=torch.long)
    pos[kept] = torch.arange(kept.numel())
    k = kept.numel()
    for step in range(3):
        joint = histogram(pos[per_step[step]] * k + pos[per_step[step + 1]], k * k)
        fit(joint, torch.outer(probs[kept], probs[kept]).flatten(), f"sampler joint of steps {step},{step + 1}")
    same = (per_step[0] == per_step[1]).double().mean().item()
    assert abs(same - float((probs**2).sum())) < 6 * math.sqrt(0.25 / n), "consecutive steps repeat tokens"


# -- (c) the noise source ----------------------------------------------------------------------------------------------
def _splitmix_mix(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def test_hash_is_splitmix64():
    """Known answer (splitmix64 seeded with 0 starts 0xE220A8397B1DCDAF) and a pure-Python reference of the
    staged counter: key = mix(mix(seed) + G*(step+1)), h[i] = mix(key + G*(i+1))."""
    assert S._mix(torch.tensor([GOLDEN - (1 << 64)])).item() % (1 << 64) == 0xE220A8397B1DCDAF
    seeds = [0, 1, -1, 12345, BASE_SEED, (1 << 63) - 1, -(1 << 63), 2**62 + 7919 * 3]
    steps = [0, 1, 2, 7, 100, 3, 0, 5]
    got = S._hash64(torch.tensor(seeds), torch.tensor(steps), 37)
    for r, (s, t) in enumerate(zip(seeds, steps)):
        key = _splitmix_mix((_splitmix_mix(s) + GOLDEN * (t + 1)) & M64)
        want = [_splitmix_mix(key + GOLDEN * (i + 1)) for i in range(37)]
        assert [v % (1 << 64) for v in got[r].tolist()] == want, f"row {r}"


def _noise(n_seeds: int = 4096, vocab: int = 256, step: int = 0, base: int = BASE_SEED) -> torch.Tensor:
    seeds = torch.tensor([base + 7919 * i for i in range(n_seeds)])
    return S._uniform(seeds, torch.full((n_seeds,), step), vocab)


def test_uniform_range_mean_and_histogram():
    u = _noise()
    n = u.numel()
    assert u.dtype == torch.float32
    assert bool((u > 0).all() and (u < 1).all()), "uniform outside the open interval (0, 1)"
    sd = math.sqrt(1 / 12 / n)
    above = float((u > 0.5).double().mean())
    print(f"\n  uniform: n={n} mean={float(u.double().mean()):.5f} (sd {sd:.5f}) fraction>0.5={above:.5f}")
    assert abs(float(u.double().mean()) - 0.5) < 6 * sd
    assert abs(above - 0.5) < 6 * 0.5 / math.sqrt(n), "the uniform does not cover (0.5, 1) as often as (0, 0.5)"
    for bins in (2, 64, 1024):
        fit(torch.bincount((u.double() * bins).long().flatten(), minlength=bins), torch.full((bins,), 1 / bins),
            f"uniform histogram, {bins} bins")
    # the tails, where the race decides: P(u < x) = x, also far below 2^-24
    big = S._uniform(torch.arange(1 << 12), torch.zeros(1 << 12, dtype=torch.long), 4096)  # 2^24 values
    for x in (2.0**-20, 2.0**-12, 1 - 2.0**-12, 1 - 2.0**-20):
        frac = float((big < x).double().mean()) if x < 0.5 else float((big > x).double().mean())
        tail = x if x < 0.5 else 1 - x
        assert abs(frac - tail) < 6 * math.sqrt(tail / big.numel()) + 2.0**-26, f"tail at {x}: {frac} vs {tail}"
    assert float(big.min()) < 2.0**-20, "no values near 0: the uniform is coarser than it should be"


def test_exponential_noise():
    e = S._exponential(torch.tensor([BASE_SEED + 7919 * i for i in range(4096)]), torch.zeros(4096, dtype=torch.long),
                       256).double()
    n = e.numel()
    assert bool(torch.isfinite(e).all() and (e > 0).all())
    assert abs(float(e.mean()) - 1) < 6 / math.sqrt(n)
    for x in (1e-4, 0.01, 0.3, 1.0, 3.0, 8.0):  # P(E > x) = exp(-x), small x included (the rare tokens' side)
        q = math.exp(-x)
        assert abs(float((e > x).double().mean()) - q) < 6 * math.sqrt(q * (1 - q) / n), f"P(E > {x})"


def test_hash_bits_balanced():
    h = S._hash64(torch.tensor([BASE_SEED + 7919 * i for i in range(4096)]), torch.zeros(4096, dtype=torch.long), 256)
    n = h.numel()
    ones = torch.stack([((h >> b) & 1).double().mean() for b in range(64)])
    worst = float((ones - 0.5).abs().max())
    print(f"\n  hash bits: n={n} worst |P(bit)-0.5|={worst:.5f} (bound {6 * 0.5 / math.sqrt(n):.5f}), "
          f"top bit {float(ones[63]):.5f}, bit 0 {float(ones[0]):.5f}")
    assert worst < 6 * 0.5 / math.sqrt(n)


def test_no_correlation_between_neighbours():
    """Adjacent vocabulary indices, adjacent steps, adjacent seeds (+1 and generate()'s +7919): |corr| < 5/sqrt(n),
    and the joint histogram of each pair over 16 x 16 cells is uniform."""
    vocab, n_seeds, n_steps = 64, 1024, 17
    seeds = torch.tensor([BASE_SEED + 7919 * i for i in range(n_seeds)])
    u = torch.stack([S._uniform(seeds, torch.full((n_seeds,), t), vocab) for t in range(n_steps)])  # [T, N, V]
    u1 = S._uniform(seeds + 1, torch.zeros(n_seeds, dtype=torch.long), vocab)
    pairs = {
        "adjacent vocab indices": (u[:, :, :-1], u[:, :, 1:]),
        "adjacent steps": (u[:-1], u[1:]),
        "seeds 7919 apart": (u[:, :-1], u[:, 1:]),
        "seeds 1 apart": (u[0], u1),
        "same index, step and seed+1 vs vocab+1": (u1[:, :-1], u[0, :, 1:]),
    }
    for label, (x, y) in pairs.items():
        c = corr(x, y)
        n = x.numel()
        print(f"\n  corr {label:<40} n={n:>7} r={c:+.5f} (bound {5 / math.sqrt(n):.5f})")
        assert abs(c) < 5 / math.sqrt(n), f"{label}: correlation {c:.5f}"
        cells = (x.flatten() * 16).long() * 16 + (y.flatten() * 16).long()
        fit(torch.bincount(cells, minlength=256), torch.full((256,), 1 / 256), f"pairs {label}")


def test_noise_depends_only_on_seed_step_index():
    seeds = torch.tensor([BASE_SEED + 7919 * i for i in range(32)])
    steps = torch.arange(32)
    full = S._uniform(seeds, steps, 300)
    for i in (0, 5, 31):
        assert torch.equal(S._uniform(seeds[i : i + 1], steps[i : i + 1], 300)[0], full[i])
    assert torch.equal(S._uniform(seeds, steps, 100), full[:, :100])  # the vocabulary size does not reshuffle
    assert not torch.equal(full[0], S._uniform(seeds[:1], steps[:1] + 1, 300)[0])


# -- (d) end to end through generate() ---------------------------------------------------------------------------------
N_GENERATE = 20_000


@pytest.fixture(scope="module")
def peaked_models():
    """The conftest Llama with its output layer scaled by 20, so the next-token distribution is far from uniform
    (the random model's own logits spread under 1 nat, where a biased sampler hardly shows); stock + accelerated."""
    stock = make_llama(0)
    with torch.no_grad():
        stock.lm_head.weight.mul_(20)
    return stock, accelerate_model(fresh_copy(stock))


def _first_tokens(model, prompt, n, seed=0, **kw):
    ids = torch.tensor([prompt])
    before = engine_steps(model)
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=1,
                         num_return_sequences=n, pad_token_id=PAD_ID, **kw)
    assert engine_steps(model) > before, "the call did not run on the hf_accel engine"
    assert_engine_idle(model)
    return out[:, -1]


E2E_CASES = {
    "generate: top_k=0": dict(top_k=0),
    "generate: top_k=0 temperature=0.7": dict(top_k=0, temperature=0.7),
    "generate: top_k=0 temperature=1.3 top_p=0.9": dict(top_k=0, temperature=1.3, top_p=0.9),
    "generate: top_k=30 min_p=0.05": dict(top_k=30, min_p=0.05),
}


@pytest.mark.parametrize("label", list(E2E_CASES))
def test_generate_first_token_distribution(peaked_models, label):
    stock, accel = peaked_models
    kw = E2E_CASES[label]
    prompt = PROMPTS[0]
    with torch.no_grad():
        ref = stock(torch.tensor([prompt])).logits[0, -1].float()
    sp = SP(do_sample=True, temperature=kw.get("temperature", 1.0), top_k=kw.get("top_k", 0),
            top_p=kw.get("top_p", 1.0), min_p=kw.get("min_p", 0.0))
    probs = expected_probs(ref, sp)
    tokens = _first_tokens(accel, prompt, N_GENERATE, seed=1, **kw)
    fit(histogram(tokens, ref.numel()), probs, label)


def test_generate_seeded_reproducibility(peaked_models):
    _, accel = peaked_models
    ids, mask = torch.tensor([PROMPTS[0], PROMPTS[0]]), torch.ones(2, len(PROMPTS[0]), dtype=torch.long)
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=8, num_return_sequences=3,
              pad_token_id=PAD_ID, eos_token_id=None)
    runs = {}
    for name, seed in (("a", 1234), ("b", 1234), ("c", 4321)):
        torch.manual_seed(seed)
        runs[name] = accel.generate(**kw)
    assert torch.equal(runs["a"], runs["b"]), "torch.manual_seed(s) does not reproduce the call"
    assert not torch.equal(runs["a"], runs["c"]), "different seeds gave identical samples"
    new = runs["a"][:, len(PROMPTS[0]):]
    assert len({tuple(r) for r in new.tolist()}) == new.shape[0], "rows of one call share their random stream"


# -- GPU ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("label", ["temperature 1, top_k=0", "t=0.8 top_k=40 top_p=0.9 min_p=0.02"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sampler_draws_bfloat16(label):
    """bfloat16 logits on CUDA (the sampler upcasts to float32): same distribution, same bound."""
    sp = SINGLE_CASES[label]
    row = logits_row().to(torch.bfloat16)
    tokens = _draw(row.cuda(), seeded([sp], N_DRAWS))
    assert tokens.is_cuda
    fit(histogram(tokens, row.numel()), expected_probs(row.float(), sp), f"cuda bf16 sampler: {label}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_noise_and_processors_match():
    """The noise is bit-identical on CUDA and CPU; the processors are bit-identical to stock's on CUDA."""
    seeds = torch.tensor([BASE_SEED + 7919 * i for i in range(256)])
    steps = torch.arange(256) % 7
    assert torch.equal(S._hash64(seeds.cuda(), steps.cuda(), 1000).cpu(), S._hash64(seeds, steps, 1000))
    assert torch.equal(S._uniform(seeds.cuda(), steps.cuda(), 1000).cpu(), S._uniform(seeds, steps, 1000))
    logits, reqs = _proc_batch(PROC_CASES * 3, vocab=1000, seed=11)
    _assert_matches_stock(logits.cuda(), reqs)
