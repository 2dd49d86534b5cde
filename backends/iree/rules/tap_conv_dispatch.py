"""kxk convolutions through the hand-written tap convolution dispatch (issue 32; llvm-cpu).

    conv2d(x, w, b)   # x [N, C, H, W] static, w [O, C, k, k] (k in KERNELS), stride 1 or 2, padding p, one group
    -> tap_conv2d(tap_phases(x, s, p, p, Hq, Wq, lanes), w, b or zeros(O), s, Ho, Wo, lanes)

The input is padded (its border p, then up to the phases' whole rows and columns) and, at stride 2, split into its
four phases, in one hand-written dispatch (`tap_phase_dispatch.py`; IREE 3.13 made a fill, a copy and a
transposition of the pad and split: findings 72); the kernel reads each tap of each output at a fixed offset of the
flattened phases (`tap_conv_dispatch.py`). `conv_as_tap_dispatch` writes AVX2's block (8 lanes),
`conv_as_tap_dispatch_avx512` AVX-512's (16). Before `conv_as_im2col_matmul` and `conv_as_tap_matmuls`. The batch
norm and the ReLU after the call fold into it (`batch_norm_into_pointwise_conv`, `relu_into_pointwise_conv`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.iree.rules.conv_performance import _CONVS, _out_size, dispatchable_2d
from fx_rewrites.backends.iree.tap_conv_dispatch import TAP_CONV2D, phase_rows
from fx_rewrites.backends.iree.tap_phase_dispatch import TAP_PHASES
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten

#: the kernel sizes the dispatch takes, by lanes (the ISA), and its strides (measured: docs/performance.md "A kxk
#: convolution dispatch of our own"): ResNet-50's 7x7/2 stem 3->64 (+ batch norm + ReLU) read 1.72 -> 0.89x eager
#: with it on AVX2; on AVX-512 0.74 -> 0.84x with the 8 x 3 block, 1.25 -> 1.05x with the 4 x 6 one in one run
#: (docs/performance.md "A call's inputs read where they lie")
KERNELS = {8: (3, 7), 16: (3, 7)}
STRIDES = (1, 2)


def _tap_conv(node: Node, lanes: int) -> dict[str, Any] | Miss:
    """A static float32 kxk convolution of one group (k in `KERNELS[lanes]`) at a stride of `STRIDES`, no
    dilation."""
    c = dispatchable_2d(node)
    if isinstance(c, Miss):
        return c
    x, w = fake_value(c["input"]), fake_value(c["weight"])
    kh, kw = w.shape[2:]
    if kh != kw or kh not in KERNELS[lanes] or c["groups"] != 1:
        return Miss(f"a {kh}x{kw} kernel in {c['groups']} groups: the kernel takes {KERNELS[lanes]} square, one group")
    if c["stride"][0] != c["stride"][1] or c["stride"][0] not in STRIDES or c["dilation"] != [1, 1]:
        return Miss(f"stride {c['stride']}, dilation {c['dilation']}: strides {STRIDES}, no dilation")
    stride, (ph, pw) = c["stride"][0], c["padding"]
    rows, cols = _out_size(x.shape[2], kh, stride, ph, 1), _out_size(x.shape[3], kw, stride, pw, 1)
    height, width = x.shape[2] + 2 * ph, x.shape[3] + 2 * pw  # padded
    if rows < 1 or cols < 1:
        return Miss("no output position")
    wq = -(-width // stride)
    if rows * wq < lanes:
        return Miss(f"{rows}x{cols} outputs: fewer than a vector's {lanes} positions")
    hq = phase_rows(kh, stride, rows, -(-height // stride), wq)
    c["geometry"] = (stride, kh, rows, cols, hq, wq)
    return c


def _write(node: Node, rw: Rewriter, found: dict[str, Any], lanes: int) -> None:
    stride, _, rows, cols, hq, wq = found["geometry"]
    w = fake_value(found["weight"])
    ph, pw = found["padding"]
    phases = rw.call(TAP_PHASES, found["input"], stride, ph, pw, hq, wq, lanes)
    bias = found["bias"]
    if bias is None:
        bias = rw.call(aten.zeros.default, [w.shape[0]], dtype=torch.float32, device=w.device)
    call = rw.call(TAP_CONV2D, phases, found["weight"], bias, stride, rows, cols, lanes, 0)
    rw.replace(node, call)


_DOC = (
    "A float32 kxk 2-D convolution ({kernels}) of one group at stride 1 or 2, static sizes, becomes the hand-written "
    "tap convolution dispatch (`fx_rewrites::tap_conv2d`): the input padded (and at stride 2 split into its phases), "
    "each tap a vector load at a fixed offset, {block} output channels x positions in registers, the bias added at "
    "the store; IREE 3.13 runs it through im2col or its direct convolution, 1.2-1.7x eager."
)


@rule(
    roots=_CONVS,
    when=lambda node: _tap_conv(node, 8),
    priority=2,  # before conv_as_tap_matmuls and conv_as_im2col_matmul
    tags={"iree", "performance", "convolution"},
    doc=_DOC.format(block="AVX2's 4 x 24", kernels="3x3 and 7x7"),
)
def conv_as_tap_dispatch(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    _write(node, rw, found, 8)


@rule(
    roots=_CONVS,
    when=lambda node: _tap_conv(node, 16),
    priority=2,  # before conv_as_im2col_matmul
    tags={"iree", "performance", "convolution"},
    doc=_DOC.format(block="AVX-512's 4 x 96", kernels="3x3 and 7x7"),
)
def conv_as_tap_dispatch_avx512(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    _write(node, rw, found, 16)


#: the rules of this module (performance.ALL; on for an ISA: targets.CPU_ISAS)
RULES = (conv_as_tap_dispatch, conv_as_tap_dispatch_avx512)
