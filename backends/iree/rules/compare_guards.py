"""A comparison of a float tensor with a Python int, which IREE 3.13 folds wrong on a constant tensor.

`(torch.full_like(x, 3.0) > 0)` is all False on IREE 3.13 (and `== 3` False,
`< 0` True): with a float tensor that folds to a constant (a `full`, `ones * 3`)
and an int scalar, the comparison is folded wrong, silently. With `0.0` it is
right, and so is every arithmetic op with an int scalar tried (`+ - * / ** %`,
clamp, masked_fill, where). torch compares a float tensor with an int scalar
in the tensor's dtype, so the same comparison with the int written as a float
is the same op (docs/iree-3.13-findings.md section 15).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule

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
def float_scalar_in_comparison_for_iree(node: Node, rw: Rewriter, m: dict[str, Any]) -> None:
    rw.replace(node, rw.call(node.target, m["self"], m["other"]))
