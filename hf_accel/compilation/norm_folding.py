"""Compile pass: a Llama-style RMSNorm (and the residual add before it) feeding one linear becomes one op.

Runs on Dynamo's graph after `small_m_linear.route_small_m_linears`. It looks for the norm by what it computes, not
by module class: `g * (h32 * rsqrt(mean(h32 ** 2, -1, keepdim=True) + eps)).to(dtype)` with `h32 = h.to(float32)`,
`g` a parameter of the activations' dtype, whose result has one user, an `hf_accel::linear` (a packed q/k/v or
gate/up product is one linear by then). Where `h` is itself `a + b` of two tensors of its shape (the residual add),
the add goes into the op too and the op's second output stands for `h` everywhere else. The chain becomes
`hf_accel::add_rms_norm_linear(a, b, g, eps, W, bias)` or `hf_accel::rms_norm_linear(h, g, eps, W, bias)`
(`ops.norm_linear`, which says when the norm really runs inside the GEMM). Gemma-style norms (`1 + weight`), norms
whose result feeds anything but one linear (Qwen3's q/k norms, a final norm followed by the logits' row selection)
keep their Inductor kernels.

By default only rows of at most `MAX_FOLD_K` columns fold: wider rows lost with the norm inside the one-row GEMM
(`ops.norm_linear.MAX_ONE_ROW_NORM_K`), and keep Inductor's norm kernel. With a residual chain
(`chain_residual_norms`, which takes only folded norms) every width folds: the chain normalizes from partial sums, at
any width, and a folded op of a wider row runs its norm as a kernel of its own wherever it does not chain.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.fx

from hf_accel.compilation.linear_packing import may_mutate
from hf_accel.compilation.small_m_linear import ROUTED_DTYPES, static_weight
from hf_accel.compilation.small_m_linear import example_value as _value
from hf_accel.ops.norm_linear import MAX_ONE_ROW_NORM_K

# widest row (hidden size) whose norm folds into the linear after it by default; see the module docstring
MAX_FOLD_K = MAX_ONE_ROW_NORM_K
_MUL = (operator.mul, torch.mul)
_ADD = (operator.add, torch.add)


def _is(node, functions=(), methods=()) -> bool:
    return isinstance(node, torch.fx.Node) and (
        (node.op == "call_function" and node.target in functions)
        or (node.op == "call_method" and node.target in methods))


def _cast_to(node, dtype: torch.dtype):
    """The node cast with `.to(dtype)` (or `.float()` for float32), or None."""
    if _is(node, methods=("float",)) and dtype == torch.float32 and len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    if not _is(node, methods=("to",)) or len(node.args) < 1:
        return None
    rest, kwargs = node.args[1:], node.kwargs
    if len(rest) == 1 and not kwargs:  # .to(dtype)
        target = rest[0]
    elif not rest and set(kwargs) == {"dtype"}:  # .to(dtype=dtype)
        target = kwargs["dtype"]
    else:
        return None
    return node.args[0] if target == dtype else None


def _single_user(node) -> bool:
    return isinstance(node, torch.fx.Node) and len(node.users) == 1


def match_llama_rms_norm(out: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, float, list] | None:
    """(h, g, eps, the chain's nodes from `out` back) when `out` is LlamaRMSNorm's result on `h`, else None."""
    if not _is(out, _MUL) or out.kwargs or len(out.args) != 2:
        return None
    for g, cast in (out.args, out.args[::-1]):
        gv = _value(g)
        if not (isinstance(g, torch.fx.Node) and static_weight(g) and _single_user(cast)):
            continue
        if gv is None or gv.dim() != 1 or gv.dtype not in ROUTED_DTYPES:
            continue
        scaled = _cast_to(cast, gv.dtype)
        if not (_is(scaled, _MUL) and _single_user(scaled) and not scaled.kwargs):
            continue
        for h32, rstd in (scaled.args, scaled.args[::-1]):
            if not (_is(rstd, (torch.rsqrt,)) and _single_user(rstd) and len(rstd.args) == 1):
                continue
            shifted = rstd.args[0]
            if not (_is(shifted, _ADD) and _single_user(shifted) and not shifted.kwargs and len(shifted.args) == 2):
                continue
            mean, eps = shifted.args
            if not isinstance(eps, float | int) or isinstance(eps, bool):
                continue
            if not (_is(mean, methods=("mean",)) and _single_user(mean) and mean.kwargs == {"keepdim": True}
                    and len(mean.args) == 2 and mean.args[1] in (-1, (-1,), [-1])):
                continue
            square = mean.args[0]
            if not (_is(square, methods=("pow",)) and _single_user(square) and square.args[1:] == (2,)
                    and square.args[0] is h32 and not square.kwargs):
                continue
            h = _cast_to(h32, torch.float32)
            hv = _value(h)
            if h is None or len(h32.users) != 2 or hv is None or hv.dtype != gv.dtype or hv.shape[-1] != gv.shape[0]:
                continue
            return h, g, float(eps), [out, cast, scaled, rstd, shifted, mean, square, h32]
    return None


def _addends(h: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(a, b) when `h` is `a + b` of two contiguous tensors of h's shape and dtype (no broadcast, no alpha), else
    None. Contiguous, because the op's second output, standing for `h` from then on, is."""
    if not (_is(h, _ADD) and not h.kwargs and len(h.args) == 2):
        return None
    a, b = h.args
    hv, av, bv = _value(h), _value(a), _value(b)
    if not all(isinstance(v, torch.Tensor) for v in (hv, av, bv)):
        return None
    if not (av.shape == bv.shape == hv.shape and av.dtype == bv.dtype == hv.dtype):
        return None
    try:
        contiguous = bool(hv.is_contiguous())
    except Exception:  # a size the shape environment cannot decide
        contiguous = False
    return (a, b) if contiguous else None


def _nodes_between(start: torch.fx.Node, end: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes after `start` and before `end` in graph order (`start` comes first: it feeds `end`'s input),
    found by walking back from `end`, so a fold costs the length of its own chain, not of the graph."""
    nodes = []
    node = end.prev
    while node is not start and node.op != "root":
        nodes.append(node)
        node = node.prev
    nodes.reverse()
    return nodes


def fold_norms_into_linears(gm: torch.fx.GraphModule, any_width: bool = False) -> int:
    """Replace each LlamaRMSNorm (with its residual add) that feeds one `hf_accel::linear` by one op (module
    docstring); returns how many were folded. `any_width`: rows wider than `MAX_FOLD_K` fold too (for a chain)."""
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.hf_accel.linear.default:
            continue
        x, w, bias, use_pdl = node.args
        if not _single_user(x):
            continue
        match = match_llama_rms_norm(x)
        if match is None:
            continue
        h, g, eps, chain = match
        wv = _value(w)
        if wv is None or wv.shape[-1] != _value(h).shape[-1] or (wv.shape[-1] > MAX_FOLD_K and not any_width):
            continue
        # the op runs at the linear's place: the add's result, which its second output replaces, must not be used
        # before that, and nothing in between may write a tensor (the norm and the add would read what it wrote)
        between = _nodes_between(h, node)
        addends = _addends(h)
        if addends is not None and any(u in between for u in h.users if u is not chain[-1]):
            addends = None
        moved_past = between if addends is not None else between[between.index(chain[-1]) + 1:]
        if any(may_mutate(n) for n in moved_past):
            continue
        with gm.graph.inserting_before(node):
            if addends is not None:
                fused = gm.graph.call_function(torch.ops.hf_accel.add_rms_norm_linear.default,
                                               (*addends, g, eps, w, bias, use_pdl))
                y = gm.graph.call_function(operator.getitem, (fused, 0))
                h_new = gm.graph.call_function(operator.getitem, (fused, 1))
                fused.meta["example_value"] = (_value(node), _value(h))
                h_new.meta.update(h.meta)
            else:
                y = gm.graph.call_function(torch.ops.hf_accel.rms_norm_linear.default, (h, g, eps, w, bias, use_pdl))
        y.meta.update(node.meta)
        node.replace_all_uses_with(y)
        gm.graph.erase_node(node)
        for dead in chain:  # from the norm's result back to its float32 cast: each one's only user was the last
            gm.graph.erase_node(dead)
        if addends is not None:
            h.replace_all_uses_with(h_new)
            gm.graph.erase_node(h)
        folded += 1
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


class ChainedPair(NamedTuple):
    """The two linears of a chain `chain_residual_norms` made, as (n, k, has_bias) weight shapes: what
    `ops.linear.tune_linears(chain_places=...)` times chain tiles for. `second` of a `gated` pair is the gate/up
    weight (its gated decisions)."""

    first: tuple[int, int, bool]
    second: tuple[int, int, bool]
    gated: bool


def chain_places(pairs: Iterable[ChainedPair], gated: bool) -> dict[tuple[int, int, bool], tuple[str, ...]]:
    """{weight shape: the places it takes in `pairs`' chains} among the plain linears' decisions (each first linear,
    the second of a plain pair) or, `gated`, among the gated ones (the second of a gated pair): what
    `ops.linear.tune_linears(chain_places=...)` takes."""
    places: dict[tuple[int, int, bool], tuple[str, ...]] = {}
    for pair in pairs:
        found = ([] if gated else [(pair.first, "first")]) + ([(pair.second, "second")] if pair.gated == gated else [])
        for shape, place in found:
            if place not in places.get(shape, ()):
                places[shape] = (*places.get(shape, ()), place)
    return places


def chain_residual_norms(gm: torch.fx.GraphModule) -> list[ChainedPair]:
    """Give each folded norm's op whose residual add takes a routed linear's output that linear too: the pair becomes
    `hf_accel::linear_add_rms_norm_linear` (`ops.residual_chain`: the add and the norm's sums of squares in the first
    GEMM's epilogue, the normalization in the second's K loop). Runs after `fold_norms_into_linears` and the gated
    pass; returns the pairs chained (a pair whose weight shapes are unknown is not chained: no chain tile could be
    timed for it)."""
    import hf_accel.ops.residual_chain  # noqa: F401  (registers the op)

    plain = torch.ops.hf_accel.add_rms_norm_linear.default
    gated = torch.ops.hf_accel.add_rms_norm_silu_mul_linear.default
    chained: list[ChainedPair] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (plain, gated):
            continue
        if node.target is plain:
            a, b, g, eps, w2, bias2, use_pdl = node.args
        else:
            (a, b, g, eps, w2, use_pdl), bias2 = node.args, None
        for first, residual in ((a, b), (b, a)):  # the add commutes (IEEE addition does)
            if not (isinstance(first, torch.fx.Node) and first.op == "call_function"
                    and first.target is torch.ops.hf_accel.linear.default and _single_user(first)
                    and residual is not first):  # `lin + lin`: the add reads the linear twice
                continue
            x1, w1, bias1, pdl1 = first.args
            w1v, w2v = _value(w1), _value(w2)
            if not static_weight(w1) or not all(isinstance(v, torch.Tensor) and v.dim() == 2 for v in (w1v, w2v)):
                continue
            # the linear runs at the op's place: nothing in between may write what it reads
            if any(may_mutate(n) for n in _nodes_between(first, node)):
                continue
            with gm.graph.inserting_before(node):
                fused = gm.graph.call_function(torch.ops.hf_accel.linear_add_rms_norm_linear.default,
                                               (x1, w1, bias1, residual, g, eps, w2, bias2, node.target is gated,
                                                bool(use_pdl and pdl1)))  # PDL only where both linears had it
            fused.meta.update(node.meta)
            node.replace_all_uses_with(fused)
            gm.graph.erase_node(node)
            gm.graph.erase_node(first)
            chained.append(ChainedPair((int(w1v.shape[0]), int(w1v.shape[1]), bias1 is not None),
                                       (int(w2v.shape[0]), int(w2v.shape[1]), bias2 is not None),
                                       node.target is gated))
            break
    if chained:
        gm.graph.lint()
        gm.recompile()
    return chained
