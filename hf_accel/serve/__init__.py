"""`hf-accel serve`: an OpenAI-compatible HTTP server over the async entry point (optional extra `[serve]`)."""

from typing import Any

__all__ = ["build_app"]


def __getattr__(name: str) -> Any:
    # lazily: `hf-accel` lists the serve subcommand (hf_accel.serve.cli) without fastapi installed
    if name == "build_app":
        from hf_accel.serve.app import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
