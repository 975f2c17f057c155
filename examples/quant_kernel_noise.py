"""How far a change of attention kernel moves a quantized model: stock vs hf_accel on one prompt (issue 16).

Builds a random llama-3.1-8b-shaped model with a few layers, loads it with each quantization method, and prints,
for stock `generate()` and for `accelerate_model` with the defaults, the torch backend (eager) and the triton
backend (eager): the greedy tokens, the first token's logits against stock's, and the relative difference of each
decoder layer's prefill output from stock's (each layer's forward wrapped, in the eager rows only: a compile would
trace the wrapper). A bf16 model gives the baseline: last-bit differences of the attention kernel. Methods that
quantize their activations (float8, LLM.int8()) turn those into whole quantization steps, which is why the bench's
guard measures stock under a change of kernel as well (`hf_accel/bench/guard.py`).

    python examples/quant_kernel_noise.py bf16 bnb-int8 torchao-float8-dynamic --layers 4
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings

import torch
import transformers

from hf_accel import accelerate_model, engine_info, restore
from hf_accel.bench.workloads import torchao_config

SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             vocab_size=128256, tie_word_embeddings=False, rope_theta=500000)


def quantization_config(method: str):
    if method == "bf16":
        return None
    if method == "bnb-int8":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    if method == "bnb-nf4":
        return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.bfloat16)
    return transformers.TorchAoConfig(torchao_config(method))


def greedy(model, ids: torch.Tensor, new_tokens: int, capture_layers: bool = True):
    """Greedy tokens, the first step's logits and each decoder layer's first (prefill) output.

    The layer outputs are taken by wrapping each decoder layer's forward (an instance attribute), not by forward
    hooks: a model with user hooks runs stock generate() under hf_accel, since a hook would see packed steps."""
    layers: dict[int, torch.Tensor] = {}

    def wrap(i: int, layer: torch.nn.Module):
        plain = type(layer).forward

        def forward(*args, **kwargs):
            out = plain(layer, *args, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
            if i not in layers:
                layers[i] = hidden.detach().float().reshape(-1, hidden.shape[-1])
            return out

        return forward

    wrapped = list(model.model.layers) if capture_layers else []
    for i, layer in enumerate(wrapped):
        layer.forward = wrap(i, layer)
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    finally:
        for layer in wrapped:
            del layer.forward
    return out.sequences[0, ids.shape[1]:].tolist(), out.logits[0][0].float(), layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("methods", nargs="+", help="bf16, bnb-int8, bnb-nf4, torchao-float8-dynamic, torchao-int8-...")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=8)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    path = tempfile.mkdtemp(prefix="hf_accel_noise_")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=args.layers, **SHAPE))
    model.to(torch.bfloat16).save_pretrained(path)
    del model
    ids = torch.randint(5, SHAPE["vocab_size"] - 256, (1, args.prompt_len),
                        generator=torch.Generator().manual_seed(3)).cuda()
    for method in args.methods:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, device_map="cuda", quantization_config=quantization_config(method)).eval()
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
        tokens, logits, layers = greedy(model, ids, args.new_tokens)
        print(f"== {method}: stock tokens {tokens}")
        for kw in ({}, {"attention_backend": "torch", "enforce_eager": True},
                   {"attention_backend": "triton", "enforce_eager": True}):
            t0 = time.perf_counter()
            accelerate_model(model, **kw)
            info = engine_info(model)
            try:
                ours, ours_logits, ours_layers = greedy(model, ids, args.new_tokens,
                                                        capture_layers=bool(kw.get("enforce_eager")))
            finally:
                restore(model)
            lead = float(logits.max() - logits[int(ours_logits.argmax())])
            print(f"  ours {kw or 'defaults'} ({info['attention_backend']}, compile {info['compile']}) in "
                  f"{time.perf_counter() - t0:.0f} s: tokens {ours} (equal to stock: {ours == tokens}); first "
                  f"step max |logit diff| {float((ours_logits - logits).abs().max()):.4f}, stock's lead over our "
                  f"first token {lead:.4f}")
            for i in sorted(set(layers) & set(ours_layers)):
                a, b = ours_layers[i], layers[i]
                if a.shape == b.shape:
                    print(f"    layer {i}: max |diff| {float((a - b).abs().max()):.4g}, relative "
                          f"{float((a - b).norm() / b.norm()):.3g}")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
