"""Scatters IREE 3.13 may write in place while their destination is still read (silent wrong results).

IREE 3.13 writes a scatter's result into its destination's buffer in place
even when something else still reads the destination, if the result is
padded (`a, pad(scatter(a, ...))`, or a convolution with padding): `a` comes
back with the scattered values in it (docs/iree-3.13-findings.md section 14,
found by the view-write fuzzer). `slice_scatter` and `index_put` are guarded
in `backends/iree/rules/views.py`; here `select_scatter` (as a `slice_scatter`, which that
guard then takes), `scatter`, `scatter_add` and `scatter_reduce` (floats:
every reduction, with or without include_self) get a fresh result: scattered
into a constant, then combined with the destination elementwise. An integer
`scatter_reduce` is left, and refused by `wrong_forms` (findings, section 14).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.iree.rules.views import added_over, full_from_sizes, placed_over, scatter_hazard
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


def _select_scatter(node: Node, args: Mapping[str, Any]) -> dict[str, Any] | Miss:
    val = args["self"].meta["val"]
    dim = args["dim"] % val.dim()
    index = args["index"]
    if index < 0 and type(val.shape[dim]) is not int:
        return Miss("a negative index into a symbolic size")
    hazard = scatter_hazard(node, args["self"], args["src"])
    if hazard is not True:
        return hazard
    return {
        "self": args["self"],
        "src": args["src"],
        "dim": dim,
        "start": index % val.shape[dim] if index < 0 else index,
    }


@rule(
    roots=(aten.select_scatter.default,),
    when=_select_scatter,
    tags={"iree", "guard"},
    doc=(
        "aten.select_scatter(t, src, dim, i) whose t something else reads (or whose src reads t) becomes "
        "slice_scatter(t, src.unsqueeze(dim), dim, i, i + 1): the same elements written, in the form "
        "slice_scatter_of_itself_for_iree then writes into a fresh tensor. IREE 3.13 writes t in place while "
        "it is still read when the result is padded (`a, pad(select_scatter(a, z, 0, 0))`)."
    ),
)
def select_scatter_as_slice_scatter_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    src = rw.call(aten.unsqueeze.default, found["src"], found["dim"])
    rw.replace(
        node,
        rw.call(aten.slice_scatter.default, found["self"], src, found["dim"], found["start"], found["start"] + 1, 1),
    )


#: scatter_reduce's reductions with include_self=True as (the value that leaves an element unchanged, the
#: elementwise op that combines the destination with what was scattered into that value)
_REDUCTIONS = {
    "sum": (-0.0, aten.add.Tensor),  # -0.0 + v == v for every float v
    "prod": (1.0, aten.mul.Tensor),
    "amax": (float("-inf"), aten.maximum.default),
    "amin": (float("inf"), aten.minimum.default),
}


def _scatter(node: Node, *, args: Mapping[str, Any]) -> dict[str, Any] | Miss:
    if node.target == aten.scatter_reduce.two and not args["self"].meta["val"].dtype.is_floating_point:
        # an integer mean divides with rounding, and an integer identity for amax/amin is the dtype's bound:
        # neither measured; such a scatter is refused by wrong_forms instead
        return Miss(f"scatter_reduce of {args['self'].meta['val'].dtype}: only floats are guarded")
    if args.get("reduce") is not None and node.target != aten.scatter_reduce.two:
        return Miss("scatter with reduce= (not guarded)")
    hazard = scatter_hazard(node, args["self"], args.get("src", args.get("value")))
    return args if hazard is True else hazard


@rule(
    roots=(aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two),
    when=_scatter,
    tags={"iree", "guard"},
    doc=(
        "aten.scatter(t, dim, index, src or value) whose t something else reads (or whose src reads t) "
        "scatters into zeros, picked by a mask scattered alike, with where(mask, scattered, t); scatter_add "
        "scatters into -0.0 and adds t (exact where each index occurs once, as index_put's guard), and "
        "scatter_reduce (floats) into the reduction's identity, then combines with t (amax, amin: exact; "
        "mean: t plus the scattered sum over 1 plus a scattered count; without include_self: into zeros, "
        "placed by a mask). IREE 3.13 "
        "scatters in place into t while t is still read when the result is padded "
        "(`a, pad(a.scatter(3, idx, src))`: `a` comes back with src in it)."
    ),
)
def scatter_into_fresh_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    x, dim, index = found["self"], found["dim"], found["index"]
    if node.target == aten.scatter_reduce.two:
        rw.replace(
            node, _reduced_fresh(rw, x, dim, index, found["src"], found["reduce"], found.get("include_self", True))
        )
        return
    if node.target == aten.scatter_add.default:
        rw.replace(node, added_over(rw, x, lambda base: rw.call(node.target, base, dim, index, found["src"])))
        return
    source = found["src"] if node.target == aten.scatter.src else found["value"]
    rw.replace(
        node, placed_over(rw, x, lambda base: rw.call(node.target, base, dim, index, source), _hits(rw, dim, index))
    )


def _hits(rw: Rewriter, dim: int, index: Node) -> Callable[[Node], Node]:
    """placed_over's `mark` for a scatter along `dim` by `index`: True scattered where it writes."""
    return lambda base: rw.call(aten.scatter.value, base, dim, index, True)


def _reduced_fresh(rw: Rewriter, x: Node, dim: int, index: Node, src: Node, reduce: str, include_self: bool) -> Node:
    """scatter_reduce(x, dim, index, src, reduce, include_self) written into fresh tensors, x read only."""
    dtype = x.meta["val"].dtype
    if not include_self:  # the hit elements reduce src alone: scattered into zeros, placed over x by a mask
        return placed_over(
            rw,
            x,
            lambda base: rw.call(aten.scatter_reduce.two, base, dim, index, src, reduce, include_self=False),
            _hits(rw, dim, index),
        )
    if reduce == "mean":  # torch: (x + the sum of what lands there) / (1 + how many land there)
        total = added_over(rw, x, lambda base: rw.call(aten.scatter_add.default, base, dim, index, src))
        ones = rw.call(aten.ones_like.default, src)
        count = rw.call(aten.scatter_add.default, full_from_sizes(rw, x, 1.0, dtype), dim, index, ones)
        return rw.call(aten.div.Tensor, total, count)
    fill, combine = _REDUCTIONS[reduce]
    return rw.call(
        combine, x, rw.call(aten.scatter_reduce.two, full_from_sizes(rw, x, fill, dtype), dim, index, src, reduce)
    )


RULES = RuleSet([select_scatter_as_slice_scatter_for_iree, scatter_into_fresh_for_iree], name="iree-live-scatters")
