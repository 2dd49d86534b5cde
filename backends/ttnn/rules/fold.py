"""Eval-mode batch norm and per-channel affines folded into the convolution before them (the ttnn fold phase).

`conv(x, W, b)` read only by an eval-mode `batch_norm` with running
statistics becomes `conv(x, W * s, (b - mean) * s + beta)`, with
`s = gamma / sqrt(var + eps)` per output channel; a convolution read only by
a `mul` / `div` / `add` / `sub` with a per-output-channel constant (the form
DEFAULT's `batch_norm_eval_to_affine` leaves: sub mean, mul scale, add bias)
folds the same way, one step at a time. The new weight and bias are aten ops
on the program's constants, so the lowering leaves them on the host, where the
backend computes them once in float32 and uploads them once
(`constants.py`): the device sees one conv with a bias instead of a conv and
a batch norm (or sub, mul, add), each result rounded to bfloat16.

A phase of its own, between DEFAULT and the lowering: each rule's root is the
reader and looks back at its convolution, so the replacement sits where all
its inputs exist; in the lowering pack the convolution (earlier in the graph)
would be lowered first. Not in DEFAULT: folding changes a float32 result by
rounding (`(x * W) * s` is not `x * (W * s)` in float32), so it is only done
for convolutions the ttnn lowering takes; a convolution that stays on the
host is left alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.backends.ttnn.rules.checks import bind
from fx_rewrites.backends.ttnn.rules.constants import from_constants
from fx_rewrites.backends.ttnn.rules.conv import conv_problem
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

CONVS = (aten.conv1d.default, aten.conv2d.default, aten.convolution.default)
#: reader op -> how it folds: "scale" (weight and bias), "shift" (bias only)
AFFINE = {
    aten.mul.Tensor: "scale",
    aten.div.Tensor: "scale",
    aten.add.Tensor: "shift",
    aten.sub.Tensor: "shift",
}
#: ops whose constant operand may come first (conv on the right)
COMMUTATIVE = frozenset({aten.mul.Tensor, aten.add.Tensor})


def _conv_input(reader: Node, value: Any) -> Node | Miss:
    """`value` as a convolution this fold may rewrite: float32, read only by `reader`, lowered to the device
    (else folding would only change a host float32 result), its weight and bias computed from constants."""
    if not isinstance(value, Node) or value.target not in CONVS:
        return Miss("its input is not a convolution")
    if len(value.users) != 1:
        return Miss(f"the convolution {value.name} has {len(value.users)} readers; they need its unfolded result")
    val = value.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
        return Miss("the convolution's result is not float32 (the fold is computed in float32)")
    why = conv_problem(value)
    if why:
        return Miss(f"the convolution stays on the host ({why}); folding would only change its float32 result")
    bound = bind(value)
    if bound.get("transposed"):
        return Miss("a transposed convolution (its weight is [in, out, ...])")
    if not from_constants(bound["weight"]) or not (bound.get("bias") is None or from_constants(bound["bias"])):
        return Miss("the convolution's weight or bias is not computed from the program's constants")
    return value


def _constant_problem(value: Any, what: str) -> str | None:
    if value is None:
        return None
    val = fake_value(value)
    if not from_constants(value) or not isinstance(val, torch.Tensor):
        return f"{what} is not computed from the program's constants"
    if val.dtype != torch.float32:
        return f"{what} is {str(val.dtype).removeprefix('torch.')}, not float32"
    return None


def _batch_norm_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if args.get("training"):
        return Miss("training-mode batch norm (batch statistics)")
    if args.get("running_mean") is None or args.get("running_var") is None:
        return Miss("no running statistics")
    for name in ("weight", "bias", "running_mean", "running_var"):
        why = _constant_problem(args.get(name), name)
        if why:
            return Miss(why)
    conv = _conv_input(node, args["input"])
    return conv if isinstance(conv, Miss) else (conv, args)


@rule(
    roots=(aten.batch_norm.default,),
    name="ttnn_fold_batch_norm",
    when=_batch_norm_when,
    tags={"ttnn", "fold"},
    doc=(
        "conv(x, W, b) then eval batch_norm -> conv(x, W * s, (b - mean) * s + beta), s = gamma / sqrt(var + eps), "
        "W * s and the bias computed from the constants on the host in float32 (once): one device conv, one "
        "bfloat16 rounding."
    ),
)
def fold_batch_norm(node: Node, rw: Rewriter, *, found: tuple[Node, dict[str, Any]]) -> None:
    conv, bound = found
    scale = rw.call(aten.rsqrt.default, rw.call(aten.add.Tensor, bound["running_var"], float(bound.get("eps", 1e-5))))
    if bound.get("weight") is not None:
        scale = rw.call(aten.mul.Tensor, scale, bound["weight"])
    conv_bound = bind(conv)
    weight, bias, mean = conv_bound["weight"], conv_bound.get("bias"), bound["running_mean"]
    centered = rw.call(aten.sub.Tensor, bias, mean) if bias is not None else rw.call(aten.neg.default, mean)
    new_bias = rw.call(aten.mul.Tensor, centered, scale)
    if bound.get("bias") is not None:
        new_bias = rw.call(aten.add.Tensor, new_bias, bound["bias"])
    new_weight = rw.call(aten.mul.Tensor, weight, _per_out_channel(rw, scale, weight))
    rw.replace(node, _conv_with(rw, conv, conv_bound, new_weight, new_bias))


def _per_channel_problem(value: Any, conv: Node) -> str | None:
    """Why `value` is not a constant that is the same over everything but the output channel of `conv`."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return None if math.isfinite(value) else f"the other operand is {value}"
    why = _constant_problem(value, "the other operand")
    if why:
        return why
    out, shape = conv.meta["val"], list(value.meta["val"].shape)
    if len(shape) > out.dim():
        return f"the other operand has rank {len(shape)}, above the convolution's {out.dim()}"
    shape = [1] * (out.dim() - len(shape)) + shape
    channels = int(out.shape[1])
    if any(s != 1 for i, s in enumerate(shape) if i != 1) or shape[1] not in (1, channels):
        return f"the other operand's shape {list(value.meta['val'].shape)} is not per output channel ({channels})"
    return None


def _affine_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if args.get("alpha", 1) != 1:
        return Miss(f"alpha={args['alpha']}")
    first, other = args["self"], args["other"]
    conv = _conv_input(node, first)
    if isinstance(conv, Miss) and node.target in COMMUTATIVE:
        swapped = _conv_input(node, other)
        if not isinstance(swapped, Miss):
            conv, other = swapped, first
    if isinstance(conv, Miss):
        return conv
    why = _per_channel_problem(other, conv)
    if why:
        return Miss(why)
    if node.target is aten.div.Tensor and (isinstance(other, Node) or other == 0):
        # W / t folds only where t has no zero: conv / 0 is +-inf or nan per element, W / 0 mixes them
        return Miss("a division by a tensor (its values are not known when rules run) or by zero")
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.shape != conv.meta["val"].shape or out.dtype != torch.float32:
        return Miss("the result's shape or dtype differs from the convolution's")
    return conv, other


@rule(
    roots=tuple(AFFINE),
    name="ttnn_fold_affine",
    when=_affine_when,
    tags={"ttnn", "fold"},
    doc=(
        "conv(x, W, b) then * or / a per-output-channel constant -> conv(x, W * t, b * t); then + or - one -> "
        "conv(x, W, b + t) (the new weight and bias computed on the host in float32, once). Folds the "
        "sub/mul/add form of eval batch norm step by step."
    ),
)
def fold_affine(node: Node, rw: Rewriter, *, found: tuple[Node, Any]) -> None:
    conv, other = found
    bound = bind(conv)
    weight, bias = bound["weight"], bound.get("bias")
    op = aten.div.Tensor if node.target is aten.div.Tensor else node.target
    per_bias = other if not isinstance(other, Node) else rw.call(aten.view.default, other, [-1])
    if AFFINE[node.target] == "scale":
        new_weight = rw.call(op, weight, _per_out_channel(rw, other, weight))
        new_bias = None if bias is None else rw.call(op, bias, per_bias)
    else:
        new_weight = weight
        out_channels = int(conv.meta["val"].shape[1])
        base = bias if bias is not None else rw.call(aten.new_zeros.default, weight, [out_channels])
        new_bias = rw.call(op, base, per_bias)
    rw.replace(node, _conv_with(rw, conv, bound, new_weight, new_bias))


def _per_out_channel(rw: Rewriter, value: Any, weight: Node) -> Any:
    """A per-channel constant shaped to scale a conv weight `[out, in / groups, *kernel]` (a number as is)."""
    if not isinstance(value, Node):
        return value
    return rw.call(aten.view.default, value, [-1] + [1] * (weight.meta["val"].dim() - 1))


def _conv_with(rw: Rewriter, conv: Node, bound: dict[str, Any], weight: Any, bias: Any) -> Node:
    named = {**bound, "weight": weight, "bias": bias}
    args, kwargs = schema.unbind(conv.target, named, explicit=False)
    return rw.call(conv.target, *args, **kwargs)


RULES = RuleSet([fold_batch_norm, fold_affine], name="ttnn_fold")
