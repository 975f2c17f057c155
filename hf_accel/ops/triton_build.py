"""Build many Triton kernels at once, before their first call.

A Triton kernel is built on its first call with a new specialization: the MLIR passes, `ptxas`, and (for a new
argument signature) a C launcher built with the host compiler, 0.2-0.6 s in all, one kernel after another. The
small-M GEMM's tuning at a fresh start builds about fifty configurations that way (12-14 s of an 8B start on the
H200), while the machine's other cores sit idle.

`build_in_parallel` takes calls of `JITFunction.warmup(...)` (compile, do not run) and makes them under Triton's
async compile mode with a thread pool: the builds run side by side (the passes and the subprocesses do not hold the
GIL: 2x on two cores, measured) and land in Triton's in-memory and on-disk caches, so the later real calls find them
built. The launchers are then built in the same pool, from each kernel's source and metadata (they are cached on
disk by their C source; the kernel's first call loads the cached module).

Triton's async mode is a private API (`triton.runtime._async_compile`, present in triton 3.4-3.9); where it is
missing or fails, nothing is built ahead and every kernel builds on its first call, as before. A configuration that
does not build (too much shared memory, an unsupported tile) is counted as failed here and fails again, as it
always did, where its caller times it.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)


def default_workers() -> int:
    """Threads for a build: the CPUs this process may use, at most 16 (`HF_ACCEL_BUILD_THREADS` overrides; a value
    that is not an integer is ignored with a warning)."""
    env = os.environ.get("HF_ACCEL_BUILD_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            logger.warning("hf_accel: HF_ACCEL_BUILD_THREADS=%r is not an integer; using the CPU count", env)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(16, cpus))


def build_in_parallel(warmups: Iterable[Callable[[], object]], workers: int | None = None) -> dict:
    """Run each `warmup` (a call returning `JITFunction.warmup(...)`'s result, or a list of them) with the builds in
    a thread pool; returns {"kernels", "failed", "launchers", "workers", "seconds"} ("workers" 0: nothing was built
    ahead, since the pool would have one thread, triton has no async mode, or it could not be entered)."""
    t0 = time.perf_counter()
    warmups = list(warmups)
    workers = default_workers() if workers is None else workers
    report = {"kernels": 0, "failed": 0, "launchers": 0, "workers": 0, "seconds": 0.0}
    if not warmups or workers < 2 or os.environ.get("TRITON_INTERPRET") == "1":
        return report
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return report
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="hf_accel-triton-build") as pool:
            try:
                # in a copy of this thread's context: the async mode's flag is a context variable, and triton 3.6
                # leaves it set when its exit is interrupted (Ctrl-C while it waits for the builds), which would send
                # every later first call of a kernel in this thread to the shut-down pool
                futures = contextvars.copy_context().run(_submit_all, AsyncCompileMode, pool, warmups, report)
                if futures is not None:
                    report["workers"] = workers
                    kernels = _distinct_kernels(futures, report)
                    report["kernels"] = len(kernels)
                    report["launchers"] = sum(pool.map(_build_launcher, _distinct_launchers(kernels)))
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)  # an interrupt waits for running builds only
                raise
    finally:
        report["seconds"] = time.perf_counter() - t0
    return report


def _distinct_kernels(futures: list, report: dict) -> list:
    """The compiled kernels behind the warm-ups' results, each once (a failed one counted in `report`)."""
    kernels, seen = [], set()
    for future in futures:
        kernel = _resolved(future)
        if kernel is None:
            report["failed"] += 1
        elif id(kernel) not in seen:
            seen.add(id(kernel))
            kernels.append(kernel)
    return kernels


def _submit_all(mode_cls, pool: ThreadPoolExecutor, warmups: list, report: dict) -> list | None:
    """Call every warm-up under the async compile mode (its exit waits for the builds); what they returned, or None
    when the mode could not be used (another one active in this thread, or this triton's differs)."""
    futures: list = []
    try:
        mode = mode_cls(pool, ignore_errors=True)
        mode.__enter__()
    except Exception as exc:
        logger.debug("hf_accel: Triton's async compile mode is unavailable (%s); kernels build on first call", exc)
        return None
    try:
        for warmup in warmups:
            try:
                built = warmup()
            except Exception as exc:  # the specialization itself failed: its real call will say why
                logger.debug("hf_accel: Triton build ahead failed: %s", exc)
                report["failed"] += 1
                continue
            futures.extend(built if isinstance(built, list) else [built])
    finally:
        mode.__exit__(None, None, None)
    return futures


def _resolved(future):
    """The compiled kernel behind what `warmup` returned (a future under the async mode), or None if it failed."""
    if future is None:
        return None
    result = getattr(future, "result", None)
    if callable(result):  # triton's FutureKernel: finalized when the async mode exited
        try:
            return result(ignore_errors=True)
        except Exception:
            return None
    return future


def _distinct_launchers(kernels: list) -> list:
    """One kernel per launcher source: the C launcher depends on the argument types (and tensor descriptors), not
    on the names or constexpr values, so most kernels share one; building each once keeps gcc runs few and avoids
    several threads building the same module."""
    out, seen = [], set()
    for kernel in kernels:
        src = getattr(kernel, "src", None)
        if src is None or getattr(kernel, "_run", None) is not None:
            continue
        signature = getattr(src, "signature", None) or {}
        key = repr((tuple(signature.values()), getattr(getattr(kernel, "metadata", None), "tensordesc_meta", None)))
        if key not in seen:
            seen.add(key)
            out.append(kernel)
    return out


def _build_launcher(kernel) -> int:
    """Build (into Triton's on-disk cache) the C launcher `kernel`'s first call would build; 1 if built."""
    try:
        from triton.runtime.driver import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
        return 1
    except Exception as exc:  # the first call builds it, as before
        logger.debug("hf_accel: Triton launcher build ahead failed: %s", exc)
        return 0
