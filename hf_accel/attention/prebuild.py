"""Keep library first-use JIT builds off the startup path: build markers and background builds.

FlashInfer compiles its kernels on first use on each machine (about 75-90 s per head dim and variant on an H200),
and triton has won the autotune on every shape measured. Timing FlashInfer inside `accelerate_model`'s autotune
would make every fresh machine wait for that build before the first token. So:

- a backend whose first use here would be a long JIT build says so (`AttentionBackend.pending_build`); the
  autotune times only the ready candidates, and the others are reported as skipped;
- `start_background_build` launches one detached process that builds the skipped backend's kernels for this
  attention shape (by running it once on synthetic steps, as the autotune does) and then writes a build marker;
- the autotune's remembered answer is keyed by the set of ready candidates, so the first start after the build
  finished times the newly ready backend and keeps it if it wins. A build that failed is not retried (delete the
  `.failed` file beside its marker to retry; its `.log` says what went wrong).

A marker records the library version, GPU, attention shape and the library's own cache directory; it counts only
while that directory still exists (a wiped or redirected library cache means "not built"). Run as a module
(`python -m hf_accel.attention.prebuild ...`) it is the background builder itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from hf_accel.attention.backend import AttentionSpec

logger = logging.getLogger(__name__)

MARKER_DIR = "builds"
ENV_DISABLE = "HF_ACCEL_BACKGROUND_BUILDS"  # "0": never start a background build


def _root(cache_dir: str | None) -> Path:
    from hf_accel.compilation.cache import default_cache_root

    if cache_dir:
        return Path(cache_dir).expanduser() / MARKER_DIR
    return default_cache_root().parent / MARKER_DIR


def spec_to_dict(spec: AttentionSpec) -> dict:
    return {"num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "dtype": str(spec.dtype).removeprefix("torch."), "uses_softcap": spec.uses_softcap,
            "uses_sliding_window": spec.uses_sliding_window}


def spec_from_dict(d: dict) -> AttentionSpec:
    return AttentionSpec(num_heads=int(d["num_heads"]), num_kv_heads=int(d["num_kv_heads"]),
                         head_dim=int(d["head_dim"]), dtype=getattr(torch, d["dtype"]),
                         uses_softcap=bool(d["uses_softcap"]), uses_sliding_window=bool(d["uses_sliding_window"]))


def _gpu(device: torch.device) -> str:
    try:
        cap = "".join(map(str, torch.cuda.get_device_capability(device)))
        return f"{torch.cuda.get_device_name(device)} sm{cap}"
    except Exception:
        return "unknown"


def marker_path(backend: str, spec: AttentionSpec, device: torch.device, library_version: str | None,
                library_cache: str, cache_dir: str | None = None) -> Path:
    """Where the marker for this (backend, library version, GPU, shape, library cache directory) lives."""
    payload = {"backend": backend, "version": library_version, "gpu": _gpu(device), "spec": spec_to_dict(spec),
               "library_cache": library_cache}
    key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]
    return _root(cache_dir) / f"{backend}-{key}.json"


def is_built(marker: Path) -> bool:
    """The marker exists and the library cache it names is still there."""
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    cache = record.get("library_cache")
    return isinstance(cache, str) and Path(cache).is_dir()


def mark_built(marker: Path, library_cache: str, seconds: float | None = None) -> None:
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"library_cache": library_cache, "built_at": time.time(),
                                   "seconds": seconds}))
        os.replace(tmp, marker)
    except OSError as exc:  # a read-only cache only costs a later re-check
        logger.debug("cannot write build marker %s: %s", marker, exc)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def build_in_progress(marker: Path) -> bool:
    lock = marker.with_suffix(".building")
    try:
        pid = int(lock.read_text().strip() or 0)
    except (OSError, ValueError):
        return False
    return pid > 0 and _pid_alive(pid)


def _take_lock(lock: Path) -> bool:
    """Create the builder's lock atomically (O_EXCL). A lock left by a dead builder is taken over once: renamed
    away first (only one process can rename it), then created afresh (only one process can create it)."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if build_in_progress(lock.with_suffix(".json")) or _young(lock):
                return False
            stale = lock.with_name(f"{lock.name}.stale{os.getpid()}")
            try:
                os.rename(lock, stale)
            except FileNotFoundError:  # another process took it over first; try to create it once more
                continue
            stale.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))  # the builder writes its own pid as it starts
        return True
    return False


def _young(lock: Path, seconds: float = 30.0) -> bool:
    """A lock written in the last seconds may still be waiting for its builder's pid."""
    try:
        return time.time() - lock.stat().st_mtime < seconds
    except OSError:
        return False


def background_builds_enabled() -> bool:
    return os.environ.get(ENV_DISABLE, "1") != "0"


def start_background_build(backend: str, spec: AttentionSpec, device: torch.device, marker: Path,
                           block_size: int | None = None) -> subprocess.Popen | None:
    """Launch the detached builder for `backend` unless one is running or builds are disabled; None if not started.

    The builder runs at the lowest CPU priority, writes its log beside the marker, and never blocks this process.
    """
    if not background_builds_enabled() or is_built(marker):
        return None
    if marker.with_suffix(".failed").exists():  # it failed here before (its log says why): not again and again
        return None
    lock = marker.with_suffix(".building")
    log = marker.with_suffix(".log")
    cmd = [sys.executable, "-m", "hf_accel.attention.prebuild", "--backend", backend,
           "--spec", json.dumps(spec_to_dict(spec)), "--device", str(device), "--marker", str(marker)]
    if block_size:
        cmd += ["--block-size", str(block_size)]
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        if not _take_lock(lock):  # another process (a TP rank, a second program) is building it
            return None
        try:
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True,
                                        preexec_fn=_lower_priority if os.name == "posix" else None)
        except BaseException:
            lock.unlink(missing_ok=True)
            raise
    except OSError as exc:  # a read-only or missing cache directory: no background build, never a failed start
        logger.info("hf_accel: could not start the background build of %s: %s", backend, exc)
        return None
    logger.info("hf_accel: building %s's kernels for this model in the background (pid %d, log %s); a later "
                "start will time it against the chosen backend", backend, proc.pid, log)
    return proc


def _lower_priority() -> None:  # runs in the child before exec
    try:
        os.nice(19)
    except OSError:
        pass


def _build(backend_name: str, spec: AttentionSpec, device: torch.device, block_size: int | None) -> None:
    """Run the backend once on a decode and a prefill step of this shape: what makes the library build."""
    from hf_accel.attention.autotune import _time_candidate
    from hf_accel.attention.registry import load_backend_class

    cls, err = load_backend_class(backend_name)
    if cls is None:
        raise RuntimeError(err or f"unknown backend {backend_name}")
    with torch.inference_mode():
        _time_candidate(cls, spec, device, block_size, [(255, 1)] * 4, [(0, 256)], num_layers=1, budget_s=0.05)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="hf_accel background kernel build (started by accelerate_model)")
    ap.add_argument("--backend", required=True)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--marker", required=True)
    ap.add_argument("--block-size", type=int, default=None)
    args = ap.parse_args(argv)
    marker = Path(args.marker)
    lock = marker.with_suffix(".building")
    t0 = time.perf_counter()
    try:
        lock.write_text(str(os.getpid()))  # the lock now names a process that exists exactly as long as the build
        spec = spec_from_dict(json.loads(args.spec))
        device = torch.device(args.device)
        _build(args.backend, spec, device, args.block_size)
        from hf_accel.attention.registry import load_backend_class

        cls, _ = load_backend_class(args.backend)
        mark_built(marker, cls.library_cache_dir() or "", time.perf_counter() - t0)
        print(f"built {args.backend} for {spec} in {time.perf_counter() - t0:.1f} s", flush=True)
        return 0
    except Exception as exc:
        print(f"build of {args.backend} failed: {type(exc).__name__}: {exc}", flush=True)
        try:
            marker.with_suffix(".failed").write_text(f"{type(exc).__name__}: {exc}")
        except OSError:
            pass
        return 1
    finally:
        try:
            lock.unlink()
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
