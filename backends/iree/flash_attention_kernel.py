"""The flash attention dispatch's kernel text (issue 34): FlashAttention-2's loop, one row block a workgroup.

out[b, h, r] = softmax(scale q[b, h, r] K^T, masked) V over the keys of key-value head h // group. A workgroup takes
(b, h, a block of the ISA's rows) and walks the keys in blocks of `KEYS` (64): the block's scores for its rows in
registers (AVX-512: 6 x 64 in zmm; AVX2: 6 x 16 in ymm, four passes a block: `BLOCKS`), q's values broadcast from a
stack copy of its rows, K laid out [keys / KEYS, D, KEYS] so that a step of D is one load of the block's keys; then
per row the mask (int8, a select to -inf), the running max, the exponentials against it (stored to a stack buffer),
the running sum and the rescale factors (one vector exp for the block's rows); then P.V in register blocks, V read as
it lies ([keys, D]), added to the rows' output (a stack buffer) after it is rescaled. A key block whose mask lets
none of the workgroup's rows through is skipped. At the end each row is divided by its sum; a row that lets no key
through gives 0. The row count is a run-time size; the last block's rows past it are computed as the last row and not
stored. The op, its packing and the splice are flash_attention_dispatch.py's.
"""

from __future__ import annotations

import dataclasses
import struct

from fx_rewrites.backends.iree import spliced

#: keys a block (one softmax step and one packed block of K, on every ISA)
KEYS = 64


@dataclasses.dataclass(frozen=True)
class Block:
    """A register block per ISA: `rows` query rows a workgroup, their scores over `chunk` keys at a time in rows x
    chunk / lanes accumulators (a block's `KEYS` keys in KEYS / chunk passes, kept on the stack between passes
    where chunk < KEYS), P.V in `pv_rows` x `pv_vectors` accumulators of `lanes` float32."""

    lanes: int
    rows: int
    chunk: int
    pv_rows: int
    pv_vectors: int

    @property
    def name(self) -> str:
        return f"r{self.rows}x{self.chunk}l{self.lanes}"


#: AVX-512: 6 rows x 64 keys in 24 zmm (12 x 32 measured 3-12% slower); AVX2: 6 x 16 in 12 ymm, four passes a block
#: (docs/performance.md, "MoE prefill's attention as a dispatch of our own" and the section after it)
BLOCKS = {"avx2": Block(8, 6, 16, 6, 2), "avx512": Block(16, 6, 64, 6, 4)}
#: the row block of both ISAs (a test's row counts are chosen around it)
ROWS = 6
#: the head size's multiple: one vector of AVX-512's
LANES = 16


def block_of(lanes: int) -> Block:
    """The block of `BLOCKS` of vectors of `lanes` float32 (the op's `lanes` argument names it)."""
    for block in BLOCKS.values():
        if block.lanes == lanes:
            return block
    raise ValueError(f"lanes={lanes}: no flash attention block has vectors of {lanes} float32 (BLOCKS: {BLOCKS})")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention: q [b, heads, rows (run time), size], keys and values [b, kv, keys, size] (the keys padded to
    `padded`), the mask [b, mask_heads (1 or heads), rows, keys] int8 (mask_heads 0: no mask), the ISA's block of
    vectors of `lanes`."""

    b: int
    heads: int
    kv: int
    keys: int
    size: int
    mask_heads: int
    scale: float
    lanes: int = 16

    @property
    def padded(self) -> int:
        return -(-self.keys // KEYS) * KEYS

    @property
    def group(self) -> int:
        return self.heads // self.kv

    @property
    def name(self) -> str:
        bits = struct.unpack("<I", struct.pack("<f", self.scale))[0]
        head = f"flash_{self.b}x{self.heads}x{self.kv}_k{self.keys}_d{self.size}_m{self.mask_heads}"
        return f"{head}_s{bits:08x}_{block_of(self.lanes).name}"


def _f32(x: float) -> str:
    """An f32 constant's bits as MLIR's hexadecimal float literal (exact)."""
    return f"0x{struct.unpack('<I', struct.pack('<f', x))[0]:08X}"


class _Kernel:
    def __init__(self, s: Shape) -> None:
        self.s, self.lines, self.k = s, [], block_of(s.lanes)
        self.v32, self.v16 = f"vector<{KEYS}xf32>", f"vector<{self.k.lanes}xf32>"

    def add(self, line: str) -> None:
        self.lines.append(line)

    def prologue(self) -> None:
        s, add, rows, lanes = self.s, self.add, self.k.rows, self.k.lanes
        kt = f"memref<{s.b * s.kv * s.padded * s.size}xf32>"
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
            "%qm = stream.binding.subspan %bq[%c0] : !stream.binding -> memref<?xf32>{%qsize}",
            f"%km = stream.binding.subspan %bk[%c0] : !stream.binding -> {kt}",
            f"%vm = stream.binding.subspan %bv[%c0] : !stream.binding -> {kt}",
            "%om = stream.binding.subspan %bo[%c0] : !stream.binding -> memref<?xf32>{%qsize}",
            f"%obuf = memref.alloca() : memref<{rows * s.size}xf32>",
            f"%qbuf = memref.alloca() : memref<{rows * s.size}xf32>",
            f"%pbuf = memref.alloca() : memref<{rows * KEYS}xf32>",
            f"%lbuf = memref.alloca() : memref<{rows * KEYS}xf32>",
            f"%mbuf = memref.alloca() : memref<{rows}xf32>",
            f"%abuf = memref.alloca() : memref<{rows}xf32>",
            "%g = stream.dispatch.workgroup.id[0] : index",
            f"%nb = arith.ceildivui %rows, %c{rows}w : index",
            "%bh = arith.divui %g, %nb : index",
            "%rb = arith.remui %g, %nb : index",
            f"%bi = arith.divui %bh, %c{s.heads}w : index",
            f"%hi = arith.remui %bh, %c{s.heads}w : index",
            f"%kvi = arith.divui %hi, %c{s.group}w : index",
            f"%bkv0 = arith.muli %bi, %c{s.kv}w : index",
            "%bkv = arith.addi %bkv0, %kvi : index",
            f"%kbase = arith.muli %bkv, %c{s.padded * s.size}w : index",
            f"%r0 = arith.muli %rb, %c{rows}w : index",
            "%rlast = arith.subi %rows, %c1 : index",
            "%bhr = arith.muli %bh, %rows : index",
        ):
            add(line)
        if self.k.chunk < KEYS:
            add(f"%sbuf = memref.alloca() : memref<{rows * KEYS}xf32>")
        if s.mask_heads:
            add(f"%msize = arith.muli %rows, %c{s.b * s.mask_heads * s.keys}w : index")
            add("%mm = stream.binding.subspan %bm[%c0] : !stream.binding -> memref<?xi8>{%msize}")
            add(f"%mh = arith.muli {'%bi' if s.mask_heads == 1 else '%bh'}, %rows : index")
        for i in range(rows):
            add(f"%row{i} = arith.addi %r0, %c{i}w : index")
            add(f"%ri{i} = arith.minui %row{i}, %rlast : index")
            add(f"%qr{i}a = arith.addi %bhr, %ri{i} : index")
            add(f"%qr{i} = arith.muli %qr{i}a, %c{s.size}w : index")  # q's and out's row
            if s.mask_heads:
                add(f"%mr{i}a = arith.addi %mh, %ri{i} : index")
                add(f"%mr{i} = arith.muli %mr{i}a, %c{s.keys}w : index")  # the mask's row
            add(f"%ib{i} = arith.constant {i} : index")
            add(f"memref.store %ninf, %mbuf[%ib{i}] : memref<{rows}xf32>")
            add(f"vector.store %zero32, %lbuf[%c{i * KEYS}w] : memref<{rows * KEYS}xf32>, {self.v32}")
            for u in range(0, s.size, lanes):
                at = f"%c{i * s.size + u}w"
                add(f"vector.store %zero16, %obuf[{at}] : memref<{rows * s.size}xf32>, {self.v16}")
                add(f"%qa{i}_{u} = arith.addi %qr{i}, %c{u}w : index")
                add(f"%qv{i}_{u} = vector.load %qm[%qa{i}_{u}] : memref<?xf32>, {self.v16}")
                add(f"vector.store %qv{i}_{u}, %qbuf[{at}] : memref<{rows * s.size}xf32>, {self.v16}")

    def block(self, t: str, j0: str, kb: str, valid: int) -> None:
        """One key block from key `j0` (packed block `kb`), `valid` keys of it real (the rest padding)."""
        add, mt, rows = self.add, f"vector<{KEYS}xi8>", self.k.rows
        if valid < KEYS:
            add(f"%{t}km = vector.constant_mask [{valid}] : vector<{KEYS}xi1>")
        if not self.s.mask_heads:  # every key seen: no mask to load, no block to skip
            self.softmax(t, self.scores(t, kb), valid)
            self.products(t, j0, valid)
            return
        for i in range(rows):
            add(f"%{t}ma{i} = arith.addi %mr{i}, {j0} : index")
            if valid == KEYS:
                add(f"%{t}mv{i} = vector.load %mm[%{t}ma{i}] : memref<?xi8>, {mt}")
            else:
                add(
                    f"%{t}mv{i} = vector.maskedload %mm[%{t}ma{i}], %{t}km, %zi8 : memref<?xi8>, "
                    f"vector<{KEYS}xi1>, {mt} into {mt}"
                )
        add(f"%{t}or0 = arith.ori %{t}mv0, %{t}mv1 : {mt}")
        for i in range(2, rows):
            add(f"%{t}or{i - 1} = arith.ori %{t}or{i - 2}, %{t}mv{i} : {mt}")
        add(f"%{t}nz = arith.cmpi ne, %{t}or{rows - 2}, %zi8 : {mt}")
        add(f"%{t}any = vector.reduction <or>, %{t}nz : vector<{KEYS}xi1> into i1")
        add(f"scf.if %{t}any {{")
        self.softmax(t, self.scores(t, kb), valid)
        self.products(t, j0, valid)
        add("}")

    def scores(self, t: str, kb: str) -> list[str]:
        """The block's scores, a row's KEYS keys a value, `chunk` keys at a time (each pass on the stack where a
        block takes more than one)."""
        s, add, rows, chunk = self.s, self.add, self.k.rows, self.k.chunk
        kt, vc = f"memref<{s.b * s.kv * s.padded * s.size}xf32>", f"vector<{chunk}xf32>"
        add(f"%{t}kb0 = arith.muli {kb}, %c{s.size * KEYS}w : index")
        add(f"%{t}kb = arith.addi %kbase, %{t}kb0 : index")
        zero = "%zero32" if chunk == KEYS else f"%{t}z"
        if chunk < KEYS:
            add(f"%{t}z = arith.constant dense<0.0> : {vc}")
        for c in range(0, KEYS, chunk):
            u = f"{t}c{c}"
            inits = ", ".join(f"%{u}a{i} = {zero}" for i in range(rows))
            add(f"%{u}s:{rows} = scf.for %{u}d = %c0 to %c{s.size}w step %c4w iter_args({inits}) -> "
                f"({', '.join([vc] * rows)}) {{")  # fmt: skip
            acc = [f"%{u}a{i}" for i in range(rows)]
            for step in range(4):
                add(f"%{u}d{step} = arith.addi %{u}d, %c{step}w : index")
                add(f"%{u}kd{step}a = arith.muli %{u}d{step}, %c{KEYS}w : index")
                add(f"%{u}kd{step}b = arith.addi %{t}kb, %{u}kd{step}a : index")
                add(f"%{u}kd{step} = arith.addi %{u}kd{step}b, %c{c}w : index")
                add(f"%{u}k{step} = vector.load %km[%{u}kd{step}] : {kt}, {vc}")
                for i in range(rows):
                    add(f"%{u}qi{step}_{i} = arith.addi %{u}d{step}, %c{i * s.size}w : index")
                    add(f"%{u}qs{step}_{i} = memref.load %qbuf[%{u}qi{step}_{i}] : memref<{rows * s.size}xf32>")
                    add(f"%{u}qb{step}_{i} = vector.broadcast %{u}qs{step}_{i} : f32 to {vc}")
                    add(f"%{u}f{step}_{i} = vector.fma %{u}k{step}, %{u}qb{step}_{i}, {acc[i]} : {vc}")
                    acc[i] = f"%{u}f{step}_{i}"
            add(f"scf.yield {', '.join(acc)} : {', '.join([vc] * rows)}")
            add("}")
            if chunk == KEYS:
                return [f"%{u}s#{i}" for i in range(rows)]
            for i in range(rows):
                add(f"vector.store %{u}s#{i}, %sbuf[%c{i * KEYS + c}w] : memref<{rows * KEYS}xf32>, {vc}")
        for i in range(rows):
            add(f"%{t}s{i} = vector.load %sbuf[%c{i * KEYS}w] : memref<{rows * KEYS}xf32>, {self.v32}")
        return [f"%{t}s{i}" for i in range(rows)]

    def softmax(self, t: str, scores: list[str], valid: int) -> None:
        """The block's mask (or its padding keys), the rows' running maxima, exponentials and sums."""
        add, v32, rows, lanes = self.add, self.v32, self.k.rows, self.k.lanes
        lt = f"memref<{rows * KEYS}xf32>"
        for i in range(rows):
            add(f"%{t}x{i} = arith.mulf {scores[i]}, %scale : {v32}")
            if self.s.mask_heads:
                add(f"%{t}c{i} = arith.cmpi ne, %{t}mv{i}, %zi8 : vector<{KEYS}xi8>")
                add(f"%{t}y{i} = arith.select %{t}c{i}, %{t}x{i}, %ninf32 : vector<{KEYS}xi1>, {v32}")
            elif valid < KEYS:  # the padding keys of the last block
                add(f"%{t}y{i} = arith.select %{t}km, %{t}x{i}, %ninf32 : vector<{KEYS}xi1>, {v32}")
            y = f"%{t}y{i}" if self.s.mask_heads or valid < KEYS else f"%{t}x{i}"
            add(f"%{t}bm{i} = vector.reduction <maxnumf>, {y} : {v32} into f32")
            add(f"%{t}mo{i} = memref.load %mbuf[%ib{i}] : memref<{rows}xf32>")
            add(f"%{t}mn{i} = arith.maxnumf %{t}mo{i}, %{t}bm{i} : f32")
            add(f"%{t}none{i} = arith.cmpf oeq, %{t}mn{i}, %ninf : f32")
            add(f"%{t}ms{i} = arith.select %{t}none{i}, %fzero, %{t}mn{i} : f32")
            add(f"%{t}al{i}a = arith.subf %{t}mo{i}, %{t}ms{i} : f32")
            add(f"memref.store %{t}mn{i}, %mbuf[%ib{i}] : memref<{rows}xf32>")
        # the rows' rescale factors exp(old max - new max) in one vector exp
        diffs = [f"%{t}al{i}a" for i in range(rows)] + ["%fzero"] * (-rows % lanes)
        width = len(diffs)
        add(f"%{t}ad = vector.from_elements {', '.join(diffs)} : vector<{width}xf32>")
        add(f"%{t}av = math.exp %{t}ad : vector<{width}xf32>")
        for i in range(rows):
            add(f"%{t}al{i} = vector.extract %{t}av[{i}] : f32 from vector<{width}xf32>")
            add(f"%{t}mb{i} = vector.broadcast %{t}ms{i} : f32 to {v32}")
            y = f"%{t}y{i}" if self.s.mask_heads or valid < KEYS else f"%{t}x{i}"
            add(f"%{t}e{i}a = arith.subf {y}, %{t}mb{i} : {v32}")
            add(f"%{t}e{i} = math.exp %{t}e{i}a : {v32}")
            add(f"vector.store %{t}e{i}, %pbuf[%c{i * KEYS}w] : {lt}, {v32}")
            add(f"%{t}l{i}o = vector.load %lbuf[%c{i * KEYS}w] : {lt}, {v32}")
            add(f"%{t}ab{i} = vector.broadcast %{t}al{i} : f32 to {v32}")
            add(f"%{t}l{i} = vector.fma %{t}l{i}o, %{t}ab{i}, %{t}e{i} : {v32}")
            add(f"vector.store %{t}l{i}, %lbuf[%c{i * KEYS}w] : {lt}, {v32}")
            add(f"memref.store %{t}al{i}, %abuf[%ib{i}] : memref<{rows}xf32>")

    def products(self, t: str, j0: str, valid: int) -> None:
        """P.V over the block's `valid` keys, added to the rows' outputs after they are rescaled."""
        s, add, v16, k = self.s, self.add, self.v16, self.k
        vt, ot = f"memref<{s.b * s.kv * s.padded * s.size}xf32>", f"memref<{k.rows * s.size}xf32>"
        pt = f"memref<{k.rows * KEYS}xf32>"
        for r0 in range(0, k.rows, k.pv_rows):
            rows = range(r0, min(k.rows, r0 + k.pv_rows))
            for d0 in range(0, s.size, k.pv_vectors * k.lanes):
                vecs = range(min(k.pv_vectors, (s.size - d0) // k.lanes))
                u = f"{t}_{r0}_{d0}"
                keys = [(r, w) for r in rows for w in vecs]
                inits = ", ".join(f"%{u}i{r}_{w} = %zero16" for r, w in keys)
                add(f"%{u}acc:{len(keys)} = scf.for %{u}j = %c0 to %c{valid}w step %c1 iter_args({inits}) -> "
                    f"({', '.join([v16] * len(keys))}) {{")  # fmt: skip
                add(f"%{u}jj = arith.addi {j0}, %{u}j : index")
                add(f"%{u}vr = arith.muli %{u}jj, %c{s.size}w : index")
                add(f"%{u}vb = arith.addi %kbase, %{u}vr : index")
                for w in vecs:
                    add(f"%{u}va{w} = arith.addi %{u}vb, %c{d0 + w * k.lanes}w : index")
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
                        add(f"%{u}al{r} = memref.load %abuf[%ib{r}] : memref<{k.rows}xf32>")
                        add(f"%{u}ab{r} = vector.broadcast %{u}al{r} : f32 to {v16}")
                    at = f"%c{r * s.size + d0 + w * k.lanes}w"
                    add(f"%{u}o{r}_{w} = vector.load %obuf[{at}] : {ot}, {v16}")
                    add(f"%{u}n{r}_{w} = vector.fma %{u}o{r}_{w}, %{u}ab{r}, %{u}acc#{n} : {v16}")
                    add(f"vector.store %{u}n{r}_{w}, %obuf[{at}] : {ot}, {v16}")

    def epilogue(self) -> None:
        s, add, v16, v32, rows = self.s, self.add, self.v16, self.v32, self.k.rows
        ot = f"memref<{rows * s.size}xf32>"
        for i in range(rows):
            add(f"%in{i} = arith.cmpi ult, %row{i}, %rows : index")
            add(f"scf.if %in{i} {{")
            add(f"%lv{i} = vector.load %lbuf[%c{i * KEYS}w] : memref<{rows * KEYS}xf32>, {v32}")
            add(f"%ls{i} = vector.reduction <add>, %lv{i} : {v32} into f32")
            add(f"%lp{i} = arith.cmpf ogt, %ls{i}, %fzero : f32")
            add(f"%lr{i} = arith.divf %fone, %ls{i} : f32")
            add(f"%inv{i} = arith.select %lp{i}, %lr{i}, %fzero : f32")
            add(f"%ivb{i} = vector.broadcast %inv{i} : f32 to {v16}")
            for u in range(0, s.size, self.k.lanes):
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
    """The name (unique per shape and block) and text of the `stream.executable`, over b x heads x ceil(rows / the
    block's rows) workgroups, taking q, the packed keys, the padded values, the int8 mask (none where mask_heads is
    0) and the row count."""
    lanes = block_of(s.lanes).lanes
    if s.size % lanes:
        raise ValueError(f"a head size of {s.size}: a multiple of {lanes}")
    names = ["%bq", "%bk", "%bv", *(["%bm"] if s.mask_heads else []), "%bo"]
    bindings = ", ".join(f"{n}: !stream.binding" for n in names)
    return s.name, spliced.executable(s.name, bindings, 0, _Kernel(s).text())
