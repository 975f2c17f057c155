"""The greedy argmax kernels (hf_accel.ops.argmax) against torch.argmax: same indices, ties, NaN and infinities.

On CPU the kernels run in the Triton interpreter; on a GPU compiled (and `greedy_argmax` is checked end to end).
"""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE, ON_GPU, load_kernel_modules

pytest.importorskip("triton")

(A,) = load_kernel_modules(["hf_accel.ops.argmax"], "_chunk_argmax_kernel")


def _check(x: torch.Tensor) -> None:
    got = A.launch_argmax(x)
    want = x.argmax(dim=-1)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want.cpu()), (got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, 5000), (3, 4096), (9, 10_000), (2, 17)])
def test_random_rows_match_torch(dtype, rows, vocab):
    torch.manual_seed(rows * vocab)
    _check(torch.randn(rows, vocab, device=DEVICE).to(dtype))


def test_ties_take_the_lowest_index_across_chunks():
    chunk = A.chunk_size(4)
    x = torch.zeros(4, 3 * chunk + 5, device=DEVICE, dtype=torch.bfloat16)
    x[0, [chunk + 3, 2 * chunk + 1]] = 2.0           # the same maximum in two chunks: the first chunk's
    x[1, [5, 7, chunk - 1]] = 1.5                      # three in one chunk
    x[2, :] = -torch.inf                               # every value -inf: index 0
    x[3, [3 * chunk + 4, 0]] = 3.0                     # in the short last chunk and at 0
    _check(x)


def test_signed_zeros_are_equal():
    x = torch.full((1, 3000), -1.0, device=DEVICE)
    x[0, 2000] = 0.0
    x[0, 10] = -0.0  # equal to +0.0: the lower index wins, as in torch
    _check(x)


def test_nan_wins_over_everything_and_the_first_nan_is_taken():
    chunk = A.chunk_size(3)
    x = torch.randn(3, 2 * chunk + 100, device=DEVICE)
    x[0, [chunk + 50, 2 * chunk + 7]] = torch.nan     # first NaN in the second chunk
    x[0, 0] = torch.inf                               # +inf loses to NaN
    x[1, -1] = torch.nan                              # the very last element
    x[2, :] = -torch.inf
    x[2, 1234] = torch.nan
    _check(x)


def test_infinity_is_a_maximum():
    x = torch.randn(2, 5000, device=DEVICE)
    x[0, [4000, 4500]] = torch.inf
    x[1, 3] = torch.finfo(torch.float32).max
    _check(x)


def test_a_view_with_a_row_stride():
    x = torch.randn(4, 6000, device=DEVICE)[:, 500:5500]  # rows 6000 apart, each 5000 long
    assert not x.is_contiguous()
    _check(x)


def test_greedy_argmax_falls_back_where_the_kernel_does_not_apply():
    x = torch.randn(3, 50, dtype=torch.float64)
    assert torch.equal(A.greedy_argmax(x), x.argmax(dim=-1))
    assert not A.kernel_applies(torch.randn(4, 6).t())  # vocabulary not contiguous
    assert not A.kernel_applies(torch.randn(0, 6))
    assert not A.kernel_applies(torch.randn(2, 3, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 7, 64, 200])
def test_greedy_argmax_on_gpu_vocabulary_sizes(rows):
    torch.manual_seed(rows)
    for vocab in (151_936, 128_256, 262_144, 32_000):
        x = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 4
        assert torch.equal(A.greedy_argmax(x), x.argmax(dim=-1))
        x = x.round()  # many exact ties of the maximum
        assert torch.equal(A.greedy_argmax(x), x.argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_sampler_falls_back_to_torch_when_the_kernel_cannot_build(monkeypatch):
    """A triton that cannot build the kernels: the first launch's error is caught, torch's argmax answers, and the
    sampler stays on torch's from then on."""
    from hf_accel.engine import sampler

    def broken(logits):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(sampler, "_greedy_argmax", broken)
    monkeypatch.setattr(sampler, "_greedy_argmax_ran", False)
    x = torch.randn(3, 1000, device="cuda")
    assert torch.equal(sampler._argmax(x), x.argmax(dim=-1))
    assert sampler._greedy_argmax is False
    assert torch.equal(sampler._argmax(x), x.argmax(dim=-1))
