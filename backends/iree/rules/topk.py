"""torch.topk over a short last dim (MoE routers) without a sort, for IREE.

IREE 3.13 lowers `aten.topk` to an in-place `iree_linalg_ext.sort` of the values together with an iota of
indices. Two topks of the same shape (a router in each layer of an MoE model) share that iota: the compiler
CSEs the two operand-less iota dispatches after its copy-on-write pass has separated them, and both sorts then
permute one buffer in place (the second runs on the first's output, concurrently with its readers): the
second topk's indices come back wrong while its values are right (docs/iree-3.13-findings.md, section 22).
Found on a tiny Qwen3-MoE exported with a Dim on the sequence: the second layer's experts read other experts'
weights (14 off), and the grouped-mm path's gathers from indices out of range crash the runtime.

Here topk of a width of at most `MAX_WIDTH` ranks every element instead: its rank is the number of elements
that come before it (greater, or equal at a lower index; NaN above every number, as torch orders it), and
output slot r takes the index whose rank is r, its value gathered. No sort, no iota shared between layers;
the ranks are a permutation, so every index is in range. Cost: width^2 comparisons a row (4 experts: 16).
A sort of values known to lie in [0, E) (the experts' sort of a topk's indices) is a counting sort instead
(rules/counting_sort.py, n * E work, tried first); the ranks take the sorts it cannot prove that of.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: the widest last dim written out as ranks (width^2 comparisons a row); MoE routers have 4-256 experts
MAX_WIDTH = 256
#: the widest static last dim a sort is written out as ranks for (the tokens x experts of a prompt)
MAX_SORT = 16384


def _short_last_dim(node: Node, args: Mapping[str, Any]) -> bool | Miss:
    x = args["self"].meta.get("val")
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return Miss("a 0-d input or one without a tensor value")
    dim, k = args.get("dim", -1), args["k"]
    if dim not in (-1, x.dim() - 1):
        return Miss(f"dim {dim} is not the last")
    width = x.shape[-1]
    if not isinstance(width, int) or not isinstance(k, int):
        return Miss("a symbolic width or k")
    if width > MAX_WIDTH:
        return Miss(f"width {width} > {MAX_WIDTH} (width^2 comparisons a row)")
    if x.dtype.is_complex or x.dtype == torch.bool:
        return Miss(f"dtype {x.dtype}")
    return True


@rule(
    roots=(aten.topk.default,),
    when=_short_last_dim,
    tags={"iree"},
    doc=(
        "torch.topk(x, k) over a last dim of at most 256 (MoE routers; largest or smallest) becomes ranks: "
        "each element's rank is the number of elements before it (greater, or equal at a lower index, NaN "
        "highest), slot r takes the index of rank r and its value gathered. IREE 3.13 shares one in-place "
        "sorted iota between two topks of the same shape (a router per layer): the second's indices come "
        "back wrong, silently (docs/iree-3.13-findings.md, section 22)."
    ),
)
def topk_as_ranks_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x, k = args["self"], args["k"]
    rank, positions = _ranks(rw, x, descending=bool(args.get("largest", True)))
    slots = rw.call(aten.arange.default, k, dtype=torch.int64, device=x.meta["val"].device)
    chosen = rw.call(aten.eq.Tensor, rw.call(aten.unsqueeze.default, rank, -1), slots)  # [..., n, k]
    weighted = rw.call(
        aten.mul.Tensor,
        rw.call(aten._to_copy.default, chosen, dtype=torch.int64),
        rw.call(aten.unsqueeze.default, positions, -1),
    )
    # the clamp changes nothing (the ranks are a permutation) and states the range [0, width) the indices are
    # in, which the counting sort of a later sort of them reads (`value_bound`)
    width = x.meta["val"].shape[-1]
    indices = rw.call(aten.clamp.default, rw.call(aten.sum.dim_IntList, weighted, [-2]), 0, width - 1)  # [..., k]
    _replace_pair(node, rw, rw.call(aten.gather.default, x, -1, indices), indices)


def _ranks(rw: Rewriter, x: Node, *, descending: bool) -> tuple[Node, Node]:
    """Each element's place along the last dim of `x` in a stable sort (NaN after every number ascending,
    before descending, as torch sorts), and the positions 0..n-1: ([..., n] int64, [n] int64)."""
    val = x.meta["val"]
    a = rw.call(aten.unsqueeze.default, x, -1)  # [..., n, 1]: element i
    b = rw.call(aten.unsqueeze.default, x, -2)  # [..., 1, n]: element j
    ahead = rw.call(aten.gt.Tensor if descending else aten.lt.Tensor, b, a)
    equal = rw.call(aten.eq.Tensor, b, a)
    if val.dtype.is_floating_point:  # NaN: highest; equal to NaN
        nan_a, nan_b = rw.call(aten.isnan.default, a), rw.call(aten.isnan.default, b)
        nan_first = (nan_b, nan_a) if descending else (nan_a, nan_b)
        beyond = rw.call(aten.logical_and.default, nan_first[0], rw.call(aten.logical_not.default, nan_first[1]))
        ahead = rw.call(aten.logical_or.default, ahead, beyond)
        equal = rw.call(aten.logical_or.default, equal, rw.call(aten.logical_and.default, nan_a, nan_b))
    positions = rw.call(aten.arange.default, rw.size(x, -1), dtype=torch.int64, device=val.device)
    lower = rw.call(
        aten.lt.Tensor,
        rw.call(aten.unsqueeze.default, positions, 0),  # j along the last dim
        rw.call(aten.unsqueeze.default, positions, 1),  # i along the one before
    )
    before = rw.call(aten.logical_or.default, ahead, rw.call(aten.logical_and.default, equal, lower))
    return rw.call(aten.sum.dim_IntList, before, [-1], dtype=torch.int64), positions


def _replace_pair(node: Node, rw: Rewriter, values: Node, indices: Node) -> None:
    parts = (values, indices)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            rw.replace(user, parts[user.args[1]])


#: sort-like ops IREE 3.13 lowers to an in-place sort of a shared iota
SORTS = (aten.sort.default, aten.topk.default)


def iota_key(node: Node) -> tuple[str, int] | None:
    """What makes two sort-like nodes' iotas one in IREE 3.13: the input's shape and the sorted dim."""
    x = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], Node) else None
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    dim = (schema.arguments(node).get("dim", -1)) % x.dim()
    return str(tuple(x.shape)), dim


def reads_indices(node: Node) -> bool:
    """Whether the graph reads the indices (output 1) of the sort-like `node`: the output the shared iota makes
    wrong (its values come back right)."""
    return any(u.target is operator.getitem and u.args[1] == 1 for u in node.users)


def shares_an_iota(node: Node) -> Node | None:
    """Another sort-like node of `node`'s graph whose iota IREE 3.13 makes one with `node`'s, or None (also
    when `node`'s indices are not read: its values are right whatever the other does)."""
    if not reads_indices(node):
        return None
    key = iota_key(node)
    for other in node.graph.nodes:
        if other is not node and other.op == "call_function" and other.target in SORTS and iota_key(other) == key:
            return other
    return None


def _another_sort(node: Node, args: Mapping[str, Any]) -> bool | Miss:
    x = args["self"].meta.get("val")
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return Miss("a 0-d input or one without a tensor value")
    if args.get("dim", -1) not in (-1, x.dim() - 1):
        return Miss(f"dim {args.get('dim')} is not the last")
    if x.dtype.is_complex or x.dtype == torch.bool:
        return Miss(f"dtype {x.dtype}")
    width = x.shape[-1]
    if isinstance(width, int) and width > MAX_SORT:
        return Miss(f"width {width} > {MAX_SORT} (width^2 comparisons a row)")
    return shares_an_iota(node) is not None or Miss("no other sort or topk of its shape (no iota to share)")


@rule(
    roots=(aten.sort.default,),
    when=_another_sort,
    tags={"iree"},
    doc=(
        "torch.sort(x) along the last dim, in a graph with another sort or topk of its shape (transformers' "
        "grouped-mm experts sort each layer's expert ids), becomes ranks: each element's place is the number "
        "of elements before it (stable; NaN last, or first descending), the indices scattered to their places and the "
        "values gathered. IREE 3.13 shares one in-place sorted iota between two sorts of the same shape: the "
        "second's indices come back wrong (MoE gathers then read out of range: a segfault; "
        "docs/iree-3.13-findings.md, section 22). Cost: n^2 comparisons a row."
    ),
)
def sort_as_ranks_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x = args["self"]
    rank, positions = _ranks(rw, x, descending=bool(args.get("descending", False)))
    last = x.meta["val"].dim() - 1  # a positive dim: IREE 3.13 crashes on a scatter along a negative one
    sources = rw.call(aten.add.Tensor, rw.call(aten.zeros_like.default, rank), positions)
    indices = rw.call(aten.scatter.src, rw.call(aten.zeros_like.default, rank), last, rank, sources)
    _replace_pair(node, rw, rw.call(aten.gather.default, x, last, indices), indices)


RULES = RuleSet([topk_as_ranks_for_iree, sort_as_ranks_for_iree], name="iree-topk")
