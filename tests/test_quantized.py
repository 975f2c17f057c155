"""Quantized checkpoints (torchao, bitsandbytes) under accelerate_model on CPU: greedy equal to the same quantized
model under stock generate(), with compile off (the CPU default) and on (Inductor, what the GPU default is).

Quantized weights are tensor subclasses (torchao) or quantized linear modules (bitsandbytes): weight packing and
the linear merge / routing passes must leave them alone (packing once crashed on torchao's Int8Tensor, the linear
merge once failed the compile on its missing storage), and the prefix cache must not serve KV across calls wrongly.
"""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
from conftest import left_pad, make_llama

from hf_accel import accelerate_model, engine_info, restore
from hf_accel.compilation.linear_packing import pack_sibling_linears

torchao = pytest.importorskip("torchao")


def _methods() -> dict:
    from transformers import BitsAndBytesConfig, TorchAoConfig

    out = {}
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig

        out["torchao-int8-weight-only"] = lambda: TorchAoConfig(Int8WeightOnlyConfig())
        out["torchao-int8-dynamic"] = lambda: TorchAoConfig(Int8DynamicActivationInt8WeightConfig())
    except ImportError:
        pass
    try:
        import bitsandbytes  # noqa: F401

        out["bnb-nf4"] = lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                    bnb_4bit_compute_dtype=torch.float32)
        out["bnb-int8"] = lambda: BitsAndBytesConfig(load_in_8bit=True)
    except ImportError:
        pass
    return out


METHODS = _methods()


@pytest.fixture(scope="module")
def checkpoint():
    with tempfile.TemporaryDirectory() as d:
        make_llama(seed=3).save_pretrained(d)
        yield d


def _load(path: str, method: str):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=METHODS[method](),
                                                    dtype=torch.float32, device_map="cpu")


PROMPTS = [[5, 9, 13, 77], [3, 4, 5, 6, 7, 8, 9], [11]]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_equals_stock_quantized(checkpoint, method, compile):
    model = _load(checkpoint, method)
    ids, mask = left_pad(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = model.generate(ids, **kw)
        accelerate_model(model, compile=compile)
        try:
            info = engine_info(model)
            if method == "bnb-int8":  # LLM.int8()'s outlier decomposition: compile and graphs off, said once
                assert info["compile"] is False and info["cudagraph_mode"] == "none"
                assert (not compile) or "torch.compile" in info["fallbacks"]["quantization"]
            else:
                assert info["compile"] is compile
                assert not info["fallbacks"]  # compiled, not a silent fallback
            # torchao int8 weight-only linears leave Inductor's slow int8 GEMM rewrite for our op (7 per layer; the
            # lm_head too where the checkpoint quantized it); no other method's do
            routed = info["int8_weight_linears"]
            if compile and method == "torchao-int8-weight-only":
                assert routed >= model.config.num_hidden_layers * 7
            else:
                assert routed == 0
            out = model.generate(ids, **kw)
            again = model.generate(ids, **kw)  # second call: the prefix cache serves the prompts' KV
            assert torch.equal(out, ref), method
            assert torch.equal(again, ref), method
        finally:
            restore(model)
        assert torch.equal(model.generate(ids, **kw), ref)


@pytest.mark.parametrize("method", sorted(m for m in METHODS if m.startswith("torchao")))
def test_packing_leaves_quantized_weights_alone(checkpoint, method):
    model = _load(checkpoint, method)
    before = {n: p for n, p in model.named_parameters()}
    record = pack_sibling_linears(model)
    assert record.groups == 0 and record.params == []
    assert all(p is before[n] for n, p in model.named_parameters())


def test_generate_batch_on_a_quantized_model(checkpoint):
    method = "torchao-int8-weight-only"
    if method not in METHODS:
        pytest.skip("torchao's int8 weight-only config is not available")
    from transformers import GenerationConfig

    model = _load(checkpoint, method)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    refs = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           generation_config=gc)[0, len(p):].tolist() for p in PROMPTS]
    accelerate_model(model)
    try:
        outs = model.generate_batch(PROMPTS, generation_config=gc)
        assert [outs[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))] == refs
    finally:
        restore(model)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_in_place_edit_of_quantized_data_clears_the_prefix_cache(checkpoint, compile):
    """Writing into torchao's inner tensors (`qdata`) leaves the outer version counter alone; the prefix cache must
    still see the change (its key digests the inner tensors) and never serve KV computed under the old weights."""
    method = "torchao-int8-weight-only"
    if method not in METHODS:
        pytest.skip("torchao's int8 weight-only config is not available")
    model = _load(checkpoint, method)
    prompt = torch.tensor([[7, 3, 9, 12, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55]])
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerate_model(model, compile=compile)
        try:
            model.generate(prompt, **kw)  # caches the prompt's full blocks
            attn = model.model.layers[0].self_attn
            inner = [name for name in ("qdata", "int_data", "data") if hasattr(attn.k_proj.weight, name)]
            if not inner:
                pytest.skip("this torchao version names its int8 data differently")
            with torch.no_grad():
                for proj in (attn.k_proj, attn.v_proj):
                    getattr(proj.weight, inner[0]).neg_()
            got = model.generate(prompt, **kw)
        finally:
            restore(model)
        want = model.generate(prompt, **kw)  # stock, on the edited weights
    assert torch.equal(got, want)


def test_a_quirk_reason_survives_a_reaccelerate_with_the_options_it_turned_off(caplog):
    """The options accelerate_model keeps for a re-accelerate already have compile and graphs off: the reason is
    still reported (engine_info's fallbacks), and the warning is not repeated."""
    import types

    from hf_accel.api import _apply_quantization_quirks
    from hf_accel.config import AccelConfig, CUDAGraphMode

    class Linear8bitLt(torch.nn.Linear):  # stands for bitsandbytes' class, matched by name
        state = types.SimpleNamespace(threshold=6.0)

    model = torch.nn.Sequential(Linear8bitLt(4, 4))
    cfg = AccelConfig(compile=True, cudagraph_mode="full_and_piecewise")
    with caplog.at_level("WARNING", logger="hf_accel"):
        first = _apply_quantization_quirks(model, cfg)
        again = _apply_quantization_quirks(model, cfg)
    assert first == again and "torch.compile and CUDA graphs off" in first
    assert cfg.compile is False and CUDAGraphMode(cfg.cudagraph_mode) == CUDAGraphMode.NONE
    assert sum("LLM.int8" in r.getMessage() for r in caplog.records) == 1
    Linear8bitLt.state = types.SimpleNamespace(threshold=0.0)  # no outlier decomposition: no quirk
    assert _apply_quantization_quirks(model, AccelConfig(compile=True)) is None


def test_int8_weight_op_computes_what_torchao_computes():
    """Off the GPU's small-M path the op is torchao's own arithmetic, bit for bit (prefill, CPU)."""
    from hf_accel.patches.quantization import int8_weight_only_parts

    from hf_accel.ops.quantized_linear import int8_weight_linear

    if "torchao-int8-weight-only" not in METHODS:
        pytest.skip("torchao's int8 weight-only config is not available")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for bias in (False, True):
            lin = torch.nn.Linear(64, 48, bias=bias, dtype=dtype)
            quantize_(lin, Int8WeightOnlyConfig())
            parts = int8_weight_only_parts(lin.weight)
            assert parts == ("qdata", "scale")
            x = torch.randn(2, 5, 64, dtype=dtype)
            got = int8_weight_linear(x, lin.weight.qdata, lin.weight.scale, lin.bias, False)
            assert torch.equal(got, torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_int8_weight_recognizer_leaves_other_weights_alone():
    from hf_accel.patches.quantization import int8_weight_only_parts

    if "torchao-int8-dynamic" not in METHODS:
        pytest.skip("torchao's int8 configs are not available")
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    lin = torch.nn.Linear(64, 48)
    assert int8_weight_only_parts(lin.weight) is None  # plain
    quantize_(lin, Int8DynamicActivationInt8WeightConfig())
    assert int8_weight_only_parts(lin.weight) is None  # activations quantized too: torchao's int8 x int8 path


def _int8_llama(granularities, seed: int = 6):
    """A 4-layer tiny llama, layers 0-1 quantized int8 weight-only with `granularities[0]`, 2-3 with `[1]`."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = make_llama(seed=seed, num_hidden_layers=4)
    for half, granularity in enumerate(granularities):
        layers = (0, 1) if half == 0 else (2, 3)
        quantize_(model, Int8WeightOnlyConfig(granularity=granularity),
                  filter_fn=lambda mod, fqn, ls=layers: isinstance(mod, torch.nn.Linear)
                  and any(f"layers.{i}." in fqn for i in ls))
    return model


@pytest.mark.parametrize("case", ["per-row-then-per-tensor", "per-group-scales-fp32-then-fp16"])
def test_layers_quantized_differently_do_not_share_compiled_code(case):
    """Identical-looking layers share one compiled piece; quantized weights whose inner tensors differ (scale shape
    or dtype) must not: that once failed the compile (per-row / per-tensor) or gave wrong tokens silently
    (per-group scales of two dtypes)."""
    if "torchao-int8-weight-only" not in METHODS:
        pytest.skip("torchao's int8 weight-only config is not available")
    from torchao.quantization.granularity import PerGroup, PerRow, PerTensor

    if case == "per-row-then-per-tensor":
        model = _int8_llama((PerRow(), PerTensor()))
    else:
        model = _int8_llama((PerGroup(32), PerGroup(32)))
        for layer in model.model.layers[2:]:
            for mod in layer.modules():
                if isinstance(mod, torch.nn.Linear):
                    mod.weight.scale = mod.weight.scale.to(torch.float16)
    ids, mask = left_pad(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = model.generate(ids, **kw)
        accelerate_model(model, compile=True, attention_backend="torch", cudagraph_mode="none")
        try:
            assert not engine_info(model)["fallbacks"]
            assert torch.equal(model.generate(ids, **kw), ref)
        finally:
            restore(model)


@pytest.mark.parametrize("edit", ["scale-flattened", "qdata-column-major", "scale-float16"])
def test_rebinding_a_quantized_weights_inner_tensors_rebuilds_the_engine(edit):
    """`weight.scale = ...` / `weight.qdata = ...` keep the outer parameter (and its shape); the compiled forward was
    built for the old inner layout, so the next call must rebuild, not fail or read stale memory."""
    if "torchao-int8-weight-only" not in METHODS:
        pytest.skip("torchao's int8 weight-only config is not available")
    import copy

    from torchao.quantization.granularity import PerRow

    model = _int8_llama((PerRow(), PerRow()), seed=2)
    twin = copy.deepcopy(model)
    ids, mask = left_pad(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)

    def apply(m):
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear) and type(mod.weight).__name__ == "Int8Tensor":
                w = mod.weight
                if edit == "scale-flattened":
                    w.scale = w.scale.flatten() * 1.5
                elif edit == "qdata-column-major":
                    w.qdata = w.qdata.t().contiguous().t()
                else:
                    w.scale = w.scale.half()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerate_model(model, compile=True, attention_backend="torch", cudagraph_mode="none")
        try:
            model.generate(ids, **kw)
            apply(model)
            apply(twin)
            assert torch.equal(model.generate(ids, **kw), twin.generate(ids, **kw))
        finally:
            restore(model)


def _float8_per_row(monkeypatch):
    """torchao's float8 dynamic-activation config, allowed on the CPU: torchao refuses it below sm89 GPUs, but the
    arithmetic itself (row-wise scales, `torch._scaled_mm`) runs on the CPU, which is what these tests need."""
    quant_api = pytest.importorskip("torchao.quantization.quant_api")
    from torchao.quantization import PerRow

    if not hasattr(quant_api, "_check_hardware_support") or not hasattr(quant_api,
                                                                        "Float8DynamicActivationFloat8WeightConfig"):
        pytest.skip("this torchao has no float8 dynamic-activation config to relax")
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda *a, **k: None)
    return quant_api.Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_inductor_rounds_float8_activations_as_eager_only_when_asked(monkeypatch, device):
    """Inductor keeps a fused bf16 intermediate in float32 where eager rounds it, and Triton divides approximately
    where eager rounds exactly; before an e4m3 cast either is a whole quantization step (on the H200 our compiled
    float8 tokens parted from eager ones 9x as often as stock's did). `inductor_settings(..., eager_casts=True)`
    must give eager's numbers exactly, on the CPU (C++ kernels) and the GPU (Triton kernels); without it they
    differ (so the test can tell the setting matters)."""
    from torchao.quantization import quantize_

    from hf_accel.compilation.piecewise import inductor_settings

    config = _float8_per_row(monkeypatch)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False), torch.nn.Linear(512, 256, bias=False))
    net = net.to(device=device, dtype=torch.bfloat16)
    quantize_(net, config)
    x = torch.randn(8, 256, dtype=torch.bfloat16, device=device)
    outs = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = net(x)
        for eager_casts in (False, True):
            torch._dynamo.reset()
            with inductor_settings(pdl=False, eager_casts=eager_casts):
                outs[eager_casts] = torch.compile(net, fullgraph=True)(x)
    torch._dynamo.reset()
    assert torch.equal(outs[True], eager)
    assert not torch.equal(outs[False], eager)


def test_float8_activation_model_compiles_with_eager_rounding_and_gives_stock_tokens(checkpoint, monkeypatch):
    from transformers import AutoModelForCausalLM, TorchAoConfig

    config = _float8_per_row(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=TorchAoConfig(config),
                                                     dtype=torch.bfloat16, device_map="cpu")
        # rows of one length: with left padding, stock's own forward turns every row with padding into NaN here
        # (the checkpoint's pad embedding is zero, a zero row gets a zero per-row scale, 0/0 reaches the real
        # positions through attention's zero weights), so there would be no stock answer to compare with
        ids = torch.tensor([[5, 9, 13, 77, 4], [3, 4, 5, 6, 7], [11, 12, 13, 14, 15]])
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        ref = model.generate(ids, **kw)
        accelerate_model(model, compile=True)
        try:
            info = engine_info(model)
            assert info["compile"] is True and not info["fallbacks"] and info["eager_precision_casts"] is True
            assert torch.equal(model.generate(ids, **kw), ref)
        finally:
            restore(model)


def _long_prompts():
    """Prompts of several KV blocks: a repeated call finds them in the prefix cache unless the key changed."""
    ids = torch.randint(3, 120, (2, 40), generator=torch.Generator().manual_seed(5))
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)


def _generate_around_a_change(model, kw, change, **accel_kwargs):
    """Accelerate, generate, apply `change` in place, generate again, restore, and generate stock: returns
    (engine_info, ours before the change, ours after it, stock after it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerate_model(model, **accel_kwargs)
        try:
            info = engine_info(model)
            before = model.generate(**kw)
            change()
            ours = model.generate(**kw)
        finally:
            restore(model)
        stock = model.generate(**kw)
    return info, before, ours, stock


@pytest.mark.parametrize("method", [m for m in ("bnb-nf4", "torchao-int8-weight-only") if m in METHODS])
def test_qlora_adapters_on_a_quantized_model_trained_in_place_between_generates(checkpoint, method):
    """QLoRA as RL loops run it: LoRA adapters on a quantized base model, accelerated once (compiled), trained with
    an optimizer between generate() calls. Every call must give what stock PEFT gives with the adapters as they are
    now; the step must change the tokens, or the test could not tell a stale engine from a correct one."""
    peft = pytest.importorskip("peft")
    base = _load(checkpoint, method)
    base.generation_config.pad_token_id = 0
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=64, init_lora_weights=False,
                                                      target_modules=["q_proj", "v_proj", "down_proj"]))
    kw = _long_prompts()  # the second call finds them in the prefix cache unless the step clears it
    ids = kw["input_ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = model.generate(**kw)

    def train_step() -> None:
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=5.0)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        model.eval()

    info, first, ours, stock = _generate_around_a_change(model, kw, train_step, compile=True)
    assert info["compile"] is True
    assert torch.equal(first, ref)
    assert not torch.equal(stock, ref), "the optimizer step did not change the tokens: the test has no teeth"
    assert torch.equal(ours, stock)


@pytest.mark.parametrize("method", [m for m in ("bnb-nf4", "bnb-int8") if m in METHODS])
def test_in_place_edit_of_bitsandbytes_scales_clears_the_prefix_cache(checkpoint, method):
    """bitsandbytes keeps a weight's scales outside its parameters (a 4-bit weight's `quant_state.absmax`, an 8-bit
    module's `state.SCB`): an in-place edit of them changes the model without touching a parameter. The prefix
    cache once kept serving the old prompts' KV after such an edit."""
    model = _load(checkpoint, method)
    model.generation_config.pad_token_id = 0
    kw = _long_prompts()

    def edit_scales() -> None:
        model.generate(**kw)  # the prompts are cached now
        with torch.no_grad():
            for layer in model.model.layers:
                for lin in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                    if method == "bnb-nf4":
                        lin.weight.quant_state.absmax.mul_(-3.0)
                    else:
                        scb = lin.weight.SCB if getattr(lin.weight, "SCB", None) is not None else lin.state.SCB
                        scb.mul_(-3.0)

    _, before, ours, stock = _generate_around_a_change(model, kw, edit_scales)
    assert not torch.equal(stock, before), "the edit did not change the tokens: the test has no teeth"
    assert torch.equal(ours, stock)


def test_accelerated_quantized_model_generates_inside_inference_mode(checkpoint):
    """`with torch.inference_mode(): model.generate(...)` works on a stock torchao model; accelerated, the weight
    check once failed in it (a torchao weight's detach() cannot run there)."""
    model = _load(checkpoint, "torchao-int8-weight-only")
    model.generation_config.pad_token_id = 0
    kw = _long_prompts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.inference_mode():
            stock = model.generate(**kw)
        accelerate_model(model)
        try:
            with torch.inference_mode():
                assert torch.equal(model.generate(**kw), stock)
                assert torch.equal(model.generate(**kw), stock)
        finally:
            restore(model)


@pytest.mark.skipif("bnb-nf4" not in METHODS, reason="needs bitsandbytes")
@pytest.mark.parametrize(("dora", "compile"), [(True, False), (False, True)], ids=["dora-eager", "plain-compiled"])
def test_nf4_accelerated_before_any_stock_forward(checkpoint, dora, compile):
    """bitsandbytes finishes 4-bit weights on their first forward (on CPUs with AVX512-BF16 it repacks them).
    Accelerated straight after loading, that first forward used to happen inside hf_accel's inference-mode step
    (the weights became inference tensors and, with DoRA adapters, every later call raised) or inside the compile
    trace (which then fell back to eager). Now it happens at accelerate_model, as in stock. (DoRA itself does not
    compile on a 4-bit base: Dynamo cannot trace its weight-norm over the quantized weight, a fallback with a
    warning; that case runs eager here.)"""
    import copy

    base = _load(checkpoint, "bnb-nf4")
    base.generation_config.pad_token_id = 0
    model = base
    if dora:
        peft = pytest.importorskip("peft")
        torch.manual_seed(11)
        model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=64, init_lora_weights=False, use_dora=True,
                                                          target_modules=["q_proj", "v_proj", "down_proj"]))
    twin = copy.deepcopy(model)  # stock, never accelerated
    kw = _long_prompts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerate_model(model, compile=compile)
        try:
            info = engine_info(model)
            assert info["compile"] is compile and not info["fallbacks"]
            want = twin.generate(**kw)
            for _ in range(3):
                assert torch.equal(model.generate(**kw), want)
            assert engine_info(model)["compile"] is compile and not engine_info(model)["fallbacks"]
        finally:
            restore(model)
