"""1x1 convolutions through the hand-written pointwise convolution dispatch (issue 32; llvm-cpu).

    conv2d(x, w, b)   # x [N, C, H, W] static, w [O, C, 1, 1], stride 1, no padding, one group
    -> pointwise_conv2d(x, w.reshape(O, C), b or zeros(O), lanes)

`pointwise_conv_as_dispatch` writes AVX2's block (8 lanes), `pointwise_conv_as_dispatch_avx512` AVX-512's (16;
`pointwise_conv_dispatch.BLOCKS`). Before `pointwise_conv_as_matmul` (the 1x1 as IREE's data-tiled product over
the channels in place, which packs x and unpacks y on every call). A strided 1x1 is sliced to stride 1 first
(`strided_pointwise_conv_as_slice`).

`batch_norm_into_pointwise_conv` folds an inference batch norm after the call (or after a `tap_conv2d`,
rules/tap_conv_dispatch.py) into its weight and bias, and `relu_into_pointwise_conv` puts a ReLU after it into the
kernel's last store: alone, the dispatch gained nothing on ResNet-50 (IREE fuses the batch norm and ReLU after a 1x1
into its own product); with both, on AVX-512 ResNet-50 read 1.12 -> 1.02x eager and MobileNetV2, ResNeXt-50,
EfficientNet-B0, MobileNetV3-L gained 7-14% (docs/performance.md, "A 1x1 convolution dispatch of our own"). Maps of
fewer than `MIN_PIXELS` pixels keep IREE's product. On for both ISAs (`targets.py`), AVX2's with the kxk dispatch
(docs/performance.md, "A kxk convolution dispatch of our own").
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.iree.pointwise_conv_dispatch import POINTWISE_CONV2D
from fx_rewrites.backends.iree.rules.conv_performance import _CONVS, dispatchable_2d
from fx_rewrites.backends.iree.rules.conv_taps import constant_weight
from fx_rewrites.backends.iree.tap_conv_dispatch import TAP_CONV2D
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten

#: the fewest pixels a map has for the dispatch: ResNet-50's 1x1s (+ batch norm + ReLU) over 14x14 ran 0.90-0.92 of
#: IREE's product with it, over 7x7 1.03-1.07 (2048->512) and 1.24-1.25 (the strided 1024->2048), on both ISAs
#: (docs/performance.md "A kxk convolution dispatch of our own"). With AVX-512's 4 x 6 block the 7x7s alone ran
#: 0.83-0.89 of IREE's product, but ResNet-50 and ResNeXt-50 1.025x and 1.04x slower with them taken
#: (docs/performance.md "A call's inputs read where they lie"): the threshold stays
MIN_PIXELS = 196


def _pointwise(node: Node) -> dict[str, Any] | Miss:
    """A static float32 1x1 convolution of one group at stride 1 with no padding, at least `MIN_PIXELS` pixels."""
    c = dispatchable_2d(node)
    if isinstance(c, Miss):
        return c
    x, w = fake_value(c["input"]), fake_value(c["weight"])
    if tuple(w.shape[2:]) != (1, 1) or c["groups"] != 1:
        return Miss(f"a {tuple(w.shape[2:])} kernel in {c['groups']} groups: the kernel is a 1x1 of one group")
    if c["stride"] != [1, 1] or any(c["padding"]) or c["dilation"] != [1, 1]:
        return Miss(f"stride {c['stride']}, padding {c['padding']} (strided_pointwise_conv_as_slice first)")
    if x.shape[2] * x.shape[3] < MIN_PIXELS:
        return Miss(f"{x.shape[2]}x{x.shape[3]} pixels: fewer than {MIN_PIXELS} (IREE's product is faster there)")
    return c


def _write(node: Node, rw: Rewriter, found: dict[str, Any], lanes: int) -> None:
    w = fake_value(found["weight"])
    weight = rw.call(aten.reshape.default, found["weight"], list(w.shape[:2]))
    bias = found["bias"]
    if bias is None:
        bias = rw.call(aten.zeros.default, [w.shape[0]], dtype=torch.float32, device=w.device)
    rw.replace(node, rw.call(POINTWISE_CONV2D, found["input"], weight, bias, lanes, 0))


_DOC = (
    "A float32 1x1 2-D convolution of one group at stride 1, no padding, static sizes, becomes the hand-written "
    "pointwise convolution dispatch (`fx_rewrites::pointwise_conv2d`): the input's rows of pixels read in place "
    "as vectors, {block} output channels x pixels in registers, the bias added at the store; IREE 3.13's "
    "data-tiled product packs the input and unpacks the output on every call."
)


@rule(
    roots=_CONVS,
    when=_pointwise,
    priority=2,  # before pointwise_conv_as_matmul
    tags={"iree", "performance", "convolution"},
    doc=_DOC.format(block="AVX2's 4 x 24"),
)
def pointwise_conv_as_dispatch(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    _write(node, rw, found, 8)


@rule(
    roots=_CONVS,
    when=_pointwise,
    priority=2,  # before pointwise_conv_as_matmul
    tags={"iree", "performance", "convolution"},
    doc=_DOC.format(block="AVX-512's 4 x 96"),
)
def pointwise_conv_as_dispatch_avx512(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    _write(node, rw, found, 16)


def _constant(node: Any) -> bool:
    """`node` is the program's own value (`constant_weight`), or a reshape or zeros of such (what `_write` passes)."""
    if node is None or constant_weight(node):
        return True
    if not isinstance(node, Node) or node.op != "call_function":
        return False
    if node.target is aten.zeros.default:
        return True
    return node.target is aten.reshape.default and constant_weight(node.args[0])


#: the convolution dispatches a batch norm and a ReLU fold into: the position of the call's `relu` argument
_RELU_ARGUMENT = {POINTWISE_CONV2D: 4, TAP_CONV2D: 7}


def _sole_input_call(node: Node) -> Node | Miss:
    """`node`'s input, a `pointwise_conv2d` or `tap_conv2d` without its ReLU used by `node` alone, or why not."""
    conv = node.args[0]
    if not isinstance(conv, Node) or conv.target not in _RELU_ARGUMENT:
        return Miss("not after a pointwise_conv2d or tap_conv2d")
    if len(conv.users) != 1:
        return Miss(f"the {conv.target.name()} has {len(conv.users)} users")
    if conv.args[_RELU_ARGUMENT[conv.target]]:
        return Miss(f"after the {conv.target.name()}'s ReLU")
    return conv


def _folded_norm(node: Node, *, args: dict[str, Any]) -> Node | Miss:
    """An inference batch norm of a `pointwise_conv2d` or `tap_conv2d` whose weight, bias and statistics are the
    program's own."""
    if args["training"]:
        return Miss("a training batch norm (its batch statistics)")
    conv = _sole_input_call(node)
    if isinstance(conv, Miss):
        return conv
    if args["running_mean"] is None or args["running_var"] is None:
        return Miss("no running statistics (the batch's own are used)")
    names = ("weight", "bias", "running_mean", "running_var")
    if not all(_constant(v) for v in (*conv.args[1:3], *(args[k] for k in names))):
        return Miss("a weight, bias or statistic that is not the program's own: it would be folded at every call")
    return conv


@rule(
    roots=(aten.batch_norm.default,),
    when=_folded_norm,
    tags={"iree", "performance", "convolution"},
    doc=(
        "An inference batch norm after a `pointwise_conv2d` or `tap_conv2d` is folded into its weight and bias "
        "(scale = gamma / sqrt(var + eps): w scale, (b - mean) scale + beta; the program's own values, evaluated "
        "once by IREE): IREE fuses a batch norm into its own product, "
        "which the dispatch would leave as a pass of its own."
    ),
)
def batch_norm_into_pointwise_conv(node: Node, rw: Rewriter, *, args: dict[str, Any], found: Node) -> Any:
    x, w, b, *rest = found.args
    inverse = rw.call(aten.rsqrt.default, rw.call(aten.add.Tensor, args["running_var"], args["eps"]))
    scale = inverse if args["weight"] is None else rw.call(aten.mul.Tensor, args["weight"], inverse)
    per_output = [-1] + [1] * (fake_value(w).dim() - 1)
    weight = rw.call(aten.mul.Tensor, w, rw.call(aten.reshape.default, scale, per_output))
    bias = rw.call(aten.mul.Tensor, rw.call(aten.sub.Tensor, b, args["running_mean"]), scale)
    if args["bias"] is not None:
        bias = rw.call(aten.add.Tensor, bias, args["bias"])
    rw.replace(node, rw.call(found.target, x, weight, bias, *rest))


@rule(
    roots=(aten.relu.default,),
    when=lambda node: _sole_input_call(node),
    tags={"iree", "performance", "convolution"},
    doc=(
        "A ReLU of a `pointwise_conv2d` or `tap_conv2d` is done in the dispatch's last store (`relu` 1): IREE fuses "
        "a ReLU into its own product, which the dispatch would leave as a pass of its own."
    ),
)
def relu_into_pointwise_conv(node: Node, rw: Rewriter, *, found: Node) -> Any:
    relu = _RELU_ARGUMENT[found.target]
    rw.replace(node, rw.call(found.target, *found.args[:relu], 1))


#: the rules of this module (performance.ALL; on for an ISA: targets.CPU_ISAS)
RULES = (
    pointwise_conv_as_dispatch,
    pointwise_conv_as_dispatch_avx512,
    batch_norm_into_pointwise_conv,
    relu_into_pointwise_conv,
)
