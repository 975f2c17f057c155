"""Compile pass: a gated MLP's packed gate/up linear and the `silu(gate) * up` after it become one op.

Runs on Dynamo's graph after `small_m_linear.route_small_m_linears` and `norm_folding.fold_norms_into_linears`, so
the gate and up projections are one routed product by then: `hf_accel::linear`, or the norm-folded
`hf_accel::rms_norm_linear` / `hf_accel::add_rms_norm_linear`, with no bias. The pass looks for that product split by
`merge_packed_linears`'s two `narrow`s into its first and second halves, each with one user, the first half's one
user `F.silu` (not in place) and the product of that SiLU with the second half, and nothing else reading the linear.
The chain becomes `hf_accel::silu_mul_linear(x, norm_weight | None, eps, W, use_pdl)` or, for the add + norm form,
`hf_accel::add_rms_norm_silu_mul_linear(a, b, norm_weight, eps, W, use_pdl)` whose second output stands for the
add's result (`ops.gated_linear`, which says when the gate really runs in the GEMM's epilogue). The new op runs
where the linear ran: everything it replaces is a pure function of the linear's output.

Anything else is left alone: a GELU or other activation, a SiLU of the second half (`silu(up) * gate` is another
function), a bias, a gate or up used by anything but the activation, unpacked gate and up projections (two linears).
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

from hf_accel.compilation.small_m_linear import example_value as _value

_MUL = (operator.mul, torch.mul)
_SILU = (F.silu, torch.ops.aten.silu.default)


def _is(node, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _narrow_of(node, source: torch.fx.Node, start: int, length: int) -> bool:
    """`node` is `torch.narrow(source, -1, start, length)` (the last dim) with one user."""
    if not (_is(node, (torch.narrow,)) and not node.kwargs and len(node.args) == 4 and len(node.users) == 1):
        return False
    src, dim, s, n = node.args
    value = _value(src)
    last = value.dim() - 1 if isinstance(value, torch.Tensor) else None
    return src is source and dim in (-1, last) and s == start and n == length


def _silu_of(node) -> torch.fx.Node | None:
    """The input of `node` when it is `F.silu(x)` (not in place), else None."""
    if not _is(node, _SILU) or len(node.args) != 1:
        return None
    if node.kwargs and node.kwargs != {"inplace": False}:
        return None
    return node.args[0]


def _producer(y: torch.fx.Node) -> tuple[str, torch.fx.Node, tuple] | None:
    """(form, the node to replace, the gated op's arguments) when `y` is a routed linear's output without a bias:
    form "plain" (`hf_accel::linear`), "norm" (`rms_norm_linear`) or "add" (`getitem(add_rms_norm_linear, 0)`)."""
    ops = torch.ops.hf_accel
    if _is(y, (ops.linear.default,)):
        x, w, bias, use_pdl = y.args
        return ("plain", y, (x, None, 0.0, w, use_pdl)) if bias is None else None
    if _is(y, (ops.rms_norm_linear.default,)):
        h, g, eps, w, bias, use_pdl = y.args
        return ("norm", y, (h, g, eps, w, use_pdl)) if bias is None else None
    if _is(y, (operator.getitem,)) and y.args[1] == 0 and _is(y.args[0], (ops.add_rms_norm_linear.default,)):
        fused = y.args[0]
        a, b, g, eps, w, bias, use_pdl = fused.args
        return ("add", fused, (a, b, g, eps, w, use_pdl)) if bias is None else None
    return None


def _match(mul: torch.fx.Node):
    """(y, the gated op's form and arguments, the nodes from `mul` back to the halves) when `mul` is
    `silu(y[..., :I]) * y[..., I:]` of a routed gate/up linear `y` of 2I columns (module docstring), else None."""
    if not _is(mul, _MUL) or mul.kwargs or len(mul.args) != 2:
        return None
    silu, up = mul.args
    if _silu_of(silu) is None:  # `up * silu(gate)`: the same product (a float product commutes exactly)
        up, silu = mul.args
    gate = _silu_of(silu)
    if gate is None or len(silu.users) != 1 or not isinstance(up, torch.fx.Node):
        return None
    y = gate.args[0] if isinstance(gate, torch.fx.Node) and gate.args else None
    yv = _value(y)
    if not isinstance(yv, torch.Tensor) or len(y.users) != 2 or isinstance(yv.shape[-1], torch.SymInt):
        return None
    cols = int(yv.shape[-1])
    if cols % 2 or not (_narrow_of(gate, y, 0, cols // 2) and _narrow_of(up, y, cols // 2, cols // 2)):
        return None
    found = _producer(y)
    if found is None:
        return None
    mv = _value(mul)
    if not isinstance(mv, torch.Tensor) or mv.dtype != yv.dtype:
        return None
    return y, found, [mul, silu, up, gate]


def fuse_silu_mul_into_linears(gm: torch.fx.GraphModule) -> list[tuple[int, int, bool]]:
    """Replace each routed gate/up linear and the SiLU-and-mul after it by one op (module docstring); returns the
    (rows, columns, False) weight shapes replaced, one per MLP (what `ops.linear.tune_linears(gated=True)` tunes)."""
    import hf_accel.ops.gated_linear  # noqa: F401  (registers the ops)

    shapes: list[tuple[int, int, bool]] = []
    for mul in list(gm.graph.nodes):
        match = _match(mul)
        if match is None:
            continue
        y, (form, replaced, args), chain = match
        wv = _value(args[-2])
        if not isinstance(wv, torch.Tensor) or wv.dim() != 2:
            continue
        with gm.graph.inserting_before(replaced):
            if form == "add":
                fused = gm.graph.call_function(torch.ops.hf_accel.add_rms_norm_silu_mul_linear.default, args)
                out = gm.graph.call_function(operator.getitem, (fused, 0))
                h_new = gm.graph.call_function(operator.getitem, (fused, 1))
            else:
                out = gm.graph.call_function(torch.ops.hf_accel.silu_mul_linear.default, args)
        out.meta.update(mul.meta)
        mul.replace_all_uses_with(out)
        for dead in chain:  # the product, the SiLU, the two halves: each one's only user was the one before
            gm.graph.erase_node(dead)
        if form == "add":
            h_old = [u for u in replaced.users if u is not y]  # getitem(add_rms_norm_linear, 1): the add's result
            hv = None
            for user in h_old:
                hv = _value(user)
                h_new.meta.update(user.meta)
                user.replace_all_uses_with(h_new)
            if hv is None:  # the add's result had no other reader: the op's second output stays unused
                hv = _value(args[0])
                h_new.meta["example_value"] = hv
            fused.meta["example_value"] = (_value(out), hv)
            gm.graph.erase_node(y)
            for user in h_old:
                gm.graph.erase_node(user)
            gm.graph.erase_node(replaced)
        else:
            gm.graph.erase_node(replaced)
        shapes.append((int(wv.shape[0]), int(wv.shape[1]), False))
    if shapes:
        gm.graph.lint()
        gm.recompile()
    return shapes
