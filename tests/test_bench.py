"""hf-accel bench: the roofline arithmetic, the inputs, and end-to-end runs of the tiny shape on CPU."""

from __future__ import annotations

import json
import math
import random
import sys
import types
from pathlib import Path

import pytest
import torch

from hf_accel import bench
from hf_accel.bench import guard as bench_guard

API_LANDED = (Path(bench.__file__).parents[1] / "api.py").exists()
TINY = ["--shape", "tiny", "--repeats", "1", "--warmup", "1", "--num-kv-blocks", "256", "--no-progress",
        "--device", "cpu"]


# ------------------------------------------------------------------------------------------------- roofline
def _meta_model(shape: str, dtype: torch.dtype = torch.bfloat16):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(bench.shape_config(shape), dtype=dtype)


@pytest.mark.parametrize(("shape", "workload", "expected"), [
    ("qwen3-0.6b", "w1", 3_500), ("llama-3.2-1b", "w1", 1_700), ("llama-3.1-8b", "w1", 265),
    ("qwen3-0.6b", "w2", 88_000), ("llama-3.1-8b", "w2", 14_900),
])
def test_roofline_matches_workloads_md(shape: str, workload: str, expected: float) -> None:
    """WORKLOADS.md's roofline row at 4.25 TB/s (every weight once per step + each sequence's KV read and the new
    token's KV written)."""
    model = _meta_model(shape)
    spec = bench.SCALES["full"][workload]
    got = bench.decode_roofline_tokens_per_s(bench.weight_bytes(model), bench.kv_bytes_per_token(model.config,
                                             torch.bfloat16), spec.prompt_lengths(), spec.new_tokens, 4.25e12)
    assert got == pytest.approx(expected, rel=0.03)


def test_roofline_w3_order_of_magnitude() -> None:
    """WORKLOADS.md says ~39,000 for W3 0.6b; the pure decode bound is a little higher (prefill not counted)."""
    model = _meta_model("qwen3-0.6b")
    spec = bench.SCALES["full"]["w3"]
    got = bench.decode_roofline_tokens_per_s(bench.weight_bytes(model), bench.kv_bytes_per_token(
        model.config, torch.bfloat16), spec.prompt_lengths(), spec.new_tokens, 4.25e12, max_batch=256)
    assert 39_000 <= got <= 46_000


def test_roofline_arithmetic_by_hand() -> None:
    # one sequence, prompt 10, 3 new tokens: KV read 10 + 11 + 12 = 33 tokens and 3 written, weights read 3 times
    got = bench.decode_roofline_tokens_per_s(100, 2, [10], 3, bandwidth=1000.0)
    assert got == pytest.approx(3 * 1000.0 / (3 * 100 + 2 * (33 + 3)))
    # two waves of one: twice the weight traffic of one wave of two, same KV
    one_wave = bench.decode_roofline_tokens_per_s(100, 2, [10, 20], 3, bandwidth=1000.0)
    two_waves = bench.decode_roofline_tokens_per_s(100, 2, [10, 20], 3, bandwidth=1000.0, max_batch=1)
    assert one_wave == pytest.approx(6 * 1000.0 / (3 * 100 + 2 * (30 * 3 + 2 * 3 + 6)))
    assert one_wave > two_waves
    assert two_waves == pytest.approx(6 * 1000.0 / (6 * 100 + 2 * (30 * 3 + 2 * 3 + 6)))
    with pytest.raises(ValueError):
        bench.decode_roofline_tokens_per_s(100, 2, [], 3, bandwidth=1000.0)


def test_weight_and_kv_bytes() -> None:
    qwen = _meta_model("qwen3-0.6b")
    assert bench.weight_bytes(qwen) == 596_049_920 * 2  # tied embedding counted once
    assert bench.kv_bytes_per_token(qwen.config, torch.bfloat16) == 2 * 28 * 8 * 128 * 2
    llama = _meta_model("llama-3.1-8b")
    assert bench.kv_bytes_per_token(llama.config, torch.float32) == 2 * 32 * 8 * 128 * 4


# --------------------------------------------------------------------------------------------------- inputs
def test_inputs_follow_the_seeds() -> None:
    w3 = bench.SCALES["full"]["w3"]
    rng = random.Random(0)
    assert w3.prompt_lengths() == [rng.randint(100, 1024) for _ in range(256)]
    assert w3.expected_tokens == 256 * 512
    prompts = bench.random_prompts([5, 300], seed=3, vocab_size=151936)
    assert prompts == bench.random_prompts([5, 300], seed=3, vocab_size=151936)
    assert [len(p) for p in prompts] == [5, 300]
    assert all(10 <= t < 10000 for p in prompts for t in p)
    tiny = bench.random_prompts([2000], seed=0, vocab_size=1000)[0]
    assert min(tiny) >= 10 and max(tiny) < 1000
    assert bench.shape_config("llama-3.1-8b").eos_token_id is None


def test_parse_list() -> None:
    assert bench.parse_list("all", bench.WORKLOAD_NAMES, "workload", all_value="all") == list(bench.WORKLOAD_NAMES)
    assert bench.parse_list("w3,w1", bench.WORKLOAD_NAMES, "workload") == ["w1", "w3"]
    assert bench.parse_list("none", bench.ANCHOR_NAMES, "anchor") == []
    with pytest.raises(ValueError):
        bench.parse_list("w9", bench.WORKLOAD_NAMES, "workload")


def test_agreement() -> None:
    assert bench.agreement([[1, 2, 3]], [[1, 2, 3]])["rows_equal"] == 1
    a = bench.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert a["rows_equal"] == 1 and a["first_divergence"] == {"row": 1, "step": 1}
    assert a["mean_common_prefix"] == 2.0


def test_plot_without_matplotlib_is_a_clear_usage_error(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert bench.main(["--plot", str(tmp_path / "p.png"), *TINY]) == 2
    assert "matplotlib" in capsys.readouterr().err


# -------------------------------------------------------------------------------------- end to end (fake API)
def _fake_api(corrupt: bool) -> types.ModuleType:
    """Stands in for hf_accel.api: 'accelerates' by wrapping generate; `corrupt` makes our tokens wrong."""
    api = types.ModuleType("hf_accel.api")

    def accelerate_model(model, **kw):
        stock = type(model).generate
        backend = kw.get("attention_backend", "auto")

        def generate(self, *a, **k):
            out = stock(self, *a, **k)
            if corrupt and backend != "torch":
                out = out.clone()
                out[:, -1] = (out[:, -1] + 1) % 1000
            return out

        model.generate = types.MethodType(generate, model)
        model._fake_backend = backend
        return model

    def restore(model):
        model.__dict__.pop("generate", None)
        model.__dict__.pop("_fake_backend", None)
        return model

    def engine_info(model):
        return {"attention_backend": model._fake_backend, "cudagraph_mode": "none", "compile": False,
                "startup": {"patch_s": 0.0, "kv_cache_s": 0.0, "compile_s": 0.0, "capture_s": 0.0, "total_s": 0.0}}

    api.accelerate_model, api.restore, api.engine_info = accelerate_model, restore, engine_info
    return api


@pytest.mark.parametrize("corrupt", [False, True])
def test_guard_marks_wrong_tokens_invalid(monkeypatch, tmp_path, corrupt: bool) -> None:
    monkeypatch.setitem(sys.modules, "hf_accel.api", _fake_api(corrupt))
    path = tmp_path / "b.json"
    rc = bench.main(["--workload", "w1", "--json", str(path), "--anchors", "eager", *TINY, "--warmup", "0"])
    report = json.loads(path.read_text())
    ours = [report["workloads"]["w1"]["methods"]["ours"]]
    assert report["guard"]["passed"] is (not corrupt)
    assert rc == (1 if corrupt else 0)
    for rec in ours:
        assert rec["valid"] is (not corrupt)
        assert (rec["median_tokens_per_s"] is None) is corrupt
        assert len(rec["run_s"]) == 1 and rec["warmup_s"] == [] and rec["tokens"] == [32]
    assert report["workloads"]["w1"]["methods"]["eager"]["valid"] is True  # the stock anchor is unaffected
    if corrupt:
        assert report["guard"]["cases"]["batch1"]["agreement"]["first_divergence"] == {"row": 0, "step": 7}


# ------------------------------------------------------------------------------------- end to end (real API)
needs_api = pytest.mark.skipif(not API_LANDED, reason="hf_accel/api.py not there yet")


@needs_api
def test_bench_w1_tiny_cpu(tmp_path, capsys) -> None:
    path = tmp_path / "b.json"
    rc = bench.main(["--workload", "w1", "--json", str(path), "--anchors", "eager,static", "--anchor-warmup", "0",
                     *TINY])
    out = capsys.readouterr().out
    report = json.loads(path.read_text())
    assert rc == 0, out

    versions = report["env"]["versions"]
    for lib in ("torch", "transformers", "triton", "flashinfer", "flash-attn"):
        assert versions[lib]  # a version or "absent"
    assert versions["torch"] == torch.__version__
    assert "gpu_name" in report["env"]

    assert report["accel"]["config"]["num_kv_blocks"] == 256  # the resolved AccelConfig
    info = report["accel"]["engine_info"]
    assert info["attention_backend"] and "startup" in info

    assert report["guard"]["passed"] is True
    w1 = report["workloads"]["w1"]
    assert w1["spec"]["num_requests"] == 1 and w1["spec"]["new_tokens"] == 32
    assert set(w1["methods"]) == {"ours", "eager", "static"}
    for name, rec in w1["methods"].items():
        assert rec["valid"] is True
        # "static" always gets one warm-up: its first call is transformers compiling
        assert len(rec["run_s"]) == 1 and len(rec["warmup_s"]) == (1 if name in ("ours", "static") else 0)
        assert rec["tokens"] == [32]
        assert rec["median_tokens_per_s"] > 0
    assert w1["ratios"]["ours/eager"] > 0
    assert w1["roofline_tokens_per_s"] is None  # CPU: no HBM roofline
    assert w1["agreement_with_stock"]["rows_equal"] == 1  # float32 on CPU: stock and ours agree exactly
    assert "hf_accel" in out and "correctness guard: PASS" in out and "stock generate (eager, sdpa)" in out


@needs_api
def test_bench_startup_inline_tiny_cpu(tmp_path) -> None:
    path = tmp_path / "s.json"
    rc = bench.main(["--workload", "startup", "--startup-isolation", "inline", "--json", str(path), *TINY])
    report = json.loads(path.read_text())
    assert rc == 0
    for phase in ("cold", "warm"):
        rec = report["startup"][phase]
        assert rec["valid"] is True
        assert rec["total_s"] == pytest.approx(rec["accelerate_s"] + rec["first_token_s"])
        assert set(rec["engine_startup"]) >= {"patch_s", "kv_cache_s", "compile_s", "capture_s", "total_s"}


@needs_api
def test_bench_w2_w3_tiny_cpu_without_anchors(tmp_path) -> None:
    path = tmp_path / "b.json"
    rc = bench.main(["--workload", "w2,w3", "--anchors", "none", "--json", str(path), *TINY, "--warmup", "0"])
    report = json.loads(path.read_text())
    assert rc == 0 and report["valid"] is True
    assert set(report["guard"]["cases"]) == {"batch1", "ragged4", "batch8", "generate_batch"}
    for w, expected in (("w2", 8 * 32), ("w3", 16 * 32)):
        methods = report["workloads"][w]["methods"]
        assert set(methods) == {"ours"}
        assert methods["ours"]["tokens"] == [expected] and methods["ours"]["valid"] is True


@needs_api
def test_bench_threads_tiny_cpu(tmp_path) -> None:
    """The threads workload reports its figure and the ratio to W2; each thread gets what one call alone gets."""
    path = tmp_path / "t.json"
    rc = bench.main(["--workload", "threads,w2", "--threads", "4", "--anchors", "eager", "--json", str(path), *TINY,
                     "--warmup", "0"])
    report = json.loads(path.read_text())
    assert rc == 0 and report["valid"] is True
    assert list(report["workloads"]) == ["w2", "threads"]  # measured (and shown) beside W2
    threads = report["workloads"]["threads"]
    assert threads["spec"]["num_requests"] == 4 and threads["spec"]["new_tokens"] == 32
    assert set(threads["methods"]) == {"ours"}  # no stock anchor for it
    assert "anchors_note" in threads
    ours = threads["methods"]["ours"]
    assert ours["valid"] is True and ours["tokens"] == [4 * 32] and ours["median_tokens_per_s"] > 0
    w2 = report["workloads"]["w2"]["methods"]["ours"]["median_tokens_per_s"]
    assert threads["threads_vs_w2"] == pytest.approx(ours["median_tokens_per_s"] / w2)
    assert report["guard"]["cases"]["threads4"]["ok"] is True

    from hf_accel.api import accelerate_model, restore

    cpu = torch.device("cpu")
    model = bench.build_model("tiny", None, torch.float32, cpu)
    prompts = bench.random_prompts([16, 5, 16, 11, 16, 3], seed=7, vocab_size=model.config.vocab_size)
    reference = [bench.call_generate(model, [p], 12, cpu)().tokens[0] for p in prompts]  # stock, one call each
    accelerate_model(model, num_kv_blocks=256)
    try:
        out = bench.call_threads(model, prompts, 12, cpu)()
    finally:
        restore(model)
    assert out.problems == [] and out.seconds > 0
    assert out.tokens == reference


@needs_api
def test_bench_w5_serving_tiny_cpu(tmp_path) -> None:
    """hf-accel serve under streamed load at a Poisson rate and all at once, beside the same requests offline."""
    for module in ("fastapi", "uvicorn", "openai"):
        pytest.importorskip(module)
    path = tmp_path / "w5.json"
    rc = bench.main(["--workload", "w5", "--w5-rates", "32,all", "--w5-requests", "8", "--anchors", "none",
                     "--json", str(path), *TINY])
    report = json.loads(path.read_text())
    w5 = report["w5"]
    assert rc == 0 and report["valid"] is True and w5["valid"] is True, w5["reasons"]
    lengths, max_tokens = bench.SERVING_SCALES["tiny"].draws()
    assert w5["spec"]["expected_tokens"] == sum(max_tokens[:8])
    assert set(w5["rates"]) == {"32", "all"} and w5["headline_rate"] == "32"
    for entry in w5["rates"].values():
        run = entry["runs"][0]
        assert run["problems"] == [] and run["tokens"] == sum(max_tokens[:8])
        for key in ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
            assert entry["median"][key] > 0
        assert entry["median"]["ttft_p50_s"] <= entry["median"]["ttft_p99_s"]
    offline = w5["offline"]
    assert offline["valid"] is True and offline["tokens"] == [sum(max_tokens[:8])]
    assert offline["calls_per_run"] == len(set(max_tokens[:8]))
    assert w5["server_vs_offline"] == pytest.approx(
        w5["rates"]["32"]["median"]["tokens_per_s"] / offline["median_tokens_per_s"])
    assert w5["stock"] is None  # --anchors none
    # float32 on CPU: the server's streamed text maps back to exactly the offline tokens, request by request
    assert w5["agreement_with_offline"]["rows_equal"] == 8
    assert w5["server"]["exit_code"] == 0


@needs_api
@pytest.mark.slow
def test_w5_stock_anchor_keeps_each_request_count() -> None:
    """Stock continuous batching with per-request max_new_tokens (or the grouped fallback) gives every request
    exactly its count."""
    from hf_accel.bench import serving

    model = bench.build_model("tiny", None, torch.float32, torch.device("cpu"))
    prompts = bench.random_prompts([12, 30, 7], seed=3, vocab_size=1000)
    out = serving.call_stock_per_request(model, prompts, [3, 6, 4])()
    assert out.problems == [] and [len(t) for t in out.tokens] == [3, 6, 4] and out.seconds > 0
    reference = [bench.call_generate(model, [p], m, torch.device("cpu"))().tokens[0]
                 for p, m in zip(prompts, [3, 6, 4], strict=True)]
    assert out.tokens == reference


@needs_api
@pytest.mark.slow
def test_bench_startup_fresh_processes_tiny_cpu(tmp_path) -> None:
    path = tmp_path / "s.json"
    assert bench.main(["--workload", "startup", "--json", str(path), *TINY]) == 0
    report = json.loads(path.read_text())
    assert report["startup"]["isolation"] == "process"
    assert all(report["startup"][p]["valid"] and report["startup"][p]["process_wall_s"] > 0 for p in ("cold", "warm"))
    assert all(isinstance(report["startup"][p]["triton_kernels_built"], int) for p in ("cold", "warm"))


def test_startup_counts_triton_builds(tmp_path) -> None:
    from hf_accel.bench.startup import triton_builds

    assert triton_builds(str(tmp_path / "absent")) == 0
    for key, name in (("AAA", "kernel_a"), ("BBB", "kernel_a"), ("CCC", "kernel_b")):
        (tmp_path / key).mkdir()
        (tmp_path / key / f"__grp__{name}.json").write_text("{}")
        (tmp_path / key / f"{name}.json").write_text("{}")  # the kernel's metadata: not counted again
    assert triton_builds(str(tmp_path)) == 3


def test_plot_from_a_report(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    report = {"model": {"name": "tiny"}, "env": {"gpu_name": None}, "startup": None, "workloads": {
        "w1": {"spec": {"title": "W1 latency"}, "roofline_tokens_per_s": 1000.0, "methods": {
            "ours": {"median_tokens_per_s": 500.0}, "eager": {"median_tokens_per_s": None}}}}}
    bench.write_plot(report, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.parametrize(("leads", "ok"), [((0.0, 0.0), True), ((0.2, 0.1), True), ((0.0, 0.3), False)])
def test_guard_accepts_only_near_ties_at_every_step(monkeypatch, leads, ok) -> None:
    cases = [bench.GuardCase("b2", "generate", [[11, 12], [13, 14]], 4)]
    guard = bench.compare_guard(cases, {"b2": [[1, 2, 3, 4], [5, 6, 7, 8]]}, {"b2": [[1, 2, 9, 9], [5, 6, 7, 8]]})
    assert guard["passed"] is False
    assert guard["cases"]["b2"]["divergences"] == [{"row": 0, "step": 2, "ours": 3, "ours_row": [1, 2, 3, 4]}]
    seen = {}

    def fake_margins(model, case, divergences, device):
        seen["rows"] = [d["row"] for d in divergences]
        # steps 2 and 3 of row 0; top logit 3.0, where a bf16 ulp is 2**-6 (16 ulps = 0.25)
        return [[(2, leads[0], 3.0), (3, leads[1], 3.0)]]

    monkeypatch.setattr(bench_guard, "reference_margins", fake_margins)  # looked up in the guard module
    bench.judge_near_ties(guard, cases, None, torch.device("cpu"), torch.bfloat16)
    assert seen["rows"] == [0]
    assert guard["passed"] is ok and guard["cases"]["b2"]["ok"] is ok
    assert guard["near_ties"] == (1 if ok else 0)
    div = guard["cases"]["b2"]["divergences"][0]
    assert div["worst_lead"] == max(leads) and div["worst_step"] == 2 + leads.index(max(leads))


# stock's own steps (lead, top 3.0: margin 0.25): clean; noisy (1 of 4 beyond, up to 0.5); noisy but never as far
@pytest.mark.parametrize(("own", "ok"), [([0.0, 0.1, 0.0, 0.2], False), ([0.0, 0.5, 0.0, 0.1], True),
                                         ([0.0, 0.28, 0.0, 0.1], False), (None, False)])
def test_guard_widens_a_margin_only_to_stocks_own_spread(monkeypatch, own, ok) -> None:
    """A lead beyond the dtype's rounding passes only where stock's own tokens for the same rows, judged the same
    way, stray beyond it as often and as far; measuring that failing keeps the row failed."""
    cases = [bench.GuardCase("b2", "generate", [[11, 12], [13, 14]], 4)]
    guard = bench.compare_guard(cases, {"b2": [[1, 2, 3, 4], [5, 6, 7, 8]]}, {"b2": [[1, 2, 9, 9], [5, 6, 7, 8]]})
    monkeypatch.setattr(bench_guard, "reference_margins", lambda m, c, d, dev: [[(2, 0.3, 3.0), (3, 0.1, 3.0)]])
    seen = {}

    def fake_noise(model, case, rows, device):
        seen["rows"] = rows
        if own is None:
            raise RuntimeError("generate failed")
        return [[(s, lead, 3.0) for s, lead in enumerate(own)]]

    monkeypatch.setattr(bench_guard, "stock_self_noise", fake_noise)
    bench.judge_near_ties(guard, cases, None, torch.device("cpu"), torch.bfloat16)
    entry = guard["cases"]["b2"]
    assert seen["rows"] == [0] and guard["passed"] is ok and entry["ok"] is ok
    text = bench.format_report({"guard": guard, "workloads": {}, "env": {}, "model": {"name": "t"}, "accel": {}})
    if own is None:
        assert "generate failed" in entry["noise_error"] and "stock_self_noise" not in guard
        assert "generate failed" in text
    else:
        assert entry["stock_self_noise"] == pytest.approx(max(0.0, max(own) - 0.25))  # beyond stock's margin
        assert entry["stock_self_spread"]["ours_beyond_margin"] == 0  # the parting step is not counted, only capped
        assert entry["divergences"][0].get("within_stock_self_noise", False) is ok
    assert ("within stock's own spread" in text) is ok and ("PASS" in text) is ok


@pytest.mark.parametrize(("kernel_own", "ok"), [([0.0, 0.5, 0.0, 0.1], True), ([0.0, 0.1, 0.0, 0.2], False)])
def test_guard_holds_ours_to_what_a_change_of_attention_kernel_does_to_stock(monkeypatch, kernel_own, ok) -> None:
    """Stock's tokens can be clean between decoding and scoring (the same kernel on the prompt both times) and still
    stray once only the attention kernel changes, as ours does on every token: a model that quantizes activations
    turns last-bit changes into quantization steps. The guard measures that too and holds ours to the noisier of
    the two; where both are clean the strict rule stands."""
    cases = [bench.GuardCase("b2", "generate", [[11, 12], [13, 14]], 4)]
    guard = bench.compare_guard(cases, {"b2": [[1, 2, 3, 4], [5, 6, 7, 8]]}, {"b2": [[1, 2, 9, 9], [5, 6, 7, 8]]})
    monkeypatch.setattr(bench_guard, "reference_margins", lambda m, c, d, dev: [[(2, 0.3, 3.0), (3, 0.1, 3.0)]])
    calls = []

    def fake_noise(model, case, rows, device, attention=None):
        calls.append(attention)
        own = kernel_own if attention == "eager" else [0.0, 0.1, 0.0, 0.0]
        return [[(s, lead, 3.0) for s, lead in enumerate(own)]]

    class Stock:  # what the guard reads of the stock model
        config = types.SimpleNamespace(_attn_implementation="sdpa")

        def set_attn_implementation(self, name):
            raise AssertionError("stock_self_noise is faked here")

    monkeypatch.setattr(bench_guard, "stock_self_noise", fake_noise)
    bench.judge_near_ties(guard, cases, Stock(), torch.device("cpu"), torch.bfloat16)
    assert calls == [None, "eager"] and guard["passed"] is ok
    text = bench.format_report({"guard": guard, "workloads": {}, "env": {}, "model": {"name": "t"}, "accel": {}})
    assert ("eager attention vs sdpa" in text) is ok


def test_stock_self_noise_with_another_attention_kernel_puts_the_model_back() -> None:
    model = bench.build_model("tiny", None, torch.float32, torch.device("cpu"))
    bench.disable_eos(model)
    before = model.config._attn_implementation
    case = bench.GuardCase("c", "generate", bench.random_prompts([5, 9], seed=2,
                                                                  vocab_size=model.config.vocab_size), 6)
    other = "eager" if before != "eager" else "sdpa"
    steps = bench.stock_self_noise(model, case, [0, 1], torch.device("cpu"), attention=other)
    assert model.config._attn_implementation == before
    assert [len(row) for row in steps] == [6, 6]
    assert all(0.0 <= lead < 1e-4 for row in steps for _, lead, _ in row)  # float32: kernels agree to rounding


M = 0.25  # a bf16 margin (top logit 3.0)
NOISY = [(0.4, M)] * 3 + [(0.0, M)] * 7  # stock's own tokens: 30 % of steps beyond the margin, by up to 0.15


@pytest.mark.parametrize(("ours_rows", "own", "within"), [
    ([[(0.3, M)] * 10], [(0.0, M)] * 9 + [(0.5, M)], False),  # a runner-up at every step: far more often
    ([[(0.3, M)] * 2 + [(0.0, M)] * 8], NOISY, True),
    ([[(0.6, M)] + [(0.0, M)] * 9], NOISY, False),  # further beyond the margin than stock ever is
    ([[(0.3, M)]], [(0.0, M)] * 10, False),  # stock clean: nothing beyond the margin, even once
    # stock clean, its largest lead (0.45) within a wider margin (0.5) elsewhere: ours passing its own is still out
    ([[(0.4, 0.125)]], [(0.45, 0.5)] + [(0.0, M)] * 9, False),
    ([[(0.3, M), (math.nan, M)]], NOISY, False),  # a NaN lead never passes
    # one row wrong at every step among clean rows: judged per row, the others buy it nothing
    ([[(0.3, M)] * 32] + [[(0.3, M)] + [(0.0, M)] * 31] * 7, [(0.3, M)] * 26 + [(0.0, M)] * 230, False),
    # every row parting late at a contested step, as stock's own tokens would: the parting step is not counted
    ([[(0.3, M), (0.3, M), (0.0, M)]] * 8, NOISY * 8, True),
])
def test_within_stock_spread_per_row_how_often_and_how_far(ours_rows, own, within) -> None:
    assert bench.within_stock_spread(ours_rows, own)["within"] is within


def test_stock_self_noise_is_nil_in_float32() -> None:
    """Stock's greedy tokens scored by its own teacher-forced forward: in float32 the two agree to rounding, so
    the guard's margin is not widened for plain models."""
    model = bench.build_model("tiny", None, torch.float32, torch.device("cpu"))
    bench.disable_eos(model)
    case = bench.GuardCase("c", "generate", bench.random_prompts([5, 9, 7], seed=2,
                                                                  vocab_size=model.config.vocab_size), 6)
    steps = bench.stock_self_noise(model, case, [0, 2], torch.device("cpu"))
    assert [len(row) for row in steps] == [6, 6]
    assert all(0.0 <= lead < 1e-4 for row in steps for _, lead, _ in row)


def test_tie_margin_scales_with_the_top_logit_and_dtype() -> None:
    assert bench.tie_margin_for(torch.bfloat16, 3.0) == 16 * 2.0**-6
    assert bench.tie_margin_for(torch.bfloat16, -5.0) == 16 * 2.0**-5
    assert bench.tie_margin_for(torch.bfloat16, 25.0) == bench.GUARD_TIE_CAP  # real checkpoints: capped
    assert bench.tie_margin_for(torch.float16, 3.0) == 16 * 2.0**-9
    assert bench.tie_margin_for(torch.float32, 3.0) < 1e-5  # CPU float32 runs stay strict


def test_reference_margins_are_teacher_forced_on_our_tokens() -> None:
    model = bench.build_model("tiny", None, torch.float32, torch.device("cpu"))
    bench.disable_eos(model)
    prompts = bench.random_prompts([5, 9], seed=1, vocab_size=model.config.vocab_size)
    case = bench.GuardCase("c", "generate", prompts, 4)
    divs = [{"row": 1, "step": 1, "ours": 42, "ours_row": [11, 42, 13, 14]},
            {"row": 0, "step": 0, "ours": 7, "ours_row": [7, 8, 9, 10]}]
    per_row = bench.reference_margins(model, case, divs, torch.device("cpu"))
    for d, steps in zip(divs, per_row, strict=True):
        assert [s for s, _, _ in steps] == list(range(d["step"], 4))  # every step from the divergence on
        for s, lead, top in steps:
            with torch.no_grad():
                logits = model(torch.tensor([prompts[d["row"]] + d["ours_row"][:s]])).logits[0, -1].float()
            assert top == pytest.approx(float(logits.max()), abs=1e-4)
            assert lead == pytest.approx(float(logits.max() - logits[d["ours_row"][s]]), abs=1e-4)


def test_quantization_option_and_stored_weight_bytes() -> None:
    """--quantization: the model the bench measures is quantized, and its weight bytes are what it stores (the
    roofline and the bandwidth column use them)."""
    pytest.importorskip("torchao")
    dev = torch.device("cpu")
    plain = bench.build_model("tiny", None, torch.float32, dev)
    quant = bench.build_model("tiny", None, torch.float32, dev, "torchao-int8-weight-only")
    assert type(quant.model.layers[0].self_attn.q_proj.weight).__name__ != "Parameter"
    linear = sum(m.weight.numel() for m in plain.modules() if isinstance(m, torch.nn.Linear))
    # int8 weights (1 byte instead of 4) plus per-row scales: at least 2.5 bytes saved per linear weight
    assert bench.weight_bytes(plain) - bench.weight_bytes(quant) >= 2.5 * linear - 4 * plain.lm_head.weight.numel()
    assert "torchao-int8-weight-only" in bench.QUANTIZATION_METHODS


def test_resolved_config_of_switches_and_piecewise_sizes_is_recorded():
    """The bench records the config accelerate_model resolves, also when an option lives only in AccelConfig
    (`--piecewise-capture-sizes`, `--no-pdl`): such options travel as `config=` beside the keywords."""
    import argparse

    from hf_accel.bench.cli import add_arguments
    from hf_accel.bench.environment import _accel_argv, accel_kwargs, resolved_accel_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--piecewise-capture-sizes", "8,1,64", "--no-pdl", "--max-num-seqs", "32",
                              "--split-mixed-attention"])
    kwargs = accel_kwargs(args)
    cfg = resolved_accel_config(kwargs, torch.device("cuda"))
    assert "error" not in cfg, cfg
    assert cfg["piecewise_capture_sizes"] == [1, 8, 64] and cfg["pdl"] is False and cfg["max_num_seqs"] == 32
    assert cfg["split_mixed_attention"] is True
    argv = _accel_argv(args)
    assert argv[argv.index("--piecewise-capture-sizes") + 1] == "8,1,64"

    args = parser.parse_args(["--no-combo-kernels", "--no-gated-gemm"])  # both on by default: the A/B's off side
    cfg = resolved_accel_config(accel_kwargs(args), torch.device("cuda"))
    assert cfg["combo_kernels"] is False and cfg["gated_gemm"] is False
    argv = _accel_argv(args)  # what a startup child is given
    assert "--no-combo-kernels" in argv and "--no-gated-gemm" in argv
    assert resolved_accel_config(accel_kwargs(parser.parse_args([])), torch.device("cuda"))["combo_kernels"] is True


def test_startup_report_flags_rebuilds_and_a_missing_bytecode_cache() -> None:
    def start(built: int) -> dict:
        return {"valid": True, "total_s": 9.0, "accelerate_s": 8.9, "first_token_s": 0.1, "triton_kernels_built": built,
                "engine_startup": {"patch_s": 0.2, "kv_cache_s": 1.0, "compile_s": 4.4, "capture_s": 3.5}}

    def report(built: int, bytecode: bool) -> str:
        return bench.format_report({"workloads": {}, "env": {"python_bytecode_cache": bytecode}, "model": {"name": "t"},
                                    "accel": {}, "startup": {"isolation": "process", "cold": start(40),
                                                             "warm": start(built)}})

    text = report(3, False)
    assert "rebuilt 3 Triton kernel(s)" in text and "no Python bytecode cache" in text
    text = report(0, True)
    assert "rebuilt" not in text and "bytecode" not in text
