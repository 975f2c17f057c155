"""`hf-accel serve MODEL`: load a checkpoint, accelerate it, serve it over HTTP (OpenAI-compatible).

This module imports only the standard library at import time, so that `hf-accel` can list its `serve` subcommand
(and run `demo`) without the `[serve]` extra installed; fastapi and uvicorn are imported when the server starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

logger = logging.getLogger("hf_accel.serve")

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_CUDAGRAPH_MODES = ("none", "piecewise", "full", "full_decode_only", "full_and_piecewise")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL_OR_PATH", help="model id or local path (as from_pretrained takes it)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the name requests must give as `model` (default: MODEL_OR_PATH as given)")
    p.add_argument("--tokenizer", default=None, help="tokenizer id or path (default: MODEL_OR_PATH)")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests in flight beyond this many get a 503 (default: 1024)")
    p.add_argument("--dtype", default=None, choices=_DTYPES,
                   help="weights dtype (default: bfloat16 on CUDA, the checkpoint's own on CPU)")
    p.add_argument("--device", default=None, help="device (default: cuda if available, else cpu)")
    g = p.add_argument_group("accelerate_model options")
    g.add_argument("--attention-backend", default="auto")
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--cudagraph-mode", default=None, choices=_CUDAGRAPH_MODES)
    g.add_argument("--no-compile", action="store_true", help="no torch.compile (CUDA graphs stay, see README)")
    from hf_accel.config import add_switch_arguments

    add_switch_arguments(g)  # --[no-]pdl, --[no-]small-m-gemm, ... as `hf-accel bench` takes them
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """Model (on its device, accelerated) and tokenizer, as the command line asks."""
    import torch
    import transformers

    from hf_accel import AccelConfig, accelerate_model
    from hf_accel.config import switch_values

    sharded = world_size() > 1  # under torchrun: transformers places each rank's shard, --device does not apply
    if sharded and args.device:
        logger.warning("--device is ignored under torchrun: transformers places each rank's shard (tp_plan='auto')")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if sharded or not args.device else args.device
    name = args.dtype or ("bfloat16" if device.startswith("cuda") else "auto")
    dtype = name if name == "auto" else getattr(torch, name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    if sharded:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, tp_plan="auto").eval()
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    accelerate_model(model, attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                     max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                     gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks,
                     block_size=args.block_size, cudagraph_mode=args.cudagraph_mode,
                     compile=False if args.no_compile else None, config=AccelConfig(**switch_values(args)))
    return model, tokenizer


def world_size() -> int:
    """The number of ranks torchrun started this command on (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _configure_logging(level: str) -> None:
    """Our request lines on stderr; uvicorn keeps its own startup/shutdown lines (its access log is off)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("hf_accel")
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False


SWITCH_INTERVAL_S = 0.0002  # the interpreter's GIL switch interval while serving (default 0.005)


def serve_app(app: Any, host: str, port: int, *, log_level: str = "info") -> None:
    """Run `app` with uvicorn until SIGINT or SIGTERM.

    On the signal, generations in flight are aborted first (their streams end with finish_reason "abort"), so
    uvicorn's graceful shutdown does not wait for long generations; then it closes the connections and returns.
    """
    import uvicorn

    abort_all = app.state.server.abort_all

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            abort_all()
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(app, host=host, port=port, access_log=False, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=10)
    server = _Server(config)
    # uvicorn re-raises the signal it caught once it has shut down, to give the previous handler its turn; with
    # these no-op handlers that turn does nothing and the process exits 0 after a clean shutdown
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    # the event loop (HTTP, detokenization) and the engine thread share the GIL: with Python's default 5 ms switch
    # interval a busy event loop holds the engine thread back up to 5 ms each time it gives the GIL up (every step
    # waits for the GPU), so decode steps stretch to 5 ms+; a short interval keeps the engine thread's waits short
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        server.run()
    finally:
        sys.setswitchinterval(interval)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"hf-accel serve needs the [serve] extra ({exc}); pip install 'hf_accel[serve]'", file=sys.stderr)
        return 2
    from hf_accel.serve.app import build_app

    if args.max_queued_requests < 1:
        print(f"--max-queued-requests must be at least 1, got {args.max_queued_requests}", file=sys.stderr)
        return 2

    _configure_logging(args.log_level)
    logger.info("loading %s", args.model)
    try:
        model, tokenizer = load(args)
    except (OSError, ValueError, NotImplementedError) as exc:  # no such checkpoint, a model we cannot accelerate
        print(f"hf-accel serve: cannot serve {args.model}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if world_size() > 1:
        return _run_tensor_parallel(args, model, tokenizer)
    app = build_app(model, tokenizer, args.served_model_name or args.model,
                    max_queued_requests=args.max_queued_requests)
    logger.info("serving %s on http://%s:%d/v1", args.served_model_name or args.model, args.host, args.port)
    serve_app(app, args.host, args.port, log_level=args.log_level)
    return 0


def _run_tensor_parallel(args: argparse.Namespace, model: Any, tokenizer: Any) -> int:
    """Under torchrun: rank 0 answers HTTP and drives the engine; every other rank follows its schedule step by
    step (engine/tp_driver.py) and returns once rank 0 has shut down."""
    import torch.distributed as dist

    from hf_accel.api import follow_tensor_parallel, lead_tensor_parallel, stop_leading_tensor_parallel
    from hf_accel.serve.app import build_app

    rank = dist.get_rank()
    if rank != 0:
        # a signal torchrun forwards to every rank must not end a follower before rank 0 has told it to stop
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        steps = follow_tensor_parallel(model)
        logger.info("rank %d: rank 0 stopped serving after %d steps", rank, steps)
        _leave_process_group()
        return 0
    lead_tensor_parallel(model)
    try:
        try:
            app = build_app(model, tokenizer, args.served_model_name or args.model,
                            max_queued_requests=args.max_queued_requests)
        except NotImplementedError as exc:
            print(f"hf-accel serve: cannot serve {args.model} tensor-parallel: {exc}", file=sys.stderr)
            return 1
        logger.info("serving %s on http://%s:%d/v1 (tensor parallel over %d ranks)",
                    args.served_model_name or args.model, args.host, args.port, dist.get_world_size())
        serve_app(app, args.host, args.port, log_level=args.log_level)
    finally:
        # a stream left open: end the job rather than leave the other ranks waiting
        if not stop_leading_tensor_parallel(model, timeout=60):
            logger.error("calls still running 60 s after shutdown; ending the job")
            logging.shutdown()
            os._exit(1)
        _leave_process_group()
    return 0


def _leave_process_group() -> None:
    """Every rank, once rank 0 has stopped leading: meet, then take the process group down together, so no rank
    exits while another still talks to it."""
    import torch.distributed as dist

    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the job is ending anyway; say why it did not end cleanly
        logger.warning("leaving the process group failed: %s: %s", type(exc).__name__, exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-accel serve", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
