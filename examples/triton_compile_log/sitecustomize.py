"""Log every `triton.compile` call of a process (and of its child processes) to the file `$TRITON_KEYLOG`.

Probe for startup work (issue 15): which Triton kernels a start builds, when, for how long, on which thread, and
from which launch site of ours or of Inductor. Put this directory first on `PYTHONPATH` and set `TRITON_KEYLOG`;
Python imports `sitecustomize` at startup. One JSON object per line; `summary.py` groups them.

    PYTHONPATH=examples/triton_compile_log:$PWD TRITON_KEYLOG=/tmp/builds.jsonl python3 -m hf_accel.bench ...
    python3 examples/triton_compile_log/summary.py /tmp/builds.jsonl
"""

import os

_LOG = os.environ.get("TRITON_KEYLOG")
if _LOG:
    try:
        import json
        import threading
        import time
        import traceback

        import triton
        import triton.compiler
        import triton.compiler.compiler as _compiler
        import triton.runtime.jit as _jit

        _original = _compiler.compile

        def _where() -> tuple[str, str]:
            """The innermost hf_accel frame and the innermost Inductor frame of the calling stack."""
            ours, inductor = "", ""
            for frame in reversed(traceback.extract_stack(limit=60)[:-2]):
                if not ours and "/hf_accel/" in frame.filename:
                    ours = f"{frame.filename.split('/hf_accel/')[-1]}:{frame.lineno}:{frame.name}"
                if not inductor and "/torch/_inductor/" in frame.filename:
                    inductor = f"{frame.filename.split('/torch/_inductor/')[-1]}:{frame.name}"
            return ours, inductor

        def compile(src, target=None, options=None, _env_vars=None):  # noqa: A001 (triton's name)
            start = time.time()
            ours, inductor = _where()
            try:
                return _original(src, target=target, options=options, _env_vars=_env_vars)
            finally:
                try:
                    name = getattr(getattr(src, "fn", None), "__name__", None) or getattr(src, "name", "?")
                    record = {"pid": os.getpid(), "t": start, "s": round(time.time() - start, 3),
                              "name": str(name)[:60], "thread": threading.current_thread().name, "ours": ours,
                              "inductor": inductor,
                              "constexprs": repr(sorted(getattr(src, "constants", {}).items(), key=repr))[:300]}
                    with open(_LOG, "a") as f:
                        f.write(json.dumps(record) + "\n")
                except Exception:
                    pass

        _compiler.compile = compile
        triton.compile = compile
        triton.compiler.compile = compile
        if hasattr(_jit, "compile"):
            _jit.compile = compile
    except Exception as exc:  # a probe never breaks the process it watches
        with open(_LOG, "a") as f:
            f.write(json.dumps({"error": repr(exc)}) + "\n")
