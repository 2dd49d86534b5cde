"""Hand-written float32 matmul dispatches (issue 32): a register block per ISA against IREE 3.13's own product.

y[M, N] = x[M, K] @ W^T (+ b), W [N, K] laid out [N/S, K, S] (`pack`: a strip of S output channels, K-major,
`vectors` vectors a step of K). The kernel keeps a `rows` x S block of y in accumulators; per step of K it loads the
strip's vectors and broadcasts `rows` values of x (row-major, one `vbroadcastss` each) into rows x vectors FMAs.
`BLOCKS` holds the block per ISA, as data for the one generator:

- AVX2: 6x16 in 12 ymm (2 loads and 6 broadcasts per 12 FMAs: oneDNN's AVX2 shape, where IREE's `mmt4d` 8x8x1 does
  one load and 8 broadcasts per 8 FMAs: docs/iree-3.13-findings.md section 50); with the strip and one broadcast 15
  of the 16 ymm.
- AVX-512: 12x32 in 24 zmm (2 loads and 12 broadcasts per 24 FMAs; IREE's 16x16x1 `mmt4d` ukernel: 1 and 16 per 16);
  27 of the 32 zmm (14x32, 31 of them, ran 2-21% slower: docs/performance.md).

The loops, outer to inner: K blocks of `kc`, row chunks of `mc`, the workgroup's `per` strips, blocks of `rows` rows
(the M % rows left over by one block of that many), sums of `ks` steps (each from zero, then added to y), the K steps
unrolled by 4; the row blocks of the first row chunk also prefetch the next strip's (or K block's) weight into L2
(`PREFETCH`). A bias, where given, is added to the accumulators when y's block is first stored. On AVX-512,
where K is a multiple of 512 and N at least 1024, x's rows are first copied 16 floats apart by a dispatch of their own
(`X_PAD`: rows 4 KiB apart share L1 sets) and the kernel reads x with that stride.

It enters a graph as `fx_rewrites::f32_matmul(x, packed, n, tile, per)` or, with a bias, `fx_rewrites::f32_linear(x,
packed, bias, n, tile, per)` (eager: the weight unpacked by torch), `tile` = S / 8 naming the block (2: AVX2's, 4:
AVX-512's), which torch-mlir imports as `torch.operator "torch.fx_rewrites.f32_matmul"` (`...f32_linear`); `splice`
(run by `IreeBackend` through `kernels.spliced`) replaces each by a `flow.dispatch` of its `stream.executable`. The
rules writing them are `rules/f32_matmul.py`'s; the packing is a view and permute of the weight in the graph, which
IREE evaluates once for a weight the program holds (in the module's initializer or at compile time). Static rows only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fx_rewrites.backends.iree import spliced


@dataclass(frozen=True)
class Block:
    """A register block: `rows` rows of y by `vectors` vectors of `lanes` float32 (a strip of lanes x vectors
    channels): rows x vectors accumulators, `vectors` registers of the strip and one broadcast."""

    lanes: int
    vectors: int
    rows: int

    @property
    def strip(self) -> int:
        return self.lanes * self.vectors

    @property
    def tile(self) -> int:
        """The op's `tile`: the strip in 8-channel units (the splice's workgroups are N / (8 tile) / per)."""
        return self.strip // 8

    @property
    def name(self) -> str:
        return f"{self.rows}x{self.strip}"


#: the register block per ISA, one per strip width (a benchmark may set AVX-512's to another block of 32 channels)
BLOCKS = {"avx2": Block(8, 2, 6), "avx512": Block(16, 2, 12)}
#: K steps unrolled
KU = 4
OP, MARK = "fx_rewrites::f32_matmul", "torch.fx_rewrites.f32_matmul"
LINEAR_OP, LINEAR_MARK = "fx_rewrites::f32_linear", "torch.fx_rewrites.f32_linear"
MARKS = (MARK, LINEAR_MARK)
#: the K block (its strip's S kc floats stay in L1 across the row blocks), the row chunk (x's block in L2; rounded
#: down to the block's rows), the K steps summed from zero before they are added to y (the error of short sums: within
#: torch's own); benchmarks sweep them (benchmarks/f32_dispatch.py), so they are part of the executable's name
BLOCKING = {"kc": 256, "mc": 96, "ks": 128}
#: x's row stride where K is a multiple of `X_PAD_EVERY` floats and N at least `X_PAD_MIN_N`: K + `X_PAD[isa]`, x's
#: rows copied there by a dispatch before the kernel's (`spliced.splice_calls`' `columns`), so that the block's rows,
#: K floats apart (K 1024: 4 KiB), do not share L1 sets. AVX-512 only: the kernel ran 7% faster on x already padded,
#: the linear 1024 -> 1024 over 128 rows 1.08x eager against 1.13x; where N is 256 (BERT's, ViT's, the Whisper
#: encoder's second MLP product) the copy, paid once for N / 32 strips, lost (docs/performance.md, "x's rows 4 KiB
#: apart"); AVX2 on this host: no gain (6 rows)
X_PAD, X_PAD_EVERY, X_PAD_MIN_N = {"avx2": 0, "avx512": 16}, 512, 1024
#: by lanes, the cache the row blocks of a strip's K block prefetch the next strip's (or K block's) into (`_ahead`, one
#: line an unrolled step of K; `memref.prefetch`'s locality: 2 `prefetcht1`, L2; 0 none), where that block's first row
#: block otherwise waits on the weight (larger than L2: streamed from L3 at each call). The linear 1024 -> 1024 over 128
#: rows 0.87-0.90 of the route without it on both ISAs, the models even or better (docs/performance.md, "The float32
#: kernel's next weight block prefetched")
PREFETCH = {8: 2, 16: 2}
#: strips a workgroup (the measured split: docs/performance.md, "A float32 matmul kernel of our own")
PER = 4


def block_of(tile: int) -> Block:
    """The block of `BLOCKS` whose strip is 8 `tile` channels."""
    for block in BLOCKS.values():
        if block.tile == tile:
            return block
    raise ValueError(f"tile {tile}: no register block has a strip of {8 * tile} channels (BLOCKS: {BLOCKS})")


def pack(w: torch.Tensor, strip: int = 16) -> torch.Tensor:
    """W [N, K] as [N/strip, K, strip] (flattened): strip s, step k holds W[strip s .. strip s + strip - 1, k]."""
    n, k = w.shape
    return w.view(n // strip, strip, k).transpose(1, 2).contiguous().flatten()


def unpack(packed: torch.Tensor, n: int, strip: int = 16) -> torch.Tensor:
    k = packed.numel() // n
    return packed.view(n // strip, k, strip).transpose(1, 2).reshape(n, k)


@dataclass(frozen=True)
class Shape:
    """One kernel's sizes and memref types (`blocks`: K's sums of `ks`; `bias`: a bias operand `%bm`)."""

    k: int
    n: int
    kc: int
    ks: int
    blocks: int
    bias: bool
    xt: str
    wt: str
    ot: str
    ld: int = 0  # x's row stride (0: K)


def stores(b: Block, rows: int, s: Shape, tag: str, *, first: bool) -> list[str]:
    """The accumulators stored into y (`first`: as they are, the bias added where given) or added to y."""
    vec, lines = f"vector<{b.lanes}xf32>", []
    add = lines.append
    if first and s.bias:
        for h in range(b.vectors):
            add(f"%bo{tag}_{h} = arith.addi %ob{tag}, %c{h * b.lanes}w : index")
            add(f"%bv{tag}_{h} = vector.load %bm[%bo{tag}_{h}] : memref<{s.n}xf32>, {vec}")
    for i, (r, h) in enumerate((r, h) for r in range(rows) for h in range(b.vectors)):
        val, at = f"%res{tag}#{i}", f"%oo{tag}{r}_{h}"
        if not first:
            add(f"%ld{tag}{r}_{h} = vector.load %om[{at}] : {s.ot}, {vec}")
            add(f"%sum{tag}{r}_{h} = arith.addf %ld{tag}{r}_{h}, {val} : {vec}")
            val = f"%sum{tag}{r}_{h}"
        elif s.bias:
            add(f"%bs{tag}{r}_{h} = arith.addf {val}, %bv{tag}_{h} : {vec}")
            val = f"%bs{tag}{r}_{h}"
        add(f"vector.store {val}, %om[{at}] : {s.ot}, {vec}")
    return lines


def micro(
    b: Block,
    rows: int,
    m: str,
    s: Shape,
    tag: str,
    *,
    layout: int = 0,
    base: str = "",
    ahead: str = "",
    locality: int = 2,
) -> list[str]:
    """A block of `rows` rows from row `m` of strip `%s` over K block [`%kb`, `%ke`) (`%first`: the first).

    The weight laid out [N/P, K, P], P = `layout` (0: the block's strip; grouped_experts_dispatch.py's 16 under
    AVX-512's 32 and AVX2's 16), from `base` (an index value; empty: 0): vector h of the block's strip at step k
    lies at base + %s strip K + (h lanes // P) P K + k P + (h lanes % P). `ahead` (an index value; empty: none):
    each unrolled step prefetches the weight at that offset from the step's own (`locality`: `memref.prefetch`'s)."""
    vec, lines = f"vector<{b.lanes}xf32>", []
    add = lines.append
    accs = [(r, h) for r in range(rows) for h in range(b.vectors)]
    add(f"%ob{tag} = arith.muli %s, %c{b.strip}w : index")
    for r in range(rows):
        add(f"%row{tag}{r} = arith.addi {m}, %c{r}w : index")
        add(f"%xr{tag}{r} = arith.muli %row{tag}{r}, %c{s.ld or s.k}w : index")
        add(f"%or{tag}{r} = arith.muli %row{tag}{r}, %c{s.n}w : index")
        add(f"%oo{tag}{r}_0 = arith.addi %or{tag}{r}, %ob{tag} : index")
        for h in range(1, b.vectors):
            add(f"%oo{tag}{r}_{h} = arith.addi %oo{tag}{r}_0, %c{h * b.lanes}w : index")
    types = ", ".join([vec] * len(accs))
    p = layout or b.strip
    if b.strip % p:
        raise ValueError(f"a weight in strips of {p} for a block of {b.strip} channels: not a divisor of the block's")
    add(f"%wb{tag} = arith.muli %s, %c{s.k * b.strip}w : index")
    wb = f"%wb{tag}"
    if base:
        add(f"%wx{tag} = arith.addi {base}, %wb{tag} : index")
        wb = f"%wx{tag}"
    args = ", ".join(f"%a{r}_{h} = %zero" for r, h in accs)
    sums = s.kc // s.ks > 1
    if sums:  # the K block in sums of `ks` steps, each from zero then added to y (error as short sums')
        add(f"scf.for %kq = %kb to %ke step %c{s.ks}w {{")
        add(f"%kqe = arith.addi %kq, %c{s.ks}w : index")
        add("%firstq = arith.cmpi eq, %kq, %c0 : index")
    lo, hi = ("%kq", "%kqe") if sums else ("%kb", "%ke")
    add(f"%res{tag}:{len(accs)} = scf.for %k = {lo} to {hi} step %c{KU}w iter_args({args}) -> ({types}) {{")
    add(f"%wk = arith.muli %k, %c{p}w : index")
    add(f"%wkb = arith.addi {wb}, %wk : index")
    if ahead:
        add(f"%wpf = arith.addi %wkb, {ahead} : index")
        add(f"memref.prefetch %wm[%wpf], read, locality<{locality}>, data : {s.wt}")
    cur = {(r, h): f"%a{r}_{h}" for r, h in accs}
    for u in range(KU):
        for h in range(b.vectors):
            at = u * p + (h * b.lanes // p) * p * s.k + h * b.lanes % p
            add(f"%w{u}_{h} = arith.addi %wkb, %c{at}w : index")
        for h in range(b.vectors):
            add(f"%b{u}_{h} = vector.load %wm[%w{u}_{h}] : {s.wt}, {vec}")
        for r in range(rows):
            add(f"%xo{u}_{r} = arith.addi %xr{tag}{r}, %k : index")
            add(f"%xu{u}_{r} = arith.addi %xo{u}_{r}, %c{u}w : index")
            add(f"%xs{u}_{r} = memref.load %xm[%xu{u}_{r}] : {s.xt}")
            add(f"%xb{u}_{r} = vector.broadcast %xs{u}_{r} : f32 to {vec}")
            for h in range(b.vectors):
                add(f"%f{u}_{r}_{h} = vector.fma %xb{u}_{r}, %b{u}_{h}, {cur[r, h]} : {vec}")
                cur[r, h] = f"%f{u}_{r}_{h}"
    add(f"scf.yield {', '.join(cur[a] for a in accs)} : {types}")
    add("}")
    if s.blocks == 1:
        return [*lines, *stores(b, rows, s, tag, first=True), *(["}"] if sums else [])]
    add(f"scf.if {'%firstq' if sums else '%first'} {{")  # each K block summed from zero, then added to y
    lines += stores(b, rows, s, tag, first=True)
    add("} else {")
    lines += stores(b, rows, s, tag, first=False)
    add("}")
    if sums:
        add("}")
    return lines


def _ahead(b: Block, k: int, kc: int, strips: int) -> list[str]:
    """`%pfd`: the offset from the weight a step of K reads to what the row block at `%mb` prefetches (`PREFETCH`).

    The strips' K blocks are read in turn (K block outer, the workgroup's strips inner; the next workgroup's first
    after its last): the row blocks of strip `%s` over K block `%kb` prefetch the next one's, row block j the line
    j % L of each unrolled step's L lines (the last of the dispatch: its own, already in cache)."""
    s, lines = b.strip, KU * b.strip // 16
    return [
        f"%pfj = arith.divui %mb, %c{b.rows}w : index",
        f"%pfl = arith.remui %pfj, %c{lines}w : index",
        "%pfo = arith.muli %pfl, %c16w : index",
        "%pfs = arith.addi %s, %c1 : index",
        "%pfms = arith.cmpi ult, %pfs, %s1 : index",
        f"%pfk = arith.addi %kb, %c{kc}w : index",
        f"%pfmk = arith.cmpi ult, %pfk, %c{k}w : index",
        "%pfs2 = arith.select %pfmk, %s0, %s1 : index",
        "%pfk2 = arith.select %pfmk, %pfk, %c0 : index",
        "%pfs3 = arith.select %pfms, %pfs, %pfs2 : index",
        "%pfk3 = arith.select %pfms, %kb, %pfk2 : index",
        f"%pfin = arith.cmpi ult, %pfs3, %c{strips}w : index",
        "%pfs4 = arith.select %pfin, %pfs3, %s : index",
        "%pfk4 = arith.select %pfin, %pfk3, %kb : index",
        "%pfds = arith.subi %pfs4, %s : index",
        "%pfdk = arith.subi %pfk4, %kb : index",
        f"%pfas = arith.muli %pfds, %c{k * s}w : index",
        f"%pfak = arith.muli %pfdk, %c{s}w : index",
        "%pfa = arith.addi %pfas, %pfak : index",
        "%pfd = arith.addi %pfa, %pfo : index",
    ]


def _kernel(b: Block, m: int, n: int, k: int, per: int, bias: bool, kc: int, mc: int, ks: int, ld: int = 0) -> str:
    kc, strips, mc = next(c for c in range(min(kc, k), 0, -KU) if k % c == 0), n // b.strip, max(b.rows, mc)
    mc -= mc % b.rows
    if k % kc or kc % KU or n % b.strip:
        raise ValueError(f"K {k} by blocks of {kc} (a multiple of {KU}), N {n} of the strip's {b.strip} channels")
    ks = next(c for c in range(min(ks, kc), 0, -KU) if kc % c == 0)
    full, tail = m - m % b.rows, m % b.rows
    ld = ld or k
    xt, wt, ot = f"memref<{m * ld}xf32>", f"memref<{n * k}xf32>", f"memref<{m * n}xf32>"
    s = Shape(k, n, kc, ks, k // ks, bias, xt, wt, ot, ld)
    lines = [
        "%c0 = arith.constant 0 : index",
        "%c1 = arith.constant 1 : index",
        f"%zero = arith.constant dense<0.0> : vector<{b.lanes}xf32>",
        f"%xm = stream.binding.subspan %bx[%c0] : !stream.binding -> {xt}",
        f"%wm = stream.binding.subspan %bw[%c0] : !stream.binding -> {wt}",
        *([f"%bm = stream.binding.subspan %bb[%c0] : !stream.binding -> memref<{n}xf32>"] if bias else []),
        f"%om = stream.binding.subspan %bo[%c0] : !stream.binding -> {ot}",
        "%wg = stream.dispatch.workgroup.id[0] : index",
        f"%s0 = arith.muli %wg, %c{per}w : index",
        f"%s1p = arith.addi %s0, %c{per}w : index",
        f"%s1 = arith.minui %s1p, %c{strips}w : index",
        f"scf.for %kb = %c0 to %c{k}w step %c{kc}w {{",
        f"%ke = arith.addi %kb, %c{kc}w : index",
        "%first = arith.cmpi eq, %kb, %c0 : index",
    ]
    start = min(mc, full) if PREFETCH[b.lanes] else 0
    if start:  # the first row chunk prefetches the next K block of a strip (`PREFETCH`; the later chunks find it in L2)
        lines += [
            "scf.for %s = %s0 to %s1 step %c1 {",
            f"scf.for %mb = %c0 to %c{start}w step %c{b.rows}w {{",
            *_ahead(b, k, kc, strips),
            *micro(b, b.rows, "%mb", s, "p", ahead="%pfd", locality=PREFETCH[b.lanes]),
            "}",
            "}",
        ]
    if full > start:
        lines += [
            f"scf.for %mc = %c{start}w to %c{full}w step %c{mc}w {{",
            f"%mep = arith.addi %mc, %c{mc}w : index",
            f"%me = arith.minui %mep, %c{full}w : index",
            "scf.for %s = %s0 to %s1 step %c1 {",
            f"scf.for %mb = %mc to %me step %c{b.rows}w {{",
            *micro(b, b.rows, "%mb", s, "f"),
            "}",
            "}",
            "}",
        ]
    if tail:
        lines += [
            "scf.for %s = %s0 to %s1 step %c1 {",
            f"%mt = arith.addi %c0, %c{full}w : index",
            *micro(b, tail, "%mt", s, "t"),
            "}",
        ]
    lines += ["}", "return"]
    return spliced.with_index_constants("\n".join(lines))


def x_columns(k: int, n: int, tile: int) -> int:
    """The row stride the kernel of strip 8 `tile` reads x [M, K] with, writing N channels (`X_PAD`)."""
    isa = next(isa for isa, block in BLOCKS.items() if block.tile == tile)
    return k + X_PAD[isa] if k % X_PAD_EVERY == 0 and n >= X_PAD_MIN_N else k


def executable_name(m: int, n: int, k: int, tile: int, per: int, bias: bool = False) -> str:
    """Unique per shape, block, bias and blocking (two executables may not share a name: findings 52)."""
    b, blocking = block_of(tile), f"kc{BLOCKING['kc']}_mc{BLOCKING['mc']}_ks{BLOCKING['ks']}"
    pf = f"_pf{PREFETCH[b.lanes]}" if PREFETCH[b.lanes] else ""
    return f"f32{'lin' if bias else 'mm'}_{m}x{k}x{n}_r{b.name}_p{per}_{blocking}_ld{x_columns(k, n, tile)}{pf}"


def executable(m: int, n: int, k: int, tile: int, per: int, bias: bool = False) -> tuple[str, str]:
    """The name and text of the `stream.executable` computing x [m, k] @ W.T (+ b) into [m, n] with the block of
    strip 8 `tile` over ceil(n / (8 tile) / per) workgroups (static rows only)."""
    if not m:
        raise ValueError("the float32 dispatch is static in its rows")
    name = executable_name(m, n, k, tile, per, bias)
    blocking = BLOCKING["kc"], BLOCKING["mc"], BLOCKING["ks"]
    body = _kernel(block_of(tile), m, n, k, per, bias, *blocking, ld=x_columns(k, n, tile))
    bindings = ["%bx", "%bw", *(["%bb"] if bias else []), "%bo"]
    return name, spliced.executable(name, ", ".join(f"{v}: !stream.binding" for v in bindings), m, body)


@torch.library.custom_op(OP, mutates_args=())
def f32_matmul(x: torch.Tensor, packed: torch.Tensor, n: int, tile: int, per: int) -> torch.Tensor:
    """x [M, K] @ W.T, W [N, K] held as `pack(W, 8 tile)`: what the dispatch computes (eager: unpacked by torch)."""
    return x @ unpack(packed, n, 8 * tile).t()


@f32_matmul.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, n: int, tile: int, per: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


@torch.library.custom_op(LINEAR_OP, mutates_args=())
def f32_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor, n: int, tile: int, per: int) -> torch.Tensor:
    """x [M, K] @ W.T + bias [N], W held as `pack(W, 8 tile)` (eager: torch's linear of the unpacked weight)."""
    return torch.nn.functional.linear(x, unpack(packed, n, 8 * tile), bias)


@f32_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor, n: int, tile: int, per: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


F32_MATMUL = torch.ops.fx_rewrites.f32_matmul.default
F32_LINEAR = torch.ops.fx_rewrites.f32_linear.default


def splice(mlir: str) -> str:
    """`mlir` with every `fx_rewrites.f32_matmul` and `f32_linear` call replaced by a `flow.dispatch` of its
    executable (`spliced.splice_calls`: N / (8 tile) / per workgroups). ValueError where it calls neither."""
    if MARK in mlir or LINEAR_MARK not in mlir:
        mlir = spliced.splice_calls(mlir, MARK, 2, executable, "fxf", x_columns)
    if LINEAR_MARK in mlir:
        build = functools.partial(executable, bias=True)
        mlir = spliced.splice_calls(mlir, LINEAR_MARK, 3, build, "fxl", x_columns)
    return mlir
