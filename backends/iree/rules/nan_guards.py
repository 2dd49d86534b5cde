"""Ops IREE 3.13 computes wrong at NaN: clamp and its kin, maximum and minimum, and sort.

Measured on llvm-cpu, as exported and after the rules (docs/iree-3.13-findings.md section 19): clamp,
clamp_min, clamp_max, hardtanh (relu6) and maximum/minimum of a NaN in their first operand give a number
where torch gives NaN (IREE selects on a comparison NaN fails); relu, amax and max over a dim keep NaN.
`sort` puts NaN second (after -inf ascending, after inf descending) where torch puts it last (first
descending). Through legalize decompositions these surfaced where IREE had failed loudly as exported:
triplet_margin_loss (its clamp_min), msort.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: the ops whose first operand's NaN IREE 3.13 drops
CLAMPS = (
    aten.clamp.default,
    aten.clamp.Tensor,
    aten.clamp_min.default,
    aten.clamp_min.Tensor,
    aten.clamp_max.default,
    aten.clamp_max.Tensor,
    aten.hardtanh.default,
    aten.relu6.default,
    aten.maximum.default,
    aten.minimum.default,
)


def _is_nan_guard(user: Node, x: Node, node: Node) -> bool:
    """`user` is where(x != x, x, node): the guard this rule writes."""
    if user.target is not aten.where.self or user.args[1:] != (x, node):
        return False
    condition = user.args[0]
    return isinstance(condition, Node) and condition.target is aten.ne.Tensor and condition.args[:2] == (x, x)


def _unguarded_float(node: Node) -> bool | Miss:
    x = node.args[0]
    val = fake_value(x)
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
        return Miss("not a floating-point tensor (no NaN)")
    if len(node.users) == 1 and _is_nan_guard(next(iter(node.users)), x, node):
        return Miss("already guarded")
    return True


@rule(
    roots=CLAMPS,
    when=_unguarded_float,
    tags={"iree", "guard"},
    doc=(
        "clamp, clamp_min, clamp_max, hardtanh, relu6, maximum and minimum of a floating-point x become "
        "where(x != x, x, op(x, ...)): the same values, NaN where x is NaN. IREE 3.13 gives a bound there "
        "(clamp_min(nan, 0) = 0, maximum(nan, 1) = 1; eager NaN): silently, as exported too. One compare and "
        "select more, fused into the op's dispatch."
    ),
)
def clamp_keeps_nan_for_iree(node: Node, rw: Rewriter) -> Any:
    x = node.args[0]
    out = rw.call(node.target, *node.args, **node.kwargs)
    rw.replace(node, rw.call(aten.where.self, rw.call(aten.ne.Tensor, x, x), x, out))


def _values_only_sort_of_float(node: Node, args: Mapping[str, Any]) -> bool | Miss:
    val = args["self"].meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
        return Miss("not a floating-point tensor (no NaN)")
    if not all(u.target is operator.getitem and (u.args[1] == 0 or not u.users) for u in node.users):
        return Miss("its indices are read (the order of NaNs among infinities is not rebuilt)")
    if val.dim() == 0 or not isinstance(val.shape[args.get("dim", -1)], int):
        return Miss("a 0-d tensor or a symbolic sorted dim")
    source = args["self"]
    condition = source.args[0] if source.op == "call_function" and source.target is aten.where.self else None
    if isinstance(condition, Node) and condition.target is aten.ne.Tensor:
        return Miss("already guarded (its NaNs are infinities)")
    return True


@rule(
    roots=(aten.sort.default, aten.sort.stable),
    when=_values_only_sort_of_float,
    tags={"iree", "guard"},
    doc=(
        "sort of a floating-point tensor whose indices are not read (msort, sort(...).values) sorts with "
        "NaN as inf, then puts NaN in the last (first) as many places as the row has NaNs: "
        "torch's order. IREE 3.13 sorts NaN second (after -inf ascending): silently, as exported too."
    ),
)
def sort_values_keep_nan_last_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x, descending = args["self"], bool(args.get("descending", False))
    val = x.meta["val"]
    dim = args.get("dim", -1) % val.dim()
    nan = rw.call(aten.ne.Tensor, x, x)
    stand_in = rw.call(aten.full_like.default, x, float("inf"))  # NaN is the largest to torch
    keys = rw.call(aten.where.self, nan, stand_in, x)
    if node.target is aten.sort.stable:
        sorted_ = rw.call(aten.sort.stable, keys, stable=args.get("stable"), dim=dim, descending=descending)
    else:
        sorted_ = rw.call(aten.sort.default, keys, dim, descending)
    values = rw.call(operator.getitem, sorted_, 0)
    count = rw.call(aten.sum.dim_IntList, nan, [dim], True, dtype=torch.int64)  # NaNs per row
    size = val.shape[dim]
    position = rw.call(aten.arange.default, size, dtype=torch.int64, device=val.device)
    position = rw.call(aten.view.default, position, [size if d == dim else 1 for d in range(val.dim())])
    in_place = (
        rw.call(aten.lt.Tensor, position, count)
        if descending
        else rw.call(aten.ge.Tensor, position, rw.call(aten.rsub.Scalar, count, size))
    )
    nans = rw.call(aten.full_like.default, values, float("nan"))
    rw.replace(node, [rw.call(aten.where.self, in_place, nans, values), rw.call(operator.getitem, sorted_, 1)])
    return None


RULES = RuleSet([clamp_keeps_nan_for_iree, sort_values_keep_nan_last_for_iree], name="iree-nan-guards")
