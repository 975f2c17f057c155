"""Dynamo's traced forward, kept on disk so that a later start of the same model skips tracing.

Tracing a 32-layer model with Dynamo takes about 9 s and is most of a warm start: Inductor's caches already make
the compilation itself cheap, but Dynamo symbolically executes every layer again in every new process. What Dynamo
produces is a plain FX graph whose inputs are the forward's arguments, the sizes read off them, and the model's
weights. This module writes that graph (without its metadata) beside Inductor's artifacts, with a table saying
where each input comes from: a forward argument, a size of one, or a model tensor by name.

Loading rebuilds the graph's fake-tensor metadata with fresh symbols for the dynamic sizes (a fake-tensor run of
the graph), binds the named tensors of the live model, and hands the graph to the same split-and-compile path
Dynamo would have called. A cold start compiles that very rebuilt graph too (trace, write, read back), so cold and
warm starts give Inductor identical graphs and the warm one hits Inductor's cache.

When is a stored graph used? Dynamo's guards, which would decide this, do not survive the process, so this
module stands in for them conservatively. The compile cache directory is already keyed by the model's config,
dtype, library versions and our own sources (compilation/cache.py). The file name adds a fingerprint of what the
trace may have read: the module tree (classes, the source files defining them, every class attribute and method
by its code), every module's attributes (PEFT's scalings, a norm's eps, `training`, plain objects such as the
config through their own attributes), the modeling files' globals, what torch's own namespaces hold, and every
tensor's name, type, shape, strides, storage layout, dtype and device. A model is refused outright (traced every
time, as before) when its forward path involves code or objects from outside the libraries (`_TRUSTED_PACKAGES`:
a forward or helper patched in from the user's script can read globals, defaults and closures no fingerprint
sees), an unregistered module attribute, or values too deep or large to describe; so are graphs with other
inputs (quantized tensor subclasses, a tensor the model does not hold), and anything that fails to write or read.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib.metadata
import inspect
import logging
import numbers
import os
import pickle
import sys
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

FORMAT = 1
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
# objects of these packages are described by their type only: their attributes are machinery (kernel caches,
# compiled-code wrappers, locks) that fills in as a process runs, not what a trace reads
_OPAQUE_PACKAGES = frozenset({"torch", "triton", "hf_accel", "builtins", "threading", "importlib", "_frozen_importlib",
                              "_frozen_importlib_external", "weakref", "_weakref", "logging"})


# -------------------------------------------------------------------------------------------------- fingerprint
# Code a stored trace may stand for: the libraries whose versions key the compile cache (or the fingerprint), the
# model's own modeling file (hashed), their dependencies and the standard library. A function defined anywhere
# else (the user's script, a kernel library patching transformers) can read any global, default or closure of its
# own; Dynamo would guard on those, this check cannot see them all, so such a model is traced every time.
_TRUSTED_PACKAGES = frozenset({
    "transformers", "transformers_modules", "torch", "hf_accel", "peft", "accelerate", "torchao", "bitsandbytes",
    "compressed_tensors", "triton", "safetensors", "huggingface_hub", "tokenizers", "kernels",
    "typing_extensions", "numpy", "tqdm", "packaging", "filelock", "regex", "yaml", "jinja2",
    *sys.stdlib_module_names})
# the packages whose version (compile cache key, or _package_versions) stands for their code
_VERSIONED_PACKAGES = frozenset({"transformers", "torch", "hf_accel", "peft", "accelerate", "torchao", "bitsandbytes",
                                 "compressed_tensors", "triton"})
_MAX_DEPTH = 6
_MAX_ITEMS = 4096


class _Describer:
    """Process-independent descriptions of what a trace may have read; also collects the reasons (untrusted code,
    values too large or deep to describe) why a model's trace must not be stored."""

    def __init__(self) -> None:
        self.untrusted: list[str] = []
        self._active: set[int] = set()

    def _distrust(self, what: str) -> str:
        if len(self.untrusted) < 8:
            self.untrusted.append(what)
        return f"<untrusted {what}>"

    def value(self, value: Any, depth: int = 0) -> str:
        """Values of plain data, the code of functions, the attributes of plain objects, types of machinery."""
        if value is None or isinstance(value, (bool, str, bytes, torch.dtype, torch.device)):
            return repr(value)
        if isinstance(value, enum.Enum):
            return f"{type(value).__qualname__}.{value.name}={value.value!r}"
        if isinstance(value, numbers.Number):  # int, float, numpy scalars, ...
            return f"{type(value).__qualname__}({value!r})"
        if isinstance(value, torch.Tensor):
            return _describe_tensor(value)
        if depth >= _MAX_DEPTH:
            return self._distrust(f"a value nested deeper than {_MAX_DEPTH} levels ({type(value).__qualname__})")
        if isinstance(value, (list, tuple, set, frozenset, dict)):
            if len(value) > _MAX_ITEMS:
                return self._distrust(f"a {type(value).__qualname__} of {len(value)} items")
            if isinstance(value, dict):
                items = sorted((self.value(k, depth + 1), self.value(v, depth + 1)) for k, v in value.items())
                return f"{type(value).__qualname__}({','.join(f'{k}:{v}' for k, v in items)})"
            inner = [self.value(v, depth + 1) for v in value]
            if isinstance(value, (set, frozenset)):
                inner.sort()
            return f"{type(value).__qualname__}({','.join(inner)})"
        if callable(value) and not isinstance(value, (type, torch.nn.Module)) or isinstance(
                value, (staticmethod, classmethod, property, functools.partialmethod)):
            return self.callable(value, depth)
        kind = type(value)
        name = f"<{kind.__module__}.{kind.__qualname__}>"
        if isinstance(value, type):
            return f"<{value.__module__}.{value.__qualname__}>"
        if isinstance(value, types.ModuleType):
            return f"<module {value.__name__}>"
        if isinstance(value, torch.nn.Module):  # registered submodules are walked; one kept as a plain attribute
            # (and so called instead of the registered one) has settings this description would not reach, unless
            # it holds nothing of its own: a function wrapped as a module (`kernels`' Func, which transformers >= 5.2x
            # makes of helpers such as `apply_rotary_pos_emb`)
            if _stateless_module(value):
                return self.stateless_module(value, depth)
            return self._distrust(f"an unregistered {type(value).__qualname__} module attribute")
        untrusted_class = next((k for k in kind.__mro__ if not _trusted_module(k.__module__)), None)
        if untrusted_class is not None:  # a class of the user's (a config subclass with a property, say)
            return self._distrust(f"an object of {untrusted_class.__module__}.{untrusted_class.__qualname__}")
        if kind.__module__.split(".")[0] in _OPAQUE_PACKAGES:
            return name
        # a plain object (a config, a helper the forward reads): its attributes, slots included, but not hashes of
        # itself, which differ between processes
        attrs = dict(getattr(value, "__dict__", None) or {})
        for klass in kind.__mro__:
            for slot in getattr(klass, "__slots__", ()):
                if isinstance(slot, str) and slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                    attrs[slot] = getattr(value, slot)
        attrs = {k: v for k, v in attrs.items() if not k.startswith("_hf_accel") and "hash" not in k}
        return name + self.value(attrs, depth + 1) if attrs else name

    def stateless_module(self, module: torch.nn.Module, depth: int) -> str:
        """A module holding nothing but what every nn.Module holds (`_stateless_module`): its class (every
        attribute, methods by code), `training` and a `forward` set on the instance."""
        cls = type(module)
        if not _trusted_module(cls.__module__):
            return self._distrust(f"an unregistered module attribute of {cls.__module__}.{cls.__qualname__}")
        attrs = {k: v for k, v in vars(module).items() if k in ("training", "forward")}
        return f"<module {cls.__module__}.{cls.__qualname__}>[{self.class_(cls)}]{self.value(attrs, depth + 1)}"

    def callable(self, fn: Any, depth: int) -> str:
        """A function by its code, defaults and closure; one defined outside the trusted packages distrusts."""
        if isinstance(fn, types.MethodType):
            return "bound " + self.callable(fn.__func__, depth)
        if isinstance(fn, (staticmethod, classmethod)):
            return f"{type(fn).__name__} " + self.callable(fn.__func__, depth)
        if isinstance(fn, property):
            return "property(" + ",".join(self.callable(f, depth) for f in (fn.fget, fn.fset) if f is not None) + ")"
        if isinstance(fn, (functools.partial, functools.partialmethod)):
            return (f"{type(fn).__name__}({self.callable(fn.func, depth)},{self.value(fn.args, depth + 1)},"
                    f"{self.value(fn.keywords, depth + 1)})")
        module = getattr(fn, "__module__", None)
        name = f"{module}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
        code = getattr(fn, "__code__", None)
        if code is None:  # a builtin (C code), or an object with __call__: its class decides
            if not isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)) and not _trusted_module(
                    type(fn).__module__):
                return self._distrust(f"callable {type(fn).__module__}.{type(fn).__qualname__}")
            return name
        if not _trusted_module(module):
            return self._distrust(f"function {name}")
        if id(fn) in self._active:  # a function reaching itself through its closure
            return f"{name}#cycle"
        self._active.add(id(fn))
        try:
            # closures and defaults of library code (decorator wrappers) nest functions in functions: only the data
            # they hold counts towards the depth
            cells = fn.__closure__ or ()
            closure = ",".join(self.value(_cell_contents(c), depth) for c in cells)
            defaults = ",".join(self.value(d, depth) for d in (*(fn.__defaults__ or ()),
                                                             *(fn.__kwdefaults__ or {}).values()))
        finally:
            self._active.discard(id(fn))
        return f"{name}#{_code_digest(code)}[{defaults}]({closure})"

    def class_(self, cls: type) -> str:
        """Every attribute of `cls` and its bases up to nn.Module: a method or constant patched on the class
        changes it."""
        parts = []
        for klass in cls.__mro__:
            if klass in (torch.nn.Module, object):
                break
            for key, value in sorted(vars(klass).items()):
                if key in ("__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "__annotations__",
                           "__orig_bases__", "__parameters__", "_abc_impl", "__abstractmethods__") or "cache" in key:
                    continue  # (values a library caches on the class lazily depend on what the process did)
                parts.append(f"{klass.__qualname__}.{key}={self.value(value, 2)}")
        return ";".join(parts)

    def module_globals(self, module_name: str) -> str:
        """Plain data, dicts, functions and classes of a modeling file (a patched helper such as
        `apply_rotary_pos_emb`, or an entry of `ROPE_INIT_FUNCTIONS`, changes what a trace records)."""
        module = sys.modules.get(module_name)
        if module is None:
            return "?"
        parts = []
        for key, value in sorted(vars(module).items()):
            if key.startswith("__"):
                continue
            if isinstance(value, type):
                parts.append(f"{key}=<{value.__module__}.{value.__qualname__}>")
            elif isinstance(value, (types.FunctionType, functools.partial, dict, bool, int, float, str, type(None))):
                parts.append(f"{key}={self.value(value, 2)}")
        return ";".join(parts)

    def torch_namespaces(self) -> str:
        """What torch's own namespaces hold under each name (`torch.nn.functional.silu = ...`, `torch.rsqrt =
        torch.sqrt`): builtins by name, functions by code; user code there distrusts."""
        parts = []
        for namespace in (torch, torch.nn.functional, torch.Tensor):
            label = getattr(namespace, "__name__", "Tensor")
            for key, value in sorted(vars(namespace).items()):
                if key.startswith("__") or isinstance(value, (types.ModuleType, type, torch.dtype)):
                    continue
                if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)):
                    parts.append(f"{label}.{key}={getattr(value, '__name__', '?')}")
                elif isinstance(value, (types.FunctionType, functools.partial, staticmethod, classmethod)) or (
                        callable(value) and not _trusted_module(type(value).__module__)):
                    parts.append(f"{label}.{key}={self.value(value, 2)}")
        return ";".join(parts)


@functools.cache
def _plain_module_attributes() -> frozenset[str]:
    """The instance attributes every nn.Module has (its machinery), and an instance `forward`."""
    return frozenset(vars(torch.nn.Module())) | {"forward"}


def _stateless_module(module: torch.nn.Module) -> bool:
    """No parameters, buffers, submodules, hooks or attributes of its own (settings such as Hardtanh's bounds)."""
    return not (module._parameters or module._buffers or module._modules or module._forward_hooks
                or module._forward_pre_hooks) and set(vars(module)) <= _plain_module_attributes()


def _trusted_module(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in _TRUSTED_PACKAGES  # type: ignore[union-attr]


def _describe_tensor(t: torch.Tensor) -> str:
    return (f"{type(t).__qualname__}{tuple(t.shape)}{t.stride()}@{t.storage_offset()}:{t.dtype}:{t.device.type}"
            f":{t.requires_grad}")


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _code_digest(code: types.CodeType) -> str:
    h = hashlib.sha256()

    def walk(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames, c.co_freevars)).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                walk(const)
            elif isinstance(const, frozenset):
                h.update(repr(sorted(map(repr, const))).encode())
            else:
                h.update(repr(const).encode())

    walk(code)
    return h.hexdigest()[:16]


_SOURCE_HASHES: dict[str, str] = {}


def _class_source_hash(cls: type) -> str:
    """Hash of the file defining `cls` (a model's own code may change between runs with the same versions); for
    code outside the versioned libraries (remote code: `transformers_modules.*`), of every .py file beside it and
    below, since its helpers may live in other files of the same folder."""
    module = sys.modules.get(cls.__module__)
    try:
        path = inspect.getsourcefile(module) if module is not None else None
    except TypeError:
        path = None
    if not path:
        return "?"
    if path not in _SOURCE_HASHES:
        files = [Path(path)]
        if cls.__module__.split(".")[0] not in _VERSIONED_PACKAGES:
            files = sorted(Path(path).parent.rglob("*.py"))[:1000]
        h = hashlib.sha256()
        try:
            for file in files:
                h.update(str(file.relative_to(Path(path).parent)).encode() + b"\0" + file.read_bytes() + b"\0")
            _SOURCE_HASHES[path] = h.hexdigest()[:16]
        except (OSError, ValueError):
            _SOURCE_HASHES[path] = "?"
    return _SOURCE_HASHES[path]


def _package_versions() -> str:
    """Versions of the trusted packages the compile cache's key does not name: installed ones, imported or not (what
    a process happened to import must not change the fingerprint)."""
    out = []
    for name in ("peft", "accelerate", "torchao", "bitsandbytes", "compressed-tensors", "kernels"):
        try:
            out.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{name}=-")
    return ",".join(out)


def model_fingerprint(root: torch.nn.Module) -> tuple[str, list[str]]:
    """Everything of `root` that a trace of its forward may have read, apart from its config and the versions; and
    why its trace must not be stored at all (code from outside the trusted packages, values too large to describe).
    """
    h = hashlib.sha256()
    storages: dict[tuple[str, int], int] = {}
    describer = _Describer()

    def put(text: str) -> None:
        h.update(text.encode())
        h.update(b"\0")

    put(f"default dtype {torch.get_default_dtype()}; {_package_versions()}")
    classes: dict[type, None] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        cls = type(module)
        classes.setdefault(cls)
        put(f"module {name} {cls.__module__}.{cls.__qualname__} {_class_source_hash(cls)}")
        for key in sorted(module.__dict__):
            if key in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
                continue
            value = module.__dict__[key]
            if key.startswith("_hf_accel") or key == "generation_config":  # not read by the forward
                continue
            if "hook" in key and isinstance(value, dict):  # keyed by handle ids, which differ between processes
                value = list(value.values())
            put(f"attr {key}={describer.value(value)}")
        for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
            for key, t in tensors.items():
                if t is None:
                    put(f"{kind} {key}=None")
                    continue
                # which tensors share a storage (packed q/k/v, tied embeddings): the n-th storage seen
                index = storages.setdefault(_storage_key(t), len(storages))
                put(f"{kind} {key}={_describe_tensor(t)} storage#{index}")
    modules: dict[str, None] = {}
    for cls in classes:
        put(f"class {cls.__module__}.{cls.__qualname__}: {describer.class_(cls)}")
        if cls.__module__.split(".")[0] not in ("torch", "builtins"):  # the modeling files (not the mixins' modules,
            modules.setdefault(cls.__module__)  # whose globals hold per-process values such as a session id)
    for module_name in modules:
        put(f"globals of {module_name}: {describer.module_globals(module_name)}")
    put(f"torch namespaces: {describer.torch_namespaces()}")
    return h.hexdigest()[:24], describer.untrusted


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    """What identifies `t`'s storage within this process (a wrapper subclass has none: itself, then)."""
    if type(t) in _PLAIN_TENSOR_TYPES and t.device.type != "meta":
        try:
            return "storage", t.untyped_storage().data_ptr()
        except RuntimeError:
            pass
    return "object", id(t)


def model_tensor_names(root: torch.nn.Module) -> dict[int, str]:
    """id -> a name of every tensor the model holds: parameters, buffers and plain tensor attributes."""
    names: dict[int, str] = {}
    for mod_name, module in root.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for store in (module._parameters, module._buffers, module.__dict__):
            for key, t in store.items():
                if isinstance(t, torch.Tensor):
                    names.setdefault(id(t), prefix + key)
    return names


def _lookup(root: torch.nn.Module, name: str) -> Any:
    owner, _, attr = name.rpartition(".")
    module = root.get_submodule(owner) if owner else root
    for store in (module._parameters, module._buffers, module.__dict__):
        if attr in store:
            return store[attr]
    raise KeyError(name)


# -------------------------------------------------------------------------------------------------- the cache
class TraceCache:
    """Writes and reads the traced forward of `root` under `directory` (one file per model fingerprint)."""

    def __init__(self, directory: str | os.PathLike, root: torch.nn.Module) -> None:
        self.directory = Path(directory)
        self.root = root
        self.fingerprint, untrusted = model_fingerprint(root)
        self.path = self.directory / f"dynamo-graph-{self.fingerprint}.pkl"
        # why this model's trace is neither stored nor read (None: it is); see _TRUSTED_PACKAGES
        self.refused: str | None = "; ".join(untrusted) if untrusted else None
        if self.refused:
            logger.info("hf_accel: the traced forward is not stored or reused for this model, whose forward may read "
                        "what the stored graph's check cannot see: %s", self.refused)

    # ---------------------------------------------------------------------------------------- write
    def encode(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
               tracing_args: Sequence[torch.Tensor]) -> bytes | None:
        """The graph Dynamo gave the backend and where its inputs come from; None when it cannot be stored."""
        if self.refused:
            return None
        try:
            return self._encode(gm, example_inputs, tracing_args)
        except Exception as exc:  # an unpicklable target, say: trace every time, as before
            logger.info("hf_accel: the traced forward cannot be stored (%s: %s); later starts trace it again",
                        type(exc).__name__, exc)
            return None

    def _encode(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                tracing_args: Sequence[torch.Tensor]) -> bytes | None:
        from torch.fx._graph_pickler import GraphPickler, Options

        names = model_tensor_names(self.root)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(example_inputs):
            raise ValueError("placeholders and example inputs differ in number")
        if any(n.op == "get_attr" for n in gm.graph.nodes):
            raise ValueError("the graph holds constants of its own")
        slots: list[tuple] = []
        symbols: set[str] = set()
        for node, ex in zip(placeholders, example_inputs, strict=True):
            if isinstance(ex, torch.SymInt):
                slots.append(("size", str(node.meta["example_value"].node.expr)))
                continue
            if not isinstance(ex, torch.Tensor):
                raise ValueError(f"graph input {node.name} is a {type(ex).__name__}")
            if type(ex) not in _PLAIN_TENSOR_TYPES:
                raise ValueError(f"graph input {node.name} is a {type(ex).__qualname__}, not a plain tensor")
            k = next((k for k, a in enumerate(tracing_args) if a is ex), None)
            if k is not None:
                fake = node.meta["example_value"]
                shape = [_dim(s) for s in fake.shape]
                stride = [_dim(s) for s in fake.stride()]
                symbols |= {s for s in shape if isinstance(s, str)}
                if any(isinstance(s, str) and s not in symbols for s in stride) or fake.storage_offset() != 0:
                    raise ValueError(f"argument {k} has a layout other than its sizes'")
                slots.append(("arg", k, shape, stride, str(ex.dtype)))
                continue
            name = names.get(id(ex))
            if name is None:
                raise ValueError(f"graph input {node.name} is a tensor the model does not hold")
            slots.append(("tensor", name))
        if any(s[0] == "size" and s[1] not in symbols for s in slots):
            raise ValueError("a size input is not a size of the forward's arguments")
        bare = torch.fx.GraphModule(torch.nn.Module(), gm.graph)
        graph = GraphPickler.dumps(bare, Options(ops_filter=None, node_metadata_key_filter=lambda key: False))
        return pickle.dumps({"format": FORMAT, "fingerprint": self.fingerprint, "torch": torch.__version__,
                             "graph": graph, "slots": slots})

    def store(self, blob: bytes) -> None:
        """Write atomically (a concurrent start reads a whole file or none)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(blob)
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.info("hf_accel: could not write the traced forward to %s (%s)", self.path, exc)

    # ---------------------------------------------------------------------------------------- read
    def load(self, tracing_args: Sequence[torch.Tensor]) -> tuple[torch.fx.GraphModule, list[Any], Any] | None:
        """The stored graph, ready for the backend, or None (nothing stored, or it no longer fits)."""
        if self.refused or not self.path.is_file():
            return None
        try:
            return self.decode(self.path.read_bytes(), tracing_args)
        except Exception as exc:
            logger.warning("hf_accel: the stored traced forward %s could not be used (%s: %s); tracing again",
                           self.path, type(exc).__name__, exc)
            return None

    def decode(self, blob: bytes, tracing_args: Sequence[torch.Tensor]
               ) -> tuple[torch.fx.GraphModule, list[Any], Any]:
        """Rebuild the graph with fresh fake-tensor metadata; returns (graph, example inputs, fake mode).

        The example inputs are what Dynamo would pass the backend: the live tensors, and symbolic sizes."""
        from torch._dispatch.python import enable_python_dispatcher
        from torch._dynamo.source import ConstantSource
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        t0 = time.perf_counter()
        data = pickle.loads(blob)
        if data.get("format") != FORMAT or data.get("fingerprint") != self.fingerprint:
            raise ValueError("stored for another model or format")
        if data.get("torch") != torch.__version__:
            raise ValueError(f"stored by torch {data.get('torch')}")
        shape_env = ShapeEnv()
        fake_mode = FakeTensorMode(shape_env=shape_env)
        gm = GraphPickler.loads(data["graph"], fake_mode)
        slots = data["slots"]

        # one symbol per dynamic size, in the order the arguments name them (deterministic: same graph, same names)
        sym_values: dict[str, torch.SymInt] = {}
        for slot in slots:
            if slot[0] != "arg":
                continue
            _, k, shape, _, _ = slot
            for d, s in enumerate(shape):
                if isinstance(s, str) and s not in sym_values:
                    hint = int(tracing_args[k].shape[d])
                    source = ConstantSource(f"hf_accel_size_{len(sym_values)}")
                    sym = shape_env.create_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC)
                    sym_values[s] = shape_env.create_symintnode(sym, hint=hint, source=source)

        def dim(v: int | str) -> Any:
            return sym_values[v] if isinstance(v, str) else v

        fakes: list[Any] = []
        example_inputs: list[Any] = []
        for slot in slots:
            if slot[0] == "size":
                fakes.append(sym_values[slot[1]])
                example_inputs.append(sym_values[slot[1]])
            elif slot[0] == "arg":
                _, k, shape, stride, dtype = slot
                arg = tracing_args[k]
                if str(arg.dtype) != dtype or arg.dim() != len(shape) or any(
                        not isinstance(s, str) and s != n for s, n in zip(shape, arg.shape, strict=True)):
                    raise ValueError(f"argument {k} does not match the stored graph")
                with fake_mode:
                    fakes.append(torch.empty_strided([dim(s) for s in shape], [dim(s) for s in stride],
                                                     dtype=arg.dtype, device=arg.device))
                example_inputs.append(arg)
            else:
                t = _lookup(self.root, slot[1])
                if not isinstance(t, torch.Tensor) or type(t) not in _PLAIN_TENSOR_TYPES:
                    raise ValueError(f"model tensor {slot[1]} is missing or not a plain tensor")
                fakes.append(fake_mode.from_tensor(t, static_shapes=True))
                example_inputs.append(t)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(fakes):
            raise ValueError("the stored graph's inputs do not match its table")
        # the Python dispatcher, as Dynamo runs its fake values: composite ops (matmul, linear) then decompose on
        # symbolic sizes; without it torch 2.11 reads their sizes as ints and pins every dynamic size
        with fake_mode, enable_python_dispatcher():
            FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*fakes)
        for node in gm.graph.nodes:
            if "val" in node.meta:
                node.meta["example_value"] = node.meta["val"]
        for node, fake in zip(placeholders, fakes, strict=True):
            node.meta["example_value"] = fake
        logger.debug("hf_accel: traced forward rebuilt from %s in %.2f s", self.path, time.perf_counter() - t0)
        return gm, example_inputs, fake_mode


def _dim(value: Any) -> int | str:
    """A size or stride as stored: an int, or its symbol's name."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        if not getattr(expr, "is_symbol", False):
            raise ValueError(f"a size or stride is the expression {expr}, not one symbol")
        return str(expr)
    return int(value)
