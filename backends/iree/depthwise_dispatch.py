"""A hand-written depthwise convolution dispatch (issue 32): rows of 8-lane vectors, every tap an FMA in registers.

y[n, c, oh, ow] = sum over (i, j) of xp[n, c, oh + i, ow + j] * w[c, i, j], xp the input already padded (NCHW,
stride 1, no dilation), w [C, kh, kw]. One workgroup a (n, c) plane. The plane's output is cut into blocks of `R`
rows by `B` vectors of 8 columns (R B accumulators, at most 12 of the 16 ymm: the loaded input vector and a
broadcast weight are the other two); for each of the R + kh - 1 input rows a block reads, each kernel column j
and each vector b, one unaligned load of 8 input columns feeds the FMAs of every output row that row reaches
(kernel row i = input row - output row). The taps of an output are summed in (i, j) order, as a plain sum.

IREE 3.13 runs a depthwise convolution as a generic loop nest 3.5-10x slower than eager (7x7 on 96 channels,
56x56); the project's graph forms (`depthwise_conv_as_taps`, `depthwise_conv_as_row_partials`) bring it to
1.2-1.9x (docs/performance.md, "Per ISA"). 8-lane vectors on both ISAs (AVX-512 runs them too).

It enters a graph as `fx_rewrites::depthwise_conv2d(xp, w)` (eager: torch's grouped convolution), which torch-mlir
imports as `torch.operator "torch.fx_rewrites.depthwise_conv2d"`; `splice` (run by `IreeBackend` through
`kernels.spliced`) replaces each call by a `flow.dispatch` of its `stream.executable`. The rule writing it is
`rules/depthwise_dispatch.py`.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

import torch

from fx_rewrites.backends.iree import spliced

OP, MARK = "fx_rewrites::depthwise_conv2d", "torch.fx_rewrites.depthwise_conv2d"
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


def _load(x: str, add: Callable[[str], None], name: str, row: str, start: int, width: int, xt: str) -> None:
    """`name` = the 8 input columns from `start` of the input row at index `row` (a plane's row start), the columns
    outside [0, width) zero (the padding): one load inside the row, shuffled against zeros at its edges."""
    vec = f"vector<{LANES}xf32>"
    base = min(max(start, 0), width - LANES)
    add(f"%{name}a = arith.addi {row}, %c{base}w : index")
    if base == start:
        add(f"%{name} = vector.load {x}[%{name}a] : {xt}, {vec}")
        return
    add(f"%{name}l = vector.load {x}[%{name}a] : {xt}, {vec}")
    lanes = [LANES + start + lane - base if 0 <= start + lane < width else 0 for lane in range(LANES)]
    add(f"%{name} = vector.shuffle %zero, %{name}l [{', '.join(map(str, lanes))}] : {vec}, {vec}")


def _block(
    add: Callable[[str], None], tag: str, r0: str, rows_in: range, shape: tuple[int, ...], starts: list[int]
) -> None:
    """A block of R output rows from row index `r0` by the vectors of 8 columns from each of `starts`; `rows_in`:
    the block's input rows (relative to r0 - ph) that lie in the plane (all of them for a block off the edges)."""
    _, _, _, w, kh, kw, ph, pw, _, ow, r, xt, ot = shape
    vec = f"vector<{LANES}xf32>"
    acc = {(o, v): "%zero" for o in range(r) for v in range(len(starts))}
    for t in rows_in:
        add(f"%{tag}ri{t} = arith.addi {r0}, %c{t}w : index")  # the input row + ph
        add(f"%{tag}rs{t} = arith.subi %{tag}ri{t}, %c{ph}w : index")
        add(f"%{tag}rm{t} = arith.muli %{tag}rs{t}, %c{w}w : index")
        add(f"%{tag}rb{t} = arith.addi %xplane, %{tag}rm{t} : index")
        for j in range(kw):
            for v, start in enumerate(starts):
                x = f"{tag}x{t}_{j}_{v}"
                _load("%xm", add, x, f"%{tag}rb{t}", start + j - pw, w, xt)
                for o in range(r):
                    if 0 <= t - o < kh:
                        name = f"%{tag}a{t}_{j}_{v}_{o}"
                        add(f"{name} = vector.fma %{x}, %wv{t - o}_{j}, {acc[o, v]} : {vec}")
                        acc[o, v] = name
    add(f"%{tag}om = arith.muli {r0}, %c{ow}w : index")
    add(f"%{tag}ob = arith.addi %oplane, %{tag}om : index")
    for (o, v), value in acc.items():
        add(f"%{tag}oa{o}_{v} = arith.addi %{tag}ob, %c{o * ow + starts[v]}w : index")
        add(f"vector.store {value}, %om[%{tag}oa{o}_{v}] : {ot}, {vec}")


def _kernel(n: int, c: int, h: int, w: int, kh: int, kw: int, ph: int, pw: int) -> str:
    oh, ow = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
    if oh < 1 or min(ow, w) < LANES:
        raise ValueError(f"an output {oh}x{ow} from {h}x{w}: widths of at least {LANES}")
    r, chunks = block(oh, ow)
    vec = f"vector<{LANES}xf32>"
    xt, wt, ot = f"memref<{n * c * h * w}xf32>", f"memref<{c * kh * kw}xf32>", f"memref<{n * c * oh * ow}xf32>"
    shape = (n, c, h, w, kh, kw, ph, pw, oh, ow, r, xt, ot)
    lines = [
        "%c0 = arith.constant 0 : index",
        f"%zero = arith.constant dense<0.0> : {vec}",
        f"%xm = stream.binding.subspan %bx[%c0] : !stream.binding -> {xt}",
        f"%wm = stream.binding.subspan %bw[%c0] : !stream.binding -> {wt}",
        f"%om = stream.binding.subspan %bo[%c0] : !stream.binding -> {ot}",
        "%p = stream.dispatch.workgroup.id[0] : index",
        f"%ch = arith.remui %p, %c{c}w : index",
        f"%xplane = arith.muli %p, %c{h * w}w : index",
        f"%oplane = arith.muli %p, %c{oh * ow}w : index",
        f"%wbase = arith.muli %ch, %c{kh * kw}w : index",
    ]
    add = lines.append
    for i in range(kh):  # the plane's weights, one scalar each, broadcast where used
        for j in range(kw):
            add(f"%wi{i}_{j} = arith.addi %wbase, %c{i * kw + j}w : index")
            add(f"%ws{i}_{j} = memref.load %wm[%wi{i}_{j}] : {wt}")
            add(f"%wv{i}_{j} = vector.broadcast %ws{i}_{j} : f32 to {vec}")
    span = r + kh - 1  # input rows a block reads, from its first output row - ph
    inside = [r0 for r0 in range(0, oh, r) if r0 - ph >= 0 and r0 - ph + span <= h]
    for k, starts in enumerate(chunks):  # column blocks, each with its own edges
        for r0 in range(0, oh, r):  # the blocks that read padding rows: their rows in the plane only
            if r0 not in inside:
                rows_in = range(max(0, ph - r0), min(span, h + ph - r0))
                _block(add, f"e{r0}_{k}_", f"%c{r0}w", rows_in, shape, starts)
        if inside:
            add(f"scf.for %r0 = %c{inside[0]}w to %c{inside[-1] + r}w step %c{r}w {{")
            _block(add, f"i{k}_", "%r0", range(span), shape, starts)
            add("}")
    lines.append("return")
    return spliced.with_index_constants("\n".join(lines))


def executable(n: int, c: int, h: int, w: int, kh: int, kw: int, ph: int, pw: int) -> tuple[str, str]:
    """The name (unique per shape: findings 52) and text of the `stream.executable` over N C workgroups."""
    name = f"dwconv_{n}x{c}x{h}x{w}_k{kh}x{kw}_p{ph}x{pw}"
    body = _kernel(n, c, h, w, kh, kw, ph, pw)
    return name, spliced.executable(name, "%bx: !stream.binding, %bw: !stream.binding, %bo: !stream.binding", 1, body)


@torch.library.custom_op(OP, mutates_args=())
def depthwise_conv2d(x: torch.Tensor, w: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
    """The depthwise convolution of `x` [N, C, H, W] by `w` [C, kh, kw], stride 1, padded by (ph, pw) zeros."""
    return torch.nn.functional.conv2d(x, w.unsqueeze(1), padding=(ph, pw), groups=w.shape[0])


@depthwise_conv2d.register_fake
def _(x: torch.Tensor, w: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
    n, c, h, width = x.shape
    return x.new_empty(n, c, h + 2 * ph - w.shape[1] + 1, width + 2 * pw - w.shape[2] + 1)


DEPTHWISE_CONV2D = torch.ops.fx_rewrites.depthwise_conv2d.default

_CALL = re.compile(
    rf'^(\s*)(%[\w]+) = torch\.operator "{re.escape(MARK)}"\((%[\w]+), (%[\w]+), (%[\w]+), (%[\w]+)\) : '
    r"\((.*)\) -> (.*)$"
)


def splice(mlir: str) -> str:
    """`mlir` with every `fx_rewrites.depthwise_conv2d` call replaced by a `flow.dispatch` of its executable.
    ValueError where a call has another form (dynamic sizes: the rule takes static ones only)."""
    out, executables = [], {}
    ints = dict(spliced._INT.findall(mlir))
    for line in mlir.splitlines():
        found = _CALL.match(line)
        if not found or found.group(5) not in ints or found.group(6) not in ints:
            if MARK in line:
                raise ValueError(f"a depthwise_conv2d call of an unknown form: {line.strip()[:200]}")
            out.append(line)
            continue
        pad, res, x, w, iph, ipw, types, otype = found.groups()
        vx, vw = re.findall(r"!torch\.vtensor<[^>]*>", types)[:2]
        (tx, sx), (tw, sw) = spliced._tensor(vx), spliced._tensor(vw)
        if "?" in sx + sw:
            raise ValueError(f"a depthwise_conv2d call with a dynamic size: {line.strip()[:200]}")
        (n, c, h, width), (kh, kw), (ph, pw) = (
            (int(s) for s in sx),
            (int(sw[1]), int(sw[2])),
            (int(ints[iph]), int(ints[ipw])),
        )
        name, text = executable(n, c, h, width, kh, kw, ph, pw)
        executables[name] = text
        to = f"tensor<{n}x{c}x{h + 2 * ph - kh + 1}x{width + 2 * pw - kw + 1}xf32>"
        v = f"dwc{res[1:]}"
        out += [
            f"{pad}%{v}_x = torch_c.to_builtin_tensor {x} : {vx} -> {tx}",
            f"{pad}%{v}_w = torch_c.to_builtin_tensor {w} : {vw} -> {tw}",
            f"{pad}%{v}_n = arith.constant {n * c} : index",
            f"{pad}%{v}_d = flow.dispatch @{name}::@{name}[%{v}_n](%{v}_x, %{v}_w) : ({tx}, {tw}) -> {to}",
            f"{pad}{res} = torch_c.from_builtin_tensor %{v}_d : {to} -> {otype.strip()}",
        ]
    if not executables:
        raise ValueError("no depthwise_conv2d call in the module")
    start = next(i for i, line in enumerate(out) if line.startswith("module"))
    return "\n".join([*out[: start + 1], *executables.values(), *out[start + 1 :]])
