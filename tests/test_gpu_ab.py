"""GPU A/B in bf16: every available backend and graph mode against stock transformers and the eager torch backend.

Greedy equality is required up to the first step where the reference prefers another token by no more than a
rounding near-tie (the bench guard's rule: 16 bf16 ulps of the top logit); after such a step sequences may diverge.

Because random bf16 weights make near-ties common, each output is also judged by a float32 copy of the same
weights: teacher-forced on the sequence, how often is each generated token the float32 argmax? Ours must agree with
float32 at least as often as stock bf16 does, minus one percentage point. Set HF_ACCEL_TEST_REPORT to a file path to
get one JSON line per case with both rates.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import transformers
from conftest import random_left_padded

from hf_accel import AccelConfig, accelerate_model, available_backends, engine_info, restore
from hf_accel.bench import tie_margin_for
from hf_accel.compilation.norm_folding import MAX_FOLD_K

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


SHAPES = {
    "qwen3-0.6b": lambda: transformers.Qwen3Config(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
    # llama-3.1-8b layer shapes, 4 layers to keep the test quick
    "llama-8b-4l": lambda: transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000),
}

_models: dict[str, torch.nn.Module] = {}
_fp32: dict[str, torch.nn.Module] = {}


def fp32_copy(shape: str) -> torch.nn.Module:
    """A float32 copy of the (never accelerated) bf16 weights: the judge."""
    if shape not in _fp32:
        model = gpu_model(shape)
        restore(model)
        _fp32[shape] = copy.deepcopy(model).float().eval()
    return _fp32[shape]


@torch.no_grad()
def fp32_agreement(shape: str, sequences: torch.Tensor, mask: torch.Tensor, prompt_len: int) -> float:
    """Fraction of generated tokens that are the float32 model's argmax given everything before them."""
    judge = fp32_copy(shape)
    full_mask = torch.cat([mask, torch.ones_like(sequences[:, prompt_len:])], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
    logits = judge(input_ids=sequences, attention_mask=full_mask, position_ids=positions).logits
    logits = logits[:, prompt_len - 1 : -1].float()
    return float((logits.argmax(-1) == sequences[:, prompt_len:]).float().mean())


# the float32 judgement needs many tokens: the two rates differ only after a near-tie, so a small sample is noise
JUDGE_LENGTHS = [16 + (37 * i) % 49 for i in range(64)]
JUDGE_NEW = 96
_judge_refs: dict[str, torch.Tensor] = {}


def judge_batch():
    return batch(JUDGE_LENGTHS, seed=7)


def stock_judge_output(shape: str) -> torch.Tensor:
    if shape not in _judge_refs:
        model = gpu_model(shape)
        restore(model)
        ids, mask = judge_batch()
        _judge_refs[shape] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=JUDGE_NEW,
                                            do_sample=False)
    return _judge_refs[shape]


def report(**fields) -> None:
    path = os.environ.get("HF_ACCEL_TEST_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(fields) + "\n")


def gpu_model(shape: str) -> torch.nn.Module:
    if shape not in _models:
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(SHAPES[shape](), dtype=torch.bfloat16).eval()
        model.generation_config.pad_token_id = 0
        model.generation_config.eos_token_id = None
        _models[shape] = model
    return _models[shape]


def batch(lengths: list[int], seed: int = 0):
    ids, mask = random_left_padded(lengths, seed)
    return ids.cuda(), mask.cuda()


def assert_greedy_matches(ref, got, ref_scores, prompt_len: int) -> None:
    """Equal tokens, except after a step where the reference's top-2 margin is a near-tie."""
    assert ref.shape == got.shape
    for row in range(ref.shape[0]):
        diff = (ref[row, prompt_len:] != got[row, prompt_len:]).nonzero()
        if len(diff) == 0:
            continue
        step = int(diff[0])
        scores = ref_scores[step][row].float()
        top, ours = float(scores.max()), float(scores[got[row, prompt_len + step]])
        lead = top - ours
        assert lead <= tie_margin_for(torch.bfloat16, top), (
            f"row {row} diverges at step {step}: the reference prefers its token by a clear {lead:.3f}")


def reference(model, ids, mask, new: int):
    restore(model)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                         return_dict_in_generate=True, output_scores=True)
    return out.sequences, out.scores


BACKENDS = ["torch", "triton", "flashinfer", "flash_attn"]
MODES = ["none", "piecewise", "full", "full_and_piecewise"]


@requires_cuda
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_backend_mode_matches_stock(shape, backend, mode):
    model = gpu_model(shape)
    reason = available_backends(model).get(backend)
    if reason:
        pytest.skip(f"{backend}: {reason}")
    # rows of different lengths (padding), more rows than small capture sizes, tiny budget -> mixed steps
    ids, mask = batch([100, 37, 64, 5, 80, 12, 90, 50, 3], seed=1)
    new = 24
    ref, ref_scores = reference(model, ids, mask, new)
    kwargs = dict(attention_backend=backend)
    if mode == "none":
        kwargs["enforce_eager"] = True
    else:
        kwargs["cudagraph_mode"] = mode
    accelerate_model(model, max_num_batched_tokens=256, cudagraph_capture_sizes=[1, 2, 4, 8, 16, 256], **kwargs)
    jids, jmask = judge_batch()
    try:
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        # a second call reuses graphs and the prefix cache
        got2 = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        judged = model.generate(input_ids=jids, attention_mask=jmask, max_new_tokens=JUDGE_NEW, do_sample=False)
    finally:
        restore(model)
    assert_greedy_matches(ref, got, ref_scores, ids.shape[1])
    assert_greedy_matches(ref, got2, ref_scores, ids.shape[1])
    stock_rate = fp32_agreement(shape, stock_judge_output(shape), jmask, jids.shape[1])
    ours_rate = fp32_agreement(shape, judged, jmask, jids.shape[1])
    report(test="fp32_agreement", shape=shape, backend=backend, mode=mode, stock=stock_rate, ours=ours_rate)
    assert ours_rate >= stock_rate - 0.01, f"float32 agreement: ours {ours_rate:.3f} < stock {stock_rate:.3f} - 1 pp"


@requires_cuda
@pytest.mark.parametrize(("mode", "split"), [("full_and_piecewise", None), ("none", True), ("full", True),
                                           ("full_and_piecewise", False)])
def test_split_mixed_attention_matches_stock(mode, split):
    """AccelConfig.split_mixed_attention (default None: on where it applies): mixed steps with at least 16 leading
    decode rows run those through the decode kernel and the rest through the unified kernel (not under mode "full",
    which captures mixed steps whole, nor with False); greedy output stays stock's."""
    from hf_accel.api import engine_of

    model = gpu_model("qwen3-0.6b")
    ids, mask = batch([20 + 3 * i for i in range(20)] + [300, 280, 310, 290], seed=5)
    new = 24
    ref, ref_scores = reference(model, ids, mask, new)
    kwargs = {"enforce_eager": True} if mode == "none" else {"cudagraph_mode": mode}
    accelerate_model(model, attention_backend="triton", max_num_batched_tokens=256,
                     config=AccelConfig(split_mixed_attention=split), **kwargs)
    planned: list[int] = []
    splits = mode != "full" and split is not False
    try:
        backend = engine_of(model).backend
        assert backend.split_mixed is splits
        plan = backend._plan_mixed_split

        def recording(meta):
            plan(meta)
            planned.append(backend._mixed_decode_rows)
        backend._plan_mixed_split = recording
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    finally:
        restore(model)
    if splits:
        assert max(planned) >= 16, planned
    else:
        assert not any(planned)
    assert_greedy_matches(ref, got, ref_scores, ids.shape[1])


@requires_cuda
def test_large_prefill_step_replays_a_piecewise_graph():
    """With the default sizes, qwen3-0.6b (small enough that a large step is host-bound) captures piecewise graphs up
    to the 8,192-token budget (config.large_piecewise_sizes): a ~5,000-token prefill step replays the 8,192 graph,
    padded, and the output stays stock's."""
    from hf_accel.api import engine_of
    from hf_accel.compilation.dispatcher import RuntimeMode

    model = gpu_model("qwen3-0.6b")
    ids, mask = batch([400 + 7 * i for i in range(12)], seed=3)
    new = 16
    ref, ref_scores = reference(model, ids, mask, new)
    accelerate_model(model)
    seen = []
    try:
        assert engine_info(model)["piecewise_graph_sizes"][-4:] == [1024, 2048, 4096, 8192]
        dispatcher = engine_of(model).runner.dispatcher
        dispatch = dispatcher.dispatch

        def recording(num_tokens, uniform_decode):
            seen.append((num_tokens, dispatch(num_tokens, uniform_decode)))
            return seen[-1][1]
        dispatcher.dispatch = recording
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    finally:
        restore(model)
    assert [(n, d.num_tokens) for n, d in seen if n > 4096 and d.mode == RuntimeMode.PIECEWISE] == [
        (int(mask.sum()), 8192)]
    assert_greedy_matches(ref, got, ref_scores, ids.shape[1])


@requires_cuda
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compile_off_fused_ops_match_stock(shape, backend):
    """compile=False on CUDA: fused Triton RMSNorm / SiLU-mul forwards, full graphs of that eager forward for
    decode, eager mixed steps; greedy output as stock's, and the stock path runs the model's own modules again."""
    from hf_accel.api import engine_info

    model = gpu_model(shape)
    ids, mask = batch([100, 37, 64, 5, 80, 12, 90, 50, 3], seed=3)
    new = 24
    ref, ref_scores = reference(model, ids, mask, new)
    accelerate_model(model, attention_backend=backend, compile=False, cudagraph_mode="full",
                     max_num_batched_tokens=256, cudagraph_capture_sizes=[1, 2, 4, 8, 16])
    try:
        fused = engine_info(model)["fused_ops"]
        assert fused and fused["norms"] > 0 and fused["mlps"] > 0, fused
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        # beam search takes the stock path: the model's own norm and MLP forwards, then the fused ones again
        with pytest.warns(UserWarning):
            model.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=2, num_beams=2)
        assert any("forward" in m.__dict__ for m in model.modules())
    finally:
        restore(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert_greedy_matches(ref, got, ref_scores, ids.shape[1])


@requires_cuda
@pytest.mark.parametrize("shape", list(SHAPES))
def test_first_step_logits_close(shape):
    model = gpu_model(shape)
    ids, mask = batch([64, 20], seed=2)
    restore(model)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                         return_dict_in_generate=True, output_logits=True).logits[0].float()
    accelerate_model(model, attention_backend="torch", enforce_eager=True)
    try:
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                             return_dict_in_generate=True, output_logits=True).logits[0].float()
    finally:
        restore(model)
    scale = ref.abs().max()
    assert float((got - ref).abs().max() / scale) < 2e-2


@requires_cuda
@pytest.mark.parametrize(("shape", "gated"), [(shape, True) for shape in SHAPES] + [("qwen3-0.6b", False)])
def test_batch_one_decode_judged_by_float32(shape, gated):
    """Batch-1 decode, where the small-M GEMM's one-row kernel runs (every other case here decodes several rows):
    two rows equal to stock up to near-ties, and the judge batch's 64 rows generated one call each agree with the
    float32 copy at least as often as stock's batched bf16 output does, minus one point. The tuner must have chosen
    the one-row kernel for some linear, or the test proves nothing about it. The gated gate/up GEMM (on by default)
    is judged here, and once without it (its A/B switch's path)."""
    model = gpu_model(shape)
    jids, jmask = judge_batch()
    refs = []
    for row in (0, 1):
        ids = jids[row : row + 1, jmask[row].bool()]
        refs.append((ids, *reference(model, ids, torch.ones_like(ids), 24)))
    accelerate_model(model, attention_backend="triton", config=AccelConfig(gated_gemm=gated))
    try:
        decisions = (engine_info(model)["small_m_gemm"] or {}).get("decisions", {})
        assert any(isinstance(d, dict) and d.get("gemv") for d in decisions.values()), decisions
        if model.config.hidden_size <= MAX_FOLD_K:  # the norms run inside the one-row GEMMs: judged here too
            assert engine_info(model)["folded_norms"] > 0
        assert (engine_info(model)["gated_linears"] > 0) == gated
        for ids, ref, ref_scores in refs:
            got = model.generate(input_ids=ids, max_new_tokens=24, do_sample=False)
            assert_greedy_matches(ref, got, ref_scores, ids.shape[1])
        new = []
        for row in range(jids.shape[0]):
            ids = jids[row : row + 1, jmask[row].bool()]
            out = model.generate(input_ids=ids, max_new_tokens=JUDGE_NEW, do_sample=False)
            new.append(out[:, ids.shape[1]:])
    finally:
        restore(model)
    judged = torch.cat([jids, torch.cat(new)], dim=1)
    stock_rate = fp32_agreement(shape, stock_judge_output(shape), jmask, jids.shape[1])
    ours_rate = fp32_agreement(shape, judged, jmask, jids.shape[1])
    report(test="fp32_agreement_batch_1", shape=shape, backend="triton", mode="auto", gated=gated, stock=stock_rate,
           ours=ours_rate)
    assert ours_rate >= stock_rate - 0.01, f"float32 agreement: ours {ours_rate:.3f} < stock {stock_rate:.3f} - 1 pp"


@requires_cuda
def test_combo_kernels_launch_fewer_kernels_and_match_stock():
    """AccelConfig(combo_kernels=True): Inductor launches independent kernels of a piece as one (Qwen3's q and k
    norm + RoPE), so the same generate() call launches fewer kernels than with it off, and its greedy tokens are
    stock's up to near-ties. The pieces run without CUDA graphs here, so the profiler sees every kernel. (On CPU
    Inductor combines nothing: only this GPU test shows the option does what it says.)"""
    model = gpu_model("qwen3-0.6b")
    ids, mask = batch([40, 9, 27], seed=5)
    new = 8
    ref, ref_scores = reference(model, ids, mask, new)
    kernels = {}
    for on in (False, True):
        accelerate_model(model, attention_backend="triton", cudagraph_mode="none",
                         config=AccelConfig(combo_kernels=on))
        try:
            assert model._hf_accel_state.engine.runner.piecewise is not None  # compiled, not the eager fallback
            assert engine_info(model)["combo_kernels"] is on
            got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
                torch.cuda.synchronize()
        finally:
            restore(model)
        assert_greedy_matches(ref, got, ref_scores, ids.shape[1])
        kernels[on] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                          and not e.name.startswith(("Memcpy", "Memset")))
    report(test="combo_kernels_launches", off=kernels[False], on=kernels[True])
    assert 0 < kernels[True] < kernels[False], kernels


@requires_cuda
@pytest.mark.parametrize("shape", list(SHAPES))
def test_residual_chain_matches_stock_judged_by_float32(monkeypatch, shape):
    """AccelConfig(chain_residual_norms=True) (ops/residual_chain.py): o_proj / down_proj add the residual and sum
    squares in their GEMM's epilogue and the next GEMM normalizes its input. Decode steps of 2-64 rows whose linears'
    decisions (or chain tiles) are our tensor-core tiles take the chained launches; greedy tokens equal stock's up to
    near-ties, and the judge batch agrees with the float32 copy at least as often as stock's bf16 output does, minus
    one point. qwen3-0.6b must chain; the 8B-layer shape (rows wider than MAX_FOLD_K, folded for the chain) chains
    only where its tuning found tiles within CHAIN_SLACK of cuBLAS, and the test says so when it did not."""
    from hf_accel.ops import skinny_gemm

    model = gpu_model(shape)
    ids, mask = batch([100, 37, 64, 5, 80, 12, 90, 50, 3], seed=1)
    new = 24
    ref, ref_scores = reference(model, ids, mask, new)
    chained = []
    real = skinny_gemm.linear_add_residual
    monkeypatch.setattr(skinny_gemm, "linear_add_residual", lambda *a, **kw: chained.append(1) or real(*a, **kw))
    accelerate_model(model, attention_backend="triton", config=AccelConfig(chain_residual_norms=True))
    jids, jmask = judge_batch()
    try:
        info = engine_info(model)
        assert info["chained_norms"] > 0
        # the tuner timed chain tiles for the chains' places (timed now or read from the compile cache)
        assert any(":chain-" in k for k in (info.get("small_m_gemm") or {}).get("decisions", {})), info
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        judged = model.generate(input_ids=jids, attention_mask=jmask, max_new_tokens=JUDGE_NEW, do_sample=False)
    finally:
        restore(model)
    assert_greedy_matches(ref, got, ref_scores, ids.shape[1])
    stock_rate = fp32_agreement(shape, stock_judge_output(shape), jmask, jids.shape[1])
    ours_rate = fp32_agreement(shape, judged, jmask, jids.shape[1])
    report(test="fp32_agreement_residual_chain", shape=shape, backend="triton", stock=stock_rate, ours=ours_rate,
           chained_launches=len(chained))
    assert ours_rate >= stock_rate - 0.01, f"float32 agreement: ours {ours_rate:.3f} < stock {stock_rate:.3f} - 1 pp"
    if not chained:
        assert shape != "qwen3-0.6b", "no step took the chained launches (no tensor-core decision at any row count?)"
        pytest.skip(f"{shape}: no chain tile within CHAIN_SLACK on this GPU, so no chained launch ran (the unchained "
                    "ops were judged)")
