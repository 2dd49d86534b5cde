"""Comparisons IREE 3.13 folds wrong: a float tensor with a Python int on a constant tensor, and a float
tensor equal to itself.

`(torch.full_like(x, 3.0) > 0)` is all False on IREE 3.13 (and `== 3` False,
`< 0` True): with a float tensor that folds to a constant (a `full`, `ones * 3`)
and an int scalar, the comparison is folded wrong, silently. With `0.0` it is
right, and so is every arithmetic op with an int scalar tried (`+ - * / ** %`,
clamp, masked_fill, where). torch compares a float tensor with an int scalar
in the tensor's dtype, so the same comparison with the int written as a float
is the same op (docs/iree-3.13-findings.md section 15).

`x == x` of a float tensor is all True on IREE 3.13, NaN included (also through a clone or a view of x:
`x == x.view(n)`), where `x != x`, `x >= x` and `x == x.exp().log()`-like distinct values are right. It is
how NaN is told apart (ATen's isfinite is `(x == x) * (|x| != inf)`): written as `~(x != x)` instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import Pattern, rule

aten = torch.ops.aten

#: the comparisons of a tensor with a scalar (the arithmetic ops were measured right with int scalars)
COMPARISONS = (aten.eq.Scalar, aten.ne.Scalar, aten.gt.Scalar, aten.ge.Scalar, aten.lt.Scalar, aten.le.Scalar)
#: ints up to this size are exact as Python floats: the float then rounds to the tensor's dtype as the int would
_EXACT_IN_DOUBLE = 2**53


def _int_scalar_of_float_tensor(node: Node, args: Mapping[str, Any]) -> dict[str, Any] | Miss:
    val, other = args["self"].meta.get("val"), args["other"]
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
        return Miss("not a floating-point tensor")
    if type(other) is not int or abs(other) > _EXACT_IN_DOUBLE:
        return Miss("the scalar is not an int exact as a float")
    return {"self": args["self"], "other": float(other)}


@rule(
    roots=COMPARISONS,
    when=_int_scalar_of_float_tensor,
    tags={"iree", "guard"},
    doc=(
        "A comparison (eq, ne, gt, ge, lt, le) of a floating-point tensor with a Python int compares with the "
        "int as a float: the same comparison, since torch compares in the tensor's dtype. IREE 3.13 folds "
        "the int form wrong when the tensor is a constant (`full_like(x, 3.0) > 0` all False, `== 3` False)."
    ),
)
def float_scalar_in_comparison_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    rw.replace(node, rw.call(node.target, found["self"], found["other"]))


#: ops whose result holds its operand's values (a copy or a view): IREE sees through them to one value
_SAME_VALUES = frozenset(
    {
        aten.clone.default,
        aten.alias.default,
        aten.detach.default,
        aten.lift_fresh_copy.default,
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.expand.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.unsqueeze.default,
        aten.slice.Tensor,
        aten.permute.default,
        aten.contiguous.default,
    }
)
_MAX_STEPS = 16


def _source(value: Any) -> Any:
    """The node `value` reads its values from, through copies and views."""
    for _ in range(_MAX_STEPS):
        if not isinstance(value, Node) or value.target not in _SAME_VALUES or not isinstance(value.args[0], Node):
            break
        value = value.args[0]
    return value


def _compared_with_itself(node: Node) -> Miss | bool:
    a, b = node.args[:2]
    val = fake_value(a)
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
        return Miss("not a floating-point tensor")
    if _source(a) is not _source(b):
        return Miss("the operands are different values")
    return True


float_self_equality_for_iree = Pattern(
    pattern=lambda a, b: aten.eq.Tensor(a, b),
    replacement=lambda a, b: aten.logical_not.default(aten.ne.Tensor(a, b)),
    when=_compared_with_itself,
    name="float_self_equality_for_iree",
    tags={"iree", "guard"},
    doc=(
        "`x == x` of a floating-point tensor (also through a clone or view of x) becomes `~(x != x)`: the "
        "same values, False at NaN. IREE 3.13 folds `x == x` to True, so NaN compared equal to itself (and "
        "ATen's isfinite, `(x == x) * (|x| != inf)`, said NaN is finite)."
    ),
)
