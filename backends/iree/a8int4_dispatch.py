"""A hand-written int8 x int4 g32 matvec dispatch for IREE 3.13 on AVX2: llama.cpp Q4_0's own scheme (issue 33).

torchao's `Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))`
quantizes x per token, asymmetric (an int8 qx, a float32 scale sx and an int8 zero point zx a row) and computes
`linear((qx - zx) sx, q s)`. In integers, for a group of 32 positions and with x' = qx + 128 (uint8):
sum_k (qx_k - zx) q_k = sum_k x'_k q_k - (128 + zx) W, W = sum_k q_k (an int32 a channel and group, packed with
the weights). AVX2's `vpmaddubsw` takes x' (u8) x q (s8), summing pairs into s16; `vpmaddwd` by ones sums those into
int32 lanes once per group; the correction, `sitofp` and the group's scale follow once per 8 channels and group,
and sx at the row's end. Per group and s16 lane: 16 products of at most 255 * 8, |sum| <= 32640, no saturation.

Layout (VNNI-style): one 32-bit lane a channel, 4 consecutive positions a lane. For a block of 8 * `tile` channels
and a group, byte (j, t, 4c + i) (j < 4, t < tile, c < 8, i < 4) holds q + 8 of channel 8t + c at position 8j + i
(low nibble) and 8j + 4 + i (high nibble): [N / (8 tile), G, 4, tile, 32] int8, half a byte a value. The kernel
takes the nibbles (`and 15`; `shift right 4`, `and 15`), subtracts 8, and multiplies each by x's 4 bytes at those
positions broadcast into every lane. `vpmaddubsw` / `vpmaddwd` are called as LLVM's x86 intrinsics
(`llvm.call_intrinsic`); the same sums in arith (shuffles, extends, the saturating clamp) are not matched by
LLVM's X86 back end (docs/iree-3.13-findings.md section 53). Each group prefetches the bytes `PREFETCH` ahead, one
`memref.prefetch` a cache line clamped to the buffer's last group, as the float kernel does its words (section 55).

It enters a graph as the custom op `fx_rewrites::a8int4_matvec(qx, sx, zx, bytes, groups, n, tile, per)`
(eager: the same values in float32 by torch), imported by torch-mlir as a `torch.operator`; `splice` replaces each
by a `flow.dispatch` of its executable, as `int4_dispatch.splice` does for the float kernel.
"""

from __future__ import annotations

import torch

from fx_rewrites.backends.iree import spliced

GROUP = 32
#: how far ahead of the group being summed the kernel prefetches the bytes, in bytes (16 KB: 32 groups of a tile of 4,
#: as `int4_dispatch.PREFETCH` for the float kernel's words; docs/iree-3.13-findings.md section 55)
PREFETCH = 16384
#: bytes a cache line
LINE = 64
OP = "fx_rewrites::a8int4_matvec"
MARK = "torch.fx_rewrites.a8int4_matvec"
MARKS = (MARK,)


def pack_bytes(q: torch.Tensor, tile: int) -> torch.Tensor:
    """int4 values q [N, K] (int8 in [-8, 7]) as bytes [N / (8 tile), G, 4, tile, 8, 4] (int8, flattened): byte
    (b, g, j, t, c, i) holds q + 8 of channel 8 (b tile + t) + c at 32 g + 8 j + i (low) and 32 g + 8 j + 4 + i."""
    n, k = q.shape
    nb, g = n // (8 * tile), k // GROUP
    u = (q.to(torch.int32) + 8).view(nb, tile, 8, g, 4, 2, 4)  # n = (b, t, c), k = (g, j, h, i)
    byte = u[..., 0, :] | (u[..., 1, :] << 4)  # [b, t, c, g, j, i]
    byte = torch.where(byte >= 128, byte - 256, byte).to(torch.int8)
    return byte.permute(0, 3, 4, 1, 2, 5).contiguous().flatten()


def pack_groups(q: torch.Tensor, s: torch.Tensor, tile: int) -> torch.Tensor:
    """Per block and group, the scales s [N, G] then W = the sum of q over the group (an integer of at most 256 in
    magnitude: exact in float32), float32 [N / (8 tile), G, 2, tile, 8] (flattened)."""
    n, k = q.shape
    g = k // GROUP
    w = q.to(torch.int32).view(n, g, GROUP).sum(-1).to(torch.float32)
    both = torch.stack([s.to(torch.float32), w])  # [2, N, G]
    return both.view(2, n // (8 * tile), tile, 8, g).permute(1, 4, 0, 2, 3).contiguous().flatten()


def unpack(packed: torch.Tensor, n: int, tile: int) -> torch.Tensor:
    """The int4 values q [N, K] (int8) that `pack_bytes(q, tile)` holds."""
    k = packed.numel() * 2 // n
    nb, g = n // (8 * tile), k // GROUP
    byte = (packed.to(torch.int32) & 255).view(nb, g, 4, tile, 8, 4)  # [b, g, j, t, c, i]
    u = torch.stack([byte & 15, byte >> 4], dim=5)  # [b, g, j, t, c, h, i]
    u = u.permute(0, 3, 4, 1, 2, 5, 6).reshape(n, k)
    return (u - 8).to(torch.int8)


def unpack_scales(groups: torch.Tensor, n: int, tile: int) -> torch.Tensor:
    """The scales s [N, G] that `pack_groups(q, s, tile)` holds."""
    g = groups.numel() // (2 * n)
    return groups.view(n // (8 * tile), g, 2, tile, 8)[:, :, 0].permute(0, 2, 3, 1).reshape(n, g)


def _intrinsic(name: str, a: str, b: str, out: str, types: str) -> str:
    return f'{out} = llvm.call_intrinsic "llvm.x86.avx2.{name}"({a}, {b}) : {types}'


def kernel(rows: int, n: int, k: int, tile: int, per: int) -> str:
    """The function's body: workgroup `wg` computes channel blocks [wg per, min(wg per + per, N / 8 tile)) for
    every row (rows 0: a dynamic count, the function's index operand %rows)."""
    nb, g = n // (8 * tile), k // GROUP
    wt, st = f"memref<{n * k // 2}xi8>", f"memref<{2 * n * g}xf32>"
    if rows:
        xt, qt, zt, ot = (f"memref<{rows * k}xi8>", f"memref<{rows}xf32>", f"memref<{rows}xi32>",
                          f"memref<{rows * n}xf32>")  # fmt: skip
        xsize, rsize, osize, bound = "", "", "", f"%c{rows}w"
    else:
        xt, qt, zt, ot = "memref<?xi8>", "memref<?xf32>", "memref<?xi32>", "memref<?xf32>"
        xsize, rsize, osize, bound = "{%xsize}", "{%rows}", "{%osize}", "%rows"
    lines = [
        "%c0 = arith.constant 0 : index",
        "%c1 = arith.constant 1 : index",
        "%zero = arith.constant dense<0.0> : vector<8xf32>",
        "%zero16 = arith.constant dense<0> : vector<16xi16>",
        "%ones16 = arith.constant dense<1> : vector<16xi16>",
        "%m15 = arith.constant dense<15> : vector<32xi8>",
        "%s4 = arith.constant dense<4> : vector<32xi8>",
        "%e8 = arith.constant dense<8> : vector<32xi8>",
        "%flip = arith.constant dense<-128> : vector<32xi8>",
        "%c128 = arith.constant 128 : i32",
        "" if rows else f"%xsize = arith.muli %rows, %c{k}w : index",
        "" if rows else f"%osize = arith.muli %rows, %c{n}w : index",
        f"%xm = stream.binding.subspan %bx[%c0] : !stream.binding -> {xt}{xsize}",
        f"%qm = stream.binding.subspan %bq[%c0] : !stream.binding -> {qt}{rsize}",
        f"%zm = stream.binding.subspan %bz[%c0] : !stream.binding -> {zt}{rsize}",
        f"%wm = stream.binding.subspan %bw[%c0] : !stream.binding -> {wt}",
        f"%sm = stream.binding.subspan %bs[%c0] : !stream.binding -> {st}",
        f"%om = stream.binding.subspan %bo[%c0] : !stream.binding -> {ot}{osize}",
        "%wg = stream.dispatch.workgroup.id[0] : index",
        f"%b0 = arith.muli %wg, %c{per}w : index",
        f"%b1p = arith.addi %b0, %c{per}w : index",
        f"%b1 = arith.minui %b1p, %c{nb}w : index",
        f"scf.for %r = %c0 to {bound} step %c1 {{",
        f"%xr = arith.muli %r, %c{k}w : index",
        f"%or = arith.muli %r, %c{n}w : index",
        f"%sx = memref.load %qm[%r] : {qt}",
        f"%zx = memref.load %zm[%r] : {zt}",
        "%cz = arith.addi %zx, %c128 : i32",
        "%czf = arith.sitofp %cz : i32 to f32",
        "%cv = vector.broadcast %czf : f32 to vector<8xf32>",
        "%sxv = vector.broadcast %sx : f32 to vector<8xf32>",
        "scf.for %b = %b0 to %b1 step %c1 {",
    ]
    add = lines.append
    totals = ", ".join(f"%tot{t} = %zero" for t in range(tile))
    vectors = ", ".join(["vector<8xf32>"] * tile)
    add(f"%res:{tile} = scf.for %g = %c0 to %c{g}w step %c1 iter_args({totals}) -> ({vectors}) {{")
    add(f"%bg0 = arith.muli %b, %c{g}w : index")
    add("%bg = arith.addi %bg0, %g : index")
    add(f"%wbase = arith.muli %bg, %c{128 * tile}w : index")
    # the bytes PREFETCH ahead, one prefetch a cache line, clamped to the buffer's last group
    add(f"%pfa = arith.addi %wbase, %c{PREFETCH}w : index")
    add(f"%pfb = arith.minui %pfa, %c{n * k // 2 - 128 * tile}w : index")
    for line in range(0, 128 * tile, LINE):
        add(f"%pf{line} = arith.addi %pfb, %c{line}w : index")
        add(f"memref.prefetch %wm[%pf{line}], read, locality<0>, data : {wt}")
    add(f"%sbase = arith.muli %bg, %c{16 * tile}w : index")
    add(f"%xg = arith.muli %g, %c{GROUP}w : index")
    add("%xbase = arith.addi %xr, %xg : index")
    acc = ["%zero16"] * tile
    ub = "(vector<32xi8>, vector<32xi8>) -> vector<16xi16>"
    for j in range(4):
        for h in range(2):  # x's 4 bytes at 8j + 4h, in every lane, as uint8 (qx + 128)
            x = f"{j}_{h}"
            add(f"%xo{x} = arith.addi %xbase, %c{8 * j + 4 * h}w : index")
            add(f"%xq{x} = vector.load %xm[%xo{x}] : {xt}, vector<4xi8>")
            add(f"%xi{x} = vector.bitcast %xq{x} : vector<4xi8> to vector<1xi32>")
            add(f"%xs{x} = vector.extract %xi{x}[0] : i32 from vector<1xi32>")
            add(f"%xb{x} = vector.broadcast %xs{x} : i32 to vector<8xi32>")
            add(f"%xc{x} = vector.bitcast %xb{x} : vector<8xi32> to vector<32xi8>")
            add(f"%xu{x} = arith.xori %xc{x}, %flip : vector<32xi8>")
        for t in range(tile):
            v = f"{j}_{t}"
            add(f"%wo{v} = arith.addi %wbase, %c{(j * tile + t) * 32}w : index")
            add(f"%wb{v} = vector.load %wm[%wo{v}] : {wt}, vector<32xi8>")
            add(f"%lo{v} = arith.andi %wb{v}, %m15 : vector<32xi8>")
            add(f"%ls{v} = arith.subi %lo{v}, %e8 : vector<32xi8>")
            add(f"%hi{v} = arith.shrui %wb{v}, %s4 : vector<32xi8>")
            add(f"%hs{v} = arith.subi %hi{v}, %e8 : vector<32xi8>")
            add(_intrinsic("pmadd.ub.sw", f"%xu{j}_0", f"%ls{v}", f"%pl{v}", ub))
            add(_intrinsic("pmadd.ub.sw", f"%xu{j}_1", f"%hs{v}", f"%ph{v}", ub))
            add(f"%pa{v} = arith.addi %pl{v}, %ph{v} : vector<16xi16>")
            add(f"%ac{v} = arith.addi {acc[t]}, %pa{v} : vector<16xi16>")
            acc[t] = f"%ac{v}"
    for t in range(tile):
        add(_intrinsic("pmadd.wd", acc[t], "%ones16", f"%d{t}", "(vector<16xi16>, vector<16xi16>) -> vector<8xi32>"))
        add(f"%so{t} = arith.addi %sbase, %c{8 * t}w : index")
        add(f"%wo{t} = arith.addi %sbase, %c{8 * (tile + t)}w : index")
        add(f"%ws{t} = vector.load %sm[%wo{t}] : {st}, vector<8xf32>")  # W: integers, exact in float32
        add(f"%df{t} = arith.sitofp %d{t} : vector<8xi32> to vector<8xf32>")
        add(f"%wc{t} = arith.mulf %ws{t}, %cv : vector<8xf32>")  # every value below 2^24: exact
        add(f"%dc{t} = arith.subf %df{t}, %wc{t} : vector<8xf32>")
        add(f"%sv{t} = vector.load %sm[%so{t}] : {st}, vector<8xf32>")
        add(f"%nt{t} = vector.fma %dc{t}, %sv{t}, %tot{t} : vector<8xf32>")
    add(f"scf.yield {', '.join(f'%nt{t}' for t in range(tile))} : {vectors}")
    add("}")
    add(f"%ob = arith.muli %b, %c{8 * tile}w : index")
    add("%obr = arith.addi %or, %ob : index")
    for t in range(tile):
        add(f"%oo{t} = arith.addi %obr, %c{8 * t}w : index")
        add(f"%os{t} = arith.mulf %res#{t}, %sxv : vector<8xf32>")
        add(f"vector.store %os{t}, %om[%oo{t}] : {ot}, vector<8xf32>")
    add("}")
    add("}")
    add("return")
    text = "\n".join(line for line in lines if line)
    return spliced.with_index_constants(text)


def executable_name(rows: int, n: int, k: int, tile: int, per: int) -> str:
    return f"a8i4mv_{rows or 'dyn'}x{k}x{n}_t{tile}_p{per}"


def executable(rows: int, n: int, k: int, tile: int, per: int) -> str:
    """A `stream.executable` taking qx [rows, K] i8, sx [rows] f32, zx [rows] i32, the bytes and the groups' scales
    and sums (and for rows 0 the row count), writing [rows, N] f32."""
    bindings = ", ".join(f"%b{c}: !stream.binding" for c in "xqzwso")
    return spliced.executable(executable_name(rows, n, k, tile, per), bindings, rows, kernel(rows, n, k, tile, per))


@torch.library.custom_op(OP, mutates_args=())
def a8int4_matvec(
    qx: torch.Tensor,
    sx: torch.Tensor,
    zx: torch.Tensor,
    packed: torch.Tensor,
    groups: torch.Tensor,
    n: int,
    tile: int,
    per: int,
) -> torch.Tensor:
    """(qx - zx) sx [rows, K] (torchao's dequantize of x) times the int4 g32 weight [N, K] that `packed` and
    `groups` hold, transposed (eager: float32 by torch; the dispatch sums each group in integers)."""
    x = (qx.to(torch.int32) - zx.to(torch.int32).unsqueeze(1)).to(torch.float32) * sx.unsqueeze(1)
    q = unpack(packed, n, tile)
    k = q.shape[1]
    w = (q.view(n, k // GROUP, GROUP).to(torch.float32) * unpack_scales(groups, n, tile).unsqueeze(-1)).view(n, k)
    return x @ w.t()


@a8int4_matvec.register_fake
def _(
    qx: torch.Tensor,
    sx: torch.Tensor,
    zx: torch.Tensor,
    packed: torch.Tensor,
    groups: torch.Tensor,
    n: int,
    tile: int,
    per: int,
) -> torch.Tensor:
    return qx.new_empty(qx.shape[0], n, dtype=torch.float32)


A8INT4_MATVEC = torch.ops.fx_rewrites.a8int4_matvec.default


def splice(mlir: str) -> str:
    """`mlir` with every `fx_rewrites.a8int4_matvec` call replaced by a `flow.dispatch` of its executable
    (`spliced.splice_calls`); ValueError where there is none, or one this form does not match."""
    return spliced.splice_calls(mlir, MARK, 5, lambda *shape: (executable_name(*shape), executable(*shape)), "fxa")
