"""The greedy argmax of the decode graphs (hf_accel.ops.greedy) and how the sampler takes its tokens.

On CPU the kernel runs in the Triton interpreter; on a GPU compiled, and the `gpu`-marked tests add real vocabulary
sizes in bf16, the launch captured in a CUDA graph after the kernel that writes the logits (with PDL where it runs),
and the engine's greedy output with the graph's argmax against the sampler's own.
"""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE, ON_GPU, load_kernel_modules

triton = pytest.importorskip("triton")

from hf_accel.engine.request import Request, SamplingParams  # noqa: E402
from hf_accel.engine.sampler import Sampler  # noqa: E402

(G,) = load_kernel_modules(["hf_accel.ops.greedy"], "_greedy_argmax_kernel")
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (compiled Triton kernels)")


def _hard_rows(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits with the cases argmax must get right: ties (first index wins), NaN (the first NaN wins),
    all -inf (index 0), +inf, -0.0 beside 0.0, and the maximum in the last slice or the last position."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g).to(dtype)
    cases = [
        lambda r: r.fill_(float("-inf")),
        lambda r: r.__setitem__(slice(None), 1.0),
        lambda r: (r.__setitem__(vocab - 1, 50.0), r.__setitem__(vocab // 2, 50.0)),
        lambda r: (r.__setitem__(vocab - 1, float("nan")), r.__setitem__(vocab // 3, float("nan"))),
        lambda r: (r.__setitem__(vocab - 1, float("inf")), r.__setitem__(0, float("nan"))),
        lambda r: (r.fill_(-0.0), r.__setitem__(vocab // 5, 0.0)),
        lambda r: r.__setitem__(vocab - 1, 99.0),
        lambda r: (r.__setitem__(0, float("inf")), r.__setitem__(vocab - 1, float("inf"))),
    ]
    for i, case in enumerate(cases[:rows]):
        case(x[i])
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 7), (3, 4096), (8, 4097), (9, 3 * 4096 + 5), (2, 20000)])
def test_matches_torch_argmax(dtype, rows, vocab):
    x = _hard_rows(rows, vocab, dtype, seed=rows * vocab).to(DEVICE)
    op = G.GreedyArgmax(16, vocab, DEVICE)
    for _ in range(2):  # the second launch finds the counters set back to zero by the first
        got = op(x)
        assert got.dtype == torch.int64
        assert torch.equal(got.cpu(), x.cpu().argmax(dim=-1))
        assert int(op.counters.abs().sum()) == 0


def test_row_stride_and_fewer_rows_than_capacity():
    wide = _hard_rows(4, 9000, torch.float32, seed=3).to(DEVICE)
    view = wide[:, :8192]  # rows 9000 apart
    op = G.GreedyArgmax(8, 8192, DEVICE)
    assert torch.equal(op(view).cpu(), view.cpu().argmax(dim=-1))
    assert op(view[:0]).shape == (0,)


def test_refuses_what_it_was_not_made_for():
    op = G.GreedyArgmax(2, 100, DEVICE)
    with pytest.raises(ValueError, match="GreedyArgmax"):
        op(torch.zeros(3, 100, device=DEVICE))  # more rows than its scratch
    with pytest.raises(ValueError, match="GreedyArgmax"):
        op(torch.zeros(2, 101, device=DEVICE))  # another vocabulary
    with pytest.raises(ValueError, match="GreedyArgmax"):
        op(torch.zeros(100, 2, device=DEVICE).t())  # columns not contiguous
    assert not op.fits(torch.zeros(2, 100, dtype=torch.int64, device=DEVICE))
    assert not op.fits(torch.zeros(2, 100, dtype=torch.float64, device=DEVICE))  # float32 would round its values


# ----------------------------------------------------------------------------- the sampler's use of the graph's tokens
def _req(**sampling) -> Request:
    return Request(request_id=0, prompt_token_ids=[1, 2, 3], max_new_tokens=4, sampling=SamplingParams(**sampling))


def test_sampler_takes_the_graphs_tokens_only_for_plain_greedy_steps():
    logits = torch.randn(2, 50)
    marker = torch.tensor([7, 9])  # not the argmax of these logits: shows which tokens were taken
    assert not torch.equal(marker, logits.argmax(-1))
    plain = [_req(), _req()]
    tokens, _ = Sampler()(logits, plain, marker)
    assert tokens is marker
    tokens, _ = Sampler()(logits, plain)
    assert torch.equal(tokens, logits.argmax(-1))
    # a step with any request that needs the processed scores computes its own tokens
    for other in (_req(do_sample=True, seed=1), _req(repetition_penalty=1.3), _req(min_new_tokens=3)):
        tokens, _ = Sampler()(logits, [_req(), other], marker)
        assert tokens.tolist() != marker.tolist()
        assert tokens[0] == logits[0].argmax()
    hooked = _req()
    hooked.logits_hook = lambda req, scores: scores
    tokens, _ = Sampler()(logits, [_req(), hooked], marker)
    assert torch.equal(tokens, logits.argmax(-1))


# --------------------------------------------------------------------------------------------------------------- GPU
def _captured(body):
    """`body` run once (its kernels built), then captured in a CUDA graph: (graph, what the capture returned)."""
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    return graph, out


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [128256, 151936, 262208])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_gpu_real_vocabularies_in_a_graph_after_the_logits_kernel(vocab, rows):
    """Captured after the GEMM that writes the logits (PDL on where supported), replayed on new logits each time:
    the tokens equal torch.argmax's, bf16 with ties, NaN and infinities included, and the counters end at zero."""
    from hf_accel.ops import pdl

    use_pdl = pdl.supported(DEVICE)
    hidden = 256
    x = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.empty(rows, vocab, device=DEVICE, dtype=torch.bfloat16)
    op = G.GreedyArgmax(64, vocab, DEVICE)
    extra = torch.zeros(rows, vocab, device=DEVICE, dtype=torch.bfloat16)

    def body():
        torch.matmul(x, w.t(), out=logits)
        logits.add_(extra)  # where the hard cases go in
        return op(logits, use_pdl)

    graph, out = _captured(body)
    for seed in range(4):
        x.copy_(torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed)).to(DEVICE, torch.bfloat16))
        hard = _hard_rows(rows, vocab, torch.bfloat16, seed)
        extra.copy_(torch.where(torch.isfinite(hard) & (hard.abs() < 10), torch.zeros_like(hard), hard).to(DEVICE)
                    if seed % 2 else torch.zeros_like(hard).to(DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, logits.argmax(dim=-1)), seed
        assert int(op.counters.abs().sum()) == 0


@gpu
@pytest.mark.gpu
def test_gpu_engine_greedy_output_with_and_without_the_graphs_argmax(monkeypatch):
    """One float32 model accelerated twice: full decode graphs ending with the argmax, and without it (the
    sampler's torch.argmax after the graph). Greedy outputs are equal, and with it on the decode steps took the
    graph's tokens."""
    transformers = pytest.importorskip("transformers")
    from hf_accel import accelerate_model, restore
    from hf_accel.config import AccelConfig

    cfg = transformers.LlamaConfig(vocab_size=5000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(DEVICE).eval()
    ids = torch.randint(0, cfg.vocab_size, (3, 12), device=DEVICE)
    given = []
    original = Sampler.__call__

    def recording(self, logits, reqs, greedy=None):
        given.append(greedy is not None)
        return original(self, logits, reqs, greedy)

    monkeypatch.setattr(Sampler, "__call__", recording)
    outs = {}
    for on in (True, False):
        given.clear()
        accelerate_model(model, attention_backend="triton", config=AccelConfig(graph_greedy_argmax=on))
        outs[on] = model.generate(ids, max_new_tokens=24, do_sample=False)
        assert any(given) == on  # decode steps replayed full graphs: with it on, they handed their tokens over
        restore(model)
    assert torch.equal(outs[True], outs[False])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_gpu_after_a_pdl_small_m_gemm_lm_head(rows):
    """As in a decode graph: the logits come from the small-M GEMM launched with PDL (the lm_head), and the argmax,
    launched with PDL too, must wait for all of them: many replays on new inputs, each equal to torch.argmax."""
    from hf_accel.ops import pdl
    from hf_accel.ops.skinny_gemm import SkinnyConfig, skinny_linear

    if not pdl.supported(DEVICE):
        pytest.skip("PDL needs sm90+ and a triton that exposes it")
    vocab, hidden = 151936, 1024
    cfg = SkinnyConfig(1, 4, 512, 1, gemv=True) if rows == 1 else SkinnyConfig(rows, 64, 128, 2)
    x = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device=DEVICE, dtype=torch.bfloat16) / 16
    logits = torch.empty(rows, vocab, device=DEVICE, dtype=torch.bfloat16)
    counters = torch.zeros(vocab, dtype=torch.int32, device=DEVICE)
    op = G.GreedyArgmax(64, vocab, DEVICE)

    def body():
        skinny_linear(x, w, None, cfg, True, out=logits, counters=counters)
        return op(logits, True)

    graph, out = _captured(body)
    for seed in range(20):
        x.copy_(torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed)).to(DEVICE, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, logits.argmax(dim=-1)), seed
    assert int(op.counters.abs().sum()) == 0
