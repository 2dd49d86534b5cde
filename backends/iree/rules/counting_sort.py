"""A sort of small non-negative integers (MoE expert ids) as a counting sort, for IREE.

transformers' grouped-mm MoE experts sort each layer's `tokens * top_k` expert ids, the indices of the
router's topk over E experts: integers in [0, E). `sort_as_ranks_for_iree` (rules/topk.py) sorts them with
n^2 comparisons (IREE 3.13 shares one sorted iota between two sorts of one shape, section 22 of
docs/iree-3.13-findings.md), 16384^2 at a prompt of 2048 and top 8. When the values are known to lie in
[0, E) a stable sort is a counting sort instead: each element's place is the number of values below its own
plus the number of equal values before it, from a one-hot [..., n, E] and its cumulative sums: n * E work,
no sort, no iota; the places are a permutation, so the indices are in range.

`value_bound` proves the range from the graph: the indices output of a topk or sort, an argmax or argmin
(the width of their dim), a clamp to [0, m] of integers, through the views and copies that keep the values.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: the most distinct values (E) written as a counting sort: a one-hot of n x E int64 elements
MAX_BINS = 1024

#: ops whose output holds only values of their first input (views, copies, reshapes)
_KEEPS_VALUES = frozenset(
    (
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.clone.default,
        aten.alias.default,
        aten.contiguous.default,
        aten.detach.default,
        aten.flatten.using_ints,
        aten.unsqueeze.default,
        aten.squeeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.permute.default,
        aten.transpose.int,
        aten.t.default,
        aten.expand.default,
        aten.slice.Tensor,
        aten.select.int,
        aten._to_copy.default,
        aten.to.dtype,
        aten.to.dtype_layout,
    )
)
#: ops whose output 1 indexes their input along `dim`
_INDEX_PAIRS = frozenset((aten.topk.default, aten.sort.default, aten.sort.stable, aten.max.dim, aten.min.dim))
_ARGS = frozenset((aten.argmax.default, aten.argmin.default))


def _integral(node: Node) -> bool:
    val = node.meta.get("val")
    return (
        isinstance(val, torch.Tensor)
        and not val.dtype.is_floating_point
        and not val.dtype.is_complex
        and (val.dtype != torch.bool)
    )


def _width(x: Any, dim: Any) -> int | None:
    """The static size of `x` along `dim` (all of it when dim is None), or None."""
    if not isinstance(x, Node) or not isinstance(x.meta.get("val"), torch.Tensor):
        return None
    val = x.meta["val"]
    if dim is None:
        size = val.numel()
    elif val.dim() == 0:
        size = 1
    else:
        size = val.shape[dim % val.dim()]
    return size if isinstance(size, int) else None


def value_bound(node: Any, depth: int = 32) -> int | None:
    """E such that every value of the integer tensor `node` is in [0, E), proved from the graph; else None."""
    if not isinstance(node, Node) or node.op != "call_function" or depth == 0 or not _integral(node):
        return None
    bound = _bound(node, depth)
    # a copy to a narrower integer type wraps what it cannot hold (topk indices over 300 as int8)
    return bound if bound is not None and bound - 1 <= torch.iinfo(node.meta["val"].dtype).max else None


def _bound(node: Node, depth: int) -> int | None:
    target = node.target
    if target in _KEEPS_VALUES:
        return value_bound(node.args[0], depth - 1)
    if target is operator.getitem and node.args[1] == 1 and isinstance(node.args[0], Node):
        source = node.args[0]
        if source.op == "call_function" and source.target in _INDEX_PAIRS:
            return _width(source.args[0], schema.arguments(source).get("dim", -1))
        return None
    if target in _ARGS:
        return _width(node.args[0], schema.arguments(node).get("dim"))
    if target is aten.clamp.default:
        args = schema.arguments(node)
        low, high = args.get("min"), args.get("max")
        if isinstance(low, int) and isinstance(high, int) and 0 <= low <= high:
            return high + 1
    return None


def _bounded_sort(node: Node, args: Mapping[str, Any]) -> tuple[int] | Miss:
    x = args["self"]
    val = fake_value(x)
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return Miss("a 0-d input or one without a tensor value")
    if args.get("dim", -1) not in (-1, val.dim() - 1):
        return Miss(f"dim {args.get('dim')} is not the last")
    bins = value_bound(x)
    if bins is None:
        return Miss("values not known to be small non-negative integers (a topk's or argmax's indices)")
    if bins > MAX_BINS:
        return Miss(f"values in [0, {bins}), more than {MAX_BINS} (an n x {bins} one-hot)")
    return (bins,)  # a 1-tuple: the bound


@rule(
    roots=(aten.sort.default, aten.sort.stable),
    when=_bounded_sort,
    priority=1,  # before sort_as_ranks_for_iree: n * E instead of n^2
    tags={"iree"},
    doc=(
        "torch.sort(x) along the last dim of integers known to lie in [0, E), E <= 1024 (the flattened expert ids "
        "of a router's topk, which transformers' grouped-mm experts sort each layer), becomes a stable counting "
        "sort: each element's place is the number of smaller values (larger, descending) plus the number of "
        "equal ones before it, from a one-hot [..., n, E] and its cumulative sums; the indices scattered to "
        "their places, the values gathered. n * E work instead of the ranks' n^2 (16384^2 at a prompt of 2048, "
        "top 8), and no sorted iota for IREE 3.13 to share between layers (docs/iree-3.13-findings.md, "
        "section 22)."
    ),
)
def counting_sort_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any], found: tuple[int]) -> Any:
    x, (bound,) = args["self"], found
    val = x.meta["val"]
    last = val.dim() - 1  # positive dims: IREE 3.13 crashes on a scatter along a negative one
    bins = rw.call(aten.arange.default, bound, dtype=val.dtype, device=val.device)
    one_hot = rw.call(
        aten._to_copy.default, rw.call(aten.eq.Tensor, rw.call(aten.unsqueeze.default, x, -1), bins), dtype=torch.int64
    )  # [..., n, E]
    running = rw.call(aten.cumsum.default, one_hot, last)  # [..., n, E]: equal values at j <= i
    counts = rw.call(aten.sum.dim_IntList, one_hot, [last])  # [..., E]
    below = rw.call(aten.cumsum.default, counts, last)  # values <= e
    if args.get("descending", False):  # values > e
        ahead = rw.call(aten.sub.Tensor, rw.call(aten.sum.dim_IntList, counts, [last], True), below)
    else:  # values < e
        ahead = rw.call(aten.sub.Tensor, below, counts)
    place = rw.call(aten.add.Tensor, running, rw.call(aten.unsqueeze.default, ahead, last))  # [..., n, E]
    rank = rw.call(
        aten.sub.Tensor, rw.call(aten.sum.dim_IntList, rw.call(aten.mul.Tensor, one_hot, place), [last + 1]), 1
    )  # [..., n]: the element's place, 0-based
    positions = rw.call(aten.arange.default, rw.size(x, -1), dtype=torch.int64, device=val.device)
    sources = rw.call(aten.add.Tensor, rw.call(aten.zeros_like.default, rank), positions)
    indices = rw.call(aten.scatter.src, rw.call(aten.zeros_like.default, rank), last, rank, sources)
    values = rw.call(aten.gather.default, x, last, indices)
    parts = (values, indices)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            rw.replace(user, parts[user.args[1]])


RULES = RuleSet([counting_sort_for_iree], name="iree-counting-sort")
"""A sort of integers known to lie in [0, E) as a counting sort on IREE (backends/iree/rules/counting_sort.py)."""
