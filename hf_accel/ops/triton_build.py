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

A warm start finds its kernels in Triton's on-disk cache only when it computes the same cache keys as the start that
built them. Two things made the keys depend on what a process happened to do first (an 8B warm start rebuilt 9 and
17 kernels in two probes, 2-4 s, measured on the H200 with triton 3.6 and torch 2.11):
- `settle_cache_keys`: triton 3.6 merges a helper's global constants (common.py's `LOG2E`) into a kernel's key
  only if the helper's own key was computed before, so a kernel first launched by the attention autotune (a cold
  start) got another key than the same kernel first launched by a forward (a warm start). Each kernel module
  computes its keys at import, callees first.
- `pin_ptxas`: Inductor's compile workers, and its in-process builds, point Triton at torch's own `ptxas`
  (`TRITON_PTXAS_PATH`), which is part of the key; the kernels a process builds before that (ours, or Inductor's
  when its cache is warm and no worker builds) used Triton's bundled one. accelerate_model pins torch's at once.
  (triton 3.6 reads that variable for Hopper; later ones read `TRITON_PTXAS_BLACKWELL_PATH` for sm_90 and up, which
  neither Inductor nor this module sets, so there every build uses the bundled assembler anyway.)

Building ahead from real code (`launcher`, `ahead`): every launch site of our kernels goes through `launcher`, which
inside `ahead(fn)` compiles instead of launching. So the startup runs one forward per CUDA-graph warm-up class with
its launches compile-only, all the builds in one pool (`build_in_parallel`), and then captures with every kernel
built: the exact specializations the captures launch (the same tensors, strides and integers), with no second
description of them to drift. On fresh H200 starts the graph warm-ups had built about a dozen attention and GEMM
kernels one after another (0.2-1.7 s each; 6.5-9.8 s of warm-ups); built ahead, the same kernels took 3.1-5.1 s
and the warm-ups 0.4-0.5 s. Triton's front end holds the GIL, so threads do not build these large kernels fully
side by side. `HF_ACCEL_BUILD_AHEAD=0` turns it off.
"""

from __future__ import annotations

import ast
import contextvars
import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)


# set (to the list the builds are recorded in) while `ahead(fn)` runs `fn`: launches compile instead of running
_AHEAD: contextvars.ContextVar[list | None] = contextvars.ContextVar("hf_accel_build_ahead", default=None)


# every JIT function `launcher` compiled without running: their caches are checked for failed builds afterwards
_COMPILED_ONLY: set = set()


def building_ahead() -> bool:
    """Whether this thread is inside `ahead(...)`: launches compile only (and zero what they declare they write)."""
    return _AHEAD.get() is not None


def build_ahead_enabled() -> bool:
    """Whether the startup builds its graph warm-ups' kernels ahead, in parallel (`HF_ACCEL_BUILD_AHEAD=0`: no)."""
    return os.environ.get("HF_ACCEL_BUILD_AHEAD", "1").strip().lower() not in ("0", "false", "no", "off")


def launcher(kernel, grid, warmup: bool = False, writes: tuple = ()) -> Callable[..., object]:
    """What a launch site calls with its kernel's arguments: `kernel[grid]`, or Triton's compile-only
    `kernel.warmup` when `warmup` is set or inside `ahead(...)`. Inside `ahead` what it returns is recorded there,
    and the tensors in `writes` (what the launch would write and the forward reads after it) are zeroed: the rest of
    the compile-only forward computes on zeros, not on whatever memory those tensors got."""
    built = _AHEAD.get()
    if built is None and not warmup:
        return kernel[grid]

    def compile_only(*args, **kwargs):
        _COMPILED_ONLY.add(kernel)
        result = kernel.warmup(*args, grid=grid, **kwargs)
        if built is not None:
            built.append(result)
            for tensor in writes:
                if hasattr(tensor, "zero_"):  # a dtype stands in for a tensor in explicit warm-ups
                    tensor.zero_()
        return result

    return compile_only


def ahead(fn: Callable[[], object]) -> Callable[[], list]:
    """A warm-up for `build_in_parallel` made of real code: calls `fn` with every launch through `launcher`
    compiled, not run, and returns what those launches built. Everything else `fn` does runs as usual, on the zeros
    the launches left in their outputs: `fn` must not depend on their values."""
    def run() -> list:
        built: list = []
        token = _AHEAD.set(built)
        try:
            fn()
        finally:
            _AHEAD.reset(token)
        return built

    return run


def settle_cache_keys(namespace: dict) -> None:
    """Compute the Triton cache key of every `@triton.jit` function defined in `namespace` (a module's globals),
    each one's JIT callees first, so that no key depends on which kernel a process launches first (see above)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return
    visited: dict[int, JITFunction] = {}

    def callees(fn: JITFunction) -> list[JITFunction]:
        found = []
        for node in ast.walk(fn.parse()):
            value: object = None
            if isinstance(node, ast.Name):
                value = fn.__globals__.get(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):  # module.helper
                value = getattr(fn.__globals__.get(node.value.id), node.attr, None)
            if isinstance(value, JITFunction) and value is not fn:
                found.append(value)
        return found

    def settle(fn: JITFunction) -> None:
        if id(fn) in visited:
            return
        visited[id(fn)] = fn
        for callee in callees(fn):
            settle(callee)
        fn.cache_key  # noqa: B018 (computed and memoized by triton)

    name = namespace.get("__name__")
    for value in list(namespace.values()):
        if not (isinstance(value, JITFunction) and getattr(value.fn, "__module__", None) == name):
            continue
        try:
            settle(value)
        except Exception as exc:
            # triton leaves a placeholder key ("recursion:<name>") on a function whose analysis raised, which would
            # key its builds by name alone: drop it, so that its first launch analyses it again and fails loudly
            for fn in visited.values():
                if str(getattr(fn, "hash", "")).startswith("recursion:"):
                    fn.hash = None
                    fn.used_global_vals = {}
            logger.warning("hf_accel: the Triton cache key of %s could not be computed at import (%s: %s)",
                           getattr(value.fn, "__qualname__", value), type(exc).__name__, exc)


def pin_ptxas() -> None:
    """Point Triton at the `ptxas` Inductor's compile workers use (torch's own, where torch ships one), unless
    `TRITON_PTXAS_PATH` is set already: every build of this process then keys and builds with the same assembler
    (see above). Inductor sets the same variable itself once it builds a kernel in this process.

    This sets `TRITON_PTXAS_PATH` in `os.environ`: it holds for every Triton user of the process and its child
    processes, and stays after `restore(model)`. Set the variable yourself (to any assembler) to opt out. Pinned
    after the process built a Triton kernel, it would not help: triton caches the assembler's version per
    architecture, so accelerate_model pins before its first build."""
    if os.environ.get("TRITON_PTXAS_PATH") is not None:
        return
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:  # another torch: nothing to agree with
        return
    try:
        _set_triton_ptxas_path()
    except Exception as exc:
        logger.debug("hf_accel: could not pin ptxas: %s", exc)


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
                # the queued launcher builds are dropped (the async mode's exit already waited for the kernels)
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    finally:
        report["seconds"] = time.perf_counter() - t0
        _drop_failed_builds()
    return report


def _drop_failed_builds() -> int:
    """Forget the builds that failed under the async mode, so that a kernel's next launch builds it again (and fails
    loudly if it fails again) instead of finding the failed attempt. triton 3.9 drops them itself; an older one may
    keep the failed future in the kernel's cache, which would turn one transient failure (an assembler killed for
    memory, a full disk) into a failure of every later launch of that specialization. Returns how many."""
    try:
        from triton.runtime._async_compile import FutureKernel
    except ImportError:
        return 0
    dropped = 0
    try:
        for fn in list(_COMPILED_ONLY):
            for caches in list(getattr(fn, "device_caches", {}).values()):
                cache = caches[0] if isinstance(caches, tuple) and caches else None
                if not isinstance(cache, dict):
                    continue
                for key, value in list(cache.items()):
                    # after the async mode's exit every build was finalized (a built one replaced by its kernel):
                    # a future still without a kernel failed. Read its own fields: its __getattr__ would wait on it
                    state = vars(value) if isinstance(value, FutureKernel) else {}
                    if "kernel" in state and state["kernel"] is None:
                        del cache[key]
                        dropped += 1
    except Exception as exc:  # another triton's layout: its own handling stands
        logger.debug("hf_accel: could not look for failed Triton builds: %s", exc)
    return dropped


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
