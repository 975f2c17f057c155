"""Compile pass: route the forward's linears through `hf_accel::linear` (cuBLAS or the small-M GEMM, per step).

Runs on Dynamo's graph after `merge_packed_linears`, so a packed q/k/v or gate/up product is one linear here. Only
plain floating-point (bf16 / fp16) 2-D weights on CUDA whose input has the weight's dtype are routed; anything
else (quantized weights, tensor subclasses, fp32, CPU) keeps its `F.linear`. The op itself falls back to
`F.linear` for every row count and shape that tuning did not give to our kernel, so the pass alone changes nothing
until `ops.linear.tune_linears` has run.

`fold_gated_activations` then gives a routed linear whose input is `silu(gate) * up` (a gated MLP's down
projection) that activation as well: `hf_accel::gated_linear` computes it while loading the GEMM's tiles, which
saves the SiLU-and-multiply kernel between the two projections of every layer.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
import torch.fx
import torch.nn.functional as F

from hf_accel.compilation.linear_packing import LINEAR_TARGETS, is_dense

ROUTED_DTYPES = (torch.bfloat16, torch.float16)


def _linear_calls(gm: torch.fx.GraphModule) -> Iterator[tuple[torch.fx.Node, tuple, tuple]]:
    """Each `F.linear`-like call of the graph: the node, its (input, weight, bias) arguments (bias None when
    absent) and their example values (None where an argument is not a node)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in LINEAR_TARGETS or node.kwargs:
            continue
        args = (list(node.args) + [None] * 3)[:3]
        yield node, tuple(args), tuple(a.meta.get("example_value") if isinstance(a, torch.fx.Node) else None
                                       for a in args)


def route_small_m_linears(gm: torch.fx.GraphModule, use_pdl: bool,
                          allow_cpu: bool = False) -> list[tuple[int, int, bool]]:
    """Replace eligible linear calls by `hf_accel::linear`; returns the (n, k, has_bias) weight shapes routed."""
    import hf_accel.ops.linear  # noqa: F401  (registers torch.ops.hf_accel.linear)

    shapes: list[tuple[int, int, bool]] = []
    for node, (x, w, b), (xv, wv, bv) in _linear_calls(gm):
        if not (is_dense(xv) and is_dense(wv)) or (b is not None and not is_dense(bv)):
            continue
        if wv.dim() != 2 or wv.dtype not in ROUTED_DTYPES or xv.dtype != wv.dtype:
            continue
        if bv is not None and (bv.dtype != wv.dtype or bv.dim() != 1):
            continue
        if not (wv.device.type == "cuda" or (allow_cpu and wv.device.type == "cpu")):
            continue
        if isinstance(wv.shape[0], torch.SymInt) or isinstance(wv.shape[1], torch.SymInt):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.hf_accel.linear.default, (x, w, b, bool(use_pdl)))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        shapes.append((int(wv.shape[0]), int(wv.shape[1]), b is not None))
    if shapes:
        gm.graph.lint()
        gm.recompile()
    return shapes


def route_int8_weight_only_linears(gm: torch.fx.GraphModule, use_pdl: bool) -> list[tuple[int, int, bool]]:
    """Replace linears whose weight is a torchao int8 weight-only tensor by `hf_accel::int8_weight_linear` on its
    int8 data and scale (`patches.quantization.int8_weight_only_parts` says which, and why); returns the (n, k,
    has_bias) weight shapes routed, one per linear."""
    import hf_accel.ops.quantized_linear  # noqa: F401  (registers torch.ops.hf_accel.int8_weight_linear)
    from hf_accel.patches.quantization import int8_weight_only_parts

    routed: list[tuple[int, int, bool]] = []
    for node, (x, w, b), (_, wv, _) in _linear_calls(gm):
        parts = int8_weight_only_parts(wv)
        if parts is None or (b is not None and not isinstance(b, torch.fx.Node)):
            continue
        with gm.graph.inserting_before(node):
            qdata = gm.graph.call_function(getattr, (w, parts[0]))
            scale = gm.graph.call_function(getattr, (w, parts[1]))
            new = gm.graph.call_function(torch.ops.hf_accel.int8_weight_linear.default,
                                         (x, qdata, scale, b, bool(use_pdl)))
        qdata.meta["example_value"], scale.meta["example_value"] = (getattr(wv, name) for name in parts)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        n, k = qdata.meta["example_value"].shape
        routed.append((int(n), int(k), b is not None))
    if routed:
        gm.graph.lint()
        gm.recompile()
    return routed


_SILU_TARGETS = (F.silu, torch.ops.aten.silu.default)
_MUL_TARGETS = (operator.mul, torch.mul, torch.ops.aten.mul.Tensor)


def _only_user(node: torch.fx.Node, user: torch.fx.Node) -> bool:
    return len(node.users) == 1 and user in node.users


def _silu_input(node: object, user: torch.fx.Node) -> torch.fx.Node | None:
    """x when `node` is a non-inplace `silu(x)` read only by `user`, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _SILU_TARGETS):
        return None
    if node.kwargs.get("inplace", False) or len(node.args) != 1 or not _only_user(node, user):
        return None
    return node.args[0] if isinstance(node.args[0], torch.fx.Node) else None


def fold_gated_activations(gm: torch.fx.GraphModule) -> list[tuple[int, int, bool]]:
    """Replace `hf_accel::linear(silu(gate) * up, w, b)` by `hf_accel::gated_linear(gate, up, w, b)` where the
    activation's nodes have no other reader and gate / up have one shape and the weight's dtype; returns the
    (n, k, has_bias) weight shapes folded. Runs after `route_small_m_linears`."""
    import hf_accel.ops.linear  # noqa: F401  (registers torch.ops.hf_accel.gated_linear)

    folded: list[tuple[int, int, bool]] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.hf_accel.linear.default:
            continue
        hidden, w, b, use_pdl = node.args
        if not (isinstance(hidden, torch.fx.Node) and hidden.op == "call_function"
                and hidden.target in _MUL_TARGETS and len(hidden.args) == 2 and not hidden.kwargs
                and _only_user(hidden, node)):
            continue
        lhs, rhs = hidden.args
        for act, up in ((lhs, rhs), (rhs, lhs)):
            gate = _silu_input(act, hidden)
            if gate is not None and isinstance(up, torch.fx.Node):
                break
        else:
            continue
        gv, uv, wv = (n.meta.get("example_value") for n in (gate, up, w))
        if not all(isinstance(v, torch.Tensor) for v in (gv, uv, wv)) or gv.shape != uv.shape:
            continue
        if gv.dtype != wv.dtype or uv.dtype != wv.dtype:
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.hf_accel.gated_linear.default, (gate, up, w, b, use_pdl))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        gm.graph.erase_node(hidden)
        gm.graph.erase_node(act)
        folded.append((int(wv.shape[0]), int(wv.shape[1]), b is not None))
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded
