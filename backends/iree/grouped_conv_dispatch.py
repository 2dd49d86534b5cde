"""A hand-written grouped (and depthwise) convolution dispatch (issue 32): rows of 8-lane vectors in registers.

y[n, o, oh, ow] = sum over the group's input channels k and taps (i, j) of x[n, g cg + k, oh sh + i - ph,
ow sw + j - pw] * w[o, k, i, j], g = o's group, x NCHW, zero outside it (the padding), w [O, cg, kh, kw], stride
(sh, sw) 1 or 2, no dilation; depthwise: cg 1. One workgroup an (n, o) plane. The plane's output is cut into blocks
of R rows by up to 7 vectors of 8 columns (at most 14 accumulators: with the loaded input vector and a broadcast
weight, the 16 ymm); for each input row a block reads, each kernel column j and each vector, one load of 8 sw input
columns (a shuffle takes every sw-th, and zeros for columns in the padding) feeds the FMAs of every output row that
input row reaches (kernel row i = input row - output row x sh); over a group's input channels, a loop carries the
accumulators. An output's terms are summed in (k, i, j) order, as a plain sum. The blocks that read padding rows
are written out with only their rows in the plane; the others are one loop. A width off 8: the last vector ends at
the row's end, overlapping the one before.

IREE 3.13's own depthwise convolution runs 4.4-10.6x slower than eager (7x7 on 96 channels, 56x56: 10x), its
grouped ones (split per group by `grouped_conv_as_convs`) 1.1-2.6x; the graph forms for depthwise
(`depthwise_conv_as_taps`, `depthwise_conv_as_row_partials`) brought it to 1.2-1.9x (docs/performance.md, "Per
ISA"). 8-lane vectors on both ISAs (AVX-512 runs them too).

It enters a graph as `fx_rewrites::grouped_conv2d(x, w, ph, pw, sh, sw)` (eager: torch's convolution), which
torch-mlir imports as `torch.operator "torch.fx_rewrites.grouped_conv2d"`; `splice` (run by `IreeBackend` through
`kernels.spliced`) replaces each call by a `flow.dispatch` of its `stream.executable`. The rules writing it are in
`rules/grouped_conv_dispatch.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable

import torch

from fx_rewrites.backends.iree import spliced

OP, MARK = "fx_rewrites::grouped_conv2d", "torch.fx_rewrites.grouped_conv2d"
MARKS = (MARK,)
#: lanes a vector (ymm); the input's and output's widths must be at least this
LANES = 8
#: the most accumulators a block keeps (16 ymm less the loaded input vector and a broadcast weight)
MAX_ACCUMULATORS = 14
#: the most output rows a block (each input row loaded once serves up to this many)
MAX_ROWS = 8
#: the most vectors of 8 columns a block: a whole row of 56 (7 vectors, 2 rows) ran the 7x7 on 96 channels in
#: 0.44-0.48 ms against 0.52-0.56 as 8 rows of one vector (kernel alone, iree-benchmark-module, AVX2 and AVX-512)
MAX_VECTORS = 7


def block(rows: int, cols: int) -> tuple[int, list[list[int]]]:
    """The register blocks for an output of `rows` x `cols` (cols >= 8): R output rows, and the columns cut into
    vectors of 8 starting at 0, 8, ... (the last at cols - 8, overlapping the one before where cols is not a
    multiple: its columns computed twice, alike) in blocks of at most MAX_VECTORS, as even as can be; R the
    largest divisor of rows up to MAX_ROWS with R times a block's vectors <= MAX_ACCUMULATORS."""
    starts = [min(v * LANES, cols - LANES) for v in range(-(-cols // LANES))]
    count = -(-len(starts) // MAX_VECTORS)
    size, extra = divmod(len(starts), count)
    edges = [i * size + min(i, extra) for i in range(count + 1)]
    chunks = [starts[a:b] for a, b in itertools.pairwise(edges)]
    widest = max(len(chunk) for chunk in chunks)
    r = max(d for d in range(1, MAX_ROWS + 1) if rows % d == 0 and d * widest <= MAX_ACCUMULATORS)
    return r, chunks


@dataclasses.dataclass(frozen=True)
class Shape:
    """One grouped convolution's static shape: input [n, c, h, w], weight [o, cg, kh, kw] (cg input channels a
    group: c // cg groups), padding, stride; its output [n, o, oh, ow]."""

    n: int
    c: int
    h: int
    w: int
    o: int
    cg: int
    kh: int
    kw: int
    ph: int
    pw: int
    sh: int
    sw: int

    @property
    def oh(self) -> int:
        return (self.h + 2 * self.ph - self.kh) // self.sh + 1

    @property
    def ow(self) -> int:
        return (self.w + 2 * self.pw - self.kw) // self.sw + 1

    @property
    def og(self) -> int:
        """Output channels a group."""
        return self.o // (self.c // self.cg)

    def memrefs(self) -> tuple[str, str, str]:
        sizes = (
            self.n * self.c * self.h * self.w,
            self.o * self.cg * self.kh * self.kw,
            self.n * self.o * self.oh * self.ow,
        )
        return tuple(f"memref<{size}xf32>" for size in sizes)


def _load(add: Callable[[str], None], name: str, row: str, start: int, conv: Shape) -> None:
    """`name` = input columns start, start + sw, ... (8 of them) of the input row at index `row` (a plane's row
    start), those outside [0, w) zero (the padding): one load of 8 sw columns inside the row, and a shuffle that
    takes every sw-th and zeros at the row's edges (none where the load is the columns themselves)."""
    vec, span = f"vector<{LANES}xf32>", LANES * conv.sw
    wide = f"vector<{span}xf32>"
    xt = conv.memrefs()[0]
    base = min(max(start, 0), conv.w - span)
    add(f"%{name}a = arith.addi {row}, %c{base}w : index")
    if base == start and conv.sw == 1:
        add(f"%{name} = vector.load %xm[%{name}a] : {xt}, {vec}")
        return
    add(f"%{name}l = vector.load %xm[%{name}a] : {xt}, {wide}")
    cols = [start + lane * conv.sw for lane in range(LANES)]
    lanes = [span + col - base if 0 <= col < conv.w else 0 for col in cols]
    add(f"%{name} = vector.shuffle %zero{span}, %{name}l [{', '.join(map(str, lanes))}] : {wide}, {wide}")


def _weights(add: Callable[[str], None], prefix: str, base: str, conv: Shape) -> None:
    """`%{prefix}{i}_{j}`: the kernel's taps at `base` (an input channel's kh x kw weights), each broadcast."""
    wt, vec = conv.memrefs()[1], f"vector<{LANES}xf32>"
    for i in range(conv.kh):
        for j in range(conv.kw):
            add(f"%{prefix}i{i}_{j} = arith.addi {base}, %c{i * conv.kw + j}w : index")
            add(f"%{prefix}s{i}_{j} = memref.load %wm[%{prefix}i{i}_{j}] : {wt}")
            add(f"%{prefix}{i}_{j} = vector.broadcast %{prefix}s{i}_{j} : f32 to {vec}")


def _block(
    add: Callable[[str], None], tag: str, r0: str, rows_in: range, conv: Shape, r: int, starts: list[int]
) -> None:
    """A block of `r` output rows from row index `r0` by the vectors of 8 output columns from each of `starts`;
    `rows_in`: the block's input rows (from input row r0 sh - ph) that lie in the plane (all of them off the
    edges). Output row o takes kernel row i from the block's input row o sh + i. Over a group's cg input channels
    (a loop carrying the accumulators where cg > 1), in order: each output's sum runs channel, kernel row, column."""
    vec = f"vector<{LANES}xf32>"
    ot = conv.memrefs()[2]
    keys = [(o, v) for o in range(r) for v in range(len(starts))]
    add(f"%{tag}r0s = arith.muli {r0}, %c{conv.sh}w : index")
    if conv.cg == 1:
        plane, weight, acc = "%xplane", "wv", dict.fromkeys(keys, "%zero")
    else:
        types = ", ".join([vec] * len(keys))
        inits = ", ".join(f"%{tag}c{o}_{v} = %zero" for o, v in keys)
        loop = f"scf.for %{tag}k = %c0 to %c{conv.cg}w step %c1w"
        add(f"%{tag}res:{len(keys)} = {loop} iter_args({inits}) -> ({types}) {{")
        add(f"%{tag}kx = arith.muli %{tag}k, %c{conv.h * conv.w}w : index")
        add(f"%{tag}xp = arith.addi %xplane, %{tag}kx : index")
        add(f"%{tag}kw = arith.muli %{tag}k, %c{conv.kh * conv.kw}w : index")
        add(f"%{tag}wb = arith.addi %wbase, %{tag}kw : index")
        _weights(add, f"{tag}w", f"%{tag}wb", conv)
        plane, weight, acc = f"%{tag}xp", f"{tag}w", {(o, v): f"%{tag}c{o}_{v}" for o, v in keys}
    for t in rows_in:
        add(f"%{tag}ri{t} = arith.addi %{tag}r0s, %c{t}w : index")  # the input row + ph
        add(f"%{tag}rs{t} = arith.subi %{tag}ri{t}, %c{conv.ph}w : index")
        add(f"%{tag}rm{t} = arith.muli %{tag}rs{t}, %c{conv.w}w : index")
        add(f"%{tag}rb{t} = arith.addi {plane}, %{tag}rm{t} : index")
        for j in range(conv.kw):
            for v, start in enumerate(starts):
                x = f"{tag}x{t}_{j}_{v}"
                _load(add, x, f"%{tag}rb{t}", start * conv.sw + j - conv.pw, conv)
                for o in range(r):
                    i = t - o * conv.sh
                    if 0 <= i < conv.kh:
                        name = f"%{tag}a{t}_{j}_{v}_{o}"
                        add(f"{name} = vector.fma %{x}, %{weight}{i}_{j}, {acc[o, v]} : {vec}")
                        acc[o, v] = name
    if conv.cg > 1:
        add(f"scf.yield {', '.join(acc[key] for key in keys)} : {', '.join([vec] * len(keys))}")
        add("}")
        acc = {key: f"%{tag}res#{n}" for n, key in enumerate(keys)}
    add(f"%{tag}om = arith.muli {r0}, %c{conv.ow}w : index")
    add(f"%{tag}ob = arith.addi %oplane, %{tag}om : index")
    for (o, v), value in acc.items():
        add(f"%{tag}oa{o}_{v} = arith.addi %{tag}ob, %c{o * conv.ow + starts[v]}w : index")
        add(f"vector.store {value}, %om[%{tag}oa{o}_{v}] : {ot}, {vec}")


def _kernel(conv: Shape) -> str:
    oh, ow, h, sh, ph = conv.oh, conv.ow, conv.h, conv.sh, conv.ph
    if oh < 1 or ow < LANES or conv.w < LANES * conv.sw:
        raise ValueError(f"an output {oh}x{ow} from {h}x{conv.w}: at least {LANES} wide, the input {LANES} strides")
    r, chunks = block(oh, ow)
    vec = f"vector<{LANES}xf32>"
    xt, wt, ot = conv.memrefs()
    lines = [
        "%c0 = arith.constant 0 : index",
        f"%zero = arith.constant dense<0.0> : {vec}",
        f"%zero{LANES * conv.sw} = arith.constant dense<0.0> : vector<{LANES * conv.sw}xf32>",
        f"%xm = stream.binding.subspan %bx[%c0] : !stream.binding -> {xt}",
        f"%wm = stream.binding.subspan %bw[%c0] : !stream.binding -> {wt}",
        f"%om = stream.binding.subspan %bo[%c0] : !stream.binding -> {ot}",
        "%p = stream.dispatch.workgroup.id[0] : index",  # the (n, output channel) plane
        f"%oc = arith.remui %p, %c{conv.o}w : index",
        f"%ni = arith.divui %p, %c{conv.o}w : index",
        f"%gr = arith.divui %oc, %c{conv.og}w : index",
        f"%nc = arith.muli %ni, %c{conv.c}w : index",
        f"%gc = arith.muli %gr, %c{conv.cg}w : index",
        "%ci = arith.addi %nc, %gc : index",  # the group's first input plane
        f"%xplane = arith.muli %ci, %c{h * conv.w}w : index",
        f"%oplane = arith.muli %p, %c{oh * ow}w : index",
        f"%wbase = arith.muli %oc, %c{conv.cg * conv.kh * conv.kw}w : index",
    ]
    add = lines.append
    if conv.cg == 1:  # the plane's weights, broadcast once
        _weights(add, "wv", "%wbase", conv)
    span = (r - 1) * sh + conv.kh  # input rows a block reads, from its first output row's sh - ph
    inside = [r0 for r0 in range(0, oh, r) if r0 * sh - ph >= 0 and r0 * sh - ph + span <= h]
    for k, starts in enumerate(chunks):  # column blocks, each with its own edges
        for r0 in range(0, oh, r):  # the blocks that read padding rows: their rows in the plane only
            if r0 not in inside:
                rows_in = range(max(0, ph - r0 * sh), min(span, h + ph - r0 * sh))
                _block(add, f"e{r0}_{k}_", f"%c{r0}w", rows_in, conv, r, starts)
        if inside:
            add(f"scf.for %r0 = %c{inside[0]}w to %c{inside[-1] + r}w step %c{r}w {{")
            _block(add, f"i{k}_", "%r0", range(span), conv, r, starts)
            add("}")
    lines.append("return")
    return spliced.with_index_constants("\n".join(lines))


def executable(conv: Shape) -> tuple[str, str]:
    """The name (unique per shape: findings 52) and text of the `stream.executable` over N O workgroups."""
    c = conv
    name = f"gconv_{c.n}x{c.c}x{c.h}x{c.w}_o{c.o}x{c.cg}_k{c.kh}x{c.kw}_p{c.ph}x{c.pw}_s{c.sh}x{c.sw}"
    return name, spliced.executable(
        name, "%bx: !stream.binding, %bw: !stream.binding, %bo: !stream.binding", 1, _kernel(c)
    )


@torch.library.custom_op(OP, mutates_args=())
def grouped_conv2d(x: torch.Tensor, w: torch.Tensor, ph: int, pw: int, sh: int, sw: int) -> torch.Tensor:
    """The convolution of `x` [N, C, H, W] by `w` [O, Cg, kh, kw] in C / Cg groups (depthwise: Cg 1), padded by
    (ph, pw) zeros, stride (sh, sw)."""
    groups = x.shape[1] // w.shape[1]
    return torch.nn.functional.conv2d(x, w, stride=(sh, sw), padding=(ph, pw), groups=groups)


@grouped_conv2d.register_fake
def _(x: torch.Tensor, w: torch.Tensor, ph: int, pw: int, sh: int, sw: int) -> torch.Tensor:
    conv = Shape(*x.shape, *w.shape, ph, pw, sh, sw)
    return x.new_empty(conv.n, conv.o, conv.oh, conv.ow)


GROUPED_CONV2D = torch.ops.fx_rewrites.grouped_conv2d.default

_CALL = re.compile(
    rf'^(\s*)(%[\w]+) = torch\.operator "{re.escape(MARK)}"\((%[\w#]+), (%[\w#]+)((?:, %[\w]+){{4}})\) : '
    r"\((.*)\) -> (.*)$"
)


def splice(mlir: str) -> str:
    """`mlir` with every `fx_rewrites.grouped_conv2d` call replaced by a `flow.dispatch` of its executable.
    ValueError where a call has another form (dynamic sizes: the rule takes static ones only)."""
    return spliced.splice_each(mlir, MARK, "grouped_conv2d", _convert)


def _convert(line: str, ints: dict[str, str]) -> spliced.Spliced:
    found = _CALL.match(line)
    scalars = found.group(5).split(", ")[1:] if found else []
    if not found or any(name not in ints for name in scalars):
        raise ValueError(f"a grouped_conv2d call of an unknown form: {line.strip()[:200]}")
    pad, res, x, w, _, types, otype = found.groups()
    vx, vw = re.findall(r"!torch\.vtensor<[^>]*>", types)[:2]
    sx, sw = spliced._tensor(vx)[1], spliced._tensor(vw)[1]
    if "?" in sx + sw:
        raise ValueError(f"a grouped_conv2d call with a dynamic size: {line.strip()[:200]}")
    conv = Shape(*(int(s) for s in sx), *(int(s) for s in sw), *(int(ints[name]) for name in scalars))
    name, text = executable(conv)
    to = f"tensor<{conv.n}x{conv.o}x{conv.oh}x{conv.ow}xf32>"
    lines = spliced.dispatch_lines(pad, f"gcv{res[1:]}", name, [(x, vx), (w, vw)], conv.n * conv.o, to, res, otype)
    return lines, name, text
