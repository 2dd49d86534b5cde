"""The hand-written int4 g32 matvec dispatch for IREE 3.13 (issue 33; docs/iree-3.13-findings.md section 49).

The weight's int4 values are stored eight to an int32 word, two a byte (half int8's bytes): for a block of
8 * `tile` output channels and a group of 32 positions, word (w, t, c) holds channel 8t + c's values at positions
8w .. 8w + 7 of the group, value p in bits 4p .. 4p + 3 ([N / (8 tile), G, 4, tile, 8] int32). The kernel runs
along the output channels, one ymm lane a channel: value p of a word is `(word << (28 - 4p)) & 0xF0000000` (q * 2^28,
exact), converted by `sitofp` and multiplied into `tile` group accumulators by x[32g + 8w + p] broadcast; each
group's sum is then multiplied by its scales (s * 2^-28, exact) into `tile` running totals. Each group prefetches
the words `PREFETCH` ahead, one `memref.prefetch` a cache line (a model's weights stream from DRAM, which the
hardware prefetcher alone left ~15% behind). It is MLIR we write (scf loops, vector and arith ops over the
bindings' memrefs) in a `stream.executable`, compiled by IREE as written.

It enters a graph as the custom op `fx_rewrites::int4_matvec(x, words, scales, n, tile, per)` (eager: the words
unpacked by torch; fake: the result's shape), which torch-mlir imports as `torch.operator
"torch.fx_rewrites.int4_matvec"`; `splice` (run by `IreeBackend` on the module text) replaces each such line by a
`flow.dispatch` of its executable between `torch_c` conversions. The rule writing it is
`rules/int4_decode.py`; the words and scales are packed when the module is built (`int4_fold.py`).
"""

from __future__ import annotations

import torch

from fx_rewrites.backends.iree import spliced

GROUP = 32
#: the top nibble of an int32 (0xF0000000 as a signed value)
TOP = -(1 << 28)
UNIT = 2.0**-28
#: how far ahead of the group being summed the kernel prefetches the words, in words (16 KB: 32 groups of a tile of 4;
#: docs/performance.md, "Where an int4 g32 decode token goes": 2048 and 8192 were no better on the real AVX2 host)
PREFETCH = 4096
#: int32 words a cache line
LINE = 16
OP = "fx_rewrites::int4_matvec"
#: the op with zero points (torchao's asymmetric mapping): a third tensor, `pack_zeros`
ZERO_OP = "fx_rewrites::asym_int4_matvec"
#: how the ops are named in torch-mlir's import (neither name holds the other: `spliced.splice_calls`)
MARK, ZERO_MARK = "torch.fx_rewrites.int4_matvec", "torch.fx_rewrites.asym_int4_matvec"
MARKS = (MARK, ZERO_MARK)


def pack_words(q: torch.Tensor, tile: int) -> torch.Tensor:
    """int4 values q [N, K] (int8 in [-8, 7]) as int32 words [N / (8 tile), G, 4, tile, 8] (flattened): word
    (b, g, w, t, c) holds q[8 (b tile + t) + c, 32 g + 8 w + p] in bits 4p .. 4p + 3."""
    n, k = q.shape
    nb, g = n // (8 * tile), k // GROUP
    nib = (q.to(torch.int64) & 15).view(nb, tile, 8, g, 4, 8)  # n = (b, t, c), k = (g, w, p)
    word = (nib << (4 * torch.arange(8))).sum(-1)  # disjoint bits: the sum is the or
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.permute(0, 3, 4, 1, 2).contiguous().flatten()


def pack_scales(s: torch.Tensor, tile: int, unit: float = UNIT) -> torch.Tensor:
    """Scales s [N, G] times `unit` (2^-28 for the kernel without zero points, 1 beside them: exact) as
    [N / (8 tile), G, tile, 8] (flattened)."""
    n, g = s.shape
    return (s.to(torch.float32) * unit).view(n // (8 * tile), tile, 8, g).permute(0, 3, 1, 2).contiguous().flatten()


def pack_zeros(z: torch.Tensor, tile: int) -> torch.Tensor:
    """Zero points z [N, G] as int32, laid out as `pack_scales` lays the scales: the kernel with zero points shifts
    each value down to q (sign-extended) and subtracts them, (q - z) exact in int32."""
    n, g = z.shape
    zeros = z.to(torch.int32)
    return zeros.view(n // (8 * tile), tile, 8, g).permute(0, 3, 1, 2).contiguous().flatten()


def unpack(
    words: torch.Tensor, scales: torch.Tensor, n: int, tile: int, zeros: torch.Tensor | None = None
) -> torch.Tensor:
    """The float32 weight [N, K], q s (or, with `zeros`, (q - z) s) that `pack_words(q, tile)`, `pack_scales(s,
    tile)` (`pack_scales(s, tile, 1.0)` beside zeros) and `pack_zeros(z, tile)` hold."""
    k = words.numel() * 8 // n
    nb, g = n // (8 * tile), k // GROUP
    nib = ((words.to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> (4 * torch.arange(8))) & 15
    q = torch.where(nib >= 8, nib - 16, nib).to(torch.float32)  # [N K / 8, 8]
    values = q.view(nb, g, 4, tile, 8, 8).permute(0, 3, 4, 1, 2, 5).reshape(n, k)  # (b, t, c) x (g, w, p)
    values = values.view(n, g, GROUP)
    unit = UNIT
    if zeros is not None:
        z = zeros.view(nb, g, tile, 8).permute(0, 2, 3, 1).reshape(n, g)
        values, unit = values - z.unsqueeze(-1).to(torch.float32), 1.0
    s = (scales / unit).view(nb, g, tile, 8).permute(0, 2, 3, 1).reshape(n, g)
    return (values * s.unsqueeze(-1)).view(n, k)


def _kernel(rows: int, n: int, k: int, tile: int, per: int, zero: bool = False) -> str:
    """The body of the executable's function: workgroup `wg` computes tiles [wg per, min(wg per + per, N/8tile))
    of 8 * tile channels for every row. With `zero`, each value moved to the top nibble is shifted down to q
    (arithmetic: sign-extended, the values below it gone) and its group's zero point (binding `bz`, `pack_zeros`)
    subtracted in int32 before the conversion."""
    nb, g, nw = n // (8 * tile), k // GROUP, n * k // 8
    wt, st, zt = f"memref<{nw}xi32>", f"memref<{n * g}xf32>", f"memref<{n * g}xi32>"
    xt, ot = (f"memref<{rows * k}xf32>", f"memref<{rows * n}xf32>") if rows else ("memref<?xf32>", "memref<?xf32>")
    xsize, osize, bound = ("", "", f"%c{rows}w") if rows else ("{%xsize}", "{%osize}", "%rows")
    lines = [
        "%c0 = arith.constant 0 : index",
        "%c1 = arith.constant 1 : index",
        "%zero = arith.constant dense<0.0> : vector<8xf32>",
        f"%mask = arith.constant dense<{TOP}> : vector<8xi32>",
        *(f"%sh{p} = arith.constant dense<{28 - 4 * p}> : vector<8xi32>" for p in range(7)),
        f"%xsize = arith.muli %rows, %c{k}w : index" if not rows else "",
        f"%osize = arith.muli %rows, %c{n}w : index" if not rows else "",
        f"%xm = stream.binding.subspan %bx[%c0] : !stream.binding -> {xt}{xsize}",
        f"%wm = stream.binding.subspan %bw[%c0] : !stream.binding -> {wt}",
        f"%sm = stream.binding.subspan %bs[%c0] : !stream.binding -> {st}",
        f"%zm = stream.binding.subspan %bz[%c0] : !stream.binding -> {zt}" if zero else "",
        "%down = arith.constant dense<28> : vector<8xi32>" if zero else "",
        f"%om = stream.binding.subspan %bo[%c0] : !stream.binding -> {ot}{osize}",
        "%wg = stream.dispatch.workgroup.id[0] : index",
        f"%b0 = arith.muli %wg, %c{per}w : index",
        f"%b1p = arith.addi %b0, %c{per}w : index",
        f"%b1 = arith.minui %b1p, %c{nb}w : index",
        f"scf.for %r = %c0 to {bound} step %c1 {{",
        f"%xr = arith.muli %r, %c{k}w : index",
        f"%or = arith.muli %r, %c{n}w : index",
        "scf.for %b = %b0 to %b1 step %c1 {",
    ]
    add = lines.append
    totals = ", ".join(f"%tot{t} = %zero" for t in range(tile))
    vectors = ", ".join(["vector<8xf32>"] * tile)
    add(f"%res:{tile} = scf.for %g = %c0 to %c{g}w step %c1 iter_args({totals}) -> ({vectors}) {{")
    add(f"%bg0 = arith.muli %b, %c{g}w : index")
    add("%bg = arith.addi %bg0, %g : index")
    add(f"%wbase = arith.muli %bg, %c{32 * tile}w : index")
    # the words PREFETCH ahead, one prefetch a cache line, clamped to the buffer's last group
    add(f"%pfa = arith.addi %wbase, %c{PREFETCH}w : index")
    add(f"%pfb = arith.minui %pfa, %c{nw - 32 * tile}w : index")
    for line in range(0, 32 * tile, LINE):
        add(f"%pf{line} = arith.addi %pfb, %c{line}w : index")
        add(f"memref.prefetch %wm[%pf{line}], read, locality<0>, data : {wt}")
    add(f"%sbase = arith.muli %bg, %c{8 * tile}w : index")
    add(f"%xg = arith.muli %g, %c{GROUP}w : index")
    add("%xbase = arith.addi %xr, %xg : index")
    acc = ["%zero"] * tile
    for t in range(tile):
        add(f"%so{t} = arith.addi %sbase, %c{8 * t}w : index")
        if zero:
            add(f"%zv{t} = vector.load %zm[%so{t}] : {zt}, vector<8xi32>")
    for w in range(4):
        for t in range(tile):
            add(f"%wo{w}_{t} = arith.addi %wbase, %c{(w * tile + t) * 8}w : index")
            add(f"%wd{w}_{t} = vector.load %wm[%wo{w}_{t}] : {wt}, vector<8xi32>")
        for p in range(8):
            add(f"%xo{w}_{p} = arith.addi %xbase, %c{8 * w + p}w : index")
            add(f"%xs{w}_{p} = memref.load %xm[%xo{w}_{p}] : {xt}")
            add(f"%xb{w}_{p} = vector.broadcast %xs{w}_{p} : f32 to vector<8xf32>")
            for t in range(tile):
                value, name = f"%wd{w}_{t}", f"{w}_{p}_{t}"
                if p < 7:  # value p to the top nibble
                    add(f"%sl{name} = arith.shli {value}, %sh{p} : vector<8xi32>")
                    value = f"%sl{name}"
                if zero:  # q - z, exact: the shift down drops the values below it
                    add(f"%sr{name} = arith.shrsi {value}, %down : vector<8xi32>")
                    add(f"%sz{name} = arith.subi %sr{name}, %zv{t} : vector<8xi32>")
                    value = f"%sz{name}"
                elif p > 0:  # the values below it cleared
                    add(f"%an{name} = arith.andi {value}, %mask : vector<8xi32>")
                    value = f"%an{name}"
                add(f"%fl{name} = arith.sitofp {value} : vector<8xi32> to vector<8xf32>")
                add(f"%ac{name} = vector.fma %fl{name}, %xb{w}_{p}, {acc[t]} : vector<8xf32>")
                acc[t] = f"%ac{name}"
    for t in range(tile):
        add(f"%sv{t} = vector.load %sm[%so{t}] : {st}, vector<8xf32>")
        add(f"%nt{t} = vector.fma {acc[t]}, %sv{t}, %tot{t} : vector<8xf32>")
    add(f"scf.yield {', '.join(f'%nt{t}' for t in range(tile))} : {vectors}")
    add("}")
    add(f"%ob = arith.muli %b, %c{8 * tile}w : index")
    add("%obr = arith.addi %or, %ob : index")
    for t in range(tile):
        add(f"%oo{t} = arith.addi %obr, %c{8 * t}w : index")
        add(f"vector.store %res#{t}, %om[%oo{t}] : {ot}, vector<8xf32>")
    add("}")
    add("}")
    add("return")
    text = "\n".join(line for line in lines if line)
    return spliced.with_index_constants(text)


def executable_name(rows: int, n: int, k: int, tile: int, per: int, zero: bool = False) -> str:
    return f"int4{'z' if zero else ''}mv_{rows or 'dyn'}x{k}x{n}_t{tile}_p{per}"


def executable(rows: int, n: int, k: int, tile: int, per: int, zero: bool = False) -> str:
    """A `stream.executable` taking x [rows, K] f32, the words, the scales, with `zero` the zero points (and, for
    rows 0: dynamic, the row count) and writing [rows, N] f32 over ceil(N / (8 tile) / per) workgroups of `per`
    channel tiles."""
    bindings = ", ".join(f"%b{name}: !stream.binding" for name in ("xwszo" if zero else "xwso"))
    name = executable_name(rows, n, k, tile, per, zero)
    return spliced.executable(name, bindings, rows, _kernel(rows, n, k, tile, per, zero))


@torch.library.custom_op(OP, mutates_args=())
def int4_matvec(
    x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, n: int, tile: int, per: int
) -> torch.Tensor:
    """x [rows, K] times the int4 g32 weight [N, K] that `words` and `scales` hold (`pack_words`, `pack_scales`),
    transposed: what the dispatch computes (eager: unpacked by torch, float32)."""
    return x @ unpack(words, scales, n, tile).t()


@int4_matvec.register_fake
def _(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, n: int, tile: int, per: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


INT4_MATVEC = torch.ops.fx_rewrites.int4_matvec.default


@torch.library.custom_op(ZERO_OP, mutates_args=())
def asym_int4_matvec(
    x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, n: int, tile: int, per: int
) -> torch.Tensor:
    """`int4_matvec` with zero points: x [rows, K] times (q - z) s, held as `words`, `scales` (times 1) and
    `zeros` (`pack_zeros`), transposed."""
    return x @ unpack(words, scales, n, tile, zeros).t()


@asym_int4_matvec.register_fake
def _(
    x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, n: int, tile: int, per: int
) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


ASYM_INT4_MATVEC = torch.ops.fx_rewrites.asym_int4_matvec.default


def splice(mlir: str) -> str:
    """`mlir` (torch-mlir's import) with every `fx_rewrites.int4_matvec` and `asym_int4_matvec` call replaced by a
    `flow.dispatch` of its executable (`spliced.splice_calls`); ValueError where there is none, or one this form
    does not match."""
    plain, zero = MARK in mlir, ZERO_MARK in mlir
    if zero:
        build = lambda *shape: (executable_name(*shape, zero=True), executable(*shape, zero=True))  # noqa: E731
        mlir = spliced.splice_calls(mlir, ZERO_MARK, 4, build, "fxz")
    if plain or not zero:  # neither: splice_calls names the missing call
        build = lambda *shape: (executable_name(*shape), executable(*shape))  # noqa: E731
        mlir = spliced.splice_calls(mlir, MARK, 3, build, "fxr")
    return mlir
