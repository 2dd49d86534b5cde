"""Depthwise and grouped convolutions through the hand-written grouped convolution dispatch (issue 32; llvm-cpu).

    conv2d(x, w, b, stride=s, padding=p, groups=G)   # x [N, C, H, W], w [O, C/G, kh, kw], stride 1 or 2
    -> grouped_conv2d(x, w, ph, pw, sh, sw) + b[:, None, None]

- `depthwise_conv_as_dispatch`: G = C = O. IREE 3.13's own depthwise convolution runs 4.4-10.6x eager (7x7 on 96
  channels, 56x56: 10x); the graph forms `depthwise_conv_as_taps` (3x3) and `depthwise_conv_as_row_partials` (5x5,
  7x7, stride 1) brought it to 1.2-1.9x and keep what this rule declines.
- `grouped_conv_as_dispatch`: 1 < G < C, a kxk kernel (not 1x1), at most `MAX_GROUP_CHANNELS` input channels a
  group (ResNeXt's),
  before `grouped_conv_as_convs` (one IREE convolution a group, concatenated: 1.1-2.6x eager).
- `conv_as_direct_dispatch`: G = 1, a kxk kernel (k >= 3), stride 1. On for no ISA: faster than IREE on AVX2's single
  3x3 (1.63 -> 1.31x eager), slower on AVX-512's (1.26 -> 1.41) and on ResNet-50 (AVX2 1.05 -> 1.08); kept for
  `--also-without +conv_as_direct_dispatch` (docs/performance.md, "A depthwise and grouped convolution dispatch").

`grouped_conv_dispatch.py`'s kernel keeps a block of output rows in registers and reads each input row once per
block and input channel. Static sizes, float32, no dilation, an output at least 8 wide and an input 8 strides wide
(the kernel's vectors).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.iree.grouped_conv_dispatch import GROUPED_CONV2D, LANES
from fx_rewrites.backends.iree.rules.conv_performance import _CONVS, _out_size, dispatchable_2d, is_depthwise
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten
#: the largest stride taken (a stride-2 row of 8 outputs is one load of 16 input columns and a shuffle)
MAX_STRIDE = 2
#: the smallest kernel `conv_as_direct_dispatch` takes
MIN_DIRECT_KERNEL = 3
#: the most input channels a group `grouped_conv_as_dispatch` takes (each output sums them all from registers'
#: worth of rows: a wide group is a matmul's work, better done by a product)
MAX_GROUP_CHANNELS = 32


def _dispatchable(node: Node) -> dict[str, Any] | Miss:
    """A static float32 2-D convolution the kernel can run, or why not."""
    c = dispatchable_2d(node)
    if isinstance(c, Miss):
        return c
    x, w = fake_value(c["input"]), fake_value(c["weight"])
    if max(c["stride"]) > MAX_STRIDE or c["dilation"] != [1, 1]:
        return Miss(f"stride {c['stride']}, dilation {c['dilation']}: the kernel's strides 1 and 2, no dilation")
    kh, kw = w.shape[2:]
    (height, width), (sh, sw), (ph, pw) = x.shape[2:], c["stride"], c["padding"]
    rows, cols = _out_size(height, kh, sh, ph, 1), _out_size(width, kw, sw, pw, 1)
    if rows < 1 or cols < LANES or width < LANES * sw:
        return Miss(f"an output {rows}x{cols} from {height}x{width}: at least {LANES} wide, the input {LANES} strides")
    return c


def _depthwise(node: Node) -> dict[str, Any] | Miss:
    c = _dispatchable(node)
    if isinstance(c, Miss):
        return c
    if not is_depthwise(c):
        channels, outs = fake_value(c["input"]).shape[1], fake_value(c["weight"]).shape[0]
        return Miss(f"groups={c['groups']}, {channels} -> {outs} channels: not depthwise (grouped_conv_as_dispatch)")
    return c


def _grouped(node: Node) -> dict[str, Any] | Miss:
    c = _dispatchable(node)
    if isinstance(c, Miss):
        return c
    if c["groups"] == 1:
        return Miss("one group (conv_as_direct_dispatch)")
    per_group, kernel = fake_value(c["weight"]).shape[1], tuple(fake_value(c["weight"]).shape[2:])
    if kernel == (1, 1):
        return Miss("a 1x1 grouped convolution: not measured (the kernel's rows serve a kernel's rows)")
    if per_group == 1:
        return Miss("one input channel a group (depthwise_conv_as_dispatch)")
    if per_group > MAX_GROUP_CHANNELS:
        return Miss(f"{per_group} input channels a group (at most {MAX_GROUP_CHANNELS})")
    return c


def _direct(node: Node) -> dict[str, Any] | Miss:
    c = _dispatchable(node)
    if isinstance(c, Miss):
        return c
    if c["groups"] != 1:
        return Miss(f"groups={c['groups']} (grouped_conv_as_dispatch)")
    if c["stride"] != [1, 1]:
        return Miss(f"stride {c['stride']}: a strided one ran 1.6-2.6x slower than IREE's (conv_classes.py's 3x3/2)")
    kernel = tuple(fake_value(c["weight"]).shape[2:])
    if min(kernel) < MIN_DIRECT_KERNEL:
        return Miss(
            f"a {kernel[0]}x{kernel[1]} kernel (from {MIN_DIRECT_KERNEL}x{MIN_DIRECT_KERNEL}: 1x1s are products)"
        )
    return c


def _write(node: Node, rw: Rewriter, found: dict[str, Any]) -> None:
    (ph, pw), (sh, sw) = found["padding"], found["stride"]
    y = rw.call(GROUPED_CONV2D, found["input"], found["weight"], ph, pw, sh, sw)
    if found["bias"] is not None:
        outs = fake_value(found["weight"]).shape[0]
        y = rw.call(aten.add.Tensor, y, rw.call(aten.reshape.default, found["bias"], [outs, 1, 1]))
    rw.replace(node, y)


@rule(
    roots=_CONVS,
    when=_depthwise,
    priority=1,  # before depthwise_conv_as_taps and depthwise_conv_as_row_partials
    tags={"iree", "performance", "convolution"},
    doc=(
        "A float32 depthwise 2-D convolution at stride 1 or 2 (no dilation, static sizes, 8 outputs wide) "
        "becomes the hand-written grouped convolution dispatch (`fx_rewrites::grouped_conv2d`), the padding read "
        "in the kernel, the bias added after: IREE 3.13's own depthwise convolution runs 4.4-10.6x eager."
    ),
)
def depthwise_conv_as_dispatch(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    _write(node, rw, found)


@rule(
    roots=_CONVS,
    when=_grouped,
    priority=1,  # before grouped_conv_as_convs
    tags={"iree", "performance", "convolution"},
    doc=(
        "A float32 grouped kxk 2-D convolution (not 1x1) of 2 to 32 input channels a group at stride 1 or 2 (no "
        "dilation, static sizes, 8 outputs wide) becomes the hand-written grouped convolution dispatch "
        "(`fx_rewrites::grouped_conv2d`), the bias added after: IREE 3.13 runs it as one convolution a group."
    ),
)
def grouped_conv_as_dispatch(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    _write(node, rw, found)


@rule(
    roots=_CONVS,
    when=_direct,
    priority=2,  # before conv_as_tap_matmuls
    tags={"iree", "performance", "convolution"},
    doc=(
        "A float32 2-D convolution of one group with a kernel of at least 3x3 at stride 1 (no dilation, static "
        "sizes, 8 outputs wide) becomes the hand-written convolution dispatch (`fx_rewrites::grouped_conv2d`, one "
        "group), its rows of outputs summed over every input channel in registers, the bias added after."
    ),
)
def conv_as_direct_dispatch(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    _write(node, rw, found)


#: the rules of this module (performance.ALL; on for an ISA: targets.CPU_ISAS)
RULES = (depthwise_conv_as_dispatch, grouped_conv_as_dispatch, conv_as_direct_dispatch)
