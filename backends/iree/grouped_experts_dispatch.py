"""MoE experts' prefill products as one hand-written dispatch over all experts (issue 34; AVX-512 and AVX2).

`fx_rewrites::grouped_packed_matmul(x, packed, ends, tile)`: x [S, K] f32, its rows sorted by expert, `ends` [E] int32
the end of each expert's rows (non-decreasing, at most S: `rules/moe_packed.py` clamps them), `packed` [E, N/16, K, 16]
the experts' weights as `packed_experts.pack` lays them out (the tensor the decode's narrow `mmt4d` tile reads too),
`tile` naming f32_dispatch.py's register block (`BLOCKS`, as its `f32_matmul`'s: 4 AVX-512's, 2 AVX2's). Row r of the
result is x[r] @ W_e.T for the expert e whose rows hold r; rows at or past ends[E-1] are 0.

One `stream.executable` (`splice`: a `flow.dispatch` over E x ceil(N / strip / per) workgroups, S passed as an index):
the workgroup of expert e and `per` of the block's strips (`CHANNELS` channels) reads e's row range from `ends` and
multiplies it in f32_dispatch.py's register block (its `micro`, the weight's strips of 16 read where they lie):
AVX-512's 12 rows x 32 channels in 24 zmm (2 loads and 12 broadcasts per 24 FMAs, where IREE 3.13's 16x16x1 `mmt4d`
microkernel does 1 and 16 per 16), two strips of 16 a step; AVX2's 6 rows x 16 channels in 12 ymm (2 loads and 6
broadcasts per 12 FMAs), one strip as two ymm of 8. A range's last rows (fewer than the block's) by a block of their
own count (`scf.index_switch`); K in blocks of `kc`, each summed from zero in sums of `ks` steps and added to y, as
f32_dispatch.py's kernel. Against the per-expert form (`packed_matmul` per expert: a pack of the rows, the mmt4d, an
unpack, and the range read to the host, per expert and product) it runs no pack, no unpack and one dispatch per
product.
"""

from __future__ import annotations

import re

import torch

from fx_rewrites.backends.iree import spliced
from fx_rewrites.backends.iree.f32_dispatch import BLOCKING, KU, Block, Shape, block_of, micro
from fx_rewrites.backends.iree.packed_experts import STRIP, unpack

OP, MARK = "fx_rewrites::grouped_packed_matmul", "torch.fx_rewrites.grouped_packed_matmul"
MARKS = (MARK,)
#: 128 channels a workgroup: AVX-512's measured split (4 blocks of 32), the same channels for AVX2 (8 of 16)
CHANNELS = 128

_CALL = re.compile(
    rf'^(\s*)(%[\w#]+) = torch\.operator "{re.escape(MARK)}"\((%[\w#]+), (%[\w#]+), (%[\w#]+), (%[\w#]+)\) : '
    r"\((.*)\) -> (.*)$"
)


@torch.library.custom_op(OP, mutates_args=())
def grouped_packed_matmul(x: torch.Tensor, packed: torch.Tensor, ends: torch.Tensor, tile: int) -> torch.Tensor:
    """Rows [ends[e-1], ends[e]) of x times expert e's weight W_e [N, K] held as `pack(W_e)` (eager: torch's);
    `tile` names the register block (f32_dispatch's: 2 AVX2's, 4 AVX-512's; the same numbers in eager)."""
    block_of(tile)
    out = x.new_zeros(x.shape[0], packed.shape[1] * packed.shape[3])
    start = 0
    for e, end in enumerate(ends.clamp(0, x.shape[0]).tolist()):
        if end > start:
            out[start:end] = x[start:end] @ unpack(packed[e]).t()
        start = max(start, end)
    return out


@grouped_packed_matmul.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, ends: torch.Tensor, tile: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[1] * packed.shape[3])


GROUPED_PACKED_MATMUL = torch.ops.fx_rewrites.grouped_packed_matmul.default


def per_workgroup(b: Block) -> int:
    """The block's strips a workgroup (`CHANNELS` channels)."""
    return max(1, CHANNELS // b.strip)


def _kernel(b: Block, experts: int, n: int, k: int, per: int) -> str:
    if b.strip % STRIP:
        raise ValueError(f"block {b.name}: its strip of {b.strip} channels is not a multiple of the layout's {STRIP}")
    kc, mc = (
        next(c for c in range(min(BLOCKING["kc"], k), 0, -KU) if k % c == 0),
        BLOCKING["mc"] - BLOCKING["mc"] % b.rows,
    )
    if k % kc or kc % KU or n % b.strip:
        raise ValueError(f"K {k} by blocks of {kc} (a multiple of {KU}), N {n} of the block's {b.strip} channels")
    ks = next(c for c in range(min(BLOCKING["ks"], kc), 0, -KU) if kc % c == 0)
    pairs, groups = n // b.strip, -(-n // b.strip // per)
    xt, wt, ot = "memref<?xf32>", f"memref<{experts * n * k}xf32>", "memref<?xf32>"
    s = Shape(k, n, kc, ks, k // ks, False, xt, wt, ot)
    vec = f"vector<{b.lanes}xf32>"
    lines = [
        "%c0 = arith.constant 0 : index",
        "%c1 = arith.constant 1 : index",
        f"%zero = arith.constant dense<0.0> : {vec}",
        f"%xsize = arith.muli %rows, %c{k}w : index",
        f"%osize = arith.muli %rows, %c{n}w : index",
        f"%xm = stream.binding.subspan %bx[%c0] : !stream.binding -> {xt}{{%xsize}}",
        f"%wm = stream.binding.subspan %bw[%c0] : !stream.binding -> {wt}",
        f"%em = stream.binding.subspan %be[%c0] : !stream.binding -> memref<{experts}xi32>",
        f"%om = stream.binding.subspan %bo[%c0] : !stream.binding -> {ot}{{%osize}}",
        "%wg = stream.dispatch.workgroup.id[0] : index",
        f"%e = arith.divui %wg, %c{groups}w : index",
        f"%g = arith.remui %wg, %c{groups}w : index",
        f"%s0 = arith.muli %g, %c{per}w : index",
        f"%s1p = arith.addi %s0, %c{per}w : index",
        f"%s1 = arith.minui %s1p, %c{pairs}w : index",
        f"%wbe = arith.muli %e, %c{n * k}w : index",
        # the expert's rows [start, end): ends clamped to [0, rows], start at most end
        "%endi = memref.load %em[%e] : memref<" + f"{experts}xi32>",
        "%endx = arith.index_cast %endi : i32 to index",
        "%endp = arith.maxsi %endx, %c0 : index",
        "%end = arith.minsi %endp, %rows : index",
        "%isfirst = arith.cmpi eq, %e, %c0 : index",
        "%ep1 = arith.maxui %e, %c1 : index",
        "%ep = arith.subi %ep1, %c1 : index",
        "%starti = memref.load %em[%ep] : memref<" + f"{experts}xi32>",
        "%startx = arith.index_cast %starti : i32 to index",
        "%startp = arith.maxsi %startx, %c0 : index",
        "%startq = arith.select %isfirst, %c0, %startp : index",
        "%start = arith.minsi %startq, %end : index",
        "%count = arith.subi %end, %start : index",
        f"%tail = arith.remui %count, %c{b.rows}w : index",
        "%full = arith.subi %count, %tail : index",
        "%fullend = arith.addi %start, %full : index",
        f"scf.for %kb = %c0 to %c{k}w step %c{kc}w {{",
        f"%ke = arith.addi %kb, %c{kc}w : index",
        "%first = arith.cmpi eq, %kb, %c0 : index",
        f"scf.for %mc = %start to %fullend step %c{mc}w {{",
        f"%mep = arith.addi %mc, %c{mc}w : index",
        "%me = arith.minui %mep, %fullend : index",
        "scf.for %s = %s0 to %s1 step %c1 {",
        f"scf.for %mb = %mc to %me step %c{b.rows}w {{",
        *micro(b, b.rows, "%mb", s, "f", layout=STRIP, base="%wbe"),
        "}",
        "}",
        "}",
        "scf.index_switch %tail",
    ]

    def tail(t: int) -> list[str]:
        return micro(b, t, "%fullend", s, f"t{t}", layout=STRIP, base="%wbe")

    for t in range(1, b.rows):
        lines += [f"case {t} {{", "scf.for %s = %s0 to %s1 step %c1 {", *tail(t)]
        lines += ["}", "scf.yield", "}"]
    lines += ["default {", "scf.yield", "}", "}"]
    # rows past the last expert's end: 0, written by the last expert's workgroups for their strips
    last = experts - 1
    lines += [
        f"%islast = arith.cmpi eq, %e, %c{last}w : index",
        "scf.if %islast {",
        "scf.for %zr = %end to %rows step %c1 {",
        f"%zo = arith.muli %zr, %c{n}w : index",
        "scf.for %s = %s0 to %s1 step %c1 {",
        f"%zb = arith.muli %s, %c{b.strip}w : index",
        "%zc = arith.addi %zo, %zb : index",
        *(
            line
            for h in range(b.vectors)
            for line in (
                f"%zc{h} = arith.addi %zc, %c{h * b.lanes}w : index",
                f"vector.store %zero, %om[%zc{h}] : {ot}, {vec}",
            )
        ),
        "}",
        "}",
        "}",
        "return",
    ]
    return spliced.with_index_constants("\n".join(lines))


def executable(experts: int, n: int, k: int, tile: int) -> tuple[str, str]:
    """The name (unique per shape, block and blocking: findings 52) and text of the executable with the block of
    strip 8 `tile`: E x ceil(N / strip / per) workgroups, the row count an index operand."""
    b = block_of(tile)
    per = per_workgroup(b)
    blocking = f"kc{BLOCKING['kc']}_mc{BLOCKING['mc']}_ks{BLOCKING['ks']}"
    name = f"gpmm_e{experts}_{k}x{n}_r{b.name}_p{per}_{blocking}"
    bindings = ", ".join(f"{v}: !stream.binding" for v in ("%bx", "%bw", "%be", "%bo"))
    return name, spliced.executable(name, bindings, 0, _kernel(b, experts, n, k, per))


def workgroups(n: int, experts: int, tile: int) -> int:
    b = block_of(tile)
    return experts * -(-n // b.strip // per_workgroup(b))


def splice(mlir: str) -> str:
    """`mlir` with every `fx_rewrites.grouped_packed_matmul` call replaced by a `flow.dispatch` of its executable.
    ValueError where there is none, or one of another form."""

    def convert(line: str, ints: dict[str, str]) -> spliced.Spliced:
        found = _CALL.match(line)
        if not found:
            raise ValueError(f"a grouped_packed_matmul call of an unknown form: {line.strip()[:200]}")
        pad, res, x, w, ends, tile_name, types, otype = found.groups()
        if tile_name not in ints:
            raise ValueError(f"a grouped_packed_matmul call whose tile is not a constant: {line.strip()[:200]}")
        tile = int(ints[tile_name])
        vts = re.findall(r"!torch\.vtensor<[^>]*>", types)[:3]
        (tx, sx), (tw, sw), (te, se) = (spliced._tensor(t) for t in vts)
        if len(sx) != 2 or len(sw) != 4 or len(se) != 1 or "?" in "".join(sx[1:] + sw + se) or sw[3] != str(STRIP):
            raise ValueError(f"a grouped_packed_matmul call with operands {sx}, {sw}, {se}: {line.strip()[:200]}")
        experts, k, n = int(sw[0]), int(sx[1]), int(sw[1]) * STRIP
        if int(sw[2]) != k or int(se[0]) != experts or te != f"tensor<{experts}xi32>":
            raise ValueError(f"a grouped_packed_matmul call with operands {sx}, {sw}, {te}: {line.strip()[:200]}")
        name, text = executable(experts, n, k, tile)
        p = f"gpmm{res[1:].replace('#', '_')}"
        out = [f"{pad}%{p}_{i} = torch_c.to_builtin_tensor {v} : {vt} -> {tt}"
               for i, (v, vt, tt) in enumerate(zip((x, w, ends), vts, (tx, tw, te), strict=True))]  # fmt: skip
        dyn = sx[0] == "?"
        out += [f"{pad}%{p}_n = arith.constant {workgroups(n, experts, tile)} : index"]
        if dyn:
            out += [f"{pad}%{p}_z = arith.constant 0 : index", f"{pad}%{p}_r = tensor.dim %{p}_0, %{p}_z : {tx}"]
        else:
            out += [f"{pad}%{p}_r = arith.constant {sx[0]} : index"]
        ty = f"tensor<{sx[0]}x{n}xf32>"
        dims = f"{{%{p}_r}}" if dyn else ""
        out += [
            f"{pad}%{p}_d = flow.dispatch @{name}::@{name}[%{p}_n](%{p}_0, %{p}_1, %{p}_2, %{p}_r) : "
            f"({tx}{dims}, {tw}, {te}, index) -> {ty}{dims}",
            f"{pad}{res} = torch_c.from_builtin_tensor %{p}_d : {ty} -> {otype.strip()}",
        ]
        return out, name, text

    return spliced.splice_each(mlir, MARK, "grouped_packed_matmul", convert)
