"""Elementwise aten ops -> ttnn: unary math, binary arithmetic, comparisons, where, clamp, leaky_relu, pow."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.ttnn.rules import ops, ops_extra
from fx_rewrites.backends.ttnn.rules.boundary import device_value
from fx_rewrites.backends.ttnn.rules.checks import MASK_DTYPES, Bound, bind, lowering, tensors_ok
from fx_rewrites.backends.ttnn.rules.movement import CASTS, same_place
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


UNARY = {
    aten.relu.default: "relu",
    aten.silu.default: "silu",
    aten.sigmoid.default: "sigmoid",
    aten.tanh.default: "tanh",
    aten.exp.default: "exp",
    aten.log.default: "log",
    aten.sqrt.default: "sqrt",
    aten.rsqrt.default: "rsqrt",
    aten.neg.default: "neg",
    aten.abs.default: "abs",
    aten.reciprocal.default: "reciprocal",
    aten.erf.default: "erf",
    aten.sin.default: "sin",
    aten.cos.default: "cos",
    aten.gelu.default: "gelu",
    aten.acos.default: "acos",
    aten.asin.default: "asin",
    aten.atan.default: "atan",
    aten.acosh.default: "acosh",
    aten.asinh.default: "asinh",
    aten.atanh.default: "atanh",
    aten.expm1.default: "expm1",
    aten.log1p.default: "log1p",
    aten.log2.default: "log2",
    aten.log10.default: "log10",
    aten.hardsigmoid.default: "hardsigmoid",
    aten.hardswish.default: "hardswish",
}
#: kept on the host, with the reason: a step function of a bfloat16-rounded input can be off by a whole unit
#: (floor(2.999) is 2, floor(bfloat16(2.999)) = floor(3.0) is 3), far beyond any bfloat16 tolerance
DISCONTINUOUS = (
    aten.floor.default,
    aten.ceil.default,
    aten.trunc.default,
    aten.round.default,
    aten.sign.default,
    aten.remainder.Tensor,  # jumps by the divisor: remainder(bfloat16(2.999), 1) is 0, not 0.999
    aten.remainder.Scalar,
)


def _unary_when(node: Node) -> Any:
    if node.target is aten.gelu.default and bind(node).get("approximate", "none") not in ("none", None):
        return Miss("gelu(approximate='tanh'): the lowering maps only the exact (erf) gelu to ttnn.gelu")
    return tensors_ok("self")(node)


@lowering("ttnn_unary", UNARY, _unary_when, "Elementwise unary aten ops -> ttnn.relu/gelu/silu/exp/... .")
def lower_unary(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops.OPS[UNARY[node.target]], device_value(rw, args["self"]))


BINARY = {
    aten.add.Tensor: "add",
    aten.add.Scalar: "add",
    aten.sub.Tensor: "subtract",
    aten.sub.Scalar: "subtract",
    aten.mul.Tensor: "multiply",
    aten.mul.Scalar: "multiply",
    aten.div.Tensor: "divide",
    aten.div.Scalar: "divide",
    aten.maximum.default: "maximum",
    aten.minimum.default: "minimum",
}


def _binary_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if args.get("alpha", 1) != 1:
        return Miss(f"alpha={args['alpha']}: ttnn.add/subtract have no alpha")
    other = args["other"]
    if isinstance(other, Node) and isinstance(other.meta.get("val"), torch.Tensor):
        return tensors_ok("self", "other", scalars=("self", "other"))(node, args)
    if isinstance(other, Node):
        return Miss(f"other is a runtime {type(other.meta.get('val')).__name__} ({other.name}); ttnn takes constants")
    if not isinstance(other, (int, float)) or isinstance(other, bool):
        return Miss(f"other is {other!r}, not a number")
    return tensors_ok("self")(node, args)


@lowering("ttnn_binary", BINARY, _binary_when, "Elementwise binary aten ops -> ttnn.add/subtract/multiply/...")
def lower_binary(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    name, other = BINARY[node.target], args["other"]
    a = device_value(rw, args["self"])
    if isinstance(other, Node):
        return rw.call(ops.OPS[name], a, device_value(rw, other))
    return rw.call(ops.OPS[f"{name}_scalar"], a, ops.bf16_finite(float(other)))


@lowering(
    "ttnn_rsub", [aten.rsub.Scalar, aten.rsub.Tensor], _binary_when, "rsub(x, y) = y - x -> ttnn.subtract / neg + add."
)
def lower_rsub(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    x, other = device_value(rw, args["self"]), args["other"]
    if isinstance(other, Node):
        return rw.call(ops.OPS["subtract"], device_value(rw, other), x)
    return rw.call(ops.OPS["add_scalar"], rw.call(ops.OPS["neg"], x), ops.bf16_finite(float(other)))


def _pow_when(node: Node) -> Any:
    exponent = node.args[1]
    if isinstance(exponent, (Node, bool)):
        return Miss(f"the exponent is a runtime value ({exponent}); ttnn.pow takes a constant")
    return tensors_ok("self")(node)


@lowering("ttnn_pow", [aten.pow.Tensor_Scalar], _pow_when, "aten.pow(x, constant) -> ttnn.pow.")
def lower_pow(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops.pow_scalar, device_value(rw, args["self"]), float(args["exponent"]))


# -- comparisons, where, activations with parameters -----------------------------------------------------

COMPARISONS = {
    getattr(getattr(aten, name), overload): name for name in ops.COMPARE for overload in ("Tensor", "Scalar")
}


def _compare_when(node: Node) -> Any:
    other = node.args[1]
    if isinstance(other, Node):
        return tensors_ok("self", "other", result=(torch.bool,), scalars=("self", "other"))(node)
    if isinstance(other, bool) or not isinstance(other, (int, float)):
        return Miss(f"other is {other!r}, not a number")
    return tensors_ok("self", result=(torch.bool,))(node)


@lowering(
    "ttnn_compare", COMPARISONS, _compare_when, "gt/lt/ge/le/eq/ne of floats -> ttnn.gt/... (1.0/0.0, read as bool)."
)
def lower_compare(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    name, other = COMPARISONS[node.target], args["other"]
    a = device_value(rw, args["self"])
    if isinstance(other, Node):
        return rw.call(ops.OPS[name], a, device_value(rw, other))
    return rw.call(ops.OPS[f"{name}_scalar"], a, ops.bf16_finite(float(other)))


@lowering(
    "ttnn_where",
    [aten.where.self],
    tensors_ok("self", "other", masks=("condition",)),
    "aten.where(cond, x, y) -> ttnn.where (a bool condition goes in as bfloat16 1.0/0.0).",
)
def lower_where(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    cond, x, y = (device_value(rw, args[n]) for n in ("condition", "self", "other"))
    return rw.call(ops.where, cond, x, y)


@lowering("ttnn_leaky_relu", [aten.leaky_relu.default], tensors_ok("self"), "leaky_relu -> ttnn.leaky_relu.")
def lower_leaky_relu(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops.leaky_relu, device_value(rw, args["self"]), float(args.get("negative_slope", 0.01)))


def _clamp_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    for key in ("min", "max", "min_val", "max_val"):
        if isinstance(args.get(key), Node):
            return Miss(f"{key} is a graph value; ttnn.clamp takes constants")
    return tensors_ok("self")(node, args)


#: the bounds an op clamps to when its arguments do not say (hardtanh's defaults; relu6 has none to give)
_CLAMP_DEFAULTS = {aten.hardtanh.default: (-1.0, 1.0), aten.relu6.default: (0.0, 6.0)}


@lowering(
    "ttnn_clamp",
    [aten.clamp.default, aten.hardtanh.default, aten.relu6.default, aten.clamp_min.default, aten.clamp_max.default],
    _clamp_when,
    "clamp / hardtanh / relu6 / clamp_min / clamp_max with constant bounds -> ttnn.clamp.",
)
def lower_clamp(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    lo_default, hi_default = _CLAMP_DEFAULTS.get(node.target, (None, None))
    lo = args.get("min", args.get("min_val", lo_default))
    hi = args.get("max", args.get("max_val", hi_default))
    lo, hi = (None if v is None else float(v) for v in (lo, hi))
    return rw.call(ops.clamp, device_value(rw, args["self"]), lo, hi)


def _step_when(node: Node) -> Any:
    return Miss(
        f"{node.target._opname}: a step function of bfloat16-rounded inputs can be off by a whole unit "
        "(floor(bfloat16(2.999)) is 3; remainder(bfloat16(2.999), 1) is 0, not 0.999); kept on the host"
    )


@lowering(
    "ttnn_step_functions",
    DISCONTINUOUS,
    _step_when,
    "floor/ceil/trunc/round/sign/remainder: declined, see the reason.",
)
def lower_step(node: Node, rw: Rewriter) -> Node:
    """Never reached: `_step_when` always declines, so the coverage report says why these stay on the host."""
    raise AssertionError("ttnn_step_functions never fires")


def _to_bool_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool:
        return Miss("not a cast to bool")
    if not same_place(node, args):
        return Miss("a copy that changes device, layout or memory format")
    return tensors_ok("self", result=(torch.bool,))(node, args)


@lowering("ttnn_to_bool", CASTS, _to_bool_when, "x.to(torch.bool) of a float tensor -> ttnn.ne(x, 0.0) (1.0 / 0.0).")
def lower_to_bool(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops.OPS["ne_scalar"], device_value(rw, args["self"]), 0.0)


def _masked_fill_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    value = args["value"]
    if isinstance(value, (Node, bool)) or not isinstance(value, (int, float)):
        return Miss(f"value is {value!r}; the lowering fills with a constant")
    return tensors_ok("self", masks=("mask",))(node, args)


@lowering(
    "ttnn_masked_fill",
    [aten.masked_fill.Scalar],
    _masked_fill_when,
    "x.masked_fill(mask, value) -> ttnn.where(mask, value, x).",
)
def lower_masked_fill(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    mask, x = device_value(rw, args["mask"]), device_value(rw, args["self"])
    return rw.call(ops.where_scalar, mask, ops.bf16_finite(float(args["value"])), x)


def _logical_not_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    val = fake_value(args["self"])
    if node.target is aten.bitwise_not.default and getattr(val, "dtype", None) != torch.bool:
        return Miss("bitwise_not of integers; the device holds bfloat16 (bool only: logical not)")
    return tensors_ok(masks=("self",), result=(torch.bool,))(node, args)


@lowering(
    "ttnn_logical_not",
    [aten.logical_not.default, aten.bitwise_not.default],
    _logical_not_when,
    "logical_not, and bitwise_not of bools -> ttnn.logical_not (1.0 / 0.0, read as bool).",
)
def lower_logical_not(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops.OPS["logical_not"], device_value(rw, args["self"]))


def _special_values_when(node: Node) -> Any:
    return Miss(
        f"{node.target._opname}: values enter the device clamped to bfloat16's finite range (float32's "
        "extremes would become infinities), so an infinity in the input would not be seen; kept on the host"
    )


@lowering(
    "ttnn_isinf_isnan",
    [aten.isinf.default, aten.isnan.default, aten.isposinf.default, aten.isneginf.default],
    _special_values_when,
    "isinf / isnan: declined, see the reason.",
)
def lower_special_values(node: Node, rw: Rewriter) -> Node:
    """Never reached: `_special_values_when` always declines, so the coverage report says why."""
    raise AssertionError("ttnn_isinf_isnan never fires")


def _elu_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if args.get("scale", 1) != 1 or args.get("input_scale", 1) != 1:
        return Miss("elu with scale or input_scale (selu-like); ttnn.elu takes alpha only")
    return tensors_ok("self")(node, args)


@lowering("ttnn_elu", [aten.elu.default], _elu_when, "elu(x, alpha) -> ttnn.elu(x, alpha=).")
def lower_elu(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops_extra.elu, device_value(rw, args["self"]), float(args.get("alpha", 1.0)))


def _tril_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if getattr(args["self"].meta.get("val"), "ndim", 2) < 2:
        return Miss("tril of a 1-D tensor")
    return tensors_ok(masks=("self",), result=MASK_DTYPES)(node, args)


@lowering("ttnn_tril", [aten.tril.default], _tril_when, "tril(x, diagonal) -> ttnn.tril (bool masks as 1.0 / 0.0).")
def lower_tril(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops_extra.tril, device_value(rw, args["self"]), int(args.get("diagonal", 0)))


ADDC = {aten.addcmul.default: ops_extra.addcmul, aten.addcdiv.default: ops_extra.addcdiv}


def _addc_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    out = node.meta.get("val")
    for name in ("self", "tensor1", "tensor2"):
        val = fake_value(args[name])
        if isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor) and tuple(val.shape) != tuple(out.shape):
            return Miss(f"{name} is broadcast; ttnn.{node.target._opname} is given operands of the result's shape")
    if isinstance(args.get("value", 1), Node):
        return Miss("value is a graph value")
    return tensors_ok("self", "tensor1", "tensor2")(node, args)


@lowering("ttnn_addcmul_addcdiv", ADDC, _addc_when, "addcmul / addcdiv -> ttnn.addcmul / addcdiv(a, b, c, value=).")
def lower_addc(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    a, b, c = (device_value(rw, args[n]) for n in ("self", "tensor1", "tensor2"))
    return rw.call(ADDC[node.target], a, b, c, float(args.get("value", 1)))


def _xlogy_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if not isinstance(args.get("other"), Node):
        return Miss("a number for y; the lowering takes two tensors")
    return tensors_ok("self", "other", scalars=("self", "other"))(node, args)


@lowering(
    "ttnn_xlogy",
    [aten.xlogy.Tensor],
    _xlogy_when,
    "xlogy(x, y) -> where(x == 0, (0 or y's NaN), x * log(y)) with ttnn.eq/where/log/multiply.",
)
def lower_xlogy(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    """Not ttnn.xlogy: its docs define it as x * log(y), which is NaN at x = y = 0 where torch gives 0.
    torch: 0 where x is 0 unless y is NaN (then NaN); `y == y` is false exactly for NaN."""
    x, y = device_value(rw, args["self"]), device_value(rw, args["other"])
    nan_or_zero = rw.call(ops.where_scalar, rw.call(ops.OPS["eq"], y, y), 0.0, y)
    product = rw.call(ops.OPS["multiply"], x, rw.call(ops.OPS["log"], y))
    return rw.call(ops.where, rw.call(ops.OPS["eq_scalar"], x, 0.0), nan_or_zero, product)


RULES = RuleSet(
    [
        lower_compare,
        lower_where,
        lower_masked_fill,
        lower_to_bool,
        lower_leaky_relu,
        lower_clamp,
        lower_unary,
        lower_step,
        lower_binary,
        lower_rsub,
        lower_pow,
        lower_elu,
        lower_tril,
        lower_logical_not,
        lower_special_values,
        lower_addc,
        lower_xlogy,
    ],
    name="ttnn_elementwise",
)
