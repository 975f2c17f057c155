"""Tensor parallel on two GPUs (NCCL), under torchrun: the llama-3.1-8b layer shapes (4 layers) sharded by
transformers' `tp_plan="auto"`, judged as issue 7's bf16 test judges (`tests/tp_worker.py gpu_judge`).

On rank 0, a float32 copy of the unsharded weights, teacher-forced on each output, says how often each generated token
is its argmax. Ours, with every available attention backend in the default graph mode (the collectives inside the
captured graphs) and led (48 concurrent streams, rank 1 following rank 0's plans, as `hf-accel serve` runs), must
agree with it at least as often as stock TP `generate()` does, minus one percentage point. Sampling with differently
seeded ranks gives one sequence on both.
"""

from __future__ import annotations

import pytest
import torch
from test_tensor_parallel import run_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    return run_ranks("gpu_judge", tmp_path_factory.mktemp("tp_gpu"), timeout=580)


def test_every_backend_agrees_with_float32_as_stock_tp_does(judged):
    leader = judged[0]
    rates = leader["agreement"]
    ran = {name: e for name, e in leader["backends"].items() if "unavailable" not in e}
    assert ran, leader["backends"]
    for name, entry in ran.items():
        assert "error" not in entry, (name, entry.get("error"))
        assert entry["cudagraph_mode"] != "none" and not entry["fallbacks"], (name, entry)
        assert rates[name] >= rates["stock"] - 0.01, (name, rates)


def test_led_streams_agree_with_float32_as_stock_tp_does(judged):
    rates = judged[0]["agreement"]
    assert rates["led"] >= rates["stock"] - 0.01, rates


def test_both_ranks_return_the_same_tokens(judged):
    leader, follower = judged
    assert leader["stock"] == follower["stock"]
    assert leader["sampled"] == follower["sampled"]
    for name, entry in leader["backends"].items():
        assert entry.get("out") == follower["backends"][name].get("out"), name
