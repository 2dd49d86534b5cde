"""MoE experts' prefill products as one hand-written dispatch over all experts (issue 34; AVX-512).

`fx_rewrites::grouped_packed_matmul(x, packed, ends)`: x [S, K] f32, its rows sorted by expert, `ends` [E] int32 the
end of each expert's rows (non-decreasing, at most S: `rules/moe_packed.py` clamps them), `packed` [E, N/16, K, 16] the
experts' weights as `packed_experts.pack` lays them out (the tensor the decode's narrow `mmt4d` tile reads too). Row r
of the result is x[r] @ W_e.T for the expert e whose rows hold r; rows at or past ends[E-1] are 0.

One `stream.executable` (`splice`: a `flow.dispatch` over E x ceil(N/32 / PER) workgroups, S passed as an index): the
workgroup of expert e and PER pairs of strips reads e's row range from `ends` and multiplies it in f32_dispatch.py's
AVX-512 register block, 12 rows x 32 channels in 24 zmm accumulators (2 loads and 12 broadcasts per 24 FMAs, where
IREE 3.13's 16x16x1 `mmt4d` microkernel does 1 and 16 per 16), the 32 channels two strips of 16 read where they lie;
a range's last rows (fewer than 12) by a block of their own count (`scf.index_switch`); K in blocks of `kc`, each
summed from zero in sums of `ks` steps and added to y, as f32_dispatch.py's kernel. Against the per-expert form
(`packed_matmul` per expert: a pack of the rows, the mmt4d, an unpack, and the range read to the host, per expert and
product) it runs no pack, no unpack and one dispatch per product.
"""

from __future__ import annotations

import re

import torch

from fx_rewrites.backends.iree import spliced
from fx_rewrites.backends.iree.f32_dispatch import BLOCKING, BLOCKS, KU, _Shape, _stores
from fx_rewrites.backends.iree.packed_experts import STRIP, unpack

OP, MARK = "fx_rewrites::grouped_packed_matmul", "torch.fx_rewrites.grouped_packed_matmul"
MARKS = (MARK,)
#: the register block: AVX-512's 12 x 32 (two strips of 16 a step)
BLOCK = BLOCKS["avx512"]
#: strip pairs (32 channels) a workgroup
PER = 4

_CALL = re.compile(
    rf'^(\s*)(%[\w#]+) = torch\.operator "{re.escape(MARK)}"\((%[\w#]+), (%[\w#]+), (%[\w#]+)\) : \((.*)\) -> (.*)$'
)


@torch.library.custom_op(OP, mutates_args=())
def grouped_packed_matmul(x: torch.Tensor, packed: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows [ends[e-1], ends[e]) of x times expert e's weight W_e [N, K] held as `pack(W_e)` (eager: torch's)."""
    out = x.new_zeros(x.shape[0], packed.shape[1] * packed.shape[3])
    start = 0
    for e, end in enumerate(ends.clamp(0, x.shape[0]).tolist()):
        if end > start:
            out[start:end] = x[start:end] @ unpack(packed[e]).t()
        start = max(start, end)
    return out


@grouped_packed_matmul.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[1] * packed.shape[3])


GROUPED_PACKED_MATMUL = torch.ops.fx_rewrites.grouped_packed_matmul.default


def _micro(rows: int, m: str, s: _Shape, tag: str) -> list[str]:
    """A block of `rows` rows from row `m` of strip pair `%s` of expert base `%wbe` over K block [`%kb`, `%ke`)."""
    b, vec, lines = BLOCK, f"vector<{BLOCK.lanes}xf32>", []
    add = lines.append
    accs = [(r, h) for r in range(rows) for h in range(b.vectors)]
    add(f"%ob{tag} = arith.muli %s, %c{b.strip}w : index")
    for r in range(rows):
        add(f"%row{tag}{r} = arith.addi {m}, %c{r}w : index")
        add(f"%xr{tag}{r} = arith.muli %row{tag}{r}, %c{s.k}w : index")
        add(f"%or{tag}{r} = arith.muli %row{tag}{r}, %c{s.n}w : index")
        add(f"%oo{tag}{r}_0 = arith.addi %or{tag}{r}, %ob{tag} : index")
        for h in range(1, b.vectors):
            add(f"%oo{tag}{r}_{h} = arith.addi %oo{tag}{r}_0, %c{h * b.lanes}w : index")
    # vector h of the pair: strip 2 s + h of the expert, [K, 16] contiguous
    add(f"%wbs{tag} = arith.muli %s, %c{b.vectors * s.k * STRIP}w : index")
    add(f"%wb{tag}_0 = arith.addi %wbe, %wbs{tag} : index")
    for h in range(1, b.vectors):
        add(f"%wb{tag}_{h} = arith.addi %wb{tag}_0, %c{h * s.k * STRIP}w : index")
    types = ", ".join([vec] * len(accs))
    args = ", ".join(f"%a{r}_{h} = %zero" for r, h in accs)
    sums = s.kc // s.ks > 1
    if sums:
        add(f"scf.for %kq = %kb to %ke step %c{s.ks}w {{")
        add(f"%kqe = arith.addi %kq, %c{s.ks}w : index")
        add("%firstq = arith.cmpi eq, %kq, %c0 : index")
    lo, hi = ("%kq", "%kqe") if sums else ("%kb", "%ke")
    add(f"%res{tag}:{len(accs)} = scf.for %k = {lo} to {hi} step %c{KU}w iter_args({args}) -> ({types}) {{")
    add(f"%wk = arith.muli %k, %c{STRIP}w : index")
    cur = {(r, h): f"%a{r}_{h}" for r, h in accs}
    for h in range(b.vectors):
        add(f"%wkb{h} = arith.addi %wb{tag}_{h}, %wk : index")
    for u in range(KU):
        for h in range(b.vectors):
            add(f"%w{u}_{h} = arith.addi %wkb{h}, %c{u * STRIP}w : index")
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
        return [*lines, *_stores(b, rows, s, tag, first=True), *(["}"] if sums else [])]
    add(f"scf.if {'%firstq' if sums else '%first'} {{")
    lines += _stores(b, rows, s, tag, first=True)
    add("} else {")
    lines += _stores(b, rows, s, tag, first=False)
    add("}")
    if sums:
        add("}")
    return lines


def _kernel(experts: int, n: int, k: int, per: int) -> str:
    b = BLOCK
    kc, mc = (
        next(c for c in range(min(BLOCKING["kc"], k), 0, -KU) if k % c == 0),
        BLOCKING["mc"] - BLOCKING["mc"] % b.rows,
    )
    if k % kc or kc % KU or n % b.strip:
        raise ValueError(f"K {k} by blocks of {kc} (a multiple of {KU}), N {n} of the block's {b.strip} channels")
    ks = next(c for c in range(min(BLOCKING["ks"], kc), 0, -KU) if kc % c == 0)
    pairs, groups = n // b.strip, -(-n // b.strip // per)
    xt, wt, ot = "memref<?xf32>", f"memref<{experts * n * k}xf32>", "memref<?xf32>"
    s = _Shape(k, n, kc, ks, k // ks, False, xt, wt, ot)
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
        *_micro(b.rows, "%mb", s, "f"),
        "}",
        "}",
        "}",
        "scf.index_switch %tail",
    ]
    for t in range(1, b.rows):
        lines += [f"case {t} {{", "scf.for %s = %s0 to %s1 step %c1 {", *_micro(t, "%fullend", s, f"t{t}")]
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


def executable(experts: int, n: int, k: int, per: int = PER) -> tuple[str, str]:
    """The name (unique per shape and blocking: findings 52) and text of the executable: E x ceil(N/32 / per)
    workgroups, the row count an index operand."""
    blocking = f"kc{BLOCKING['kc']}_mc{BLOCKING['mc']}_ks{BLOCKING['ks']}"
    name = f"gpmm_e{experts}_{k}x{n}_r{BLOCK.name}_p{per}_{blocking}"
    bindings = ", ".join(f"{v}: !stream.binding" for v in ("%bx", "%bw", "%be", "%bo"))
    return name, spliced.executable(name, bindings, 0, _kernel(experts, n, k, per))


def workgroups(n: int, experts: int, per: int = PER) -> int:
    return experts * -(-n // BLOCK.strip // per)


def splice(mlir: str) -> str:
    """`mlir` with every `fx_rewrites.grouped_packed_matmul` call replaced by a `flow.dispatch` of its executable.
    ValueError where there is none, or one of another form."""

    def convert(line: str, ints: dict[str, str]) -> spliced.Spliced:
        found = _CALL.match(line)
        if not found:
            raise ValueError(f"a grouped_packed_matmul call of an unknown form: {line.strip()[:200]}")
        pad, res, x, w, ends, types, otype = found.groups()
        vts = re.findall(r"!torch\.vtensor<[^>]*>", types)[:3]
        (tx, sx), (tw, sw), (te, se) = (spliced._tensor(t) for t in vts)
        if len(sx) != 2 or len(sw) != 4 or len(se) != 1 or "?" in "".join(sx[1:] + sw + se) or sw[3] != str(STRIP):
            raise ValueError(f"a grouped_packed_matmul call with operands {sx}, {sw}, {se}: {line.strip()[:200]}")
        experts, k, n = int(sw[0]), int(sx[1]), int(sw[1]) * STRIP
        if int(sw[2]) != k or int(se[0]) != experts or te != f"tensor<{experts}xi32>":
            raise ValueError(f"a grouped_packed_matmul call with operands {sx}, {sw}, {te}: {line.strip()[:200]}")
        name, text = executable(experts, n, k)
        p = f"gpmm{res[1:].replace('#', '_')}"
        out = [f"{pad}%{p}_{i} = torch_c.to_builtin_tensor {v} : {vt} -> {tt}"
               for i, (v, vt, tt) in enumerate(zip((x, w, ends), vts, (tx, tw, te), strict=True))]  # fmt: skip
        dyn = sx[0] == "?"
        out += [f"{pad}%{p}_n = arith.constant {workgroups(n, experts)} : index"]
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
