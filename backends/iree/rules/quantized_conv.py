"""PT2E int8 convolutions as integer matmuls: im2col of the 8-bit activation and `aten._int_mm` (issue 33).

A model quantized by PT2E (torchao's `prepare_pt2e` / `convert_pt2e`, X86 quantizer) exports each conv as
`conv2d(dequantize_per_tensor(x_q), dequantize_per_channel(w_q))`: uint8 activations per tensor with a zero
point, int8 weights per channel. IREE 3.13 runs that as a float32 convolution of the dequantized operands
(1.24x float eager's time for ResNet-18 on AVX-512, 1.51x on AVX2). The same sum in integers is one int8 x int8
-> int32 matmul, which IREE data-tiles onto its s8s8s32 microkernel: 1.8-2.5x faster per ResNet-18 3x3 conv
(`benchmarks/pt2e_conv_forms.py`).

With x' = x_q - shift in int8 (shift 128 for uint8, 0 for int8), padded with z_a - shift (a padded value is
the zero point, 0 once dequantized), e = shift - z_a, and K = C kh kw, the conv's sum per output
channel c and output position m is, exactly in int32:

    sum_k (x_q - z_a)(w_q - z_w[c]) = _int_mm(cols(x'), W)[m, c] + e S_w[c] - z_w[c] (R[m] + e K)

(S_w: the sum of channel c's weights; R: the row sum of the im2col matrix), then times s_a s_w[c] in float32,
plus the bias. X86's weights are symmetric (z_w = 0); the zero points are program buffers whose values a rule
does not see, so the z_w term is always written (one row sum of the int8 columns). The integers are exact; the
float result differs from torch's float32 conv of the dequantized operands only by float32 rounding (torch sums
K float products, this rounds once).

The dequantizes are matched as PT2E's ops or as the ATen torch's own kernels lower them to
(`lower_quantized_decomposed_ops`, which the first phase runs on them before the conv is visited).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch.fx import Node

from fx_rewrites.backends.iree.rules import im2col
from fx_rewrites.backends.iree.rules.conv import _conv_args
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_tensor
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten
_quantized_decomposed = torch.ops.quantized_decomposed

#: the largest reduction whose int32 sums cannot overflow: K x 256 x 256 < 2^31
MAX_REDUCTION = (2**31 - 1) // (256 * 256)


@attrs.frozen
class QuantizedConv:
    """What `_quantized_conv` found: the 8-bit activation and its literal scale / zero point, the int8 weight
    [O, C, kh, kw] and its per-channel scale and zero point nodes [O], and the conv's geometry."""

    activation: Node
    scale: float
    zero: int
    weight: Node
    weight_scale: Node
    weight_zero: Node
    bias: Node | None
    stride: list[int]
    padding: list[int]
    dilation: list[int]


def _through_no_ops(node: Any) -> Any:
    """`node` past identity permutes and conversions to its own dtype (what the lowered dequantizes hold)."""
    while isinstance(node, Node):
        if (node.target is aten.permute.default and list(node.args[1]) == list(range(len(node.args[1])))) or (
            node.target is aten._to_copy.default
            and set(node.kwargs) <= {"dtype"}
            and fake_tensor(node.args[0]) is not None
            and fake_tensor(node.args[0]).dtype == fake_tensor(node).dtype
        ):
            node = node.args[0]
        else:
            return node
    return node


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _per_tensor(node: Any) -> tuple[Node, float, int] | Miss:
    """(x_q, scale, zero point) of a per-tensor dequantize with literal parameters, as PT2E's op or lowered:
    `mul(sub(_to_copy(x_q, float32), zero), scale)`; x_q uint8 or int8."""
    if not isinstance(node, Node):
        return Miss("the input is not a node")
    if node.target is _quantized_decomposed.dequantize_per_tensor.default:
        q, scale, zero = node.args[:3]
        out_dtype = node.kwargs.get("out_dtype")
        if out_dtype not in (None, torch.float32):
            return Miss(f"the input's dequantize gives {out_dtype}")
    elif node.target is aten.mul.Tensor and isinstance(node.args[0], Node):
        sub, scale = node.args[:2]
        if not (sub.target is aten.sub.Tensor and len(sub.args) == 2 and not sub.kwargs):
            return Miss("the input is not a dequantize (mul(sub(...), scale))")
        converted, zero = sub.args
        if not (isinstance(converted, Node) and converted.target is aten._to_copy.default):
            return Miss("the input is not a dequantize (no conversion of the quantized values)")
        if set(converted.kwargs) - {"dtype"} or converted.kwargs.get("dtype") is not torch.float32:
            return Miss("the dequantize's conversion is not a plain conversion to float32")
        q = converted.args[0]
    else:
        return Miss(f"the input is {node.target}, not a per-tensor dequantize")
    value = fake_tensor(q)
    if value is None or value.dtype not in (torch.uint8, torch.int8):
        return Miss(f"the dequantized input is {getattr(value, 'dtype', None)}, not uint8 or int8")
    if not (_number(scale) and isinstance(zero, int) and not isinstance(zero, bool)):
        return Miss("the activation's scale and zero point are not literals")
    return q, float(scale), zero


def _channel_vector(node: Any, channels: int) -> Node | None:
    """The [O] node under a `view`/`reshape` to [O, 1, 1, 1] (or the [O] node itself when unviewed)."""
    if isinstance(node, Node) and node.target in (aten.view.default, aten.reshape.default):
        node = node.args[0]
    value = fake_tensor(node)
    return node if value is not None and tuple(value.shape) == (channels,) else None


def _per_channel(node: Any) -> tuple[Node, Node, Node] | Miss:
    """(w_q, scales, zero points) of a per-channel dequantize of an int8 4-D weight along dim 0, as PT2E's op
    or lowered: `mul(sub(w_q, view(zero, [O,1,1,1])), view(scale, [O,1,1,1]))`, identity permutes around."""
    node = _through_no_ops(node)
    if not isinstance(node, Node):
        return Miss("the weight is not a node")
    if node.target is _quantized_decomposed.dequantize_per_channel.default:
        w, scale, zero, axis = node.args[:4]
        if axis != 0 or node.kwargs.get("out_dtype") not in (None, torch.float32):
            return Miss(f"the weight's dequantize is along dim {axis} (or not to float32), not 0")
    elif node.target is aten.mul.Tensor and isinstance(node.args[0], Node):
        sub, scale = node.args[:2]
        if not (sub.target is aten.sub.Tensor and len(sub.args) == 2 and not sub.kwargs):
            return Miss("the weight is not a dequantize (mul(sub(...), scale))")
        w, zero = _through_no_ops(sub.args[0]), sub.args[1]
    else:
        return Miss(f"the weight is {node.target}, not a per-channel dequantize")
    value = fake_tensor(w)
    if value is None or value.dtype != torch.int8 or value.dim() != 4:
        return Miss(f"the dequantized weight is {getattr(value, 'dtype', None)}, not a 4-D int8 tensor")
    if not all(isinstance(s, int) for s in value.shape):
        return Miss("the weight has symbolic sizes")
    scale, zero = _channel_vector(scale, value.shape[0]), _channel_vector(zero, value.shape[0])
    if scale is None or zero is None:
        return Miss("the weight's scale or zero point is not one value per output channel")
    if fake_tensor(scale).dtype != torch.float32 or fake_tensor(zero).dtype.is_floating_point:
        return Miss("the weight's scale is not float32 or its zero point not an integer")
    return w, scale, zero


def _quantized_conv(node: Node) -> QuantizedConv | Miss:
    named = _conv_args(node)
    if isinstance(named, Miss):
        return named
    out = fake_tensor(node)
    if named["n"] != 2 or named.get("groups", 1) != 1 or out is None or out.dtype != torch.float32:
        return Miss("not a float32 2-D convolution of one group")
    if not all(isinstance(v, int) for v in (*named["padding"], *named["stride"], *named["dilation"])):
        return Miss("symbolic padding, stride or dilation")
    activation = _per_tensor(named["input"])
    if isinstance(activation, Miss):
        return activation
    weight = _per_channel(named["weight"])
    if isinstance(weight, Miss):
        return weight
    reduction = fake_tensor(weight[0]).shape[1:].numel()
    if reduction > MAX_REDUCTION:
        return Miss(f"a reduction of {reduction} > {MAX_REDUCTION} could overflow int32")
    bias = named.get("bias")
    if bias is not None and (fake_tensor(bias) is None or fake_tensor(bias).dtype != torch.float32):
        return Miss("the bias is not a float32 tensor")
    return QuantizedConv(
        *activation, *weight, bias, stride=named["stride"], padding=named["padding"], dilation=named["dilation"]
    )


@rule(
    roots=(aten.conv2d.default, aten.conv2d.padding, aten.convolution.default),
    when=_quantized_conv,
    priority=10,
    tags={"iree", "quantized"},
    doc=(
        "A PT2E int8 conv (`conv2d(dequantize_per_tensor(x_q), dequantize_per_channel(w_q))`, uint8 or int8 "
        "activations, int8 weights) becomes im2col of the 8-bit activation (padded with its zero point), "
        "`aten._int_mm` (i8 x i8 -> i32, IREE's s8s8s32 microkernel) and the zero points' sums, times the "
        "scales in float32. IREE 3.13 runs the float conv of the dequantized operands 1.8-2.5x slower."
    ),
)
def quantized_conv_as_int_mm_for_iree(node: Node, rw: Rewriter, *, found: QuantizedConv) -> None:
    conv = found
    w = fake_tensor(conv.weight)
    channels_out, channels, *kernel = w.shape
    reduction = channels * kernel[0] * kernel[1]
    shift = 128 if fake_tensor(conv.activation).dtype == torch.uint8 else 0
    x = conv.activation
    if shift:  # uint8 -> int8, x - 128
        wide = rw.call(aten.sub.Tensor, rw.call(aten._to_copy.default, x, dtype=torch.int32), shift)
        x = rw.call(aten._to_copy.default, wide, dtype=torch.int8)
    # padded with the zero point: 0 once dequantized
    columns, (batch, rows_out, cols_out) = im2col.columns(
        rw, x, (kernel[0], kernel[1]), conv.stride, conv.dilation, conv.padding, conv.zero - shift
    )
    weights = rw.call(aten.reshape.default, rw.call(aten.permute.default, conv.weight, [2, 3, 1, 0]), [reduction, -1])
    acc = rw.call(aten._int_mm.default, columns, weights)
    excess = shift - conv.zero  # x_q - z_a = x' + excess
    weight_zero = rw.call(aten._to_copy.default, conv.weight_zero, dtype=torch.int32)
    row_sums = rw.call(aten.sum.dim_IntList, columns, [1], True, dtype=torch.int32)
    if excess:
        weight_sums = rw.call(aten.sum.dim_IntList, conv.weight, [1, 2, 3], dtype=torch.int32)
        acc = rw.call(aten.add.Tensor, acc, rw.call(aten.mul.Tensor, weight_sums, excess))
        row_sums = rw.call(aten.add.Tensor, row_sums, excess * reduction)
    acc = rw.call(aten.sub.Tensor, acc, rw.call(aten.mul.Tensor, row_sums, weight_zero))
    scales = rw.call(aten.mul.Tensor, conv.weight_scale, conv.scale)
    out = rw.call(aten.mul.Tensor, rw.call(aten._to_copy.default, acc, dtype=torch.float32), scales)
    if conv.bias is not None:
        out = rw.call(aten.add.Tensor, out, conv.bias)
    out = rw.call(aten.view.default, out, [batch, rows_out, cols_out, channels_out])
    rw.replace(node, rw.call(aten.permute.default, out, [0, 3, 1, 2]))


RULES = RuleSet([quantized_conv_as_int_mm_for_iree], name="iree-quantized-conv")
