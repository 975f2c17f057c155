"""One GEMM instead of several: q/k/v and gate/up projections that read the same input.

A decode step multiplies a handful of rows by every weight matrix; each GEMM then costs its launch and latency
more than its bandwidth, so seven projections per layer take several times what one pass over the weights would.
vLLM merges them when it loads weights. We keep the user's modules untouched instead:

1. `pack_sibling_linears(model)` (at accelerate time, compile on): for each module holding sibling projections
   (q_proj/k_proj/v_proj, gate_proj/up_proj), copy their weights (and biases) into one contiguous tensor and make
   each parameter a view of its rows. Values, shapes, strides and the modules stay the same, and no memory is
   added; the stock path, `restore()` and saving still see ordinary parameters (restore gives each its own
   storage back).
2. `merge_packed_linears(gm, example_inputs)` (a pass of our torch.compile backend, before splitting): linears
   that read the same input node and whose weights are consecutive rows of one packed storage become one linear
   over the whole block (`as_strided` on the first weight: a view, no copy) followed by `narrow`s. Weights are
   graph inputs, so the pieces of every layer stay identical and are still compiled once.

Anything that does not match exactly (a tied weight, different dtypes, a quantized weight, an input computed
separately for k and v, an in-place write between the linears) is left alone: the pass only rewrites what is
provably the same product.

The merged outputs are column slices of one result, so views taken of them downstream have other strides than the
example values Dynamo recorded for the separate outputs. Pieces are compiled from the values that cross a cut, and
those are the tensors handed to the attention op, which the attention function makes contiguous first; a compiled
piece given other strides than it was compiled for fails its input check at warm-up, never silently.
"""

from __future__ import annotations

import logging
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

SIBLING_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)


@dataclass
class PackRecord:
    """What pack_sibling_linears changed: the parameters now viewing a packed tensor (for unpacking)."""

    params: list[torch.nn.Parameter] = field(default_factory=list)
    groups: int = 0
    bytes: int = 0


def is_dense(t: object) -> bool:
    """A plain floating-point tensor, or Dynamo's fake of one: not a quantized tensor subclass (torchao, bitsandbytes)
    or a DTensor, which have their own storage formats (no concatenation, no `as_strided` over a packed block, no
    raw data pointer for our kernels)."""
    if not isinstance(t, torch.Tensor):
        return False
    if type(t).__name__ == "FakeTensor":
        return t.dtype.is_floating_point and not t.is_quantized
    return (type(t) in (torch.nn.Parameter, torch.Tensor) and type(t.data) is torch.Tensor
            and t.dtype.is_floating_point and not t.is_quantized)


def _dense(t: torch.Tensor | None) -> bool:
    return t is None or is_dense(t)


def _packable(linears: list[torch.nn.Module], shared: set[int]) -> bool:
    first = linears[0]
    if not all(type(m) is torch.nn.Linear for m in linears):
        return False
    if not all(_dense(m.weight) and _dense(m.bias) for m in linears):
        return False
    w0 = first.weight
    for m in linears:
        w, b = m.weight, m.bias
        if (w.dtype != w0.dtype or w.device != w0.device or w.shape[1] != w0.shape[1] or not w.is_contiguous()
                or id(w) in shared or (b is None) != (first.bias is None)):
            return False
        if b is not None and (b.dtype != w0.dtype or b.device != w0.device or id(b) in shared):
            return False
    return True


def _pack(params: list[torch.nn.Parameter], record: PackRecord) -> None:
    with torch.no_grad():
        packed = torch.cat([p.detach() for p in params], dim=0).contiguous()
        offset = 0
        for p in params:
            n = p.shape[0]
            p.data = packed[offset : offset + n]
            offset += n
            record.params.append(p)
    record.bytes += packed.numel() * packed.element_size()


def pack_sibling_linears(model: torch.nn.Module) -> PackRecord:
    """Give each group of sibling projections one storage (see the module docstring); returns what changed."""
    counts: dict[int, int] = defaultdict(int)
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] += 1
    shared = {k for k, c in counts.items() if c > 1}  # tied weights keep their own storage
    record = PackRecord()
    try:
        for module in model.modules():
            for names in SIBLING_GROUPS:
                linears = [getattr(module, n, None) for n in names]
                if any(m is None for m in linears) or not _packable(linears, shared):
                    continue
                _pack([m.weight for m in linears], record)
                if linears[0].bias is not None:
                    _pack([m.bias for m in linears], record)
                record.groups += 1
    except BaseException:  # e.g. out of memory for one group's packed copy: leave the model as it was
        unpack_sibling_linears(record)
        raise
    return record


def unpack_sibling_linears(record: PackRecord) -> None:
    """Give every packed parameter its own storage again (values unchanged)."""
    with torch.no_grad():
        for p in record.params:
            p.data = p.data.clone()
    record.params.clear()


def consecutive_rows(tensors: list[torch.Tensor]) -> bool:
    """Row blocks of one contiguous 2-D (or 1-D) storage, in order, with nothing in between."""
    base = tensors[0]
    ptr = base.untyped_storage().data_ptr()
    expect = base.storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != ptr or not t.is_contiguous() or t.storage_offset() != expect:
            return False
        if t.dim() != base.dim() or t.shape[1:] != base.shape[1:] or t.dtype != base.dtype:
            return False
        expect += t.numel()
    return expect * base.element_size() <= base.untyped_storage().nbytes()


def merge_packed_linears(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> int:
    """Rewrite sibling linears over packed weights into one linear + narrows; returns how many groups merged."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    real = {n: ex for n, ex in zip(placeholders, example_inputs, strict=False) if isinstance(ex, torch.Tensor)}
    by_input: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in LINEAR_TARGETS or node.kwargs:
            continue
        args = list(node.args) + [None] * (3 - len(node.args))
        x, w, b = args[:3]
        if not isinstance(x, torch.fx.Node) or w not in real or (b is not None and b not in real):
            continue
        if real[w].dim() != 2 or not _dense(real[w]) or (b is not None and not _dense(real[b])):
            continue  # quantized subclasses have no plain storage to span
        by_input[x].append(node)
    merged = 0
    for nodes in by_input.values():
        if len(nodes) < 2:
            continue
        # longest runs of consecutive weights, in storage order
        nodes = sorted(nodes, key=lambda n: (real[n.args[1]].untyped_storage().data_ptr(),
                                             real[n.args[1]].storage_offset()))
        run: list[torch.fx.Node] = []
        for node in [*nodes, None]:
            if node is not None and run and _can_extend(run, node, real):
                run.append(node)
                continue
            if len(run) >= 2 and _rewrite(graph, run, real):
                merged += 1
            run = [node] if node is not None else []
    if merged:  # no eliminate_dead_code(): older torch would also drop the (in-place) attention ops
        graph.lint()
        gm.recompile()
    return merged


def _bias(node: torch.fx.Node) -> Any:
    return node.args[2] if len(node.args) > 2 else None


def _can_extend(run: list[torch.fx.Node], node: torch.fx.Node, real: dict) -> bool:
    weights = [real[n.args[1]] for n in [*run, node]]
    if not consecutive_rows(weights):
        return False
    biases = [_bias(n) for n in [*run, node]]
    if all(b is None for b in biases):
        return True
    if any(b is None for b in biases):
        return False
    return consecutive_rows([real[b] for b in biases])


def _fake_values(run: list[torch.fx.Node], rows: list[int], cols: int) -> list[Any] | None:
    """The merged linear's outputs on Dynamo's fake tensors (None if the fake weights cannot span the block)."""
    x = run[0].args[0].meta.get("example_value")
    w0 = run[0].args[1].meta.get("example_value")
    b0 = _bias(run[0]).meta.get("example_value") if _bias(run[0]) is not None else None
    fake_mode = getattr(x, "fake_mode", None)
    if fake_mode is None or w0 is None or (_bias(run[0]) is not None and b0 is None):
        return None
    total = sum(rows)
    try:
        with fake_mode:
            w_all = torch.as_strided(w0, (total, cols), (cols, 1))  # raises if the fake storage is too small
            b_all = torch.as_strided(b0, (total,), (1,)) if b0 is not None else None
            # shapes only: running linear/narrow here, outside Dynamo's tracing, pins symbolic sizes on torch 2.11
            y = x.new_empty((*x.shape[:-1], total))
            outs, offset = [], 0
            for n in rows:
                outs.append(y[..., offset : offset + n])
                offset += n
        return [w_all, b_all, y, *outs]
    except Exception as exc:  # e.g. the fake weight's storage is only its own rows: leave this group alone
        logger.debug("linear merge skipped: %s", exc)
        return None


_INPLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.setitem}


def may_mutate(node: torch.fx.Node) -> bool:
    """Conservatively: could this node write into an existing tensor (an in-place op or a mutating custom op)?"""
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op != "call_function":
        return node.op == "call_module"  # an opaque module call: assume the worst
    target = node.target
    if target in _INPLACE_FUNCTIONS:
        return True
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(getattr(target, o)._schema.is_mutable for o in target.overloads())
    name = getattr(target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _rewrite(graph: torch.fx.Graph, run: list[torch.fx.Node], real: dict) -> bool:
    """linear(x, W_i, b_i) for the run -> y = linear(x, W_all, b_all); out_i = y.narrow(-1, off_i, n_i).

    The merged product runs where the earliest of the run did, so nothing between the first and the last linear of
    the run may write into a tensor (x or a view of it could change in between): such runs are left alone.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    first, last = min(order[n] for n in run), max(order[n] for n in run)
    members = set(run)
    if any(may_mutate(n) for n in graph.nodes if first < order[n] < last and n not in members):
        return False
    earliest = min(run, key=lambda n: order[n])
    x, w0, b0 = run[0].args[0], run[0].args[1], _bias(run[0])
    rows = [real[n.args[1]].shape[0] for n in run]
    total, cols = sum(rows), real[w0].shape[1]
    fakes = _fake_values(run, rows, cols)
    if fakes is None:
        return False
    with graph.inserting_before(earliest):
        # as_strided over the first weight spans the whole packed block: a view, never a copy
        w_all = graph.call_function(torch.as_strided, (w0, (total, cols), (cols, 1)))
        b_all = graph.call_function(torch.as_strided, (b0, (total,), (1,))) if b0 is not None else None
        y = graph.call_function(torch._C._nn.linear, (x, w_all, b_all))
        outs, offset = [], 0
        for n in rows:
            outs.append(graph.call_function(torch.narrow, (y, -1, offset, n)))
            offset += n
    for node, fake in zip([w_all, b_all, y, *outs], fakes, strict=True):
        if node is not None:
            node.meta["example_value"] = fake
    for node, out in zip(run, outs, strict=True):
        node.replace_all_uses_with(out)
        graph.erase_node(node)
    return True
