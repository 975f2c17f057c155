"""compressed-tensors checkpoints (GPTQ / AWQ-style weight-only int4 and int8, the format llm-compressor writes)
under accelerate_model on CPU: greedy equal to the same checkpoint under stock generate().

transformers loads such a model packed and decompresses it to dense weights on the first forward (a pre-hook on
the model); accelerate_model must decompress it before packing, compiling and sizing the KV cache, not run the
packed module or leave the hook to fire inside a compiled forward.
"""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
from conftest import left_pad, make_llama, save_compressed_tensors_checkpoint

from hf_accel import accelerate_model, engine_info, restore

pytest.importorskip("compressed_tensors")

# "W4A16_ASYM" (AWQ-style zero points) is left out: with compressed-tensors 0.20.1 its checkpoint does not load in
# stock transformers 5.24 (the packed zero points' shape mismatches the model's), so there is nothing to compare
PRESETS = ["W4A16", "W8A16"]
PROMPTS = [[5, 9, 13, 77], [3, 4, 5, 6, 7, 8, 9], [11]]


@pytest.fixture(scope="module")
def checkpoints():
    with tempfile.TemporaryDirectory() as d:
        paths = {}
        for preset in PRESETS:
            paths[preset] = f"{d}/{preset}"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                save_compressed_tensors_checkpoint(make_llama(seed=5), paths[preset], preset)
        yield paths


def _load(path: str):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu")


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_equals_stock_compressed_tensors(checkpoints, preset, compile):
    stock = _load(checkpoints[preset])
    ids, mask = left_pad(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    ref = stock.generate(ids, **kw)
    model = _load(checkpoints[preset])  # fresh: still packed, the decompression hook not fired yet
    q_proj = model.model.layers[0].self_attn.q_proj
    assert hasattr(model, "ct_decompress_hook") and "weight_packed" in dict(q_proj.named_parameters())
    accelerate_model(model, compile=compile)
    try:
        info = engine_info(model)
        assert "decompressed" in info["quantization_decompressed"] and not info["fallbacks"]
        assert not hasattr(model, "ct_decompress_hook")
        assert q_proj.weight.dtype == torch.float32 and q_proj.weight.shape == (64, 64)
        assert info["compile"] is compile
        out = model.generate(ids, **kw)
        again = model.generate(ids, **kw)  # the prefix cache serves the prompts' KV
        assert torch.equal(out, ref) and torch.equal(again, ref)
    finally:
        restore(model)
    assert torch.equal(model.generate(ids, **kw), ref)


def test_decompressed_weights_are_the_quantized_ones(checkpoints):
    """The dense weights the engine runs are the dequantized int4 values (each group on a grid of at most 16 steps
    of its scale), not the float weights the checkpoint was made from."""
    model = _load(checkpoints["W4A16"])
    accelerate_model(model)
    try:
        w = model.model.layers[1].mlp.down_proj.weight.detach()
        scale = model.model.layers[1].mlp.down_proj.weight_scale.detach().float()
        steps = w.reshape(w.shape[0], -1, 32) / scale.unsqueeze(-1)
        assert torch.allclose(steps, steps.round(), atol=1e-3) and steps.abs().max() <= 8
        assert not torch.equal(w, make_llama(seed=5).model.layers[1].mlp.down_proj.weight)
    finally:
        restore(model)


def test_a_model_stock_already_ran_compiles_too(checkpoints):
    """Stock's first forward fires the decompression hook and leaves compressed-tensors' wrappers on the modules:
    accelerate_model judges from the modules, so the forward still compiles (no fallback) and the tokens are
    stock's; no module keeps an instance forward (hf_accel's fused ops would skip such a module)."""
    from hf_accel.patches.quantization import decompress_packed_weights

    model = _load(checkpoints["W4A16"])
    ids, mask = left_pad(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    ref = model.generate(ids, **kw)  # stock: decompresses, wrappers stay
    assert not hasattr(model, "ct_decompress_hook")
    assert any("forward" in m.__dict__ for m in model.modules())
    assert decompress_packed_weights(model) is not None
    assert not [n for n, m in model.named_modules() if "forward" in m.__dict__]
    accelerate_model(model, compile=True)
    try:
        info = engine_info(model)
        assert info["compile"] is True and not info["fallbacks"] and info["quantization_decompressed"]
        assert torch.equal(model.generate(ids, **kw), ref)
    finally:
        restore(model)
    accelerate_model(model, compile=True)  # again after restore: still said, still compiled
    try:
        info = engine_info(model)
        assert info["quantization_decompressed"] and not info["fallbacks"]
        assert torch.equal(model.generate(ids, **kw), ref)
    finally:
        restore(model)


def test_a_forward_the_user_patched_after_loading_is_kept(checkpoints):
    """After stock's first forward, a user patches one linear's forward: accelerate_model must run that forward (not
    put the pre-patch one back when it removes compressed-tensors' wrappers), and leave it in place on restore()."""
    import types

    model = _load(checkpoints["W4A16"])
    ids, mask = left_pad(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    plain = model.generate(ids, **kw)  # stock: decompresses, wrappers stay
    down = model.model.layers[0].mlp.down_proj

    def halved(self, x):
        return torch.nn.functional.linear(x, self.weight) * 0.5

    down.forward = types.MethodType(halved, down)
    ref = model.generate(ids, **kw)
    assert not torch.equal(ref, plain)  # the patch changes the tokens, so the A/B below can tell
    accelerate_model(model)
    try:
        assert down.__dict__["forward"].__func__ is halved
        assert torch.equal(model.generate(ids, **kw), ref)
    finally:
        restore(model)
    assert down.__dict__["forward"].__func__ is halved
    assert torch.equal(model.generate(ids, **kw), ref)


def test_a_checkpoint_dequantized_while_loading_is_a_plain_model(checkpoints):
    """transformers may dequantize a compressed-tensors checkpoint while loading (`CompressedTensorsConfig(dequantize=
    True)`): the model is then a plain one, nothing is left to decompress or unwrap, and greedy output is stock's."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    path = checkpoints[PRESETS[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu",
                                                     quantization_config=CompressedTensorsConfig(dequantize=True))
    q_proj = model.model.layers[0].self_attn.q_proj
    assert "weight_packed" not in dict(q_proj.named_parameters()) and not hasattr(model, "ct_decompress_hook")
    ids, mask = left_pad(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    ref = model.generate(ids, **kw)
    accelerate_model(model, compile=False)
    try:
        info = engine_info(model)
        assert info["quantization_decompressed"] is None and not info["fallbacks"]
        assert torch.equal(model.generate(ids, **kw), ref)
    finally:
        restore(model)
