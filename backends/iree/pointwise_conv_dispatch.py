"""A hand-written 1x1 convolution dispatch over NCHW (issue 32): output channels by pixel vectors in registers.

y[n, o, p] = b[o] + sum over c of w[o, c] x[n, c, p], x [N, C, P] (P = H W, the pixels contiguous), w [O, C]. A
block is R output channels by V vectors of `lanes` pixels: for each input channel, V vector loads of x's row and R
broadcast weights feed R x V FMAs (AVX2: 4 x 3 of 8 lanes in 12 ymm; AVX-512: 4 x 6 of 16 in 24 zmm). No packing:
x is read as it lies (its rows of pixels are the vectors), where IREE 3.13 packs x for its data-tiled product and
unpacks y (the 1x1 256->64 on 56x56 at 1.75-2.10x eager, docs/performance.md "Both ISAs on one AVX-512 host"). One
workgroup an (n, chunk of `PARTS` V lanes pixels); it runs every block of output channels over its chunk (each
block its parts in turn), whose x (C x chunk floats) stays in cache; the last chunk holds the rest, its partial
vector masked (an overlapping chunk would race on y, which each block of input channels adds to). The input
channels are summed in blocks of `CHANNEL_BLOCK` (in channel order, in registers), each block added to y, the first
with the bias, the last with the ReLU where the call has one.

The same kernel runs a kxk convolution as k k taps (`Shape.taps`: each a fixed offset into x's flattened, padded
channel; `tap_conv_dispatch.py`), its channel blocks then `CHANNEL_BLOCK` products a sum.

It enters a graph as `fx_rewrites::pointwise_conv2d(x, w, b, lanes, relu)` (eager: torch's convolution, then the
ReLU where `relu` is 1), imported by torch-mlir as `torch.operator "torch.fx_rewrites.pointwise_conv2d"`; `splice`
(run by `IreeBackend` through `kernels.spliced`) replaces each call by a `flow.dispatch` of its `stream.executable`.
The rules writing it (and folding a batch norm and a ReLU into it) are in `rules/pointwise_conv_dispatch.py`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch

from fx_rewrites.backends import freezing_fold
from fx_rewrites.backends.iree import spliced

OP, MARK = "fx_rewrites::pointwise_conv2d", "torch.fx_rewrites.pointwise_conv2d"
MARKS = (MARK,)
#: (output channels, vectors) a block, by lanes: R V accumulators, V loaded vectors and a broadcast weight within
#: the ISA's vector registers (16 ymm, 32 zmm). AVX-512's 4 x 6 (96 pixels a workgroup) ran 0-12% faster than 8 x 3
#: on each of ten ResNet-50 1x1 and kxk shapes (docs/performance.md, "A call's inputs read where they lie"); AVX2's
#: 4 x 3 beat 2 x 5 and 2 x 6 (the latter spill)
BLOCKS = {8: (4, 3), 16: (4, 6)}
#: input channels a block sums in registers before adding it to y (a plain sum over 1024 channels was 5-7x torch's
#: float32 error against float64; torch's blocks its sums too)
CHANNEL_BLOCK = 64
#: by lanes: a 1x1's blocks of output channels prefetch the next block of input channels' rows of x into L2
#: (`prefetcht1`), one vector a row each, where the first block over a block of input channels otherwise waits on
#: x's rows from L3 (a 24 KiB panel in 6-line pieces 12.5 KiB apart). AVX-512: the module alone 0.87-0.88 of it
#: without (1x1 256->64, 56x56), ResNet-50 0.968, MobileNetV2 0.975 (docs/performance.md, "A 1x1's next input
#: channels prefetched"). AVX2: on with `PARTS` 4 (alone, whole models had read 0.99-1.015)
PREFETCH = {8: True, 16: True}
#: by lanes: a 1x1's register blocks of pixels a workgroup (its chunk: PARTS V vectors), each block of output channels
#: running them in turn over the same weights. AVX2's 4 (96 pixels, x's rows 6 whole cache lines), with `PREFETCH`:
#: the 1x1 256->64 row through the route 0.88-0.93 of 1 without it, the strided 1x1 row 1.00, ResNeXt-50 0.88-0.96,
#: MobileNetV2 0.95-0.98, EfficientNet-B0 0.97-0.99, ResNet-50 0.96-1.00; 2 gave the row the same, the models less
#: (docs/performance.md, "AVX2's 1x1: four blocks of pixels a workgroup"). AVX-512 keeps 1 (2 read 1.05-1.10 of it)
PARTS = {8: 4, 16: 1}


@dataclasses.dataclass(frozen=True)
class Shape:
    """One convolution as taps over flattened pixels: y[n, o, q] = b[o] + sum over c, t of w[o, c, t] x[n, c, q +
    taps[t]], x [n, c, span] (`span` floats a channel: p by default), w [o, c, len(taps)], y [n, o, p]; `lanes` a
    vector's floats; `relu`: y's negative values stored as 0. A 1x1 is the one tap 0 (q a pixel of h w); a kxk is
    k k taps over a padded image (`tap_conv_dispatch.py`)."""

    n: int
    c: int
    p: int
    o: int
    lanes: int
    relu: bool = False
    taps: tuple[int, ...] = (0,)
    span: int = 0

    def __post_init__(self) -> None:
        if self.span and self.p - 1 + max(self.taps) >= self.span:
            raise ValueError(f"taps up to {max(self.taps)} over {self.p} positions read past a channel's {self.span}")

    @property
    def stride(self) -> int:
        """x's floats a channel."""
        return self.span or self.p

    @property
    def channel_block(self) -> int:
        """Input channels summed in registers before y is added to: `CHANNEL_BLOCK` products a sum."""
        return max(1, CHANNEL_BLOCK // len(self.taps))

    @property
    def block(self) -> tuple[int, int]:
        """(R output channels, V vectors): R the largest divisor of o up to the ISA's, V as many vectors as fit p."""
        rows, vectors = BLOCKS[self.lanes]
        return max(d for d in range(1, rows + 1) if self.o % d == 0), min(vectors, -(-self.p // self.lanes))

    @property
    def parts(self) -> int:
        """Register blocks of pixels a workgroup: `PARTS` for a 1x1, one for taps."""
        return PARTS[self.lanes] if self.taps == (0,) else 1

    @property
    def chunk(self) -> int:
        """Pixels a workgroup (the last one: the rest, `tail`)."""
        return min(self.parts * self.block[1], -(-self.p // self.lanes)) * self.lanes

    @property
    def chunks(self) -> int:
        """Workgroups an image."""
        return -(-self.p // self.chunk)

    @property
    def tail(self) -> int:
        """Pixels of an image's last workgroup."""
        return self.p - (self.chunks - 1) * self.chunk

    def memrefs(self) -> tuple[str, str, str, str]:
        sizes = (self.n * self.c * self.stride, self.o * self.c * len(self.taps), self.o, self.n * self.o * self.p)
        return tuple(f"memref<{size}xf32>" for size in sizes)


def _vectors(pixels: int, lanes: int) -> list[int]:
    """The lanes in use of each vector over `pixels` (all but the last full)."""
    return [min(lanes, pixels - start) for start in range(0, pixels, lanes)]


class _Writer:
    """The kernel's lines for one chunk of pixels (`vectors`: each vector's lanes in use; a partial one masked)."""

    def __init__(self, add: Callable[[str], None], conv: Shape, tag: str, vectors: list[int]) -> None:
        self.add, self.conv, self.tag, self.vectors = add, conv, tag, vectors
        self.vec = f"vector<{conv.lanes}xf32>"
        self.mask = f"vector<{conv.lanes}xi1>"
        for u, used in enumerate(vectors):
            if used < conv.lanes:
                add(f"%{tag}m{u} = vector.constant_mask [{used}] : {self.mask}")

    def load(self, name: str, memref: str, at: str, u: int) -> None:
        c, t = self.conv, self.tag
        if self.vectors[u] == c.lanes:
            self.add(f"{name} = vector.load {memref}[{at}] : {self._type(memref)}, {self.vec}")
        else:
            self.add(
                f"{name} = vector.maskedload {memref}[{at}], %{t}m{u}, %zero : {self._type(memref)}, {self.mask}, "
                f"{self.vec} into {self.vec}"
            )

    def store(self, value: str, memref: str, at: str, u: int) -> None:
        if self.vectors[u] == self.conv.lanes:
            self.add(f"vector.store {value}, {memref}[{at}] : {self._type(memref)}, {self.vec}")
        else:
            types = f"{self._type(memref)}, {self.mask}, {self.vec}"
            self.add(f"vector.maskedstore {memref}[{at}], %{self.tag}m{u}, {value} : {types}")

    def _type(self, memref: str) -> str:
        xt, _, _, ot = self.conv.memrefs()
        return xt if memref == "%xm" else ot

    def products(
        self, tag: str, first: str, last: str, part: list[int], weights: str, ahead: str | None = None
    ) -> list[str]:
        """The block's R x V accumulators (the vectors `part`) over input channels `first` to `last` (index values),
        from zero, in channel order; returns their names. `weights`: the index of the block's first weight;
        `ahead`: an index value, x's offset from each step's row to prefetch."""
        add, conv, vec = self.add, self.conv, self.vec
        r = conv.block[0]
        wt = conv.memrefs()[1]
        keys = [(o, u) for o in range(r) for u in part]
        add(
            f"%{tag}acc:{len(keys)} = scf.for %{tag}k = {first} to {last} step %c1w iter_args("
            + ", ".join(f"%{tag}a{o}_{u} = %zero" for o, u in keys)
            + f") -> ({', '.join([vec] * len(keys))}) {{"
        )
        taps = len(conv.taps)
        add(f"%{tag}kx = arith.muli %{tag}k, %c{conv.stride}w : index")
        add(f"%{tag}xr = arith.addi %xb, %{tag}kx : index")
        add(f"%{tag}kt = arith.muli %{tag}k, %c{taps}w : index")
        add(f"%{tag}wk = arith.addi {weights}, %{tag}kt : index")
        sums = {key: f"%{tag}a{key[0]}_{key[1]}" for key in keys}
        if ahead is not None:
            add(f"%{tag}pf = arith.addi %{tag}xr, {ahead} : index")
            add(f"memref.prefetch %xm[%{tag}pf], read, locality<2>, data : {conv.memrefs()[0]}")
        for t, offset in enumerate(conv.taps):
            for u in part:
                add(f"%{tag}xi{t}_{u} = arith.addi %{tag}xr, %c{offset + u * conv.lanes}w : index")
                self.load(f"%{tag}x{t}_{u}", "%xm", f"%{tag}xi{t}_{u}", u)
            for o in range(r):
                add(f"%{tag}wi{t}_{o} = arith.addi %{tag}wk, %c{o * conv.c * taps + t}w : index")
                add(f"%{tag}ws{t}_{o} = memref.load %wm[%{tag}wi{t}_{o}] : {wt}")
                add(f"%{tag}w{t}_{o} = vector.broadcast %{tag}ws{t}_{o} : f32 to {vec}")
                for u in part:
                    add(f"%{tag}f{t}_{o}_{u} = vector.fma %{tag}x{t}_{u}, %{tag}w{t}_{o}, {sums[o, u]} : {vec}")
                    sums[o, u] = f"%{tag}f{t}_{o}_{u}"
        add(f"scf.yield {', '.join(sums[key] for key in keys)} : {', '.join([vec] * len(keys))}")
        add("}")
        return [f"%{tag}acc#{n}" for n in range(len(keys))]

    def blocks(self, tag: str, first: str, last: str, initial: bool, relu: bool, more: bool) -> None:
        """Every block of R output channels over input channels `first` to `last`: y = the sums + the bias where
        `initial`, else y += the sums; then max(y, 0) where `relu` (the last block of input channels). `more`: a
        block of input channels follows, whose rows a 1x1's blocks prefetch (`PREFETCH`), block i its vector i % the
        chunk's vectors. Each block of output channels runs the chunk's parts (V vectors each, `PARTS`) in turn."""
        add, conv = self.add, self.conv
        r, v = conv.block
        add(f"scf.for %{tag}ob = %c0 to %c{conv.o}w step %c{r}w {{")
        add(f"%{tag}wb = arith.muli %{tag}ob, %c{conv.c * len(conv.taps)}w : index")
        ahead = None
        if PREFETCH[conv.lanes] and more and conv.taps == (0,):
            add(f"%{tag}oi = arith.divui %{tag}ob, %c{r}w : index")
            add(f"%{tag}ou = arith.remui %{tag}oi, %c{len(self.vectors)}w : index")
            add(f"%{tag}ol = arith.muli %{tag}ou, %c{conv.lanes}w : index")
            add(f"%{tag}pa = arith.addi %{tag}ol, %c{conv.channel_block * conv.stride}w : index")
            ahead = f"%{tag}pa"
        parts = [list(range(s, min(s + v, len(self.vectors)))) for s in range(0, len(self.vectors), v)]
        for i, part in enumerate(parts):
            named = tag if len(parts) == 1 else f"{tag}p{i}"
            sums = self.products(named, first, last, part, f"%{tag}wb", ahead if i == 0 else None)
            self._stored(named, f"%{tag}ob", part, sums, initial, relu)
        add("}")

    def _stored(self, tag: str, ob: str, part: list[int], sums: list[str], initial: bool, relu: bool) -> None:
        """y's R rows from output channel `ob` over the vectors `part`: the sums + the bias where `initial`, else
        y + the sums; max(_, 0) where `relu`."""
        add, conv, vec = self.add, self.conv, self.vec
        r, bt = conv.block[0], conv.memrefs()[2]
        for o in range(r):
            add(f"%{tag}oc{o} = arith.addi {ob}, %c{o}w : index")
            add(f"%{tag}yo{o} = arith.muli %{tag}oc{o}, %c{conv.p}w : index")
            add(f"%{tag}yr{o} = arith.addi %yb, %{tag}yo{o} : index")
            if initial:
                add(f"%{tag}bs{o} = memref.load %bm[%{tag}oc{o}] : {bt}")
                add(f"%{tag}bv{o} = vector.broadcast %{tag}bs{o} : f32 to {vec}")
            for j, u in enumerate(part):
                at = f"%{tag}yi{o}_{u}"
                add(f"{at} = arith.addi %{tag}yr{o}, %c{u * conv.lanes}w : index")
                if initial:
                    add(f"%{tag}s{o}_{u} = arith.addf {sums[o * len(part) + j]}, %{tag}bv{o} : {vec}")
                else:
                    self.load(f"%{tag}y{o}_{u}", "%om", at, u)
                    add(f"%{tag}s{o}_{u} = arith.addf %{tag}y{o}_{u}, {sums[o * len(part) + j]} : {vec}")
                value = f"%{tag}s{o}_{u}"
                if relu:
                    add(f"%{tag}r{o}_{u} = arith.maximumf {value}, %zero : {vec}")
                    value = f"%{tag}r{o}_{u}"
                self.store(value, "%om", at, u)

    def chunk(self) -> None:
        """The chunk's y: its first block of input channels with the bias, then each other block added, the last
        with the ReLU where the convolution has one."""
        conv, add, t = self.conv, self.add, self.tag
        block = conv.channel_block
        starts = list(range(0, conv.c, block))
        if len(starts) == 1:
            self.blocks(f"{t}h", "%c0", f"%c{conv.c}w", True, conv.relu, False)
            return
        self.blocks(f"{t}h", "%c0", f"%c{block}w", True, False, True)
        if len(starts) > 2:  # the whole blocks between the first and the last
            add(f"scf.for %{t}kb = %c{starts[1]}w to %c{starts[-1]}w step %c{block}w {{")
            add(f"%{t}ke = arith.addi %{t}kb, %c{block}w : index")
            self.blocks(f"{t}t", f"%{t}kb", f"%{t}ke", False, False, True)
            add("}")
        self.blocks(f"{t}z", f"%c{starts[-1]}w", f"%c{conv.c}w", False, conv.relu, False)


def _kernel(conv: Shape) -> str:
    if conv.lanes not in BLOCKS:
        raise ValueError(f"vectors of {conv.lanes} lanes: one of {sorted(BLOCKS)}")
    xt, wt, bt, ot = conv.memrefs()
    add = (lines := []).append
    for line in (
        "%c0 = arith.constant 0 : index",
        f"%zero = arith.constant dense<0.0> : vector<{conv.lanes}xf32>",
        f"%xm = stream.binding.subspan %bx[%c0] : !stream.binding -> {xt}",
        f"%wm = stream.binding.subspan %bw[%c0] : !stream.binding -> {wt}",
        f"%bm = stream.binding.subspan %bb[%c0] : !stream.binding -> {bt}",
        f"%om = stream.binding.subspan %bo[%c0] : !stream.binding -> {ot}",
        "%g = stream.dispatch.workgroup.id[0] : index",  # (n, chunk)
        f"%ch = arith.remui %g, %c{conv.chunks}w : index",
        f"%ni = arith.divui %g, %c{conv.chunks}w : index",
        f"%p0 = arith.muli %ch, %c{conv.chunk}w : index",
        f"%nx = arith.muli %ni, %c{conv.c * conv.stride}w : index",
        "%xb = arith.addi %nx, %p0 : index",
        f"%ny = arith.muli %ni, %c{conv.o * conv.p}w : index",
        "%yb = arith.addi %ny, %p0 : index",
    ):
        add(line)
    if conv.tail == conv.chunk:
        _Writer(add, conv, "f", _vectors(conv.chunk, conv.lanes)).chunk()
    else:  # the last chunk's vectors: as many as its pixels need, the last one masked where it is partial
        add(f"%last = arith.cmpi eq, %ch, %c{conv.chunks - 1}w : index")
        add("scf.if %last {")
        _Writer(add, conv, "l", _vectors(conv.tail, conv.lanes)).chunk()
        add("} else {")
        _Writer(add, conv, "f", _vectors(conv.chunk, conv.lanes)).chunk()
        add("}")
    add("return")
    return spliced.with_index_constants("\n".join(lines))


def executable(conv: Shape, name: str = "") -> tuple[str, str]:
    """The name (unique per shape: findings 52; `name` where the caller makes it) and text of the
    `stream.executable` over n x chunks workgroups."""
    c = conv
    name = name or f"pwconv_{c.n}x{c.c}x{c.p}_o{c.o}_l{c.lanes}{'_relu' if c.relu else ''}"
    bindings = "%bx: !stream.binding, %bw: !stream.binding, %bb: !stream.binding, %bo: !stream.binding"
    return name, spliced.executable(name, bindings, 1, _kernel(c))


@torch.library.custom_op(OP, mutates_args=())
def pointwise_conv2d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, lanes: int, relu: int) -> torch.Tensor:
    """The 1x1 convolution of `x` [N, C, H, W] by `w` [O, C] plus `b` [O], then a ReLU where `relu` is 1 (`lanes`:
    the kernel's vectors)."""
    y = torch.nn.functional.conv2d(x, w[:, :, None, None], b)
    return torch.relu(y) if relu else y


@pointwise_conv2d.register_fake
def _(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, lanes: int, relu: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0], *x.shape[2:])


POINTWISE_CONV2D = torch.ops.fx_rewrites.pointwise_conv2d.default
freezing_fold.CONVOLUTIONS[POINTWISE_CONV2D] = 4  # its `relu` argument: the torch.compile route folds a batch norm in

_CALL = re.compile(
    rf'^(\s*)(%[\w]+) = torch\.operator "{re.escape(MARK)}"\((%[\w#]+), (%[\w#]+), (%[\w#]+), (%[\w]+), (%[\w]+)\) : '
    r"\((.*)\) -> (.*)$"
)


def splice(mlir: str) -> str:
    """`mlir` with every `fx_rewrites.pointwise_conv2d` call replaced by a `flow.dispatch` of its executable.
    ValueError where a call has another form (dynamic sizes: the rule takes static ones only)."""
    return spliced.splice_each(mlir, MARK, "pointwise_conv2d", _convert)


def _convert(line: str, ints: dict[str, str]) -> spliced.Spliced:
    found = _CALL.match(line)
    if not found or found.group(6) not in ints or found.group(7) not in ints:
        raise ValueError(f"a pointwise_conv2d call of an unknown form: {line.strip()[:200]}")
    pad, res, x, w, b, lanes, relu, types, otype = found.groups()
    vx, vw, vb = re.findall(r"!torch\.vtensor<[^>]*>", types)[:3]
    sx, sw = spliced._tensor(vx)[1], spliced._tensor(vw)[1]
    if "?" in "".join(sx + sw):
        raise ValueError(f"a pointwise_conv2d call with a dynamic size: {line.strip()[:200]}")
    n, c, h, width = (int(s) for s in sx)
    conv = Shape(n, c, h * width, int(sw[0]), int(ints[lanes]), bool(int(ints[relu])))
    name, text = executable(conv)
    to = f"tensor<{n}x{conv.o}x{h}x{width}xf32>"
    operands = [(x, vx), (w, vw), (b, vb)]
    return spliced.dispatch_lines(pad, f"pwc{res[1:]}", name, operands, n * conv.chunks, to, res, otype), name, text
