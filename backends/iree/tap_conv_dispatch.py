"""A kxk convolution as the pointwise kernel's taps over a padded, flattened image (issue 32; llvm-cpu).

A convolution of stride s reads input (s y + ky, s x + kx) for output (y, x). The rule pads the input and, at stride
2, splits it into its s s phases (rows and columns even or odd: `phases`; both in one dispatch,
`tap_phase_dispatch.py`), so that x is [N, C, s s, Hq, Wq]: each
tap (ky, kx) then reads one phase at a fixed offset from the output's position, and with the output's rows laid out
`Wq` wide (q = y Wq + x, its last Wq - Wo columns garbage), at a fixed offset of the flattened phases. So the
convolution is `pointwise_conv_dispatch`'s kernel with k k taps: R output channels x V vectors of positions in
registers, a tap a vector load, a weight a broadcast. `splice` runs it over [N, O, Ho Wq] and slices [N, O, Ho, Wo]
out (IREE 3.13 runs a 3x3 through im2col and its data-tiled product: 1.24-1.65x eager, docs/performance.md "Both
ISAs on one AVX-512 host").

It enters a graph as `fx_rewrites::tap_conv2d(x, w, b, stride, rows, width, lanes, relu)`: x the phases [N, C, s s,
Hq, Wq], w [O, C, k, k], b [O], the output's `rows` x `width`; eager: the phases put back, torch's convolution,
sliced. The rules writing it are in `rules/tap_conv_dispatch.py`; the batch norm and ReLU after it fold in as they
do for the 1x1 (`rules/pointwise_conv_dispatch.py`).
"""

from __future__ import annotations

import re

import torch

from fx_rewrites.backends import freezing_fold
from fx_rewrites.backends.iree import spliced
from fx_rewrites.backends.iree.pointwise_conv_dispatch import Shape, executable

OP, MARK = "fx_rewrites::tap_conv2d", "torch.fx_rewrites.tap_conv2d"
MARKS = (MARK,)


def taps(kernel: int, stride: int, hq: int, wq: int) -> tuple[int, ...]:
    """Each tap's offset in the flattened phases [s s, hq, wq], (ky, kx) in w's order."""
    return tuple(
        ((ky % stride) * stride + kx % stride) * hq * wq + (ky // stride) * wq + kx // stride
        for ky in range(kernel)
        for kx in range(kernel)
    )


def phase_rows(kernel: int, stride: int, rows: int, hq: int, wq: int) -> int:
    """The phases' rows (at least `hq`) the taps of `rows` output rows `wq` wide read within."""
    while rows * wq - 1 + max(taps(kernel, stride, hq, wq)) >= stride * stride * hq * wq:
        hq += 1
    return hq


def phases(x: torch.Tensor, stride: int) -> torch.Tensor:
    """A padded image [N, C, s Hq, s Wq] as its phases [N, C, s s, Hq, Wq] (phase i s + j: rows i, columns j mod s)."""
    n, c, h, w = x.shape
    parts = x.reshape(n, c, h // stride, stride, w // stride, stride)
    return parts.permute(0, 1, 3, 5, 2, 4).reshape(n, c, stride * stride, h // stride, w // stride)


def image(x: torch.Tensor) -> torch.Tensor:
    """`phases`' inverse: [N, C, s s, Hq, Wq] -> [N, C, s Hq, s Wq]."""
    n, c, planes, hq, wq = x.shape
    s = round(planes**0.5)
    return x.reshape(n, c, s, s, hq, wq).permute(0, 1, 4, 2, 5, 3).reshape(n, c, s * hq, s * wq)


@torch.library.custom_op(OP, mutates_args=())
def tap_conv2d(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, stride: int, rows: int, width: int, lanes: int, relu: int
) -> torch.Tensor:
    """The convolution of the phases `x` [N, C, s s, Hq, Wq] of a padded image by `w` [O, C, k, k] at `stride`, plus
    `b`, its first `rows` x `width` outputs, then a ReLU where `relu` is 1 (`lanes`: the kernel's vectors)."""
    y = torch.nn.functional.conv2d(image(x), w, b, stride=stride)[:, :, :rows, :width].contiguous()
    return torch.relu(y) if relu else y


@tap_conv2d.register_fake
def _(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, stride: int, rows: int, width: int, lanes: int, relu: int):
    return x.new_empty(x.shape[0], w.shape[0], rows, width)


TAP_CONV2D = torch.ops.fx_rewrites.tap_conv2d.default
freezing_fold.CONVOLUTIONS[TAP_CONV2D] = 7  # its `relu` argument: the torch.compile route folds a batch norm in

_CALL = re.compile(
    rf'^(\s*)(%[\w]+) = torch\.operator "{re.escape(MARK)}"\((%[\w#]+), (%[\w#]+), (%[\w#]+), '
    r"(%[\w]+), (%[\w]+), (%[\w]+), (%[\w]+), (%[\w]+)\) : \((.*)\) -> (.*)$"
)


def shape(n: int, c: int, stride: int, hq: int, wq: int, o: int, kernel: int, rows: int, **kw) -> Shape:
    """The kernel's shape for phases [n, c, s s, hq, wq] and `rows` output rows."""
    return Shape(n, c, rows * wq, o, taps=taps(kernel, stride, hq, wq), span=stride * stride * hq * wq, **kw)


def splice(mlir: str) -> str:
    """`mlir` with every `fx_rewrites.tap_conv2d` call replaced by a `flow.dispatch` of its executable over [N, O,
    rows Wq] and the slice [N, O, rows, width] of it. ValueError where a call has another form (dynamic sizes: the
    rule takes static ones only)."""
    return spliced.splice_each(mlir, MARK, "tap_conv2d", _convert)


def _convert(line: str, ints: dict[str, str]) -> spliced.Spliced:
    found = _CALL.match(line)
    if not found or any(found.group(i) not in ints for i in range(6, 11)):
        raise ValueError(f"a tap_conv2d call of an unknown form: {line.strip()[:200]}")
    pad, res, x, w, b, *scalars, types, otype = found.groups()
    stride, rows, width, lanes, relu = (int(ints[s]) for s in scalars)
    vx, vw, vb = re.findall(r"!torch\.vtensor<[^>]*>", types)[:3]
    sx, sw = spliced._tensor(vx)[1], spliced._tensor(vw)[1]
    if "?" in "".join(sx + sw):
        raise ValueError(f"a tap_conv2d call with a dynamic size: {line.strip()[:200]}")
    n, c, _, hq, wq = (int(s) for s in sx)
    o, kernel = int(sw[0]), int(sw[2])
    conv = shape(n, c, stride, hq, wq, o, kernel, rows, lanes=lanes, relu=bool(relu))
    name = f"tapconv_{n}x{c}x{stride}x{hq}x{wq}_k{kernel}_o{o}_r{rows}_l{lanes}{'_relu' if relu else ''}"
    name, text = executable(conv, name)
    wide, narrow = f"tensor<{n}x{o}x{rows}x{wq}xf32>", f"tensor<{n}x{o}x{rows}x{width}xf32>"
    v = f"tpc{res[1:]}"
    lines = spliced.dispatch_lines(pad, v, name, [(x, vx), (w, vw), (b, vb)], n * conv.chunks, wide, res, otype)
    # the dispatch's wide result sliced before it goes back to torch (in place of dispatch_lines' last line)
    sliced = f"{pad}%{v}_s = tensor.extract_slice %{v}_d[0, 0, 0, 0] [{n}, {o}, {rows}, {width}] [1, 1, 1, 1] : "
    back = f"{pad}{res} = torch_c.from_builtin_tensor %{v}_s : {narrow} -> {otype.strip()}"
    return [*lines[:-1], f"{sliced}{wide} to {narrow}", back], name, text
