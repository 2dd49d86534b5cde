"""A hand-written float32 matmul dispatch for AVX2 (issue 32): a 6x16 register block against IREE 3.13's 8x8x1.

y[M, N] = x[M, K] @ W^T, W [N, K] laid out [N/16, K, 16] (`pack`: a strip of 16 output channels, K-major, two ymm a
step of K). The kernel keeps a 6x16 block of y in 12 ymm accumulators; per step of K it loads the strip's two vectors
and broadcasts six values of x (row-major, one `vbroadcastss` each) into 12 FMAs: oneDNN's AVX2 shape, where IREE's
`mmt4d` (8x8x1, with or without its ukernel) does one load and 8 broadcasts per 8 FMAs (docs/iree-3.13-findings.md
section 50). The loops, outer to inner: K blocks of `kc`, row chunks of `mc`, the workgroup's `per` strips, blocks of
6 rows (the M % 6 left over by one block of that many), sums of `ks` steps (each from zero, then added to y), the K
steps unrolled by 4. No spills: 12 accumulators, the strip's two vectors and one broadcast are 15 of the 16 ymm.

It enters a graph as `fx_rewrites::f32_matmul(x, packed, n, 2, per)` (eager: the weight unpacked by torch), which
torch-mlir imports as `torch.operator "torch.fx_rewrites.f32_matmul"`; `splice` (run by `IreeBackend` through
`kernels.spliced`) replaces it by a `flow.dispatch` of its `stream.executable`. The rule writing it is
`rules/f32_matmul.py`; the packing is a view and permute of the weight in the graph, which IREE evaluates once for a
weight the program holds (in the module's initializer or at compile time). Static rows only.
"""

from __future__ import annotations

import torch

from fx_rewrites.backends.iree import spliced

#: rows a register block, channels a strip, K steps unrolled
MR, NR, KU = 6, 16, 4
OP, MARK = "fx_rewrites::f32_matmul", "torch.fx_rewrites.f32_matmul"
MARKS = (MARK,)
#: the K block (its strip's 16 kc floats stay in L1 across the row blocks), the row chunk (x's block in L2), the K
#: steps summed from zero before they are added to y (the error of short sums: within torch's own); benchmarks sweep
#: them (benchmarks/f32_dispatch.py), so they are part of the executable's name
BLOCKING = {"kc": 256, "mc": 96, "ks": 128}
#: strips of 16 channels a workgroup (the measured split: docs/performance.md, "A float32 matmul kernel of our own")
PER = 4


def pack(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] as [N/16, K, 16] (flattened): strip s, step k holds W[16 s .. 16 s + 15, k]."""
    n, k = w.shape
    return w.view(n // NR, NR, k).transpose(1, 2).contiguous().flatten()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    k = packed.numel() // n
    return packed.view(n // NR, k, NR).transpose(1, 2).reshape(n, k)


def _micro(
    rows: int, m: str, k: int, n: int, kc: int, ks: int, blocks: int, xt: str, wt: str, ot: str, tag: str
) -> list[str]:
    """A block of `rows` rows from row `m` of strip `%s` over K block [`%kb`, `%ke`) (`%first`: the first)."""
    vec, lines = "vector<8xf32>", []
    add = lines.append
    accs = [(r, h) for r in range(rows) for h in range(2)]
    add(f"%ob{tag} = arith.muli %s, %c{NR}w : index")
    for r in range(rows):
        add(f"%row{tag}{r} = arith.addi {m}, %c{r}w : index")
        add(f"%xr{tag}{r} = arith.muli %row{tag}{r}, %c{k}w : index")
        add(f"%or{tag}{r} = arith.muli %row{tag}{r}, %c{n}w : index")
        add(f"%oo{tag}{r}_0 = arith.addi %or{tag}{r}, %ob{tag} : index")
        add(f"%oo{tag}{r}_1 = arith.addi %oo{tag}{r}_0, %c8w : index")
    types = ", ".join([vec] * len(accs))
    init = ["%zero"] * len(accs)
    add(f"%wb{tag} = arith.muli %s, %c{k * NR}w : index")
    args = ", ".join(f"%a{r}_{h} = {v}" for (r, h), v in zip(accs, init, strict=True))
    sums = kc // ks > 1
    if sums:  # the K block in sums of `ks` steps, each from zero then added to y (error as short sums')
        add(f"scf.for %kq = %kb to %ke step %c{ks}w {{")
        add(f"%kqe = arith.addi %kq, %c{ks}w : index")
        add("%firstq = arith.cmpi eq, %kq, %c0 : index")
    lo, hi = ("%kq", "%kqe") if sums else ("%kb", "%ke")
    add(f"%res{tag}:{len(accs)} = scf.for %k = {lo} to {hi} step %c{KU}w iter_args({args}) -> ({types}) {{")
    add(f"%wk = arith.muli %k, %c{NR}w : index")
    add(f"%wkb = arith.addi %wb{tag}, %wk : index")
    cur = {(r, h): f"%a{r}_{h}" for r, h in accs}
    for u in range(KU):
        add(f"%w{u}_0 = arith.addi %wkb, %c{u * NR}w : index")
        add(f"%w{u}_1 = arith.addi %wkb, %c{u * NR + 8}w : index")
        add(f"%b{u}_0 = vector.load %wm[%w{u}_0] : {wt}, {vec}")
        add(f"%b{u}_1 = vector.load %wm[%w{u}_1] : {wt}, {vec}")
        for r in range(rows):
            add(f"%xo{u}_{r} = arith.addi %xr{tag}{r}, %k : index")
            add(f"%xu{u}_{r} = arith.addi %xo{u}_{r}, %c{u}w : index")
            add(f"%xs{u}_{r} = memref.load %xm[%xu{u}_{r}] : {xt}")
            add(f"%xb{u}_{r} = vector.broadcast %xs{u}_{r} : f32 to {vec}")
            for h in range(2):
                add(f"%f{u}_{r}_{h} = vector.fma %xb{u}_{r}, %b{u}_{h}, {cur[r, h]} : {vec}")
                cur[r, h] = f"%f{u}_{r}_{h}"
    add(f"scf.yield {', '.join(cur[a] for a in accs)} : {types}")
    add("}")
    stores = [f"vector.store %res{tag}#{i}, %om[%oo{tag}{r}_{h}] : {ot}, {vec}" for i, (r, h) in enumerate(accs)]
    if blocks == 1:
        return [*lines, *stores, *(["}"] if sums else [])]
    add(
        f"scf.if {'%firstq' if sums else '%first'} {{"
    )  # each K block summed from zero, then added to y: shorter sums than one over K
    lines += stores
    add("} else {")
    for i, (r, h) in enumerate(accs):
        add(f"%ld{tag}{r}_{h} = vector.load %om[%oo{tag}{r}_{h}] : {ot}, {vec}")
        add(f"%sum{tag}{r}_{h} = arith.addf %ld{tag}{r}_{h}, %res{tag}#{i} : {vec}")
        add(f"vector.store %sum{tag}{r}_{h}, %om[%oo{tag}{r}_{h}] : {ot}, {vec}")
    add("}")
    if sums:
        add("}")
    return lines


def _kernel(m: int, n: int, k: int, per: int, kc: int, mc: int, ks: int) -> str:
    kc, strips = next(b for b in range(min(kc, k), 0, -KU) if k % b == 0), n // NR
    if k % kc or kc % KU or n % NR or mc % MR:
        raise ValueError(f"K {k} by blocks of {kc} (a multiple of {KU}), N {n} of {NR}, row chunk {mc} of {MR}")
    ks = next(b for b in range(min(ks, kc), 0, -KU) if kc % b == 0)
    full, tail, blocks = m - m % MR, m % MR, k // ks
    xt, wt, ot = f"memref<{m * k}xf32>", f"memref<{n * k}xf32>", f"memref<{m * n}xf32>"
    lines = [
        "%c0 = arith.constant 0 : index",
        "%c1 = arith.constant 1 : index",
        "%zero = arith.constant dense<0.0> : vector<8xf32>",
        f"%xm = stream.binding.subspan %bx[%c0] : !stream.binding -> {xt}",
        f"%wm = stream.binding.subspan %bw[%c0] : !stream.binding -> {wt}",
        f"%om = stream.binding.subspan %bo[%c0] : !stream.binding -> {ot}",
        "%wg = stream.dispatch.workgroup.id[0] : index",
        f"%s0 = arith.muli %wg, %c{per}w : index",
        f"%s1p = arith.addi %s0, %c{per}w : index",
        f"%s1 = arith.minui %s1p, %c{strips}w : index",
        f"scf.for %kb = %c0 to %c{k}w step %c{kc}w {{",
        f"%ke = arith.addi %kb, %c{kc}w : index",
        "%first = arith.cmpi eq, %kb, %c0 : index",
    ]
    if full:
        lines += [
            f"scf.for %mc = %c0 to %c{full}w step %c{mc}w {{",
            f"%mep = arith.addi %mc, %c{mc}w : index",
            f"%me = arith.minui %mep, %c{full}w : index",
            "scf.for %s = %s0 to %s1 step %c1 {",
            f"scf.for %mb = %mc to %me step %c{MR}w {{",
            *_micro(MR, "%mb", k, n, kc, ks, blocks, xt, wt, ot, "f"),
            "}",
            "}",
            "}",
        ]
    if tail:
        lines += [
            "scf.for %s = %s0 to %s1 step %c1 {",
            f"%mt = arith.addi %c0, %c{full}w : index",
            *_micro(tail, "%mt", k, n, kc, ks, blocks, xt, wt, ot, "t"),
            "}",
        ]
    lines += ["}", "return"]
    return spliced.with_index_constants("\n".join(lines))


def executable_name(m: int, n: int, k: int, per: int) -> str:
    """Unique per shape and blocking (two executables may not share a name: findings 52)."""
    return f"f32mm_{m}x{k}x{n}_p{per}_kc{BLOCKING['kc']}_mc{BLOCKING['mc']}_ks{BLOCKING['ks']}"


def executable(m: int, n: int, k: int, tile: int, per: int) -> tuple[str, str]:
    """The name and text of the `stream.executable` computing x [m, k] @ W.T into [m, n] over ceil(n / 16 / per)
    workgroups (static rows only)."""
    if not m:
        raise ValueError("the float32 dispatch is static in its rows")
    name = executable_name(m, n, k, per)
    body = _kernel(m, n, k, per, BLOCKING["kc"], BLOCKING["mc"], BLOCKING["ks"])
    return name, spliced.executable(name, "%bx: !stream.binding, %bw: !stream.binding, %bo: !stream.binding", m, body)


@torch.library.custom_op(OP, mutates_args=())
def f32_matmul(x: torch.Tensor, packed: torch.Tensor, n: int, tile: int, per: int) -> torch.Tensor:
    """x [M, K] @ W.T, W [N, K] held as `pack(W)`: what the dispatch computes (eager: unpacked by torch)."""
    return x @ unpack(packed, n).t()


@f32_matmul.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, n: int, tile: int, per: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


F32_MATMUL = torch.ops.fx_rewrites.f32_matmul.default


def splice(mlir: str) -> str:
    """`mlir` with every `fx_rewrites.f32_matmul` call replaced by a `flow.dispatch` of its executable
    (`spliced.splice_calls`: N / 16 / per workgroups, `tile` 2 being the strip's two ymm)."""
    return spliced.splice_calls(mlir, MARK, 2, executable, "fxf")
