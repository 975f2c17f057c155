"""Compile pass: route the forward's linears through `hf_accel::linear` (cuBLAS or the small-M GEMM, per step).

Runs on Dynamo's graph after `merge_packed_linears`, so a packed q/k/v or gate/up product is one linear here. Only
plain floating-point (bf16 / fp16) 2-D weights on CUDA whose input has the weight's dtype are routed; anything
else (quantized weights, tensor subclasses, fp32, CPU) keeps its `F.linear`. The op itself falls back to
`F.linear` for every row count and shape that tuning did not give to our kernel, so the pass alone changes nothing
until `ops.linear.tune_linears` has run.

PDL: a linear is launched with PDL only where its weight is a graph input or attribute (a parameter or buffer) or a
view of one (`static_weight`). The one-row kernel reads its first weight tile before its PDL wait, which is safe only
when no kernel of the step writes that weight; a weight the forward computes (`self.w.to(x.dtype)`, `self.g * 0.5`)
may come from the kernel just before, whose stores PDL would let the read overtake, so such a linear runs without
PDL (it then waits for every kernel before it).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
import torch.fx

from hf_accel.compilation.linear_packing import LINEAR_TARGETS, is_dense

ROUTED_DTYPES = (torch.bfloat16, torch.float16)
# ops that return a view of their first argument (no kernel writes the result)
_VIEW_FUNCTIONS = (torch.as_strided, torch.narrow, torch.t, torch.transpose, torch.detach, operator.getitem)
_VIEW_METHODS = ("as_strided", "narrow", "t", "transpose", "detach", "view", "__getitem__")


def static_weight(node) -> bool:
    """`node` is a graph input or attribute (Dynamo lifts parameters and buffers to inputs), or a chain of views of
    one, such as the packed q/k/v block's `as_strided`: nothing the forward runs writes it."""
    while isinstance(node, torch.fx.Node):
        if node.op in ("placeholder", "get_attr"):
            return True
        viewing = ((node.op == "call_function" and node.target in _VIEW_FUNCTIONS)
                   or (node.op == "call_method" and node.target in _VIEW_METHODS))
        if not viewing or not node.args:
            return False
        node = node.args[0]
    return False


def example_value(node: object) -> object:
    """Dynamo's example (fake) value of a graph node; None for a constant argument or a node without one."""
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _linear_calls(gm: torch.fx.GraphModule) -> Iterator[tuple[torch.fx.Node, tuple, tuple]]:
    """Each `F.linear`-like call of the graph: the node, its (input, weight, bias) arguments (bias None when
    absent) and their example values (None where an argument is not a node)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in LINEAR_TARGETS or node.kwargs:
            continue
        args = (list(node.args) + [None] * 3)[:3]
        yield node, tuple(args), tuple(example_value(a) for a in args)


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
            pdl = bool(use_pdl) and static_weight(w)  # see the module docstring
            new = gm.graph.call_function(torch.ops.hf_accel.linear.default, (x, w, b, pdl))
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
