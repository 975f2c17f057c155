"""The model changes under the engine: training steps, edits through `.data`, PEFT adapters, restore() mid-call.

Every case compares with a stock (never accelerated) copy that went through the same change, and with the same
call with the prefix cache off, so a stale cached prefix, a stale compiled forward or a lost update shows up as a
token difference. Tiny float32 models on the CPU.
"""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
from conftest import PROMPTS, left_pad, make_llama, small_stock_cb

from hf_accel import accelerate_model, restore
from hf_accel.api import engine_info

peft = pytest.importorskip("peft")

# a shared prefix of two full blocks (block_size 16), so a repeated call is served from the prefix cache
LONG = [(7 * i + 3) % 190 + 5 for i in range(40)]
GEN = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)


def batch():
    return left_pad([LONG, LONG[:35] + [9, 9], PROMPTS[0]])


def run(model) -> torch.Tensor:
    ids, mask = batch()
    return model.generate(input_ids=ids, attention_mask=mask, **GEN)


def hits(model) -> int:
    return model._hf_accel_state.engine.scheduler.prefix_hit_tokens if hasattr(model, "_hf_accel_state") else 0


@pytest.fixture
def pair():
    """(stock, accelerated) with the same weights; the accelerated one uses 16-token blocks."""
    torch.manual_seed(0)
    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock), block_size=16)
    yield stock, accel
    restore(accel)


def assert_fresh_equal(stock, accel) -> None:
    """The repeated call equals stock, and equals a prefix-cache-free engine on the same weights."""
    got = run(accel)
    assert torch.equal(got, run(stock))
    uncached = accelerate_model(copy.deepcopy(accel), block_size=16, enable_prefix_caching=False)
    assert torch.equal(got, run(uncached))


# -- weights edited behind the version counters ------------------------------------------------------------------
@pytest.mark.parametrize("edit", ["data_mul", "data_flip_columns", "data_roll_rows", "no_grad_copy", "one_element"])
def test_prefix_cache_never_serves_kv_of_other_weights(pair, edit):
    stock, accel = pair
    assert torch.equal(run(accel), run(stock))
    before = hits(accel)
    assert torch.equal(run(accel), run(stock)) and hits(accel) > before  # the cache is in use

    def apply(m):
        w = m.model.layers[0].self_attn.v_proj.weight
        if edit == "data_mul":
            w.data.mul_(1.7)  # `.data` has a fresh version counter: the parameter's own does not move
        elif edit == "data_flip_columns":
            w.data.copy_(w.data.flip(-1))  # same values, same sums per row: only positions change
        elif edit == "data_roll_rows":
            w.data.copy_(w.data.roll(1, 0))
        elif edit == "no_grad_copy":
            with torch.no_grad():
                w.copy_(torch.randn_like(w) * 0.1)
        else:
            w.data[3, 5] = torch.nextafter(w.data[3, 5], torch.tensor(1.0))  # one ulp of one element

    torch.manual_seed(1)
    apply(stock)
    torch.manual_seed(1)
    apply(accel)
    before = hits(accel)
    assert_fresh_equal(stock, accel)
    assert hits(accel) == before, "a prefix computed under the old weights was reused"


def test_version_only_check_is_documented_blind_to_data_edits():
    """prefix_cache_weight_check="version" trusts version counters: an in-place optimizer-style update is seen."""
    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock), block_size=16, config=None)
    from hf_accel.config import AccelConfig

    accel = accelerate_model(accel, config=AccelConfig(block_size=16, prefix_cache_weight_check="version"))
    run(accel)
    for m in (stock, accel):
        with torch.no_grad():
            m.model.layers[1].mlp.down_proj.weight.mul_(1.3)
    before = hits(accel)
    assert torch.equal(run(accel), run(stock))
    assert hits(accel) == before
    with pytest.raises(ValueError, match="prefix_cache_weight_check"):
        accelerate_model(accel, config=AccelConfig(prefix_cache_weight_check="never"))
    restore(accel)


# -- PEFT ----------------------------------------------------------------------------------------------------------
def lora(model, name="default", seed=0):
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"],
                          init_lora_weights=False)
    if isinstance(model, peft.PeftModel):
        model.add_adapter(name, cfg)
        return model
    return peft.get_peft_model(model, cfg, adapter_name=name)


def two_adapter_pair(accelerate_first: bool):
    stock = lora(lora(make_llama(0), "a", seed=1), "b", seed=2)
    base = make_llama(0)
    if accelerate_first:
        accelerate_model(base, block_size=16)
        accel = lora(lora(base, "a", seed=1), "b", seed=2)
    else:
        accel = accelerate_model(lora(lora(base, "a", seed=1), "b", seed=2), block_size=16)
    for m in (stock, accel):
        m.set_adapter("a")
    return stock, accel


@pytest.mark.parametrize("accelerate_first", [True, False], ids=["accelerate-then-wrap", "wrap-then-accelerate"])
def test_peft_both_ways_adapters_switched_and_disabled(accelerate_first):
    stock, accel = two_adapter_pair(accelerate_first)
    plain = run(make_llama(0))
    assert engine_info(accel)["attention_backend"] == "torch"
    seen = []
    for step in ["a", "a", "b", "disabled", "a", "b", "merged-a", "unmerged", "b"]:
        if step == "disabled":
            with stock.disable_adapter(), accel.disable_adapter():
                got, want = run(accel), run(stock)
            assert torch.equal(got, plain)
        elif step == "merged-a":
            for m in (stock, accel):
                m.set_adapter("a")
                m.merge_adapter()  # writes the LoRA product into the base weights through `.data`
            got, want = run(accel), run(stock)
        elif step == "unmerged":
            for m in (stock, accel):
                m.unmerge_adapter()
            got, want = run(accel), run(stock)
        else:
            for m in (stock, accel):
                m.set_adapter(step)
            got, want = run(accel), run(stock)
        assert torch.equal(got, want), step
        seen.append(got)
    assert not torch.equal(seen[0], seen[2]), "adapters a and b should give different tokens on this model"
    restore(accel)
    assert not hasattr(accel.get_base_model(), "_hf_accel_state")
    assert torch.equal(run(accel), run(stock))


def test_restore_and_reaccelerate_a_peft_model():
    stock = lora(make_llama(0))
    base = make_llama(0)
    accelerate_model(base)
    accel = lora(base)
    accelerate_model(accel, block_size=32)  # on the PeftModel: acts on its base model
    assert engine_info(accel)["block_size"] == 32
    assert torch.equal(run(accel), run(stock))
    assert restore(accel) is accel
    assert "generate" not in accel.get_base_model().__dict__
    assert torch.equal(run(accel), run(stock))


# -- training while accelerated ------------------------------------------------------------------------------------
def loss_and_grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_training_steps_between_generate_calls():
    """Plain forward and backward are stock's exactly (padded batch); after AdamW steps generate() uses the new
    weights, on the same engine, without a prefix from the old weights."""
    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock), block_size=16)
    engine = accel._hf_accel_state.engine
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (stock, accel)]
    ids, mask = batch()
    for it in range(3):
        assert torch.equal(run(accel), run(stock)), it
        for m in (stock, accel):
            m.train()
        (loss_s, grads_s), (loss_a, grads_a) = loss_and_grads(stock, ids, mask), loss_and_grads(accel, ids, mask)
        assert torch.equal(loss_s, loss_a)
        for name in grads_s:
            assert torch.equal(grads_s[name], grads_a[name]), name
        for opt in opts:
            opt.step()
        for m in (stock, accel):
            m.eval()
    assert torch.equal(run(accel), run(stock))
    assert accel._hf_accel_state.engine is engine  # same engine: nothing rebuilt by weight updates
    with torch.no_grad():  # a plain eval forward with a KV cache (DynamicCache), as evaluation code does
        a = accel(input_ids=ids, attention_mask=mask, use_cache=True)
        s = stock(input_ids=ids, attention_mask=mask, use_cache=True)
    assert torch.equal(a.logits, s.logits)
    restore(accel)


def test_compiled_engine_keeps_its_compiled_code_across_optimizer_steps():
    """compile=True (CPU Inductor): a training step runs the stock modules; the next generate() reuses the compiled
    forward (no new trace) and reads the updated weights in place."""
    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock), compile=True, block_size=16)
    runner = accel._hf_accel_state.engine.runner
    piecewise = runner.piecewise
    assert piecewise is not None
    traced = piecewise.stats.trace_seconds
    assert torch.equal(run(accel), run(stock))
    ids, mask = batch()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (stock, accel)]
    grads = [loss_and_grads(m, ids, mask)[1] for m in (stock, accel)]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0)
    for opt in opts:
        opt.step()
    assert torch.equal(run(accel), run(stock))
    assert accel._hf_accel_state.engine.runner.piecewise is piecewise and piecewise.stats.trace_seconds == traced
    restore(accel)


def test_compiled_engine_rebuilt_when_an_adapter_is_added(caplog):
    """Compiled code froze the module tree: wrapping with PEFT afterwards rebuilds it (logged), never serves the
    forward without the adapter."""
    stock = lora(make_llama(0))
    base = make_llama(0)
    accelerate_model(base, compile=True, block_size=16)
    accel = lora(base)
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        assert torch.equal(run(accel), run(stock))
    assert "accelerating it again" in caplog.text
    assert base._hf_accel_state.engine.runner.piecewise is not None
    restore(accel)


# -- restore() and threads -------------------------------------------------------------------------------------------
class _GateStreamer:
    """Blocks the generating thread after its first tokens until released."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.puts = 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 3:
            self.started.set()
            assert self.release.wait(30)

    def end(self) -> None:
        pass


def test_restore_waits_for_a_running_call():
    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock))
    ids, mask = batch()
    want = stock.generate(input_ids=ids, attention_mask=mask, **GEN)
    streamer = _GateStreamer()
    result: dict = {}

    def call():
        result["out"] = accel.generate(input_ids=ids, attention_mask=mask, streamer=streamer, **GEN)

    worker = threading.Thread(target=call)
    worker.start()
    assert streamer.started.wait(30)
    restorer = threading.Thread(target=restore, args=(accel,))
    restorer.start()
    restorer.join(0.5)
    assert restorer.is_alive(), "restore() returned while generate() was running"
    assert hasattr(accel, "_hf_accel_state")
    streamer.release.set()
    worker.join(30)
    restorer.join(30)
    assert torch.equal(result["out"], want)
    assert not hasattr(accel, "_hf_accel_state")


def test_restore_from_inside_the_running_call_raises():
    accel = accelerate_model(make_llama(0))
    ids, mask = batch()

    class Restorer:
        error = None

        def put(self, value):
            if self.error is None:
                try:
                    restore(accel)
                except RuntimeError as exc:
                    self.error = exc

        def end(self):
            pass

    streamer = Restorer()
    out = accel.generate(input_ids=ids, attention_mask=mask, streamer=streamer, **GEN)
    assert streamer.error is not None and "inside a running generate" in str(streamer.error)
    assert torch.equal(out, run(make_llama(0)))
    restore(accel)


def test_many_threads_one_model_and_two_models_in_two_threads():
    """Concurrent calls on one model each get exactly their own answer; two accelerated models stepping in two
    threads never see each other's step (the forward context is per thread)."""
    stock_a, stock_b = make_llama(0), make_llama(5)
    accel_a = accelerate_model(copy.deepcopy(stock_a))
    accel_b = accelerate_model(copy.deepcopy(stock_b))
    rows = [PROMPTS[i % 3][: 3 + i % 5] for i in range(8)]
    want = {(k, i): m.generate(input_ids=torch.tensor([r]), **GEN) for k, m in (("a", stock_a), ("b", stock_b))
            for i, r in enumerate(rows)}
    got: dict = {}
    errors: list = []

    def work(key, model):
        try:
            for _ in range(2):
                for i, r in enumerate(rows):
                    got[(key, i)] = model.generate(input_ids=torch.tensor([r]), **GEN)
                    assert torch.equal(got[(key, i)], want[(key, i)]), (key, i)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k, m)) for k, m in
               [("a", accel_a), ("b", accel_b), ("a", accel_a), ("b", accel_b), ("a", accel_a), ("b", accel_b)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    restore(accel_a)
    restore(accel_b)


# -- bad input ids and small items -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.float16, torch.int16])
def test_non_integer_input_ids_raise_the_stock_error(dtype):
    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock))
    ids = torch.tensor([[5, 6, 7]]).to(dtype)
    with pytest.raises(Exception) as stock_err:
        stock.generate(ids, max_new_tokens=2, do_sample=False)
    with pytest.raises(type(stock_err.value)) as ours:
        accel.generate(ids, max_new_tokens=2, do_sample=False)
    assert str(ours.value) == str(stock_err.value)
    restore(accel)


def test_int32_input_ids_accepted():
    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock))
    ids = torch.tensor([[5, 6, 7]], dtype=torch.int32)
    assert torch.equal(accel.generate(ids, **GEN), stock.generate(ids.long(), **GEN))
    restore(accel)


def test_explicit_graph_mode_on_cpu_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        accel = accelerate_model(make_llama(0), cudagraph_mode="full")
    assert "needs a CUDA device" in caplog.text
    assert engine_info(accel)["cudagraph_mode"] == "none"
    restore(accel)


def test_deep_copy_of_an_accelerated_model_is_a_stock_model():
    """As an RL loop's frozen reference model: forward and generate() stock, no second engine; accelerating the copy
    works; restoring it strips what was copied."""
    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock))
    ref = copy.deepcopy(accel)
    assert ref.__dict__.get("_hf_accel_state") is None
    ids, mask = batch()
    with torch.no_grad():
        assert torch.equal(ref(input_ids=ids, attention_mask=mask).logits,
                           stock(input_ids=ids, attention_mask=mask).logits)
    with pytest.warns(UserWarning, match="copy of an accelerated model"):
        assert torch.equal(run(ref), run(stock))
    accelerate_model(ref)
    assert torch.equal(run(ref), run(stock)) and engine_info(ref)["attention_backend"] == "torch"
    restore(ref)
    assert "generate" not in ref.__dict__ and ref.config._attn_implementation == stock.config._attn_implementation
    restore(accel)


# -- found by a hostile review -------------------------------------------------------------------------------------
def test_call_queued_behind_restore_runs_stock():
    """A generate() that waits for the running call while restore() is also waiting must not run on the freed
    engine: it runs stock (or on the new engine after a re-accelerate)."""
    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock))
    ids, mask = batch()
    want = stock.generate(input_ids=ids, attention_mask=mask, **GEN)
    for then_reaccelerate in (False, True):
        streamer = _GateStreamer()
        results: dict = {}

        def first_call(streamer=streamer, results=results):
            results["first"] = accel.generate(input_ids=ids, attention_mask=mask, streamer=streamer, **GEN)

        def restorer(then_reaccelerate=then_reaccelerate):
            restore(accel)
            if then_reaccelerate:
                accelerate_model(accel)

        def queued_call(results=results):
            results["queued"] = accel.generate(input_ids=ids, attention_mask=mask, **GEN)

        first = threading.Thread(target=first_call)
        first.start()
        assert streamer.started.wait(30)
        r = threading.Thread(target=restorer)
        r.start()
        r.join(0.3)
        queued = threading.Thread(target=queued_call)
        queued.start()
        queued.join(0.3)
        streamer.release.set()
        for t in (first, r, queued):
            t.join(60)
        assert torch.equal(results["first"], want) and torch.equal(results["queued"], want), then_reaccelerate
        if not then_reaccelerate:
            accelerate_model(accel)
    restore(accel)


def test_attention_implementation_switched_after_accelerate():
    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock))
    run(accel)
    accel.set_attn_implementation("eager")
    stock.set_attn_implementation("eager")
    assert torch.equal(run(accel), run(stock))
    assert engine_info(accel)["attention_backend"] == "torch"  # rebuilt, plain forwards now route to eager
    restore(accel)
    assert accel.config._attn_implementation == "eager"


@pytest.mark.parametrize("edit", ["act_fn", "eps", "rope_buffer", "module_swapped"])
def test_prefix_cache_dropped_for_non_parameter_changes(pair, edit):
    stock, accel = pair
    run(accel)

    def apply(m):
        layer = m.model.layers[0]
        if edit == "act_fn":
            layer.mlp.act_fn = torch.nn.ReLU()
        elif edit == "eps":
            layer.input_layernorm.variance_epsilon = 0.5
        elif edit == "rope_buffer":
            m.model.rotary_emb.inv_freq.data.mul_(0.5)
        else:
            class MyLinear(torch.nn.Linear):
                def forward(self, x):
                    return super().forward(x) * 2

            old = layer.mlp.down_proj
            new = MyLinear(old.in_features, old.out_features, bias=False)
            new.weight = old.weight
            layer.mlp.down_proj = new

    apply(stock)
    apply(accel)
    before = hits(accel)
    assert torch.equal(run(accel), run(stock))
    assert hits(accel) == before


def test_dtype_cast_after_accelerate_rebuilds_the_engine():
    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock))
    run(accel)
    accel.to(torch.bfloat16)
    stock.to(torch.bfloat16)
    run(accel)
    assert accel._hf_accel_state.engine.kv_caches[0][0].dtype == torch.bfloat16
    restore(accel)


def test_peft_per_row_adapters_run_stock():
    stock = lora(lora(make_llama(0), "a", seed=1), "b", seed=2)
    accel = accelerate_model(lora(lora(make_llama(0), "a", seed=1), "b", seed=2))
    stock.eval()
    accel.eval()
    ids, mask = left_pad([PROMPTS[0], PROMPTS[1]])
    kw = dict(input_ids=ids, attention_mask=mask, adapter_names=["a", "b"], **GEN)
    with pytest.warns(UserWarning, match="per-row PEFT adapters"):
        got = accel.generate(**kw)
    assert torch.equal(got, stock.generate(**kw))
    restore(accel)


@pytest.mark.parametrize("kind", ["prompt", "prefix"])
def test_peft_prompt_learning_adapters_run_stock(kind):
    """Prompt / prefix tuning feed their virtual tokens through PEFT's prepare_inputs_for_generation, which the engine
    never runs: the call takes stock's path with a warning (it gave the bare base model's tokens, silently; found
    by a hostile test, 2026-12-01)."""
    def build():
        torch.manual_seed(1)
        config = (peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5) if kind == "prompt"
                  else peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5))
        return peft.get_peft_model(make_llama(0, initializer_range=0.3), config).eval()

    stock, accel = build(), accelerate_model(build())
    ids, mask = left_pad([PROMPTS[0], PROMPTS[1]])
    kw = dict(input_ids=ids, attention_mask=mask, **GEN)
    with pytest.warns(UserWarning, match="prompt-learning"):
        got = accel.generate(**kw)
    assert torch.equal(got, stock.generate(**kw))
    restore(accel)


# -- second hostile review ---------------------------------------------------------------------------------------
def _edits():
    """Changes to what the forward does that touch no parameter: each must be seen (cache dropped, compiled code
    rebuilt). Applied to a stock and an accelerated copy alike."""

    def hook_swap(m):
        mlp = m.model.layers[0].mlp
        if not hasattr(mlp, "_test_handle"):
            mlp._test_handle = mlp.register_forward_hook(lambda mod, args, out: out * 2)
        mlp._test_handle.remove()
        mlp._test_handle = mlp.register_forward_hook(lambda mod, args, out: out * -1)

    def instance_forward(m):
        mlp = m.model.layers[1].mlp
        plain = type(mlp).forward
        mlp.forward = lambda x: plain(mlp, x) * 0.5

    def buffer_replaced(m):
        rope = m.model.rotary_emb
        rope.register_buffer("inv_freq", rope.inv_freq * 0.7, persistent=False)

    def scaling_attribute(m):
        m.model.layers[0].self_attn.scaling = m.model.layers[0].self_attn.scaling * 1.5

    return {"hook_swap": hook_swap, "instance_forward": instance_forward, "buffer_replaced": buffer_replaced,
            "scaling_attribute": scaling_attribute}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_forward_changes_without_parameter_changes(compiled):
    stock = make_llama(0, initializer_range=0.3)
    accel = accelerate_model(copy.deepcopy(stock), block_size=16, compile=compiled)
    try:
        assert torch.equal(run(accel), run(stock))
        for name, edit in _edits().items():
            edit(stock)
            edit(accel)
            assert torch.equal(run(accel), run(stock)), name
    finally:
        restore(accel)


def test_class_forward_patched_after_accelerate(monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaMLP

    stock = make_llama(0, initializer_range=0.3)
    accel = accelerate_model(copy.deepcopy(stock), block_size=16)
    run(accel)
    plain = LlamaMLP.forward
    monkeypatch.setattr(LlamaMLP, "forward", lambda self, x: plain(self, x) * 0.25)  # a kernel-patching library
    before = hits(accel)
    assert torch.equal(run(accel), run(stock))
    assert hits(accel) == before
    restore(accel)


def test_restore_during_a_rebuild_waits(monkeypatch):
    from hf_accel import api

    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock), compile=True)
    run(accel)
    rebuilding = threading.Event()
    real = api.accelerate_model

    def slow_accelerate(*args, **kwargs):
        rebuilding.set()
        import time

        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "accelerate_model", slow_accelerate)
    for m in (stock, accel):  # a replaced parameter: compiled code must be rebuilt
        with torch.no_grad():
            m.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(m.model.layers[0].mlp.up_proj.weight * 2)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", run(accel)))
    worker.start()
    assert rebuilding.wait(30)
    restore(accel)  # must wait for the call (and its rebuild) to finish: the call ran on the rebuilt engine
    worker.join(10)  # the call is over; its thread only has to return
    assert not worker.is_alive()
    assert torch.equal(result["out"], run(stock))
    assert "_hf_accel_state" not in accel.__dict__ and accel.config._attn_implementation == "sdpa"


def test_cast_to_a_dtype_no_backend_runs_falls_back_to_stock(caplog):
    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock))
    run(accel)
    for m in (stock, accel):
        m.double()
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        got = run(accel)
    assert torch.equal(got, run(stock))
    assert "could not accelerate the changed model again" in caplog.text
    assert "_hf_accel_state" not in accel.__dict__


def assert_runs_stock_with_dropout(stock, accel) -> None:
    """The call warns and takes the stock path: the same dropout draws as stock under the same seed."""
    torch.manual_seed(3)
    want = run(stock)
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match="training mode with dropout"):
        got = run(accel)
    assert torch.equal(got, want)


def test_training_mode_with_dropout_runs_stock_and_greedy_draws_no_random_numbers():
    stock = make_llama(0, attention_dropout=0.3)
    accel = accelerate_model(copy.deepcopy(stock))
    for m in (stock, accel):
        m.train()
    assert_runs_stock_with_dropout(stock, accel)
    for m in (stock, accel):
        m.eval()
    torch.manual_seed(5)
    run(stock)
    after_stock = torch.rand(3)
    torch.manual_seed(5)
    run(accel)
    assert torch.equal(torch.rand(3), after_stock), "a greedy call consumed the global RNG"
    restore(accel)


# -- third hostile review -----------------------------------------------------------------------------------------
def test_copies_and_pickles_of_an_accelerated_model_are_stock():
    import pickle

    stock = make_llama(0)
    accel = accelerate_model(copy.deepcopy(stock))
    run(accel)
    prompts = [PROMPTS[0], PROMPTS[1]]
    want = stock.generate_batch(prompts, max_new_tokens=4, continuous_batching_config=small_stock_cb())
    got = copy.deepcopy(accel).generate_batch(prompts, max_new_tokens=4, continuous_batching_config=small_stock_cb())
    assert [got[k].generated_tokens for k in sorted(got)] == [want[k].generated_tokens for k in sorted(want)]
    loaded = pickle.loads(pickle.dumps(accel))
    assert loaded.__dict__.get("_hf_accel_state") is None
    assert torch.equal(run(loaded), run(stock))
    accelerate_model(loaded)
    assert torch.equal(run(loaded), run(stock))
    restore(loaded)
    restore(accel)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_config_values_read_by_the_forward(compiled):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    stock = MistralForCausalLM(MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=200,
                                             max_position_embeddings=256, sliding_window=8,
                                             initializer_range=0.3)).eval()
    accel = accelerate_model(copy.deepcopy(stock), block_size=16, compile=compiled)
    try:
        assert torch.equal(run(accel), run(stock))
        for value in (16, None):
            for m in (stock, accel):
                m.config.sliding_window = value
            assert torch.equal(run(accel), run(stock)), value
        for m in (stock, accel):
            m.config.num_hidden_layers = 1  # the decoder loop reads it
        assert torch.equal(run(accel), run(stock))
    finally:
        restore(accel)


def test_global_hook_swapped():
    stock = make_llama(0, initializer_range=0.3)
    accel = accelerate_model(copy.deepcopy(stock), block_size=16)
    from torch.nn.modules.module import register_module_forward_hook

    def scale(factor):
        def hook(module, args, out):
            return out * factor if type(module).__name__ == "LlamaMLP" else out
        return hook

    first = register_module_forward_hook(scale(2.0))
    try:
        assert torch.equal(run(accel), run(stock))
        first.remove()
        first = register_module_forward_hook(scale(-1.0))
        assert torch.equal(run(accel), run(stock))
    finally:
        first.remove()
        restore(accel)


@pytest.mark.parametrize("case", ["submodule_training", "module_rate"])
def test_dropout_anywhere_in_training_mode_runs_stock(case):
    stock = make_llama(0, attention_dropout=0.3 if case == "submodule_training" else 0.0)
    accel = accelerate_model(copy.deepcopy(stock))
    for m in (stock, accel):
        if case == "submodule_training":
            m.model.train()  # the top module stays in eval mode
        else:
            m.train()
            m.model.layers[0].self_attn.attention_dropout = 0.3
    assert_runs_stock_with_dropout(stock, accel)
    restore(accel)


# -- third hostile review: what steering and training code does between calls ----------------------------------------
@pytest.mark.parametrize("hook_kind", ["stateful", "shape"])
def test_user_forward_hooks_run_stock(hook_kind):
    """Activation steering through a forward hook: the hook's own state (a strength set between calls) is not
    something the prefix cache or compiled code can follow (stale KV was served, compiled code froze the value), and
    a hook that reads the shapes stock gives it ("steer only generated tokens": `out.shape[1] == 1`) saw the
    engine's packed step instead. Calls on a model with user hooks run stock, with a warning."""
    stock = make_llama(0, initializer_range=0.3)
    accel = accelerate_model(copy.deepcopy(stock), block_size=16, compile=True)
    vec = torch.randn(stock.config.hidden_size, generator=torch.Generator().manual_seed(5)) * 2

    class Steer:
        alpha = 0.0

        def __call__(self, module, args, out):
            if hook_kind == "shape":
                return out + vec if out.shape[1] == 1 else out
            return out + self.alpha * vec

    steer = Steer()
    try:
        for m in (stock, accel):
            m.model.layers[0].register_forward_hook(steer)
        with pytest.warns(UserWarning, match="forward hooks"):
            assert torch.equal(run(accel), run(stock))
        steer.alpha = 3.0
        assert torch.equal(run(accel), run(stock))
    finally:
        restore(accel)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_tensor_attribute_the_forward_reads_is_followed(compiled):
    """A control vector held as a plain tensor attribute (neither parameter nor buffer), as control-vector libraries
    set it between calls: replacing it served stale prefixes, and compiled code kept the vector it was traced with.
    Replacing it now rebuilds; editing it in place drops the cached prefixes."""

    class ControlMLP(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module, width: int) -> None:
            super().__init__()
            self.inner, self.control = inner, torch.zeros(width)

        def forward(self, x):
            return self.inner(x) + self.control

    stock = make_llama(0, initializer_range=0.3)
    stock.model.layers[0].mlp = ControlMLP(stock.model.layers[0].mlp, stock.config.hidden_size)
    accel = accelerate_model(copy.deepcopy(stock), block_size=16, compile=compiled)
    vec = torch.randn(stock.config.hidden_size, generator=torch.Generator().manual_seed(5)) * 2
    try:
        base = run(stock)
        assert torch.equal(run(accel), base) and torch.equal(run(accel), base)  # the prompts are cached now
        for m in (stock, accel):
            m.model.layers[0].mlp.control = vec.clone()
        replaced = run(stock)
        assert not torch.equal(replaced, base)
        assert torch.equal(run(accel), replaced)
        for m in (stock, accel):
            m.model.layers[0].mlp.control.mul_(-1.0)
        assert torch.equal(run(accel), run(stock))
    finally:
        restore(accel)


def test_longrope_context_is_capped_at_its_original_length():
    """Longrope (Phi-3 long-context) picks the long or short RoPE factors for a whole forward from its largest
    position id. A packed engine step mixes sequences, so one request changed another's factors (a short row
    decoded beside a long one, or a row whose batch-mate ended early). Below `original_max_position_embeddings`
    every forward uses the short factors, in stock too: hf_accel serves up to that length, exactly, and refuses
    longer sequences with the reason."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0], "original_max_position_embeddings": 64}
    stock = make_llama(0, initializer_range=0.3, rope_parameters=rope)
    accel = accelerate_model(copy.deepcopy(stock), block_size=16)
    try:
        ids, mask = left_pad([list(range(5, 45)), list(range(7, 20))])
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert torch.equal(accel.generate(**kw), stock.generate(**kw))
        with pytest.raises(ValueError, match="longrope"):
            accel.generate(**dict(kw, max_new_tokens=30))  # 40 + 30 > 64
    finally:
        restore(accel)


def test_an_accelerated_model_saved_whole_runs_stock_in_a_fresh_process(tmp_path):
    """torch.save of an accelerated model keeps our attention name in its config; loaded in a new process, its
    forward and generate() failed ("`hf_accel` is not a valid attention implementation"), since the name was only
    registered by accelerate_model. hf_accel registers its names on import (unpickling imports it)."""
    import json
    import subprocess
    import sys

    stock = make_llama(0, initializer_range=0.3)
    accel = accelerate_model(copy.deepcopy(stock), block_size=16)
    ids, mask = left_pad([PROMPTS[0], PROMPTS[1]])
    want = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    try:
        torch.save({"model": accel, "ids": ids, "mask": mask}, tmp_path / "model.pt")
    finally:
        restore(accel)
    script = (
        "import json, sys, torch\n"
        f"d = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        "m = d['model']\n"
        "out = m.generate(input_ids=d['ids'], attention_mask=d['mask'], max_new_tokens=6, do_sample=False, "
        "pad_token_id=0)\n"
        "print(json.dumps(out.tolist()))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == want.tolist()


def test_tuner_layers_and_bitsandbytes_state_are_found_on_the_class_or_the_instance():
    """The per-call walk looks PEFT's adapter names up on the class (remembered per class) and in the instance's
    own attributes, and bitsandbytes' side tensors only where their attributes exist: the same answers as a full
    attribute lookup, for names set either way."""
    from hf_accel.patches.quantization import side_tensors

    from hf_accel.engine.model_state import is_tuner_layer

    class Tuner(torch.nn.Linear):
        active_adapters = ("default",)
        disable_adapters = False
        merged_adapters: list = []

    class Partial(torch.nn.Linear):
        active_adapters = ("default",)
        disable_adapters = False

    assert is_tuner_layer(Tuner(2, 2))
    partial = Partial(2, 2)
    assert not is_tuner_layer(partial)
    partial.merged_adapters = []  # the third name on the instance only
    assert is_tuner_layer(partial)
    plain = torch.nn.Linear(2, 2)
    assert not is_tuner_layer(plain)
    plain.active_adapters, plain.disable_adapters, plain.merged_adapters = ("a",), False, []
    assert is_tuner_layer(plain)

    lin = torch.nn.Linear(3, 3)
    assert side_tensors(lin) == []
    scb = torch.ones(3)
    lin.weight.SCB = scb  # an 8-bit weight's row scales, before the first forward moves them
    assert [t is scb for t in side_tensors(lin)] == [True]

    class MatmulLtState:  # bitsandbytes' state object, by class name
        def __init__(self) -> None:
            self.CB, self.SCB = None, torch.ones(3)

    other = torch.nn.Linear(3, 3)
    other.state = MatmulLtState()
    assert [t is other.state.SCB for t in side_tensors(other)] == [True]

    class StateByProperty(torch.nn.Linear):  # `state` read through the class, not the instance dict
        @property
        def state(self):
            return self._lt

    by_property = StateByProperty(3, 3)
    by_property._lt = MatmulLtState()
    assert [t is by_property._lt.SCB for t in side_tensors(by_property)] == [True]

    class Lazy(torch.nn.Linear):  # the names exist on the class but cannot be read on this instance
        @property
        def active_adapters(self):
            raise AttributeError("not set up")

        disable_adapters = False
        merged_adapters: list = []

    assert not is_tuner_layer(Lazy(2, 2))

    class Later(torch.nn.Linear):
        pass

    later = Later(2, 2)
    assert not is_tuner_layer(later)
    Later.active_adapters, Later.disable_adapters, Later.merged_adapters = ("a",), False, []  # a class changed
    assert is_tuner_layer(later)
