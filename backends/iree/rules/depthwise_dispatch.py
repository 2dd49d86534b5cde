"""A depthwise convolution through the hand-written depthwise dispatch (issue 32; llvm-cpu).

    conv2d(x, w, b, stride=s, padding=p, groups=C)   # x [N, C, H, W], w [C, 1, kh, kw], stride 1 or 2
    -> depthwise_conv2d(x, w.reshape(C, kh, kw), ph, pw, sh, sw) + b[:, None, None]

IREE 3.13's own depthwise convolution runs 4.4-10.6x eager (7x7 on 96 channels, 56x56: 10x); the graph forms
`depthwise_conv_as_taps` (3x3) and `depthwise_conv_as_row_partials` (5x5, 7x7) bring it to 1.2-1.9x eager.
`depthwise_dispatch.py`'s kernel keeps a block of output rows in registers and reads each input row once per block.
Static sizes, float32, no dilation, an output at least 8 wide and an input 8 strides wide (the kernel's vectors).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.iree.depthwise_dispatch import DEPTHWISE_CONV2D, LANES
from fx_rewrites.backends.iree.rules.conv_performance import _CONVS, _any_depthwise, _out_size
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten
#: the largest stride taken (a stride-2 row of 8 outputs is one load of 16 input columns and a shuffle)
MAX_STRIDE = 2


def _dispatchable(node: Node) -> dict[str, Any] | Miss:
    c = _any_depthwise(node)
    if isinstance(c, Miss):
        return c
    x, w = fake_value(c["input"]), fake_value(c["weight"])
    if x.dtype != torch.float32 or w.dtype != torch.float32:
        return Miss(f"{x.dtype} x {w.dtype}: the kernel is float32")
    if max(c["stride"]) > MAX_STRIDE or c["dilation"] != [1, 1]:
        return Miss(f"stride {c['stride']}, dilation {c['dilation']}: the kernel's strides 1 and 2, no dilation")
    kh, kw = w.shape[2:]
    (height, width), (sh, sw), (ph, pw) = x.shape[2:], c["stride"], c["padding"]
    rows, cols = _out_size(height, kh, sh, ph, 1), _out_size(width, kw, sw, pw, 1)
    if rows < 1 or cols < LANES or width < LANES * sw:
        return Miss(f"an output {rows}x{cols} from {height}x{width}: at least {LANES} wide, the input {LANES} strides")
    if c["bias"] is not None and not isinstance(c["bias"], Node):
        return Miss("a bias that is not a tensor")
    return c


@rule(
    roots=_CONVS,
    when=_dispatchable,
    priority=1,  # before depthwise_conv_as_taps and depthwise_conv_as_row_partials
    tags={"iree", "performance", "convolution"},
    doc=(
        "A float32 depthwise 2-D convolution at stride 1 or 2 (no dilation, static sizes, 8 outputs wide) "
        "becomes the hand-written depthwise dispatch (`fx_rewrites::depthwise_conv2d`), the padding read in the "
        "kernel, the bias added after: IREE 3.13's own depthwise convolution runs 4.4-10.6x eager."
    ),
)
def depthwise_conv_as_dispatch(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    x, w = found["input"], found["weight"]
    channels, _, kh, kw = fake_value(w).shape
    (ph, pw), (sh, sw) = found["padding"], found["stride"]
    y = rw.call(DEPTHWISE_CONV2D, x, rw.call(aten.reshape.default, w, [channels, kh, kw]), ph, pw, sh, sw)
    if found["bias"] is not None:
        y = rw.call(aten.add.Tensor, y, rw.call(aten.reshape.default, found["bias"], [channels, 1, 1]))
    rw.replace(node, y)


#: the rules of this module (performance.ALL; on for an ISA: targets.CPU_ISAS)
RULES = (depthwise_conv_as_dispatch,)
