"""A hand-written masked attention dispatch (issue 34): FlashAttention-2's loop, one row block a workgroup.

out[b, h, r] = softmax(scale q[b, h, r] K^T, masked) V over the keys of key-value head h // group. A workgroup takes
(b, h, a block of `ROWS` query rows) and walks the keys in blocks of `KEYS` (64: four zmm a row): the block's scores
for its rows in registers (`ROWS` x `KEYS` accumulators, q's values broadcast from a stack copy of its rows, K laid
out [keys / KEYS, D, KEYS] so that a step of D is one load of the block's keys), then per row the mask (int8, a
select to -inf), the running max, the exponentials against it (stored to a stack buffer), the running sum (`KEYS`
lanes a row) and the rescale factors (one vector exp for the block's rows); then P.V, 6 rows by 4 vectors of D a
register block, V read as it lies ([keys, D]), added to the rows' output (a stack buffer) after it is rescaled. A
key block whose mask lets none of the workgroup's rows through is skipped (a causal prefill's keys past the rows, and
a static cache's keys past the prompt). At the end each row is divided by its sum; a row that lets no key through
gives 0 (torch 2.13 CPU eager's answer, and the guard's). The row count is a run-time size (the prompt's Dim); the
last block's rows past it are computed as the last row and not stored.

It enters a graph as `fx_rewrites::flash_attention(q, k_packed, v_padded, mask, scale)` (eager: the keys unpacked,
torch's SDPA), imported by torch-mlir as `torch.operator "torch.fx_rewrites.flash_attention"`; `splice` (run by
`IreeBackend` through `kernels.spliced`) replaces each call by a `flow.dispatch` of its `stream.executable`. The rule
writing it is `rules/flash_attention.py`'s.
"""

from __future__ import annotations

import dataclasses
import re
import struct

import torch

from fx_rewrites.backends.iree import spliced

OP, MARK = "fx_rewrites::flash_attention", "torch.fx_rewrites.flash_attention"
MARKS = (MARK,)
#: query rows a workgroup (the scores' register block: ROWS x KEYS keys in 4 ROWS zmm; 12 x 32 measured 3-12% slower)
ROWS = 6
#: keys a block: a row's scores in four 16-lane vectors
KEYS = 64
#: P.V's register block: rows by vectors of 16 of the head size
PV_ROWS, PV_VECTORS = 6, 4
LANES = 16


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention: q [b, heads, rows (run time), size], keys and values [b, kv, keys, size] (the keys padded to
    `padded`), the mask [b, mask_heads (1 or heads), rows, keys] int8."""

    b: int
    heads: int
    kv: int
    keys: int
    size: int
    mask_heads: int
    scale: float

    @property
    def padded(self) -> int:
        return -(-self.keys // KEYS) * KEYS

    @property
    def group(self) -> int:
        return self.heads // self.kv

    @property
    def name(self) -> str:
        bits = struct.unpack("<I", struct.pack("<f", self.scale))[0]
        return f"flash_{self.b}x{self.heads}x{self.kv}_k{self.keys}_d{self.size}_m{self.mask_heads}_s{bits:08x}"


def _f32(x: float) -> str:
    """An f32 constant's bits as MLIR's hexadecimal float literal (exact)."""
    return f"0x{struct.unpack('<I', struct.pack('<f', x))[0]:08X}"


class _Kernel:
    def __init__(self, s: Shape) -> None:
        self.s, self.lines = s, []
        self.v32, self.v16 = f"vector<{KEYS}xf32>", f"vector<{LANES}xf32>"

    def add(self, line: str) -> None:
        self.lines.append(line)

    def prologue(self) -> None:
        s, add = self.s, self.add
        for line in (
            "%c0 = arith.constant 0 : index",
            "%c1 = arith.constant 1 : index",
            f"%zero32 = arith.constant dense<0.0> : {self.v32}",
            f"%zero16 = arith.constant dense<0.0> : {self.v16}",
            f"%ninf32 = arith.constant dense<0xFF800000> : {self.v32}",
            "%ninf = arith.constant 0xFF800000 : f32",
            "%fzero = arith.constant 0.0 : f32",
            "%fone = arith.constant 1.0 : f32",
            f"%scale = arith.constant dense<{_f32(s.scale)}> : {self.v32}",
            f"%zi8 = arith.constant dense<0> : vector<{KEYS}xi8>",
            f"%qsize = arith.muli %rows, %c{s.b * s.heads * s.size}w : index",
            f"%msize = arith.muli %rows, %c{s.b * s.mask_heads * s.keys}w : index",
            "%qm = stream.binding.subspan %bq[%c0] : !stream.binding -> memref<?xf32>{%qsize}",
            f"%km = stream.binding.subspan %bk[%c0] : !stream.binding -> memref<{s.b * s.kv * s.padded * s.size}xf32>",
            f"%vm = stream.binding.subspan %bv[%c0] : !stream.binding -> memref<{s.b * s.kv * s.padded * s.size}xf32>",
            "%mm = stream.binding.subspan %bm[%c0] : !stream.binding -> memref<?xi8>{%msize}",
            "%om = stream.binding.subspan %bo[%c0] : !stream.binding -> memref<?xf32>{%qsize}",
            f"%obuf = memref.alloca() : memref<{ROWS * s.size}xf32>",
            f"%qbuf = memref.alloca() : memref<{ROWS * s.size}xf32>",
            f"%pbuf = memref.alloca() : memref<{ROWS * KEYS}xf32>",
            f"%lbuf = memref.alloca() : memref<{ROWS * KEYS}xf32>",
            f"%mbuf = memref.alloca() : memref<{ROWS}xf32>",
            f"%abuf = memref.alloca() : memref<{ROWS}xf32>",
            "%g = stream.dispatch.workgroup.id[0] : index",
            f"%nb = arith.ceildivui %rows, %c{ROWS}w : index",
            "%bh = arith.divui %g, %nb : index",
            "%rb = arith.remui %g, %nb : index",
            f"%bi = arith.divui %bh, %c{s.heads}w : index",
            f"%hi = arith.remui %bh, %c{s.heads}w : index",
            f"%kvi = arith.divui %hi, %c{s.group}w : index",
            f"%bkv0 = arith.muli %bi, %c{s.kv}w : index",
            "%bkv = arith.addi %bkv0, %kvi : index",
            f"%kbase = arith.muli %bkv, %c{s.padded * s.size}w : index",
            f"%r0 = arith.muli %rb, %c{ROWS}w : index",
            "%rlast = arith.subi %rows, %c1 : index",
            "%bhr = arith.muli %bh, %rows : index",
        ):
            add(line)
        if s.mask_heads == 1:
            add("%mh = arith.muli %bi, %rows : index")
        else:
            add("%mh = arith.muli %bh, %rows : index")
        for i in range(ROWS):
            add(f"%row{i} = arith.addi %r0, %c{i}w : index")
            add(f"%ri{i} = arith.minui %row{i}, %rlast : index")
            add(f"%qr{i}a = arith.addi %bhr, %ri{i} : index")
            add(f"%qr{i} = arith.muli %qr{i}a, %c{s.size}w : index")  # q's and out's row
            add(f"%mr{i}a = arith.addi %mh, %ri{i} : index")
            add(f"%mr{i} = arith.muli %mr{i}a, %c{s.keys}w : index")  # the mask's row
            add(f"%ib{i} = arith.constant {i} : index")
            add(f"memref.store %ninf, %mbuf[%ib{i}] : memref<{ROWS}xf32>")
            add(f"vector.store %zero32, %lbuf[%c{i * KEYS}w] : memref<{ROWS * KEYS}xf32>, {self.v32}")
            for u in range(0, s.size, LANES):
                at = f"%c{i * s.size + u}w"
                add(f"vector.store %zero16, %obuf[{at}] : memref<{ROWS * s.size}xf32>, {self.v16}")
                add(f"%qa{i}_{u} = arith.addi %qr{i}, %c{u}w : index")
                add(f"%qv{i}_{u} = vector.load %qm[%qa{i}_{u}] : memref<?xf32>, {self.v16}")
                add(f"vector.store %qv{i}_{u}, %qbuf[{at}] : memref<{ROWS * s.size}xf32>, {self.v16}")

    def block(self, t: str, j0: str, kb: str, valid: int) -> None:
        """One key block from key `j0` (packed block `kb`), `valid` keys of it real (the rest padding)."""
        add, mt = self.add, f"vector<{KEYS}xi8>"
        if valid < KEYS:
            add(f"%{t}km = vector.constant_mask [{valid}] : vector<{KEYS}xi1>")
        for i in range(ROWS):
            add(f"%{t}ma{i} = arith.addi %mr{i}, {j0} : index")
            if valid == KEYS:
                add(f"%{t}mv{i} = vector.load %mm[%{t}ma{i}] : memref<?xi8>, {mt}")
            else:
                add(
                    f"%{t}mv{i} = vector.maskedload %mm[%{t}ma{i}], %{t}km, %zi8 : memref<?xi8>, "
                    f"vector<{KEYS}xi1>, {mt} into {mt}"
                )
        add(f"%{t}or0 = arith.ori %{t}mv0, %{t}mv1 : {mt}")
        for i in range(2, ROWS):
            add(f"%{t}or{i - 1} = arith.ori %{t}or{i - 2}, %{t}mv{i} : {mt}")
        add(f"%{t}nz = arith.cmpi ne, %{t}or{ROWS - 2}, %zi8 : {mt}")
        add(f"%{t}any = vector.reduction <or>, %{t}nz : vector<{KEYS}xi1> into i1")
        add(f"scf.if %{t}any {{")
        self.scores(t, kb)
        self.softmax(t)
        self.products(t, j0, valid)
        add("}")

    def scores(self, t: str, kb: str) -> None:
        s, add, v32 = self.s, self.add, self.v32
        kt = f"memref<{s.b * s.kv * s.padded * s.size}xf32>"
        add(f"%{t}kb0 = arith.muli {kb}, %c{s.size * KEYS}w : index")
        add(f"%{t}kb = arith.addi %kbase, %{t}kb0 : index")
        inits = ", ".join(f"%{t}a{i} = %zero32" for i in range(ROWS))
        add(f"%{t}s:{ROWS} = scf.for %{t}d = %c0 to %c{s.size}w step %c4w iter_args({inits}) -> "
            f"({', '.join([v32] * ROWS)}) {{")  # fmt: skip
        acc = [f"%{t}a{i}" for i in range(ROWS)]
        for step in range(4):
            add(f"%{t}d{step} = arith.addi %{t}d, %c{step}w : index")
            add(f"%{t}kd{step}a = arith.muli %{t}d{step}, %c{KEYS}w : index")
            add(f"%{t}kd{step} = arith.addi %{t}kb, %{t}kd{step}a : index")
            add(f"%{t}k{step} = vector.load %km[%{t}kd{step}] : {kt}, {v32}")
            for i in range(ROWS):
                add(f"%{t}qi{step}_{i} = arith.addi %{t}d{step}, %c{i * s.size}w : index")
                add(f"%{t}qs{step}_{i} = memref.load %qbuf[%{t}qi{step}_{i}] : memref<{ROWS * s.size}xf32>")
                add(f"%{t}qb{step}_{i} = vector.broadcast %{t}qs{step}_{i} : f32 to {v32}")
                add(f"%{t}f{step}_{i} = vector.fma %{t}k{step}, %{t}qb{step}_{i}, {acc[i]} : {v32}")
                acc[i] = f"%{t}f{step}_{i}"
        add(f"scf.yield {', '.join(acc)} : {', '.join([v32] * ROWS)}")
        add("}")

    def softmax(self, t: str) -> None:
        add, v32 = self.add, self.v32
        lt = f"memref<{ROWS * KEYS}xf32>"
        for i in range(ROWS):
            add(f"%{t}x{i} = arith.mulf %{t}s#{i}, %scale : {v32}")
            add(f"%{t}c{i} = arith.cmpi ne, %{t}mv{i}, %zi8 : vector<{KEYS}xi8>")
            add(f"%{t}y{i} = arith.select %{t}c{i}, %{t}x{i}, %ninf32 : vector<{KEYS}xi1>, {v32}")
            add(f"%{t}bm{i} = vector.reduction <maxnumf>, %{t}y{i} : {v32} into f32")
            add(f"%{t}mo{i} = memref.load %mbuf[%ib{i}] : memref<{ROWS}xf32>")
            add(f"%{t}mn{i} = arith.maxnumf %{t}mo{i}, %{t}bm{i} : f32")
            add(f"%{t}none{i} = arith.cmpf oeq, %{t}mn{i}, %ninf : f32")
            add(f"%{t}ms{i} = arith.select %{t}none{i}, %fzero, %{t}mn{i} : f32")
            add(f"%{t}al{i}a = arith.subf %{t}mo{i}, %{t}ms{i} : f32")
            add(f"memref.store %{t}mn{i}, %mbuf[%ib{i}] : memref<{ROWS}xf32>")
        # the rows' rescale factors exp(old max - new max) in one vector exp
        diffs = [f"%{t}al{i}a" for i in range(ROWS)] + ["%fzero"] * (-ROWS % LANES)
        width = len(diffs)
        add(f"%{t}ad = vector.from_elements {', '.join(diffs)} : vector<{width}xf32>")
        add(f"%{t}av = math.exp %{t}ad : vector<{width}xf32>")
        for i in range(ROWS):
            add(f"%{t}al{i} = vector.extract %{t}av[{i}] : f32 from vector<{width}xf32>")
            add(f"%{t}mb{i} = vector.broadcast %{t}ms{i} : f32 to {v32}")
            add(f"%{t}e{i}a = arith.subf %{t}y{i}, %{t}mb{i} : {v32}")
            add(f"%{t}e{i} = math.exp %{t}e{i}a : {v32}")
            add(f"vector.store %{t}e{i}, %pbuf[%c{i * KEYS}w] : {lt}, {v32}")
            add(f"%{t}l{i}o = vector.load %lbuf[%c{i * KEYS}w] : {lt}, {v32}")
            add(f"%{t}ab{i} = vector.broadcast %{t}al{i} : f32 to {v32}")
            add(f"%{t}l{i} = vector.fma %{t}l{i}o, %{t}ab{i}, %{t}e{i} : {v32}")
            add(f"vector.store %{t}l{i}, %lbuf[%c{i * KEYS}w] : {lt}, {v32}")
            add(f"memref.store %{t}al{i}, %abuf[%ib{i}] : memref<{ROWS}xf32>")

    def products(self, t: str, j0: str, valid: int) -> None:
        """P.V over the block's `valid` keys, added to the rows' outputs after they are rescaled."""
        s, add, v16 = self.s, self.add, self.v16
        vt, ot = f"memref<{s.b * s.kv * s.padded * s.size}xf32>", f"memref<{ROWS * s.size}xf32>"
        pt = f"memref<{ROWS * KEYS}xf32>"
        for r0 in range(0, ROWS, PV_ROWS):
            rows = range(r0, min(ROWS, r0 + PV_ROWS))
            for d0 in range(0, s.size, PV_VECTORS * LANES):
                vecs = range(min(PV_VECTORS, (s.size - d0) // LANES))
                u = f"{t}_{r0}_{d0}"
                keys = [(r, w) for r in rows for w in vecs]
                inits = ", ".join(f"%{u}i{r}_{w} = %zero16" for r, w in keys)
                add(f"%{u}acc:{len(keys)} = scf.for %{u}j = %c0 to %c{valid}w step %c1 iter_args({inits}) -> "
                    f"({', '.join([v16] * len(keys))}) {{")  # fmt: skip
                add(f"%{u}jj = arith.addi {j0}, %{u}j : index")
                add(f"%{u}vr = arith.muli %{u}jj, %c{s.size}w : index")
                add(f"%{u}vb = arith.addi %kbase, %{u}vr : index")
                for w in vecs:
                    add(f"%{u}va{w} = arith.addi %{u}vb, %c{d0 + w * LANES}w : index")
                    add(f"%{u}v{w} = vector.load %vm[%{u}va{w}] : {vt}, {v16}")
                for r in rows:
                    add(f"%{u}pa{r} = arith.addi %{u}j, %c{r * KEYS}w : index")
                    add(f"%{u}ps{r} = memref.load %pbuf[%{u}pa{r}] : {pt}")
                    add(f"%{u}pb{r} = vector.broadcast %{u}ps{r} : f32 to {v16}")
                    for w in vecs:
                        add(f"%{u}f{r}_{w} = vector.fma %{u}v{w}, %{u}pb{r}, %{u}i{r}_{w} : {v16}")
                add(f"scf.yield {', '.join(f'%{u}f{r}_{w}' for r, w in keys)} : {', '.join([v16] * len(keys))}")
                add("}")
                for n, (r, w) in enumerate(keys):
                    if w == 0:
                        add(f"%{u}al{r} = memref.load %abuf[%ib{r}] : memref<{ROWS}xf32>")
                        add(f"%{u}ab{r} = vector.broadcast %{u}al{r} : f32 to {v16}")
                    at = f"%c{r * s.size + d0 + w * LANES}w"
                    add(f"%{u}o{r}_{w} = vector.load %obuf[{at}] : {ot}, {v16}")
                    add(f"%{u}n{r}_{w} = vector.fma %{u}o{r}_{w}, %{u}ab{r}, %{u}acc#{n} : {v16}")
                    add(f"vector.store %{u}n{r}_{w}, %obuf[{at}] : {ot}, {v16}")

    def epilogue(self) -> None:
        s, add, v16, v32 = self.s, self.add, self.v16, self.v32
        ot = f"memref<{ROWS * s.size}xf32>"
        for i in range(ROWS):
            add(f"%in{i} = arith.cmpi ult, %row{i}, %rows : index")
            add(f"scf.if %in{i} {{")
            add(f"%lv{i} = vector.load %lbuf[%c{i * KEYS}w] : memref<{ROWS * KEYS}xf32>, {v32}")
            add(f"%ls{i} = vector.reduction <add>, %lv{i} : {v32} into f32")
            add(f"%lp{i} = arith.cmpf ogt, %ls{i}, %fzero : f32")
            add(f"%lr{i} = arith.divf %fone, %ls{i} : f32")
            add(f"%inv{i} = arith.select %lp{i}, %lr{i}, %fzero : f32")
            add(f"%ivb{i} = vector.broadcast %inv{i} : f32 to {v16}")
            for u in range(0, s.size, LANES):
                add(f"%ov{i}_{u} = vector.load %obuf[%c{i * s.size + u}w] : {ot}, {v16}")
                add(f"%ow{i}_{u} = arith.mulf %ov{i}_{u}, %ivb{i} : {v16}")
                add(f"%oa{i}_{u} = arith.addi %qr{i}, %c{u}w : index")
                add(f"vector.store %ow{i}_{u}, %om[%oa{i}_{u}] : memref<?xf32>, {v16}")
            add("}")

    def text(self) -> str:
        s = self.s
        self.prologue()
        full, tail = divmod(s.keys, KEYS)
        self.add(f"scf.for %kbi = %c0 to %c{full}w step %c1 {{")
        self.add(f"%kj0 = arith.muli %kbi, %c{KEYS}w : index")
        self.block("f", "%kj0", "%kbi", KEYS)
        self.add("}")
        if tail:
            self.block("t", f"%c{full * KEYS}w", f"%c{full}w", tail)
        self.epilogue()
        self.add("return")
        return spliced.with_index_constants("\n".join(self.lines))


def executable(s: Shape) -> tuple[str, str]:
    """The name (unique per shape) and text of the `stream.executable`, over b x heads x ceil(rows / ROWS)
    workgroups, taking q, the packed keys, the padded values, the int8 mask and the row count."""
    if s.size % (4 * LANES) and s.size % LANES:
        raise ValueError(f"a head size of {s.size}: a multiple of {LANES}")
    bindings = "%bq: !stream.binding, %bk: !stream.binding, %bv: !stream.binding, %bm: !stream.binding, " \
        "%bo: !stream.binding"  # fmt: skip
    return s.name, spliced.executable(s.name, bindings, 0, _Kernel(s).text())


def pack_keys(k: torch.Tensor) -> torch.Tensor:
    """k [b, kv, keys, D] as [b, kv, padded / 32, D, 32] (the keys padded with zeros to a multiple of 32)."""
    b, kv, keys, size = k.shape
    padded = -(-keys // KEYS) * KEYS
    k = torch.nn.functional.pad(k, (0, 0, 0, padded - keys))
    return k.view(b, kv, padded // KEYS, KEYS, size).transpose(-1, -2).contiguous()


def pad_values(v: torch.Tensor) -> torch.Tensor:
    keys = v.shape[-2]
    return torch.nn.functional.pad(v, (0, 0, 0, -(-keys // KEYS) * KEYS - keys))


@torch.library.custom_op(OP, mutates_args=())
def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked attention of `q` [b, h, rows, D] over keys `k` (`pack_keys`) and values `v` (`pad_values`) of kv heads
    (h a multiple of kv), `mask` [b, 1 or h, rows, keys] int8 (nonzero: the key is seen); 0 where a row sees none."""
    b, kv, blocks, size, _ = k.shape
    keys = mask.shape[-1]
    keys_ = k.transpose(-1, -2).reshape(b, kv, blocks * KEYS, size)[:, :, :keys]
    seen = mask != 0
    out = torch.nn.functional.scaled_dot_product_attention(
        q, keys_, v[:, :, :keys], attn_mask=seen, scale=scale, enable_gqa=True
    )
    return torch.where(seen.any(-1, keepdim=True), out, 0.0)


@flash_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


FLASH_ATTENTION = torch.ops.fx_rewrites.flash_attention.default

_CALL = re.compile(
    rf'^(\s*)(%[\w]+) = torch\.operator "{re.escape(MARK)}"\((%[\w#]+), (%[\w#]+), (%[\w#]+), (%[\w#]+), '
    r"(%[\w.+\-]+)\) : \((.*)\) -> (.*)$"
)
_FLOAT = re.compile(r"^\s*(%[\w.+\-]+) = torch\.constant\.float (\S+)", re.M)


def splice(mlir: str) -> str:
    """`mlir` with every `fx_rewrites.flash_attention` call replaced by a `flow.dispatch` of its executable."""
    floats = dict(_FLOAT.findall(mlir))

    def convert(line: str, ints: dict[str, str]) -> spliced.Spliced:
        found = _CALL.match(line)
        if not found or found.group(7) not in floats:
            raise ValueError(f"a flash_attention call of an unknown form: {line.strip()[:200]}")
        pad, res, q, k, v, m, scale, types, otype = found.groups()
        vts = re.findall(r"!torch\.vtensor<[^>]*>", types)[:4]
        (tq, sq), (tk, sk), (tv, sv), (tm, sm) = (spliced._tensor(t) for t in vts)
        if len(sk) != 5 or sk[4] != str(KEYS) or "?" in "".join(sq[:2] + sq[3:] + sk + sv + sm[:2] + sm[3:]):
            raise ValueError(f"a flash_attention call with a dynamic size other than the rows: {line.strip()[:200]}")
        shape = Shape(int(sq[0]), int(sq[1]), int(sk[1]), int(sm[3]), int(sq[3]), int(sm[1]), float(floats[scale]))
        name, text = executable(shape)
        p = f"fa{res[1:]}"
        out = [f"{pad}%{p}_{i} = torch_c.to_builtin_tensor {x} : {vt} -> {tt}"
               for i, (x, vt, tt) in enumerate(zip((q, k, v, m), vts, (tq, tk, tv, tm), strict=True))]  # fmt: skip
        out += [
            f"{pad}%{p}_two = arith.constant 2 : index",
            f"{pad}%{p}_rows = arith.constant {ROWS} : index",
            f"{pad}%{p}_bh = arith.constant {shape.b * shape.heads} : index",
            f"{pad}%{p}_r = tensor.dim %{p}_0, %{p}_two : {tq}",
            f"{pad}%{p}_nb = arith.ceildivui %{p}_r, %{p}_rows : index",
            f"{pad}%{p}_n = arith.muli %{p}_nb, %{p}_bh : index",
        ]
        dq = "{%" + p + "_r}" if sq[2] == "?" else ""
        dm = "{%" + p + "_r}" if sm[2] == "?" else ""
        sig = f"{tq}{dq}, {tk}, {tv}, {tm}{dm}, index"
        out += [
            f"{pad}%{p}_d = flow.dispatch @{name}::@{name}[%{p}_n](%{p}_0, %{p}_1, %{p}_2, %{p}_3, %{p}_r) : ({sig}) "
            f"-> {tq}{dq}",
            f"{pad}{res} = torch_c.from_builtin_tensor %{p}_d : {tq} -> {otype.strip()}",
        ]
        return out, name, text

    return spliced.splice_each(mlir, MARK, "flash_attention", convert)
