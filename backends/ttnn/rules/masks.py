"""Attention-mask plumbing -> ttnn: bool `&` and `where` with a number, on device "bools" (1.0 / 0.0).

transformers 5 builds its masks as bool tensors combined with `&` and turned
additive with `torch.where(mask, x, torch.finfo(dtype).min)`
(`aten.where.ScalarOther`); both read the input mask, so they run on every
call. On the device a bool is a bfloat16 1.0 or 0.0 (what the comparisons
give): `a & b` of two bools is their product (exact: 0 or 1), and
`where(c, x, number)` is `ttnn.where(not c, number, x)`, the stand-in
masked_fill uses, with the number clamped to bfloat16's finite range
(float32's lowest, -3.40e38, becomes bfloat16's, -3.39e38: 0.4% apart, and
both mask a softmax score alike). Integer `&` (bitwise) and infinite or NaN
numbers are declined.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.ttnn.rules import ops
from fx_rewrites.backends.ttnn.rules.boundary import device_value
from fx_rewrites.backends.ttnn.rules.checks import Bound, lowering, tensors_ok
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


def _and_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    for name in ("self", "other"):
        value = args.get(name)
        if not isinstance(value, Node):
            return Miss(f"{name} is {value!r}, not a tensor")
        val = value.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype != torch.bool:
            what = str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else "not a tensor"
            return Miss(f"{name} is {what}, not bool: the lowering takes bool masks (integer & is bitwise)")
    return tensors_ok(masks=("self", "other"), result=(torch.bool,), scalars=("self", "other"))(node, args)


@lowering(
    "ttnn_bool_and",
    [aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default],
    _and_when,
    "a & b of bool masks -> ttnn.multiply of their 1.0 / 0.0 (exact), read back as bool.",
)
def lower_bool_and(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    a, b = (device_value(rw, args[n]) for n in ("self", "other"))
    return rw.call(ops.OPS["multiply"], a, b)


def _where_number_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    number_slot = "other" if node.target is aten.where.ScalarOther else "self"
    tensor_slot = "self" if number_slot == "other" else "other"
    number = args.get(number_slot)
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
        return Miss(f"{number_slot} is {number!r}; the lowering takes a finite number")
    if not isinstance(args.get(tensor_slot), Node):
        return Miss(f"{tensor_slot} is not a tensor")
    found = tensors_ok(tensor_slot, masks=("condition",))(node, args)
    return found if isinstance(found, Miss) else (found, number_slot, tensor_slot)


@lowering(
    "ttnn_where_number",
    [aten.where.ScalarOther, aten.where.ScalarSelf],
    _where_number_when,
    "where(c, x, number) -> ttnn.where(not c, number, x); where(c, number, y) -> ttnn.where(c, number, y).",
)
def lower_where_number(node: Node, rw: Rewriter, *, found: tuple[Bound, str, str]) -> Node:
    bound, number_slot, tensor_slot = found
    cond, tensor = device_value(rw, bound["condition"]), device_value(rw, bound[tensor_slot])
    if number_slot == "other":  # the number where the condition is false
        cond = rw.call(ops.OPS["logical_not"], cond)
    return rw.call(ops.where_scalar, cond, ops.bf16_finite(float(bound[number_slot])), tensor)


RULES = RuleSet([lower_bool_and, lower_where_number], name="ttnn_masks")
