"""Tensor parallel on CPU: two ranks over gloo under torchrun, transformers' own `tp_plan="auto"` sharding.

`tests/tp_worker.py` runs on each rank and records what every call returned; the checks are here. For Llama (GQA),
Qwen3 (q/k norms), a Llama without GQA and Llama with torch.compile on (the collectives inside the compiled pieces),
the accelerated sharded model must give, on every rank:
- greedy output equal to stock `generate()` of the same model unsharded (and to stock TP generate);
- the same again on a second call (prefix cache) and through `generate_batch()`;
- sampled output identical on both ranks although the ranks' torch seeds differ (rank 0's seed is broadcast);
- after rank 1 alone changed its shard of a K projection, output equal to stock TP generate of the changed model on
  both ranks (every rank dropped its prefix cache, not just the one whose shard changed).
A model whose KV heads do not divide by the TP size is refused with the reason (transformers' own TP cannot run it
either). A rank that fails ends the job on every rank quickly, with the failing rank's error.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import kill_process_tree

WORKER = Path(__file__).with_name("tp_worker.py")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(mode: str, out: Path, timeout: float) -> subprocess.CompletedProcess:
    """torchrun with two ranks on a free local port; on timeout the whole process group is killed (no orphans)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_ACCEL_BACKGROUND_BUILDS="0")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(WORKER), mode, str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_tree(proc.pid)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"torchrun {mode} did not finish in {timeout} s:\n{stderr[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_ranks(mode: str, out: Path, timeout: float) -> list[dict]:
    """Run a worker mode on two ranks; what each rank recorded (`rank{r}.json` in `out`)."""
    proc = _torchrun(mode, out, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks("check", tmp_path_factory.mktemp("tp"), timeout=300)


FAMILIES = ["llama", "qwen3", "llama-mha", "llama-compiled"]


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_and_accelerated_equals_unsharded_stock(ranks, family):
    for rank, rec in enumerate(ranks):
        entry = rec[family]
        assert "accelerate_error" not in entry, entry.get("accelerate_error")
        assert entry["tensor_parallel"] == {"size": 2, "rank": rank}
        assert entry["stock_tp"] == entry["reference"]  # the sharding itself is exact here (fp32)
        assert entry["greedy"] == entry["reference"]
        assert entry["greedy_again"] == entry["reference"]
        assert entry["generate_batch"] == entry["reference_generate_batch"]
        assert entry.get("compile_error") is None  # compiled for real, not a fallback to eager


@pytest.mark.parametrize("family", FAMILIES)
def test_every_rank_holds_its_own_kv_heads_and_agrees_on_blocks(ranks, family):
    kv_total = {"llama-mha": 4}.get(family, 2)
    blocks = {rec[family]["num_kv_blocks"] for rec in ranks}
    assert len(blocks) == 1
    assert all(rec[family]["kv_heads_local"] == kv_total // 2 for rec in ranks)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_is_identical_on_every_rank(ranks, family):
    assert ranks[0][family]["sampled"] == ranks[1][family]["sampled"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_shard_changed_on_one_rank_clears_every_ranks_prefix_cache(ranks, family):
    for rec in ranks:
        entry = rec[family]
        assert entry["after_change"] != entry["greedy"]  # the change matters
        assert entry["after_change"] == entry["after_change_stock"]


def test_calls_that_could_end_at_different_steps_are_refused(ranks):
    for rec in ranks:
        refused = rec["llama"]["refused"]
        assert set(refused) == {"max_time", "agenerate", "agenerate_stream", "MaxTimeCriteria"}
        assert all(v.startswith("NotImplementedError") and "tensor-parallel" in v for v in refused.values()), refused


def test_uneven_kv_heads_are_refused_with_the_reason(ranks):
    for rec in ranks:
        entry = rec["uneven-kv"]
        assert "NotImplementedError" in entry["accelerate_error"] and "divide" in entry["accelerate_error"]


def test_a_failing_rank_ends_the_job(tmp_path):
    t0 = time.monotonic()
    proc = _torchrun("fault", tmp_path, timeout=300)
    assert proc.returncode != 0
    assert "injected fault on rank 1" in proc.stderr + proc.stdout
    assert time.monotonic() - t0 < 240


def test_a_compile_failure_on_one_rank_ends_the_job_with_its_cause(tmp_path):
    proc = _torchrun("compile_fault", tmp_path, timeout=300)
    assert proc.returncode != 0
    assert "torch.compile of the forward failed on tensor-parallel rank 1" in proc.stderr + proc.stdout


def test_a_call_that_ended_early_on_one_rank_stops_that_rank():
    """A call that raised on this rank after it was submitted (a streamer, Ctrl-C) may have run another number of
    steps than on the other ranks: the next call on this rank refuses, naming why, instead of pairing collectives
    wrongly."""
    from conftest import make_llama

    from hf_accel import accelerate_model, restore
    from hf_accel.api import engine_of

    class OneRank:
        def any(self, flag: bool) -> bool:
            return flag

    class Boom(Exception):
        pass

    class RaisingStreamer:
        def put(self, value):
            if value.dim() == 1:  # the first new token (the prompt comes as a 2-D batch)
                raise Boom("streamer failed")

        def end(self):
            pass

    model = make_llama()
    accelerate_model(model)
    try:
        engine_of(model).tp = OneRank()
        ids = torch.tensor([[5, 6, 7]])
        with pytest.raises(Boom):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, streamer=RaisingStreamer())
        with pytest.raises(RuntimeError, match="out of step"):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5)
        engine_of(model).tp = None
    finally:
        restore(model)


def test_local_heads_arithmetic():
    from hf_accel.engine.tensor_parallel import TensorParallel, local_heads

    tp = TensorParallel(size=4, rank=1, group=None, device=torch.device("cpu"))
    assert local_heads(32, 8, tp) == (8, 2)
    assert local_heads(32, 8, None) == (32, 8)
    with pytest.raises(NotImplementedError, match="divide by 4"):
        local_heads(32, 2, tp)


def test_a_second_concurrent_call_on_a_tp_rank_is_refused():
    from conftest import make_llama

    from hf_accel import accelerate_model, restore
    from hf_accel.api import _admit, _leave, engine_of

    model = make_llama()
    accelerate_model(model)
    try:
        engine = engine_of(model)
        class OneRank:  # stands for a TP group of one: agreement is what this rank says
            def any(self, flag: bool) -> bool:
                return flag

        engine.tp = OneRank()
        state = _admit(model, True)
        try:
            with pytest.raises(RuntimeError, match="one call at a time per rank"):
                _admit(model, True)
        finally:
            _leave(model, state, True)
        engine.tp = None
    finally:
        restore(model)


def test_bench_runs_tensor_parallel(tmp_path):
    """`hf-accel bench --tensor-parallel` under torchrun: every rank measures, rank 0 writes a valid report."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_ACCEL_BACKGROUND_BUILDS="0", TMPDIR=str(tmp_path))
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "hf_accel.bench", "--shape", "tiny", "--workload", "w1",
           "--tensor-parallel", "--anchors", "none", "--repeats", "1", "--warmup", "0", "--no-progress",
           "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["valid"] and report["guard"]["passed"]
    assert report["accel"]["engine_info"]["tensor_parallel"]["size"] == 2


@pytest.fixture(scope="module")
def led(tmp_path_factory):
    return run_ranks("lead", tmp_path_factory.mktemp("tp_lead"), timeout=300)


def test_led_streams_started_at_different_steps_equal_stock(led):
    """Rank 0 drives (what `hf-accel serve` does under torchrun): streams that join the running batch at other
    steps, a sync generate() from a thread meanwhile, all equal to stock generate() of the unsharded model."""
    leader = led[0]
    ref = leader["reference"]
    (s0, r0), (s1, r1), (s2, r2), (s3, r3) = leader["streams"]
    assert (s0, r0) == (ref[0], "length")
    assert (s2, r2) == (ref[2], "length")
    assert (s3, r3) == (ref[0], "length")
    assert leader["sync_generate"] == ref[1]
    # the aborted stream: a prefix of the reference, ended by the abort
    assert r1 == "abort" and 3 <= len(s1) < 12 and s1 == ref[1][: len(s1)]


def test_led_follower_ran_every_step_and_freed_every_block(led):
    leader, follower = led
    assert follower["follower_steps"] == leader["leader_steps"] > 0
    assert follower["follower_free_blocks"] == leader["leader_free_blocks"]
    # after stop_leading_tensor_parallel, plain calls on every rank pair up again
    assert leader["after_stop"] == follower["after_stop"] == leader["reference"][2]


def test_led_sampling_is_seeded_and_host_callbacks_are_refused(led):
    leader = led[0]
    first, second = leader["sampled"]
    assert first == second and len(first) == 4 + 8
    assert leader["criteria"].startswith("NotImplementedError") and "rank 0" in leader["criteria"]


def test_a_failing_follower_ends_a_led_job(tmp_path):
    """A step that raises on a following rank: that rank ends, rank 0's next plan or step fails, and rank 0's process
    ends too (no hang, no call returning as if all were well)."""
    t0 = time.monotonic()
    proc = _torchrun("lead_fault", tmp_path, timeout=300)
    assert proc.returncode != 0
    assert "injected step failure on follower rank 1" in proc.stderr
    assert not (tmp_path / "rank0-finished").exists()
    assert time.monotonic() - t0 < 200


def test_led_and_following_ranks_refuse_what_would_break_the_pairing(led):
    """Stock generate() on a led rank would run collectives between the plans; a second lead or a follow on rank 0
    makes no sense; a call on a following rank would step its engine alone: all refused, with the reason."""
    leader, follower = led
    refused = leader["refusals"]
    stock = refused["stock_fallback"]
    assert stock.startswith("NotImplementedError") and "tensor-parallel" in stock
    assert refused["lead_again"].startswith("RuntimeError") and "already leads" in refused["lead_again"]
    assert refused["follow_on_rank_0"].startswith("ValueError") and "rank 0 leads" in refused["follow_on_rank_0"]
    side_call = follower["call_while_following"]
    assert side_call.startswith("RuntimeError") and "following" in side_call


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_on_a_sharded_accelerated_model_equals_unsharded_stock(ranks, family):
    """pipeline("text-generation") (batched, left-padded by the tokenizer) on every rank: stock's texts."""
    for rank in ranks:
        entry = rank[family]
        assert entry["pipeline"] == entry["reference_pipeline"]
        assert entry["pipeline_engine_steps"] > 0


def test_plans_of_every_size_cross_the_plan_channel_intact(tmp_path):
    """Empty plans, flags, adds with their sampling parameters, aborts, and plans larger than the channel's fixed
    buffer (a second broadcast) arrive on rank 1 equal to what rank 0 sent."""
    follower = run_ranks("channel", tmp_path, timeout=120)[1]
    assert follower["same"] == [True] * 5
