"""The one-launch content digest (hf_accel.ops.digest) behind the prefix cache's per-call weight check.

On CPU the kernel runs in the Triton interpreter; on a GPU compiled, and `weights_digest` takes it for CUDA tensors.
Checked: the kernel's two sums equal a plain-torch computation of the same formula (tensors of odd byte counts,
misaligned views, slices crossing program boundaries), and every ordinary edit changes them.
"""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE, ON_GPU, load_kernel_modules

pytest.importorskip("triton")

from hf_accel.engine import model_state  # noqa: E402

(D,) = load_kernel_modules(["hf_accel.ops.digest"], "_digest_kernel")


@pytest.fixture
def small_slices(monkeypatch):
    """Programs of 1,000 words, so modest tensors span several programs (and slice ends fall mid-block)."""
    monkeypatch.setattr(D, "SLICE_WORDS", 1000)


def test_kernel_sums_equal_the_torch_formula(small_slices):
    torch.manual_seed(0)
    base = torch.randn(4001, dtype=torch.bfloat16, device=DEVICE)
    views = [
        torch.randn(2500, 3, device=DEVICE),               # 7,500 words: eight programs, the last one short
        base,                                               # an odd number of bf16 values: copied and padded
        base[2:],                                           # starts mid-line: copied to an aligned buffer
        torch.randn(30, 40, device=DEVICE).t(),             # not contiguous: copied
        torch.tensor([True, False, True], device=DEVICE),   # three bytes
        torch.randint(-2**31, 2**31 - 1, (4 * 999,), dtype=torch.int32, device=DEVICE),  # in place, ends mid-block
        torch.zeros(0, device=DEVICE),                      # empty: no program, no position
    ]
    assert torch.equal(D.digest_sums(views).cpu(), D.reference_sums(views))
    assert torch.equal(D.digest_sums([]).cpu(), torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("edit", ["one_ulp", "swap_two", "roll_rows", "flip_columns", "scale", "move_between",
                                  "sign_bit", "add_delta"])
def test_every_ordinary_edit_changes_the_sums(small_slices, edit):
    torch.manual_seed(1)
    a = torch.randn(64, 96, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(64, 96, dtype=torch.bfloat16, device=DEVICE)
    c = torch.randn(17, device=DEVICE)

    def sums():
        return D.digest_sums([a, b, c]).cpu()

    before = sums()
    assert torch.equal(before, sums())  # deterministic
    if edit == "one_ulp":
        a.view(torch.int16)[3, 5] += 1  # the next bf16 value
    elif edit == "swap_two":
        a[0, 0], a[40, 7] = a[40, 7].clone(), a[0, 0].clone()
    elif edit == "roll_rows":
        a.copy_(a.roll(1, 0))
    elif edit == "flip_columns":
        a.copy_(a.flip(-1))
    elif edit == "scale":
        b.mul_(1.5)
    elif edit == "move_between":  # the same bytes in the other tensor: only their stream positions change
        tmp = a.clone()
        a.copy_(b)
        b.copy_(tmp)
    elif edit == "sign_bit":
        c[16] = -c[16]
    else:
        a.add_(1e-2 * torch.randn_like(a))
    assert not torch.equal(before, sums()), edit
    after = sums()
    assert not torch.equal(after[:1], before[:1]) and not torch.equal(after[1:], before[1:]), "both sums move"


def test_doubling_a_tensor_the_first_sum_cannot_see_is_seen_by_the_second():
    """The first sum is linear in the position: doubling a float32 tensor (+2^23 on every word) at an offset where
    that keeps both of its moments modulo 2^64 leaves it unchanged (module docstring); the pair still changes."""
    torch.manual_seed(3)
    a = torch.randn(512, 1024, device=DEVICE)
    b = torch.rand(1024, 1024, device=DEVICE) + 1  # no zeros: every word moves by exactly 2^23
    before = D.digest_sums([a, b]).cpu()
    b.mul_(2)
    after = D.digest_sums([a, b]).cpu()
    assert torch.equal(after, D.reference_sums([a, b]))
    assert torch.equal(after[0], before[0]), "the case the docstring describes (first sum blind)"
    assert not torch.equal(after[1], before[1])


def test_copies_beyond_the_budget_take_more_launches_and_the_same_sums(monkeypatch, small_slices):
    """Tensors that must be copied first (not contiguous, odd sizes) are digested a budget's worth at a time, with
    the stream positions running on: the sums do not change with the budget. A layout seen before reuses its
    table; what the table points at is read afresh."""
    monkeypatch.setattr(D, "_COPY_BUDGET", 1000)
    torch.manual_seed(4)
    ts = [torch.randn(30, 40, device=DEVICE).t(), torch.randn(333, device=DEVICE, dtype=torch.bfloat16),
          torch.randn(64, 64, device=DEVICE), torch.randn(50, 20, device=DEVICE)[:, ::2], torch.randn(7, 9)[0:1, 2]]
    ts[-1] = ts[-1].to(DEVICE)
    assert torch.equal(D.digest_sums(ts).cpu(), D.reference_sums(ts))
    in_place = [torch.randn(64, 64, device=DEVICE), torch.randn(128, device=DEVICE)]
    first = D.digest_sums(in_place).cpu()
    assert torch.equal(D.digest_sums(in_place).cpu(), first)  # from the remembered table
    in_place[0][5, 5] += 1
    assert torch.equal(D.digest_sums(in_place).cpu(), D.reference_sums(in_place))
    assert not torch.equal(D.digest_sums(in_place).cpu(), first)


def test_a_one_element_view_with_any_stride_is_read():
    w = torch.randn(4, 8, device=DEVICE)
    view = w[0:1, 2]  # one element, stride 8
    assert torch.equal(D.digest_sums([view]).cpu(), D.reference_sums([view]))
    assert model_state.weights_digest([view.cpu()]) != model_state.weights_digest([w[0:1, 3].cpu()])


def test_weights_digest_uses_the_kernel_on_a_gpu_only(monkeypatch):
    """CUDA tensors go through the one-launch kernel; CPU tensors through the chunked torch path, as before."""
    calls = []
    real = model_state._gpu_digest()
    if real is None:
        pytest.skip("no triton")

    def spy(views):
        calls.append(len(views))
        return real(views)

    monkeypatch.setattr(model_state, "_gpu_digest_fn", spy)
    torch.manual_seed(2)
    ts = [torch.randn(33, 8, device=DEVICE), torch.randn(5, dtype=torch.bfloat16, device=DEVICE)]
    d1 = model_state.weights_digest(ts)
    assert calls == ([2] if ON_GPU else [])
    ts[1][2] += 1
    assert model_state.weights_digest(ts) != d1


def test_cpu_chunk_sums_are_the_torch_reductions():
    """On the CPU the chunk path sums with numpy (faster there): the same two numbers as torch's reductions."""
    torch.manual_seed(5)
    pieces = [torch.randn(3000).view(torch.uint8), torch.randint(0, 255, (4099,), dtype=torch.uint8)]
    flat = torch.cat(pieces)
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % (4 * model_state._COLUMNS))])
    words = flat.view(torch.int32).view(-1, model_state._COLUMNS)
    rows, cols = words.sum(dim=1, dtype=torch.int64), words.sum(dim=0, dtype=torch.int64)
    want = torch.stack([(rows * model_state._position_weights(rows.numel(), rows.device)).sum(),
                        (cols * model_state._position_weights(model_state._COLUMNS, cols.device)).sum()])
    assert torch.equal(model_state._chunk_sums(pieces), want)
