"""Convolution performance rules for IREE's llvm-cpu target, chosen by measurement (issue 25).

- `strided_pointwise_conv_as_slice`: a 1x1 convolution with a stride
  (ResNet's downsampling shortcuts) reads every stride-th pixel: the input
  sliced with that step, then the same convolution with stride 1. IREE 3.13
  lowers a strided 1x1 convolution, channels last, to a generic reduction
  at about 2 GFLOP/s (ResNet-50's three shortcuts: most of its time); the
  unstrided one is a matmul.
- `conv3d_as_conv2d_over_frames`: a 3-D convolution as the sum of one 2-D
  convolution per kernel frame, the output frames as batch rows (IREE's
  3-D convolution: 9x eager; its 2-D ones run at eager's speed).
- `depthwise_conv_as_taps`: a depthwise 2-D convolution of at most 3x3
  taps as a sum of shifted windows times per-channel weights, fused
  element-wise dispatches (IREE's depthwise convolution: 2-3x eager).
- `depthwise_conv_as_row_partials`: a larger one (up to 7x7, stride 1) as
  a width partial per kernel row, its rows shifted, summed (7x7: IREE's
  convolution 3.5-4.6x eager, the partials about 1.2x). On for both ISAs
  (`targets.CPU_ISAS`): ConvNeXt-T, EfficientNet-B0 and MobileNetV3-L
  faster with it (AVX2's ConvNeXt-T by 1-4%, the others 11-19%).
- `grouped_conv_as_convs`: a grouped convolution as one convolution per
  group, concatenated (IREE's grouped convolution: 12x eager).

Speed: benchmarks/conv_classes.py (one op per class) and
benchmarks/scale_cnn.py (ResNet-50); docs/performance.md has the tables.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten

_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default)


def _conv(node: Node) -> dict[str, Any] | Miss:
    """The convolution's arguments by name (spatial lists as long as the kernel's spatial dims), or why not."""
    named = schema.arguments(node)
    w, x = fake_value(named["weight"]), fake_value(named["input"])
    if w is None or x is None:
        return Miss("no tensor value on the input or weight")
    spatial = w.dim() - 2
    if x.dim() != spatial + 2:
        return Miss("an unbatched input")
    if named.get("transposed", False):
        return Miss("a transposed convolution")
    if not w.dtype.is_floating_point:
        return Miss(f"a {w.dtype} convolution")
    out: dict[str, Any] = {"input": named["input"], "weight": named["weight"], "bias": named.get("bias")}
    for key, default in (("stride", 1), ("padding", 0), ("dilation", 1)):
        value = named.get(key, [default])
        if isinstance(value, str):
            return Miss(f"{key}={value!r}")
        out[key] = list(value) * spatial if len(value) == 1 else list(value)
    out["groups"] = named.get("groups", 1)
    out["spatial"] = spatial
    return out


def _strided_pointwise(node: Node) -> dict[str, Any] | Miss:
    c = _conv(node)
    if isinstance(c, Miss):
        return c
    kernel = list(fake_value(c["weight"]).shape[2:])
    if any(k != 1 for k in kernel):
        return Miss(f"a {kernel} kernel: not pointwise")
    if all(s == 1 for s in c["stride"]):
        return Miss("stride 1: nothing to slice")
    if any(p != 0 for p in c["padding"]):
        return Miss(f"padding {c['padding']}: the padded border would be sliced too")
    sizes = fake_value(c["input"]).shape[2:]
    if any(step != 1 and not isinstance(size, int) for size, step in zip(sizes, c["stride"], strict=True)):
        # the slice's length ((n + s - 1) // s) and the convolution's ((n - 1) // s + 1) are equal, but the
        # engine cannot prove it of two symbolic expressions and rolls the rewrite back
        return Miss(f"a symbolic size {list(sizes)} along a strided dim")
    return c


@rule(
    roots=_CONVS,
    when=_strided_pointwise,
    tags={"iree", "performance", "convolution"},
    doc=(
        "A convolution with a 1x1 (1, 1x1x1) kernel, a stride and no padding reads every stride-th input "
        "position: the input sliced with that step, then the same convolution with stride 1 (the same "
        "products and sums). IREE 3.13 on llvm-cpu lowers the strided form, channels last, to a generic "
        "reduction at about 2 GFLOP/s; ResNet-50's three downsampling shortcuts took most of its time."
    ),
)
def strided_pointwise_conv_as_slice(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    x = found["input"]
    for dim, step in enumerate(found["stride"], start=2):
        if step != 1:
            x = rw.call(aten.slice.Tensor, x, dim, 0, torch.iinfo(torch.int64).max, step)
    ones = [1] * found["spatial"]
    zeros = [0] * found["spatial"]
    rw.replace(
        node,
        rw.call(
            aten.convolution.default,
            x,
            found["weight"],
            found["bias"],
            ones,
            zeros,
            ones,
            False,
            zeros,
            found["groups"],
        ),
    )


def _static_sizes(c: dict[str, Any]) -> bool | Miss:
    """The input's channel and spatial sizes are known (a Dim batch is fine)."""
    if not all(isinstance(d, int) for d in (*fake_value(c["input"]).shape[1:], *fake_value(c["weight"]).shape)):
        return Miss("symbolic channel or spatial sizes")
    return True


def _one_group_2d(node: Node) -> dict[str, Any] | Miss:
    """`_conv(node)` where it is 2-D, of one group, with static channel and spatial sizes (im2col's and the taps')."""
    c = _conv(node)
    if isinstance(c, Miss):
        return c
    if c["spatial"] != 2:
        return Miss(f"a {c['spatial']}-D convolution")
    if c["groups"] != 1:
        return Miss(f"groups={c['groups']} (grouped_conv_as_convs, depthwise_conv_as_taps)")
    ok = _static_sizes(c)
    return c if ok is True else ok


def _out_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _window(rw: Rewriter, x: Node, dim: int, start: int, count: int, step: int) -> Node:
    """`count` elements of `x` along `dim` from `start`, every `step`-th."""
    return rw.call(aten.slice.Tensor, x, dim, start, start + step * (count - 1) + 1, step)


# ----------------------------------------------------------------------------- 3-D as 2-D over frames


def _frames_read(tap: int, time: int, frames: int, stride: int, padding: int, dilation: int) -> tuple[int, int]:
    """The first and last output frame whose `tap` reads an input frame, not the padding (first > last: none)."""
    first = max(0, -(-(padding - tap * dilation) // stride))
    return first, min(frames - 1, (time - 1 + padding - tap * dilation) // stride)


def _conv3d(node: Node) -> dict[str, Any] | Miss:
    c = _conv(node)
    if isinstance(c, Miss):
        return c
    if c["spatial"] != 3:
        return Miss(f"a {c['spatial']}-D convolution")
    ok = _static_sizes(c)
    if ok is not True:
        return ok
    time, taps = fake_value(c["input"]).shape[2], fake_value(c["weight"]).shape[2]
    (st, _, _), (pt, _, _), (dt, _, _) = c["stride"], c["padding"], c["dilation"]
    frames = _out_size(time, taps, st, pt, dt)
    if frames < 1:
        return Miss("no output frame")
    reads = [_frames_read(i, time, frames, st, pt, dt) for i in range(taps)]
    if all(first > last for first, last in reads):
        return Miss("every tap reads the time padding only")
    return c


@rule(
    roots=_CONVS,
    when=_conv3d,
    tags={"iree", "performance", "convolution"},
    doc=(
        "A 3-D convolution with a kt-frame kernel is the sum of kt 2-D convolutions, the i-th over the "
        "input's frames t * stride + i * dilation (padded in time), every output frame a batch row: "
        "[N, C, T, H, W] -> [N * T_out, C, H, W] per tap, conv2d by the weight's i-th frame, summed, back to "
        "[N, O, T_out, H_out, W_out]. IREE 3.13 on llvm-cpu runs its 3-D convolution 9x slower than eager "
        "(32->32 3x3x3 on 8x28x28: 101 ms); its 2-D convolutions run at eager's speed (4.4 ms against 11)."
    ),
)
def conv3d_as_conv2d_over_frames(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    x, w = found["input"], found["weight"]
    _, channels, time, height, width = fake_value(x).shape
    out_channels, _, taps, _, _ = fake_value(w).shape
    (st, *stride), (pt, *padding), (dt, *dilation) = found["stride"], found["padding"], found["dilation"]
    frames = _out_size(time, taps, st, pt, dt)
    x = rw.call(aten.permute.default, x, [0, 2, 1, 3, 4])  # [N, T, C, H, W]: a frame is a batch row
    total = None
    for i in range(taps):
        # output frame t reads input frame t * st + i * dt - pt: only the frames inside the input are computed
        # (no convolution of the time padding's zeros), the others are zeros padded onto the tap's result
        first, last = _frames_read(i, time, frames, st, pt, dt)
        if first > last:
            continue
        count = last - first + 1
        window = _window(rw, x, 1, first * st + i * dt - pt, count, st)
        weight = rw.call(aten.select.int, w, 2, i)
        y = rw.call(
            aten.convolution.default,
            rw.call(aten.reshape.default, window, [-1, channels, height, width]),
            weight,
            None,
            stride,
            padding,
            dilation,
            False,
            [0, 0],
            found["groups"],
        )
        y = rw.call(aten.reshape.default, y, [-1, count, out_channels, *fake_value(y).shape[2:]])
        if count != frames:
            y = rw.call(aten.constant_pad_nd.default, y, [0, 0, 0, 0, 0, 0, first, frames - 1 - last], 0.0)
        total = y if total is None else rw.call(aten.add.Tensor, total, y)
    if found["bias"] is not None:
        total = rw.call(aten.add.Tensor, total, rw.call(aten.reshape.default, found["bias"], [out_channels, 1, 1]))
    rw.replace(node, rw.call(aten.permute.default, total, [0, 2, 1, 3, 4]))


# ----------------------------------------------------------------------------- depthwise as taps

#: the most kernel taps `depthwise_conv_as_taps` writes out (one multiply-add of the input each): 3x3, where it wins
#: in a model on both ISAs (MobileNetV2, AVX2 0.90x -> 0.72x eager, AVX-512 0.91x -> 0.69x); ConvNeXt-T's 7x7 ran
#: 1.23x -> 1.40x on AVX2 with it, 1.20x -> 1.19x on AVX-512 (one thread, CPU time, interleaved; docs/performance.md)
MAX_DEPTHWISE_TAPS = 9
#: taps summed in one chain before the chains are added: IREE 3.13 fuses a chain of up to about this many windows
#: into one dispatch; 49 taps in one chain became 20 dispatches, 15 of them a single product written out (7x7 on
#: 96 channels, 56x56, AVX2: 6.7 ms in one chain, 4.0 in chains of 7, eager 1.7; 3x3 on 64 channels: 0.78 / 0.60)
TAPS_PER_SUM = 7


def static_2d(node: Node, why: str) -> dict[str, Any] | Miss:
    """`_conv(node)` where it is 2-D (else a Miss saying so, then `why`) with static channel and spatial sizes."""
    c = _conv(node)
    if isinstance(c, Miss):
        return c
    if c["spatial"] != 2:
        return Miss(f"a {c['spatial']}-D convolution: {why}")
    ok = _static_sizes(c)
    return c if ok is True else ok


def dispatchable_2d(node: Node) -> dict[str, Any] | Miss:
    """`static_2d(node)` where a hand-written convolution dispatch can take it: a static batch (its workgroups are
    static), float32 input and weight, the bias a tensor or none; else a Miss saying which."""
    c = static_2d(node, "the kernel is 2-D")
    if isinstance(c, Miss):
        return c
    x, w = fake_value(c["input"]), fake_value(c["weight"])
    if not isinstance(x.shape[0], int):
        return Miss("a Dim on the batch: the kernel's workgroups are static")
    if x.dtype != torch.float32 or w.dtype != torch.float32:
        return Miss(f"{x.dtype} x {w.dtype}: the kernel is float32")
    if c["bias"] is not None and not isinstance(c["bias"], Node):
        return Miss("a bias that is not a tensor")
    return c


def is_depthwise(c: dict[str, Any]) -> bool:
    """`_conv`'s arguments `c` are a depthwise convolution's: groups = input channels = output channels."""
    out_channels, per_group = fake_value(c["weight"]).shape[:2]
    return c["groups"] == fake_value(c["input"]).shape[1] == out_channels and per_group == 1


def _any_depthwise(node: Node) -> dict[str, Any] | Miss:
    """A static depthwise 2-D convolution's arguments (`_conv`), or why not."""
    c = static_2d(node, "only 2-D measured")
    if isinstance(c, Miss):
        return c
    if not is_depthwise(c):
        return Miss(f"groups={c['groups']}, weight {list(fake_value(c['weight']).shape)}: not depthwise")
    return c


def _depthwise(node: Node) -> dict[str, Any] | Miss:
    c = _any_depthwise(node)
    if isinstance(c, Miss):
        return c
    kh, kw = fake_value(c["weight"]).shape[2:]
    if kh * kw > MAX_DEPTHWISE_TAPS:
        return Miss(f"a {kh}x{kw} kernel: more than {MAX_DEPTHWISE_TAPS} taps (depthwise_conv_as_row_partials)")
    return c


def _depthwise_operands(rw: Rewriter, found: dict[str, Any]) -> tuple[Node, Node, int, int]:
    """A depthwise convolution's input padded, its weight as one [C, 1, 1] tap per kernel position ([C, kh kw,
    1, 1]) and its output's rows and columns."""
    x, w = found["input"], found["weight"]
    channels, _, kh, kw = fake_value(w).shape
    height, width = fake_value(x).shape[2:]
    (sh, sw), (ph, pw), (dh, dw) = found["stride"], found["padding"], found["dilation"]
    rows, cols = _out_size(height, kh, sh, ph, dh), _out_size(width, kw, sw, pw, dw)
    if ph or pw:
        x = rw.call(aten.constant_pad_nd.default, x, [pw, pw, ph, ph], 0.0)
    return x, rw.call(aten.reshape.default, w, [channels, kh * kw, 1, 1]), rows, cols


def _replace_with_bias(node: Node, rw: Rewriter, total: Node, found: dict[str, Any]) -> None:
    """`node` replaced by `total` plus the convolution's bias (per channel), if it has one."""
    if found["bias"] is not None:
        channels = fake_value(found["weight"]).shape[0]
        total = rw.call(aten.add.Tensor, total, rw.call(aten.reshape.default, found["bias"], [channels, 1, 1]))
    rw.replace(node, total)


@rule(
    roots=_CONVS,
    when=_depthwise,
    tags={"iree", "performance", "convolution"},
    doc=(
        "A depthwise 2-D convolution of at most 3x3 taps (groups = input channels = output channels: MobileNet, "
        "EfficientNet) is a sum over its kernel's taps of the (padded) input's shifted, strided window times that "
        "tap's per-channel weight: element-wise work IREE fuses into a dispatch per chain of 7 taps. IREE 3.13 on "
        "llvm-cpu runs the convolution 2-2.4x slower than eager (64 channels 3x3 on 56x56), the taps 0.8-1.1x; "
        "MobileNetV2 0.9x -> 0.7x eager on AVX2 and AVX-512."
    ),
)
def depthwise_conv_as_taps(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    x, taps, rows, cols = _depthwise_operands(rw, found)
    kh, kw = fake_value(found["weight"]).shape[2:]
    (sh, sw), (dh, dw) = found["stride"], found["dilation"]
    chains: list[Node] = []
    chain, length = None, 0
    for i in range(kh):
        band = _window(rw, x, 2, i * dh, rows, sh)
        for j in range(kw):
            tap = rw.call(aten.select.int, taps, 1, i * kw + j)  # [C, 1, 1]
            term = rw.call(aten.mul.Tensor, _window(rw, band, 3, j * dw, cols, sw), tap)
            chain, length = (term, 1) if chain is None else (rw.call(aten.add.Tensor, chain, term), length + 1)
            if length == TAPS_PER_SUM:
                chains.append(chain)
                chain = None
    if chain is not None:
        chains.append(chain)
    total = chains[0]
    for more in chains[1:]:
        total = rw.call(aten.add.Tensor, more, total)
    _replace_with_bias(node, rw, total, found)


#: the most kernel taps `depthwise_conv_as_row_partials` writes out: 7x7 (ConvNeXt), the size measured
MAX_ROW_PARTIAL_TAPS = 49


def _large_depthwise(node: Node) -> dict[str, Any] | Miss:
    c = _any_depthwise(node)
    if isinstance(c, Miss):
        return c
    kh, kw = fake_value(c["weight"]).shape[2:]
    if kh * kw <= MAX_DEPTHWISE_TAPS:
        return Miss(f"a {kh}x{kw} kernel: at most {MAX_DEPTHWISE_TAPS} taps (depthwise_conv_as_taps)")
    if kh * kw > MAX_ROW_PARTIAL_TAPS:
        return Miss(f"a {kh}x{kw} kernel: more than {MAX_ROW_PARTIAL_TAPS} taps, not measured")
    if c["stride"] != [1, 1]:
        return Miss(f"stride {c['stride']}: only stride 1 measured (each partial spans every input row)")
    return c


@rule(
    roots=_CONVS,
    when=_large_depthwise,
    tags={"iree", "performance", "convolution"},
    doc=(
        "A depthwise 2-D convolution of more than 3x3 taps, up to 7x7 (ConvNeXt), stride 1, is a sum over its "
        "kernel's rows of a partial: that row's taps summed along the width over every (padded) input row, then "
        "the partial's rows shifted by the kernel row. IREE 3.13 on llvm-cpu fuses each partial into one "
        "dispatch; 7x7 on 96 channels, 56x56: IREE's convolution 3.5-4.6x eager, the partials 1.2x (AVX2 and "
        "AVX-512), the taps in chains of 7 1.5-1.8x."
    ),
)
def depthwise_conv_as_row_partials(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    x, taps, rows, cols = _depthwise_operands(rw, found)  # stride 1 (`_large_depthwise`)
    kh, kw = fake_value(found["weight"]).shape[2:]
    dh, dw = found["dilation"]
    total = None
    for i in range(kh):
        partial = None
        for j in range(kw):
            tap = rw.call(aten.select.int, taps, 1, i * kw + j)  # [C, 1, 1]
            term = rw.call(aten.mul.Tensor, _window(rw, x, 3, j * dw, cols, 1), tap)
            partial = term if partial is None else rw.call(aten.add.Tensor, partial, term)
        shifted = _window(rw, partial, 2, i * dh, rows, 1)
        total = shifted if total is None else rw.call(aten.add.Tensor, total, shifted)
    _replace_with_bias(node, rw, total, found)


# ----------------------------------------------------------------------------- grouped as one per group

#: the most groups `grouped_conv_as_convs` splits into (the graph grows by a convolution a group)
MAX_GROUPS = 32


def _grouped(node: Node) -> dict[str, Any] | Miss:
    c = _conv(node)
    if isinstance(c, Miss):
        return c
    groups = c["groups"]
    if groups == 1:
        return Miss("groups=1")
    ok = _static_sizes(c)
    if ok is not True:
        return ok
    if fake_value(c["weight"]).shape[1] == 1 and c["spatial"] == 2:
        return Miss("depthwise: depthwise_conv_as_taps")
    if groups > MAX_GROUPS:
        return Miss(f"{groups} groups: more than {MAX_GROUPS} convolutions")
    return c


@rule(
    roots=_CONVS,
    when=_grouped,
    tags={"iree", "performance", "convolution"},
    doc=(
        "A grouped convolution (ResNeXt, RegNet; not depthwise) is one convolution per group on its slice of "
        "the channels, concatenated. IREE 3.13 on llvm-cpu runs grouped convolutions 12x slower than eager "
        "(64->64 in 8 groups, 3x3 on 56x56: 9.8 ms); one per group runs at eager's speed (0.84 ms)."
    ),
)
def grouped_conv_as_convs(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    x, w, b, groups = found["input"], found["weight"], found["bias"], found["groups"]
    per_in, per_out = fake_value(x).shape[1] // groups, fake_value(w).shape[0] // groups
    zeros = [0] * found["spatial"]
    outs = []
    for g in range(groups):
        xg = rw.call(aten.slice.Tensor, x, 1, g * per_in, (g + 1) * per_in)
        wg = rw.call(aten.slice.Tensor, w, 0, g * per_out, (g + 1) * per_out)
        bg = None if b is None else rw.call(aten.slice.Tensor, b, 0, g * per_out, (g + 1) * per_out)
        args = (xg, wg, bg, found["stride"], found["padding"], found["dilation"], False, zeros, 1)
        outs.append(rw.call(aten.convolution.default, *args))
    rw.replace(node, rw.call(aten.cat.default, outs, 1))


#: the rules of this module (performance.ALL; which are on for an ISA: targets.CPU_ISAS)
RULES = (
    strided_pointwise_conv_as_slice,
    conv3d_as_conv2d_over_frames,
    grouped_conv_as_convs,
    depthwise_conv_as_taps,
    depthwise_conv_as_row_partials,
)
#: their names (benchmarks/scale_cnn.py measures the route without them)
NAMES: tuple[str, ...] = tuple(r.name for r in RULES)
