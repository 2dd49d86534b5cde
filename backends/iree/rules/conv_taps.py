"""A 3x3 convolution as nine products summed, one per kernel tap, with no im2col matrix (issue 32; llvm-cpu, AVX2).

    conv2d(x, w, b, padding=1)   # x [N, C, H, W], w [O, C, 3, 3]
    -> sum over taps (i, j) of  w[:, :, i, j] @ pad(x)[:, :, i : i + OH, j : j + OW].reshape(N, C, OH OW)
       + b[:, None], viewed [N, O, OH, OW]

On AVX2 the route takes IREE's global im2col flag: each 3x3 becomes an im2col matrix, packed into 8-pixel tiles
for the data-tiled product. That pack gathers one float at a time (`vector_common_parallel = [1, 1, 1, 1, 1]`) and
on ResNet-50's 3x3 64->64 over 56x56 costs more than the product (docs/iree-3.13-findings.md, "The float32 matmul
on a real AVX2 CPU"). Here each tap is a 1x1 product of the padded input's shifted window in place (channels
first, as `pointwise_conv_as_matmul` writes the 1x1s): the window's pack reads rows of consecutive pixels, and the
nine products are summed. The weight's taps are sliced from the weight laid out [kh, kw, O, C].
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export.graph_signature import InputKind
from torch.fx import Node

from fx_rewrites.backends.iree.rules.conv_performance import _one_group_2d, _out_size
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule
from fx_rewrites.program import input_spec

aten = torch.ops.aten
#: placeholders a program feeds from its own state (IREE folds the taps' slices and packs of those at compile time)
_STATE = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)

#: the kernels the rule takes: measured on ResNet-50's 3x3s (docs/performance.md, "3x3 convolutions as tap products")
KERNELS = ((3, 3),)
#: ... over at least this many input and output channels: the measured shapes had 64 to 512 (ResNet-50's); a grouped
#: convolution's per-group convolutions (`grouped_conv_as_convs`: 4 to 32 channels in ResNeXt-50) stay IREE's
MIN_TAP_CHANNELS = 64


def constant_weight(weight: Any) -> bool:
    """`weight` is the program's own (a parameter, buffer or lifted constant placeholder of an ExportedProgram) or
    a graph's attribute (`get_attr`), not a value passed in at every call. torch.compile's route hands the rules a
    graph whose weights are plain placeholders, frozen or not: it does not take the rule."""
    if not isinstance(weight, Node):
        return False
    if weight.op == "get_attr":
        return True
    spec = input_spec(weight) if weight.op == "placeholder" else None
    return spec is not None and spec.kind in _STATE


def _tap_conv(node: Node) -> dict[str, Any] | Miss:
    c = _one_group_2d(node)
    if isinstance(c, Miss):
        return c
    if not constant_weight(c["weight"]):
        return Miss("the weight is not the program's own: its nine taps would be sliced and packed at every call")
    kernel = tuple(fake_value(c["weight"]).shape[2:])
    if kernel not in KERNELS:
        return Miss(f"a {kernel[0]}x{kernel[1]} kernel (taps for {', '.join(f'{h}x{w}' for h, w in KERNELS)})")
    out_channels, channels = fake_value(c["weight"]).shape[:2]
    if min(out_channels, channels) < MIN_TAP_CHANNELS:
        return Miss(f"{channels} -> {out_channels} channels (taps from {MIN_TAP_CHANNELS} each)")
    if c["stride"] != [1, 1] or c["dilation"] != [1, 1]:
        return Miss(f"stride {c['stride']}, dilation {c['dilation']} (stride and dilation 1 only)")
    height, width = fake_value(c["input"]).shape[2:]
    rows = _out_size(height, kernel[0], 1, c["padding"][0], 1)
    cols = _out_size(width, kernel[1], 1, c["padding"][1], 1)
    if rows < 1 or cols < 1:
        return Miss("no output position")
    c["out"] = (rows, cols)
    return c


@rule(
    roots=(aten.conv2d.default, aten.convolution.default),
    when=_tap_conv,
    priority=1,  # before conv_as_im2col_matmul where both are on
    tags={"iree", "performance", "convolution"},
    doc=(
        "A float 3x3 2-D convolution of one group, stride 1, no dilation, is nine 1x1 products summed: for each "
        "kernel tap (i, j) the weight's [O, C] slice times the padded input's window shifted by (i, j), as "
        "[N, C, OH OW] (channels first, in place), plus the bias per row, viewed [N, O, OH, OW]. On AVX2 IREE 3.13's "
        "im2col of a 3x3 packs its patches into 8-pixel tiles one float at a time; the windows pack by rows."
    ),
)
def conv_as_tap_matmuls(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    x, w = found["input"], found["weight"]
    out_channels, channels, kh, kw = fake_value(w).shape
    rows, cols = found["out"]
    pad_h, pad_w = found["padding"]
    if pad_h or pad_w:
        x = rw.call(aten.constant_pad_nd.default, x, [pad_w, pad_w, pad_h, pad_h], 0.0)
    # the taps leading, [kh, kw, O, C]: one copy, then each tap's [O, C] is contiguous (a weight passed as an input,
    # as torch.compile's route without freezing does, is sliced at every call; a constant one at compile time)
    taps = rw.call(aten.permute.default, w, [2, 3, 0, 1])
    total = None
    for i in range(kh):
        for j in range(kw):
            window = rw.call(aten.slice.Tensor, rw.call(aten.slice.Tensor, x, 2, i, i + rows), 3, j, j + cols)
            window = rw.call(aten.reshape.default, window, [-1, channels, rows * cols])
            tap = rw.call(aten.select.int, rw.call(aten.select.int, taps, 0, i), 0, j)
            y = rw.call(aten.matmul.default, tap, window)
            total = y if total is None else rw.call(aten.add.Tensor, total, y)
    if found["bias"] is not None:
        total = rw.call(aten.add.Tensor, total, rw.call(aten.reshape.default, found["bias"], [out_channels, 1]))
    rw.replace(node, rw.call(aten.reshape.default, total, [-1, out_channels, rows, cols]))


#: the rules of this module (performance.ALL; on for an ISA: targets.CPU_ISAS)
RULES = (conv_as_tap_matmuls,)
