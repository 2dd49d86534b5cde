"""Convolutions as im2col + matmul in the graph, per convolution shape (issue 32).

- `columns`: the im2col matrix of an NCHW input (taken channels last, padded), [N OH OW, kh kw C], from one
  strided window per kernel tap. Shared by `conv_as_im2col_matmul` (float) and `quantized_conv.py` (int8 `_int_mm`).
- `pointwise_conv_as_matmul`: llvm-cpu, AVX-512 and AVX2. A 1x1 convolution, stride 1, over more than one position:
  the weight as [O, C] times the input as [N, C, H W], in place (no layout change).
- `conv_as_im2col_matmul`: llvm-cpu, AVX-512. A 2-D convolution of one group whose shape IREE 3.13 runs
  faster as a matmul than as its direct convolution (`im2col_wins`: a 1x1 the rule above leaves, strided or
  padded; a kxk one over at least `MIN_IM2COL_CHANNELS` input channels to at most `MAX_IM2COL_POSITIONS`
  output positions) becomes the im2col matrix times the weight as [O, kh kw C].

On AVX-512 the two replace IREE's global `--iree-global-opt-use-im2col-for-convs`, which turns every
convolution into im2col + matmul: with the mmt4d ukernel, IREE's direct convolution beats that below 256
input channels (3x3 64->64 on 56x56: 0.86x eager against 1.98x, the 7x7/2 stem 0.71 against 1.46) and loses
2-7x on the 1x1s and the wide kxk ones (1x1 1024->256 on 14x14: 7.1x eager against 1.21x; 3x3 256->256 on
14x14: 2.0 against 1.1). docs/performance.md, "im2col per convolution shape".
"""

from __future__ import annotations

import operator
import sys
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.iree.rules.conv_performance import _one_group_2d, _out_size
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten


# ----------------------------------------------------------------------------- the im2col matrix


def _strided(rw: Rewriter, x: Node, dim: int, tap: int, taps: int, dilation: int, stride: int) -> Node:
    """The positions of tap `tap` of `taps` along `dim`: from tap d to (padded size - (taps-1-tap) d), every
    s-th (static bounds, symbolic sizes welcome). A step is an `unfold` of windows of one, its trailing size-1
    dim kept: torch's meta guards on a symbolic size's parity for a stepped `slice` (`16*s < 32*((s + 1)//2)`)
    and for a `select` of that dim alike; the views after the copy take the trailing dims away."""
    start, cut = tap * dilation, (taps - 1 - tap) * dilation
    if start or cut:
        x = rw.call(aten.slice.Tensor, x, dim, start, -cut if cut else sys.maxsize)
    if stride == 1:
        return x
    return rw.call(aten.unfold.default, x, dim, 1, stride)


def windows(rw: Rewriter, x: Node, kernel: tuple[int, int], stride: list[int], dilation: list[int]) -> list[Node]:
    """Each kernel tap's window of `x` (NHWC, padded): x[:, i d : .. : s, j d : .. : s, :], [N, OH, OW, C] (and a
    trailing 1 per strided dim), taps in row-major order."""
    out = []
    for i in range(kernel[0]):
        rows = _strided(rw, x, 1, i, kernel[0], dilation[0], stride[0])
        out.extend(_strided(rw, rows, 2, j, kernel[1], dilation[1], stride[1]) for j in range(kernel[1]))
    return out


def product(rw: Rewriter, a: Any, b: Any) -> Any:
    """a * b, an int or a symbolic size's node (IREE needs a collapse's sizes spelled out, not -1)."""
    return a * b if isinstance(a, int) and isinstance(b, int) else rw.call(operator.mul, a, b)


def columns(
    rw: Rewriter,
    x: Node,
    kernel: tuple[int, int],
    stride: list[int],
    dilation: list[int],
    padding: list[int],
    pad_value: float | int = 0,
) -> tuple[Node, tuple[Any, Any, Any]]:
    """The im2col matrix of `x` (NCHW), [N OH OW, kh kw C] (tap-major, then channel: the weight as
    [O, kh, kw, C]), and the output's (N, OH, OW), ints or symbolic sizes' nodes. `x` is taken channels last and
    padded by `padding` (per spatial dim, both sides) with `pad_value`."""
    x = rw.call(aten.permute.default, x, [0, 2, 3, 1])
    if any(padding):
        pad_h, pad_w = padding
        x = rw.call(aten.constant_pad_nd.default, x, [0, 0, pad_w, pad_w, pad_h, pad_h], pad_value)
    taps = windows(rw, x, kernel, stride, dilation)
    first = taps[0]
    batch, rows_out, cols_out = rw.size(first, 0), rw.size(first, 1), rw.size(first, 2)
    reduction = kernel[0] * kernel[1] * fake_value(x).shape[3]
    positions = product(rw, product(rw, batch, rows_out), cols_out)
    if len(taps) == 1:  # a contiguous copy (a view of the strided window would guard on the sizes)
        stacked = rw.call(aten.clone.default, taps[0], memory_format=torch.contiguous_format)
    else:
        stacked = rw.call(aten.stack.default, taps, 3)
    # the taps and channels first (static), then the positions: IREE 3.13 fails to collapse both at once
    # ("'tensor.collapse_shape' op expected dimension 1 of collapsed type to be static")
    stacked = rw.call(aten.view.default, stacked, [batch, rows_out, cols_out, reduction])
    return rw.call(aten.view.default, stacked, [positions, reduction]), (batch, rows_out, cols_out)


# ----------------------------------------------------------------------------- float convolutions by shape

#: a kxk convolution goes through im2col from this many input channels, at ...
MIN_IM2COL_CHANNELS = 256
#: ... at most this many output positions (OH x OW): ResNet-50's 3x3s of layers 3 and 4 (256 channels on 14x14,
#: 512 on 7x7), not its 64- and 128-channel ones on 56x56 and 28x28, nor its 7x7 stem (3 channels)
MAX_IM2COL_POSITIONS = 14 * 14


#: a 1x1 convolution goes through a matmul from this many output positions: one position (squeeze-and-excitation's
#: 1x1s over a pooled map, EfficientNet's) stays IREE's convolution
MIN_POINTWISE_POSITIONS = 2


def im2col_wins(kernel: tuple[int, int], channels: int, positions: int) -> bool:
    """Whether IREE 3.13 (AVX-512, data tiling, mmt4d ukernel) runs a 2-D convolution of this kernel over
    `channels` input channels to `positions` output positions faster as im2col + matmul than directly."""
    if kernel == (1, 1):
        return positions >= MIN_POINTWISE_POSITIONS
    return channels >= MIN_IM2COL_CHANNELS and positions <= MAX_IM2COL_POSITIONS


def _im2col_conv(node: Node) -> dict[str, Any] | Miss:
    c = _one_group_2d(node)
    if isinstance(c, Miss):
        return c
    kernel = tuple(fake_value(c["weight"]).shape[2:])
    if kernel != (1, 1) and c["stride"] == list(kernel) and not any(c["padding"]) and c["dilation"] == [1, 1]:
        return Miss("a patch convolution (patch_conv_as_matmul)")
    channels, height, width = fake_value(c["input"]).shape[1:]
    rows = _out_size(height, kernel[0], c["stride"][0], c["padding"][0], c["dilation"][0])
    cols = _out_size(width, kernel[1], c["stride"][1], c["padding"][1], c["dilation"][1])
    if rows < 1 or cols < 1:
        return Miss("no output position")
    if not im2col_wins(kernel, channels, rows * cols):
        return Miss(
            f"a {kernel[0]}x{kernel[1]} kernel over {channels} channels to {rows}x{cols}: IREE's direct convolution "
            f"is faster (im2col from {MIN_IM2COL_CHANNELS} channels at most {MAX_IM2COL_POSITIONS} positions)"
        )
    return c


@rule(
    roots=(aten.conv2d.default, aten.convolution.default),
    when=_im2col_conv,
    tags={"iree", "performance", "convolution"},
    doc=(
        "A float 2-D convolution of one group, a 1x1 over more than one position or a kxk one over at least 256 "
        "input channels to at most 14x14 outputs, is im2col + matmul: the input channels last, padded, one "
        "strided window per kernel tap stacked to [N OH OW, kh kw C], times the weight as [O, kh kw C] (linear, "
        "with the bias), back to [N, O, OH, OW]. IREE 3.13 on llvm-cpu (AVX-512, mmt4d ukernel) runs those shapes "
        "2-7x faster as the data-tiled matmul than as its direct convolution (3x3 256->256 on 14x14: 2.0x eager "
        "-> 1.1x), and the others faster directly; this rule, not IREE's global im2col flag, picks per shape."
    ),
)
def conv_as_im2col_matmul(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    x, w = found["input"], found["weight"]
    out_channels, _, kh, kw = fake_value(w).shape
    matrix, (batch, rows, cols) = columns(rw, x, (kh, kw), found["stride"], found["dilation"], found["padding"], 0.0)
    weight = rw.call(aten.reshape.default, rw.call(aten.permute.default, w, [0, 2, 3, 1]), [out_channels, -1])
    y = rw.call(aten.linear.default, matrix, weight, found["bias"])
    y = rw.call(aten.view.default, y, [batch, rows, cols, out_channels])
    rw.replace(node, rw.call(aten.permute.default, y, [0, 3, 1, 2]))


def _pointwise(node: Node) -> dict[str, Any] | Miss:
    c = _im2col_conv(node)
    if isinstance(c, Miss):
        return c
    if tuple(fake_value(c["weight"]).shape[2:]) != (1, 1):
        return Miss("not a 1x1 kernel (conv_as_im2col_matmul)")
    if c["stride"] != [1, 1] or any(c["padding"]):
        return Miss(f"stride {c['stride']}, padding {c['padding']} (strided_pointwise_conv_as_slice first)")
    return c


@rule(
    roots=(aten.conv2d.default, aten.convolution.default),
    when=_pointwise,
    priority=1,  # before conv_as_im2col_matmul, which takes a 1x1 channels last
    tags={"iree", "performance", "convolution"},
    doc=(
        "A float 1x1 2-D convolution of one group, stride 1, no padding, is a matmul over the channels in place: "
        "the weight as [O, C] times the input as [N, C, H W], + the bias per row, viewed [N, O, H, W]; no layout "
        "change (conv_as_im2col_matmul's form permutes to channels last and back)."
    ),
)
def pointwise_conv_as_matmul(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    x, w = found["input"], found["weight"]
    out_channels, channels = fake_value(w).shape[:2]
    height, width = fake_value(x).shape[2:]
    rows = rw.call(aten.reshape.default, x, [-1, channels, height * width])
    y = rw.call(aten.matmul.default, rw.call(aten.reshape.default, w, [out_channels, channels]), rows)
    if found["bias"] is not None:
        y = rw.call(aten.add.Tensor, y, rw.call(aten.reshape.default, found["bias"], [out_channels, 1]))
    rw.replace(node, rw.call(aten.reshape.default, y, [-1, out_channels, height, width]))


#: the rules of this module (performance.ALL; on for an ISA: targets.CPU_ISAS)
RULES = (pointwise_conv_as_matmul, conv_as_im2col_matmul)
