"""`hf_accel.ops.triton_build`: Triton kernel builds ahead of their first call, side by side in a thread pool.

On CPU the pool is exercised with stand-in warm-ups (nothing here can compile for a GPU): they run under Triton's
async compile mode, their results are resolved and counted, and a warm-up that fails is counted, never raised. The
GPU test in `test_small_m_gemm.py` checks that the kernels built ahead are the very specializations the tuner runs.
"""

from __future__ import annotations

import os
import threading

import pytest

pytest.importorskip("triton")

from hf_accel.ops import triton_build  # noqa: E402


@pytest.fixture(autouse=True)
def _compiled_triton(monkeypatch):
    """The builds ahead are for compiled Triton; other test modules may have switched this process to the
    interpreter (tests/triton_mode.py), where nothing is built ahead."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


class _Future:
    """What `JITFunction.warmup` returns under the async mode: a future kernel with `result(ignore_errors=...)`."""

    def __init__(self, kernel):
        self.kernel = kernel

    def result(self, ignore_errors: bool = False):
        if isinstance(self.kernel, Exception):
            if ignore_errors:
                return None
            raise self.kernel
        return self.kernel


class _Kernel:
    def __init__(self, name: str):
        self.src = None  # no launcher to build for a stand-in
        self.name = name
        self._run = None


def test_warmups_run_under_the_async_mode_with_a_pool():
    from triton.runtime._async_compile import active_mode

    seen = []

    def warmup(i):
        mode = active_mode.get()
        assert mode is not None  # builds submitted from here would go to the pool
        seen.append(i)
        return _Future(_Kernel(f"k{i}"))

    report = triton_build.build_in_parallel([lambda i=i: warmup(i) for i in range(5)], workers=3)
    assert seen == list(range(5))
    assert report["kernels"] == 5 and report["failed"] == 0 and report["workers"] == 3
    assert active_mode.get() is None  # left as it was found


def test_submitted_builds_run_in_the_pool_threads():
    """A build submitted the way Triton's `_do_compile` does runs on a pool thread, not the caller's."""
    from triton.runtime._async_compile import active_mode

    threads = []

    def warmup(i):
        mode = active_mode.get()
        pool = mode.executor
        future = pool.submit(lambda: threads.append(threading.current_thread().name) or _Kernel(str(i)))
        return _Future(future.result())

    report = triton_build.build_in_parallel([lambda i=i: warmup(i) for i in range(4)], workers=2)
    assert report["kernels"] == 4
    assert threads and all(name.startswith("hf_accel-triton-build") for name in threads)


def test_failures_are_counted_not_raised_and_lists_are_flattened():
    shared = _Kernel("shared")

    def broken():
        raise RuntimeError("no such specialization")

    warmups = [
        broken,
        lambda: _Future(RuntimeError("ptxas failed")),
        lambda: [_Future(_Kernel("gemm")), _Future(_Kernel("reduce"))],
        lambda: _Future(shared),
        lambda: _Future(shared),  # the same kernel twice (one specialization asked for twice) counts once
        lambda: None,
    ]
    report = triton_build.build_in_parallel(warmups, workers=2)
    assert report["failed"] == 3 and report["kernels"] == 3


def test_one_worker_builds_nothing_ahead(monkeypatch):
    called = []
    report = triton_build.build_in_parallel([lambda: called.append(1)], workers=1)
    assert report["workers"] == 0 and not called  # every kernel builds on its first call, as before
    monkeypatch.setenv("HF_ACCEL_BUILD_THREADS", "3")
    assert triton_build.default_workers() == 3
    monkeypatch.delenv("HF_ACCEL_BUILD_THREADS")
    assert 1 <= triton_build.default_workers() <= 16


def test_nothing_is_built_ahead_in_the_interpreter_or_beside_another_async_mode(monkeypatch):
    from triton.runtime._async_compile import AsyncCompileMode, active_mode

    called = []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    report = triton_build.build_in_parallel([lambda: called.append(1)], workers=4)
    assert report["workers"] == 0 and not called
    monkeypatch.delenv("TRITON_INTERPRET")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as other, AsyncCompileMode(other):  # e.g. a caller's own async build
        report = triton_build.build_in_parallel([lambda: called.append(1)], workers=4)
        assert report["workers"] == 0 and not called  # every kernel then builds on its first call, as before
        assert active_mode.get() is not None  # the caller's mode is left alone


def test_an_interrupted_build_leaves_no_async_mode_behind(monkeypatch):
    """A KeyboardInterrupt (Ctrl-C) while the async mode waits for the builds: triton 3.6 then leaves its flag set
    (simulated here). The flag lives in a copied context, so later first calls of kernels in this thread compile as
    usual instead of going to a shut-down pool."""
    from triton.runtime import _async_compile
    from triton.runtime._async_compile import active_mode

    def interrupted_exit(self, *exc):  # triton 3.6: waits for the futures first, clears the flag after
        raise KeyboardInterrupt

    monkeypatch.setattr(_async_compile.AsyncCompileMode, "__exit__", interrupted_exit)
    with pytest.raises(KeyboardInterrupt):
        triton_build.build_in_parallel([lambda: _Future(_Kernel("k"))], workers=2)
    assert active_mode.get() is None


def test_a_bad_thread_count_falls_back_to_the_cpus(monkeypatch, caplog):
    monkeypatch.setenv("HF_ACCEL_BUILD_THREADS", "auto")
    with caplog.at_level("WARNING"):
        assert 1 <= triton_build.default_workers() <= 16
    assert "HF_ACCEL_BUILD_THREADS" in caplog.text


def test_launchers_are_built_once_per_argument_types():
    class _Src:
        def __init__(self, signature):
            self.signature = signature

    class _Meta:
        tensordesc_meta = None

    def kernel(signature):
        k = _Kernel("k")
        k.src, k.metadata = _Src(signature), _Meta()
        return k

    same = [kernel({"x": "*bf16", "n": "i32", "BLOCK": "constexpr"}),
            kernel({"y": "*bf16", "m": "i32", "B": "constexpr"})]
    other = kernel({"x": "*fp32", "n": "i32"})
    assert len(triton_build._distinct_launchers([*same, other])) == 2


# ---------------------------------------------------------------------------------------------- stable cache keys
_KERNEL_MODULE = '''
import triton
import triton.language as tl

SCALE = tl.constexpr(3)


@triton.jit
def kernel(x_ptr):  # defined before the helper it calls, as split_kv_decode's kernel is before _merge_group
    tl.store(x_ptr, helper(tl.load(x_ptr)))


@triton.jit
def helper(x):
    return x * SCALE
'''


def test_settle_cache_keys_computes_each_callee_before_its_caller(tmp_path, monkeypatch):
    """triton 3.6 merges a callee's global constants into a caller's key only if the callee's key was computed
    first; the order must not be left to whichever kernel a process launches first."""
    import importlib.util

    from triton.runtime.jit import JITFunction

    path = tmp_path / "two_kernels.py"
    path.write_text(_KERNEL_MODULE)
    spec = importlib.util.spec_from_file_location("two_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    owner = next(k for k in JITFunction.__mro__ if "cache_key" in vars(k))
    original = vars(owner)["cache_key"]
    events: list[tuple[str, str]] = []

    def recorded(self):
        events.append(("start", self.fn.__name__))
        key = original.fget(self)
        events.append(("end", self.fn.__name__))
        return key

    monkeypatch.setattr(owner, "cache_key", property(recorded))
    triton_build.settle_cache_keys(vars(module))
    assert module.kernel.hash is not None and module.helper.hash is not None
    assert events.index(("end", "helper")) < events.index(("start", "kernel")), events
    assert "SCALE" in {name for name, _ in module.kernel.used_global_vals}


def test_a_key_that_cannot_be_computed_is_left_to_the_first_launch(tmp_path, caplog):
    """Triton leaves a placeholder key on a function whose analysis raised; a kernel keyed by its name alone could
    load a stale build after an edit, so the placeholder is dropped and the first launch raises as it always did."""
    import importlib.util

    path = tmp_path / "bad_kernel.py"
    path.write_text('''
import triton
import triton.language as tl


def plain(x):
    return x


@triton.jit
def kernel(x_ptr):
    if False:
        plain(1)
    tl.store(x_ptr, 1)
''')
    spec = importlib.util.spec_from_file_location("bad_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with caplog.at_level("WARNING", logger="hf_accel.ops.triton_build"):
        triton_build.settle_cache_keys(vars(module))
    assert module.kernel.hash is None
    assert any("could not be computed" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="Unsupported function"):
        module.kernel.cache_key  # noqa: B018


def test_every_kernel_key_is_settled_at_import_and_holds_its_callees_globals():
    """In a fresh process (compiled Triton, not the interpreter): importing our kernel modules computes every JIT
    function's key, and each key covers the global constants of the helpers it calls."""
    import os
    import subprocess
    import sys

    code = '''
import ast, importlib
from triton.runtime.jit import JITFunction
names = ["hf_accel.attention.kernels.common", "hf_accel.attention.kernels.kv_write",
         "hf_accel.attention.kernels.split_kv_decode", "hf_accel.attention.kernels.unified_attention",
         "hf_accel.ops.digest", "hf_accel.ops.fused_kernels", "hf_accel.ops.skinny_gemm"]
fns = []
for name in names:
    module = importlib.import_module(name)
    fns += [v for v in vars(module).values() if isinstance(v, JITFunction) and v.fn.__module__ == name]
unsettled = [f.fn.__name__ for f in fns if f.hash is None]
assert not unsettled, unsettled
for f in fns:
    callees = [f.__globals__.get(n.id) for n in ast.walk(f.parse()) if isinstance(n, ast.Name)]
    for c in callees:
        if isinstance(c, JITFunction) and c is not f:
            missing = set(c.used_global_vals) - set(f.used_global_vals)
            assert not missing, (f.fn.__name__, c.fn.__name__, missing)
print(len(fns))
'''
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip().splitlines()[-1]) >= 10  # every module's kernels and helpers were looked at


def test_pin_ptxas_keeps_the_users_choice(monkeypatch):
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/my/ptxas")
    triton_build.pin_ptxas()
    assert os.environ["TRITON_PTXAS_PATH"] == "/opt/my/ptxas"


def test_pin_ptxas_points_at_the_assembler_inductor_uses(monkeypatch):
    compile_tasks = pytest.importorskip("torch._inductor.runtime.compile_tasks")
    setter = getattr(compile_tasks, "_set_triton_ptxas_path", None)
    if setter is None:
        pytest.skip("this torch does not pick Triton's ptxas")
    monkeypatch.setenv("TRITON_PTXAS_PATH", "placeholder")  # restored (or removed again) after the test
    monkeypatch.delenv("TRITON_PTXAS_PATH")
    if hasattr(setter, "cache_clear"):
        setter.cache_clear()
    try:
        triton_build.pin_ptxas()
    finally:
        pinned = os.environ.get("TRITON_PTXAS_PATH")
        if hasattr(setter, "cache_clear"):  # not "done" for a variable this test's teardown removes
            setter.cache_clear()
    # torch ships a ptxas with CUDA wheels only: then it is pinned, an executable file; otherwise nothing is set
    if pinned is not None:
        assert os.path.isfile(pinned) and os.access(pinned, os.X_OK)
        assert pinned.startswith(os.path.dirname(os.path.dirname(compile_tasks.__file__)))


# ---------------------------------------------------------------------- building ahead from real launch code
class _StandInKernel:
    """A JIT function as a launch site sees it: `kernel[grid](...)` runs it, `kernel.warmup(...)` only builds."""

    def __init__(self):
        self.ran, self.built, self.threads = [], [], []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.ran.append((grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        """As Triton's: under the async compile mode the build goes to the mode's executor (a pool thread)."""
        from triton.runtime._async_compile import active_mode

        self.built.append((grid, args, kwargs))
        kernel = _Kernel(f"k{len(self.built)}")
        mode = active_mode.get()
        if mode is None:
            return kernel
        return _Future(mode.executor.submit(lambda: (self.threads.append(threading.current_thread().name),
                                                     kernel)[1]).result())


def test_launcher_runs_the_kernel_outside_ahead_and_builds_it_inside():
    kernel = _StandInKernel()
    triton_build.launcher(kernel, (4, 2))(1, 2, BLOCK=16)
    assert kernel.ran == [((4, 2), (1, 2), {"BLOCK": 16})] and kernel.built == []

    def step():
        triton_build.launcher(kernel, (8,))(3, BLOCK=32)
        triton_build.launcher(kernel, (1,))(4, BLOCK=64)

    built = triton_build.ahead(step)()
    assert len(built) == 2 and len(kernel.ran) == 1  # compiled with the same arguments, never launched
    assert kernel.built == [((8,), (3,), {"BLOCK": 32}), ((1,), (4,), {"BLOCK": 64})]
    triton_build.launcher(kernel, (2,))(5)  # after ahead(): launches again
    assert len(kernel.ran) == 2
    # an explicit warmup builds without recording anywhere (the small-M tuner collects those itself)
    triton_build.launcher(kernel, (2,), warmup=True)(6)
    assert len(kernel.built) == 3 and len(kernel.ran) == 2


def test_ahead_leaves_the_mode_off_when_its_step_raises():
    kernel = _StandInKernel()

    def step():
        triton_build.launcher(kernel, (1,))(1)
        raise RuntimeError("a forward that cannot run")

    with pytest.raises(RuntimeError):
        triton_build.ahead(step)()
    triton_build.launcher(kernel, (1,))(2)
    assert len(kernel.ran) == 1 and len(kernel.built) == 1


def test_ahead_steps_build_in_the_pool_and_a_failing_step_is_counted():
    kernel = _StandInKernel()

    def step(n):
        for i in range(n):
            triton_build.launcher(kernel, (i,))(i)

    def broken():
        raise RuntimeError("no such shape")

    report = triton_build.build_in_parallel([triton_build.ahead(lambda: step(3)), triton_build.ahead(broken),
                                             triton_build.ahead(lambda: step(2))], workers=2)
    assert report["kernels"] == 5 and report["failed"] == 1 and kernel.ran == []
    assert len(kernel.threads) == 5 and all(t.startswith("hf_accel-triton-build") for t in kernel.threads)


def test_building_ahead_is_seen_only_inside_ahead():
    seen = []
    triton_build.ahead(lambda: seen.append(triton_build.building_ahead()))()
    assert seen == [True] and not triton_build.building_ahead()


def test_a_failed_build_is_forgotten_so_the_next_launch_builds_again():
    """An older triton may keep a failed build's future in the kernel cache: dropped after the build, so the next
    launch compiles again instead of re-raising the old failure forever. A finished build stays."""
    import inspect
    from concurrent.futures import Future

    from triton.runtime._async_compile import FutureKernel

    names = list(inspect.signature(FutureKernel.__init__).parameters)[1:]
    parts = {"finalize_compile": lambda k: None, "cleanup_compile": lambda fk: None}
    if set(names) - set(parts) != {"future"}:
        pytest.skip(f"this triton's FutureKernel takes {names}")

    def future_kernel(future):
        return FutureKernel(*[future if n == "future" else parts[n] for n in names])

    failed, done = Future(), Future()
    failed.set_exception(RuntimeError("ptxas was killed"))
    done.set_result("kernel")
    bad = future_kernel(failed)
    bad.result(ignore_errors=True)  # what the async mode's exit does; the placeholder stays in the cache
    good = future_kernel(done)
    good.result()

    class _Jit:
        device_caches = {0: ({"bad": bad, "good": good, "plain": "compiled"}, {}, None, None, None)}

    jit = _Jit()
    triton_build._COMPILED_ONLY.add(jit)
    try:
        assert triton_build._drop_failed_builds() == 1
        assert set(jit.device_caches[0][0]) == {"good", "plain"}
    finally:
        triton_build._COMPILED_ONLY.discard(jit)


def test_every_launch_of_our_kernels_goes_through_launcher():
    """A `kernel[grid](...)` launch elsewhere would run for real inside `ahead` (and wait for its build there)."""
    import pathlib
    import re

    root = pathlib.Path(triton_build.__file__).resolve().parents[1]
    direct = []
    for path in root.rglob("*.py"):
        if path.name == "triton_build.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b\w*_kernel\[[^\]]*\]\s*\(", line):
                direct.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not direct, direct


def test_build_ahead_switch(monkeypatch):
    monkeypatch.delenv("HF_ACCEL_BUILD_AHEAD", raising=False)
    assert triton_build.build_ahead_enabled()
    for off in ("0", "false", "off"):
        monkeypatch.setenv("HF_ACCEL_BUILD_AHEAD", off)
        assert not triton_build.build_ahead_enabled()
    monkeypatch.setenv("HF_ACCEL_BUILD_AHEAD", "1")
    assert triton_build.build_ahead_enabled()


def test_warmup_representatives_are_the_keys_capture_warms_up():
    from hf_accel.compilation.cuda_graph import capture_with_warmups, warmup_representatives

    keys = [512, 256, 64, 56, 48, 32, 24, 16, 8, 4, 2, 1]

    def cls(t):
        return (t == 1, t % 16 == 0, t > 32)

    warmed = []
    capture_with_warmups(keys, cls, warmed.append, lambda k: None, lambda: None, "test")
    assert warmup_representatives(keys, cls) == warmed == [512, 56, 32, 24, 1]
    assert warmup_representatives(keys, None) == keys


@pytest.mark.gpu
def test_gpu_capture_warmups_build_no_kernel_of_ours_after_the_build_ahead(tmp_path):
    """A fresh process with empty Triton and compile caches: every Triton kernel of ours that the graph warm-ups
    launch was built ahead (none is compiled inside a warm-up), and the start still generates what stock does."""
    import subprocess
    import sys

    if not __import__("torch").cuda.is_available():
        pytest.skip("needs CUDA")
    code = '''
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
import triton.runtime.jit as jit
from hf_accel import AccelConfig, accelerate_model, engine_info
from hf_accel.compilation.cuda_graph import FullCUDAGraphRunner
from hf_accel.compilation.piecewise import PiecewiseForward

state = {"in_warmup": False, "warmup_builds": [], "builds": 0}
original = jit.JITFunction._do_compile
def recording(self, *args, **kwargs):
    if self.fn.__module__.startswith("hf_accel"):
        state["builds"] += 1
        if state["in_warmup"]:
            state["warmup_builds"].append(self.fn.__name__)
    return original(self, *args, **kwargs)
jit.JITFunction._do_compile = recording
for cls in (FullCUDAGraphRunner, PiecewiseForward):
    def wrap(warm_up):
        def inner(self, *args, **kwargs):
            state["in_warmup"] = True
            try:
                return warm_up(self, *args, **kwargs)
            finally:
                state["in_warmup"] = False
        return inner
    cls._warm_up = wrap(cls._warm_up)

torch.manual_seed(0)
config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
model = LlamaForCausalLM(config).to("cuda", torch.float32).eval()
ids = torch.randint(3, 500, (2, 12), device="cuda")
stock = model.generate(ids, max_new_tokens=6, do_sample=False)
accelerate_model(model, config=AccelConfig(compile_cache_dir=sys.argv[1]), max_num_seqs=8,
                 attention_backend="triton")
ours = model.generate(ids, max_new_tokens=6, do_sample=False)
info = engine_info(model)["startup"]
split = info.get("capture_split") or {}
print(json.dumps({"same": bool(torch.equal(stock, ours)), "warmup_builds": state["warmup_builds"],
                  "builds": state["builds"], "ahead": info.get("capture_build_ahead"),
                  "retries": split.get("piecewise_retries", 0) + split.get("full_retries", 0)}))
'''
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    env.pop("HF_ACCEL_BUILD_AHEAD", None)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "hf_accel")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["same"], result
    assert result["ahead"] and result["ahead"]["kernels"] > 0 and result["ahead"]["forwards"] > 0, result
    assert result["warmup_builds"] == [], result
    assert result["retries"] == 0, result


def test_autotune_builds_first_steps_only_for_triton_kernels_and_never_raises(monkeypatch):
    from hf_accel.attention import autotune

    calls = []
    monkeypatch.setattr(triton_build, "build_in_parallel", lambda warmups, workers=None: calls.append(len(warmups)))

    class _Library:  # a backend whose kernels are a library's
        builds_triton_kernels = False

    assert autotune._build_first_steps(_Library(), None, [object(), object()], ()) == 0.0 and calls == []

    class _Ours:
        builds_triton_kernels = True
        name = "triton"

    assert autotune._build_first_steps(_Ours(), None, [object(), object()], ()) >= 0.0 and calls == [2]

    def broken(warmups, workers=None):
        raise OSError("no threads left")

    monkeypatch.setattr(triton_build, "build_in_parallel", broken)
    assert autotune._build_first_steps(_Ours(), None, [object()], ()) >= 0.0  # logged, the first calls build
    monkeypatch.setenv("HF_ACCEL_BUILD_AHEAD", "0")
    monkeypatch.setattr(triton_build, "build_in_parallel", lambda warmups, workers=None: calls.append(0))
    assert autotune._build_first_steps(_Ours(), None, [object()], ()) == 0.0 and calls == [2]


def test_a_compile_only_launch_zeroes_what_it_declares_it_writes():
    import torch

    kernel = _StandInKernel()
    out = torch.full((4,), float("nan"))
    triton_build.launcher(kernel, (1,), writes=(out,))(out)
    assert torch.isnan(out).all()  # a real launch: the kernel writes it, the launcher does not touch it
    triton_build.ahead(lambda: triton_build.launcher(kernel, (1,), writes=(out,))(out))()
    assert torch.equal(out, torch.zeros(4))  # compiled only: the rest of the forward reads zeros
    triton_build.launcher(kernel, (1,), warmup=True, writes=(torch.float32,))(torch.float32)  # dtypes: nothing
