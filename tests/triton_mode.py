"""Run our Triton kernels compiled on a GPU, or in the Triton interpreter on CPU tensors (CI).

Import this module before triton is imported by the test module: without a usable GPU it sets TRITON_INTERPRET=1.
`@triton.jit` binds a function to interpreter or compiler when it is defined, and triton is often imported earlier
(torch._dynamo imports it), so `load_kernel_modules` also rebinds triton's own library functions for the interpreter
and reloads our kernel modules if they were defined in the other mode.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels then run on CPU tensors

DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def _make_triton_language_interpretable() -> None:
    """Make triton's own @jit library functions (tl.zeros, tl.max, ...) callable by the interpreter; kernels never
    compile in this process, so nothing else sees a change. Running it twice is harmless."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    done: dict[int, InterpretedFunction] = {}
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("triton.language"):
            continue
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction):
                if id(obj) not in done:
                    done[id(obj)] = InterpretedFunction(obj.fn)
                setattr(mod, name, done[id(obj)])


def load_kernel_modules(names: list[str], probe: str) -> list[ModuleType]:
    """Import the kernel modules `names` (dotted), reloading them all if `probe` (a kernel of the first module) was
    defined in the other mode than this process runs."""
    if not ON_GPU:
        _make_triton_language_interpretable()
    mods = [importlib.import_module(n) for n in names]
    interpreted = type(getattr(mods[0], probe)).__name__ == "InterpretedFunction"
    if interpreted == ON_GPU:
        mods = [importlib.reload(sys.modules[n]) for n in names]
    return mods
