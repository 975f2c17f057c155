"""`hf-accel` command line: `demo` (accelerate a model and A/B it against stock), `bench` (WORKLOADS.md) and `serve`
(an OpenAI-compatible server)."""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _demo_model(model_id: str | None, device: str, dtype: torch.dtype):
    import transformers

    if model_id:
        tok = transformers.AutoTokenizer.from_pretrained(model_id)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype).to(device).eval()
        return model, tok
    # no download: a small random-weight Qwen3 built from its config
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=4, head_dim=32, vocab_size=4096, max_position_embeddings=2048)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).eval()
    return model, None


def demo(args: argparse.Namespace) -> int:
    from hf_accel import accelerate_model, engine_info

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        args.dtype or ("bfloat16" if device == "cuda" else "float32")]
    model, tok = _demo_model(args.model, device, dtype)
    if tok is not None:
        enc = tok([args.prompt] * args.batch_size, return_tensors="pt").to(device)
        input_ids, mask = enc["input_ids"], enc["attention_mask"]
    else:
        g = torch.Generator().manual_seed(0)
        input_ids = torch.randint(10, model.config.vocab_size, (args.batch_size, 32), generator=g).to(device)
        mask = torch.ones_like(input_ids)
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None,
              pad_token_id=model.generation_config.pad_token_id or 0)

    def timed(fn):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    model.generate(input_ids=input_ids, attention_mask=mask, **{**kw, "max_new_tokens": 2})  # warm-up
    stock, t_stock = timed(lambda: model.generate(input_ids=input_ids, attention_mask=mask, **kw))
    t0 = time.perf_counter()
    accelerate_model(model, attention_backend=args.attention_backend, enforce_eager=args.enforce_eager)
    t_accel = time.perf_counter() - t0
    model.generate(input_ids=input_ids, attention_mask=mask, **{**kw, "max_new_tokens": 2})  # warm-up
    ours, t_ours = timed(lambda: model.generate(input_ids=input_ids, attention_mask=mask, **kw))
    new = args.batch_size * args.max_new_tokens
    info = engine_info(model)
    print(f"model: {type(model).__name__} on {device} ({dtype}), batch {args.batch_size}, "
          f"{args.max_new_tokens} new tokens per row")
    print(f"hf_accel: backend={info['attention_backend']} cudagraph_mode={info['cudagraph_mode']} "
          f"compile={info['compile']} startup={t_accel:.1f}s")
    print(f"stock generate(): {new / t_stock:10.1f} tok/s")
    print(f"hf_accel        : {new / t_ours:10.1f} tok/s  ({t_stock / t_ours:.2f}x)")
    same = torch.equal(stock, ours)
    print(f"tokens match stock: {same}")
    if not str(device).startswith("cuda"):
        print("note: off CUDA the engine runs its torch reference attention with no CUDA graphs or compile, so it is "
              "not faster than stock there; the speed is a CUDA feature (H200 figures: examples/results/)")
    if tok is not None:
        print("sample:", tok.decode(ours[0, input_ids.shape[1]:], skip_special_tokens=True))
    return 0 if same else 1


def demo_concurrent(args: argparse.Namespace) -> int:
    """N threads, each calling generate() with its own prompt length, against the same calls one after another and
    against stock: the calls join one running batch, which pays even on a CPU."""
    import threading

    from hf_accel import accelerate_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        args.dtype or ("bfloat16" if device == "cuda" else "float32")]
    model, _ = _demo_model(None, device, dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, model.config.vocab_size, (1, 8 + 24 * (i % 4)), generator=g).to(device)
               for i in range(args.concurrent)]
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)

    def one_by_one() -> list[torch.Tensor]:
        return [model.generate(input_ids=p, **kw) for p in prompts]

    def together() -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(prompts)

        def work(i: int) -> None:
            out[i] = model.generate(input_ids=prompts[i], **kw)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    stock, t_stock = timed(one_by_one)
    accelerate_model(model, attention_backend=args.attention_backend, enforce_eager=args.enforce_eager)
    model.generate(input_ids=prompts[0], **{**kw, "max_new_tokens": 2})  # warm-up
    seq, t_seq = timed(one_by_one)
    conc, t_conc = timed(together)
    new = len(prompts) * args.max_new_tokens
    print(f"{len(prompts)} threads, prompts of 8-80 tokens, {args.max_new_tokens} new tokens each, {device} ({dtype})")
    print(f"stock generate(), one after another : {new / t_stock:10.1f} tok/s")
    print(f"hf_accel, one after another         : {new / t_seq:10.1f} tok/s")
    print(f"hf_accel, all threads at once       : {new / t_conc:10.1f} tok/s  ({t_seq / t_conc:.2f}x one after "
          "another: the calls share one batch)")
    same = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(stock, seq, conc))
    print(f"every thread's tokens match stock: {same}")
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-accel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="accelerate a model, generate, and compare with stock generate()")
    p.add_argument("--model", default=None, help="model id or path (default: a small random-weight model, no download)")
    p.add_argument("--prompt", default="The quick brown fox", help="prompt (with --model)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--concurrent", type=int, default=0, metavar="N",
                   help="N threads each calling generate() at once (the small built-in model), against the same calls "
                        "one after another")
    p.set_defaults(func=lambda a: demo_concurrent(a) if a.concurrent else demo(a))
    try:
        from hf_accel import bench
    except ImportError:
        bench = None
    if bench is not None:
        b = sub.add_parser("bench", help="benchmarks of WORKLOADS.md beside stock transformers")
        bench.add_arguments(b)
        b.set_defaults(func=bench.run)
    # the serve subcommand's arguments need only the standard library; fastapi and uvicorn load when it runs
    from hf_accel.serve import cli as serve_cli

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server for a model (needs the [serve] extra)")
    serve_cli.add_arguments(s)
    s.set_defaults(func=serve_cli.run)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
