"""MoE experts' weights laid out as IREE's float32 microkernel reads them, multiplied by `linalg.mmt4d` (issue 34).

An expert's weight W [N, K] (transformers stores the experts as [E, N, K]) held as [N/16, K, 16] (`pack`: a strip of
16 output channels, K-major) is the right-hand operand IREE's data tiling packs for AVX-512's 16x16x1 `mmt4d` tile:
the same bytes. Written in the graph as a view and transpose of the [E, N, K] parameter, it is one tensor, which the
module computes once (in its initializer, or the parameter encoder at `save(params=)`), and which both products of a
`compile_lm` module read in place (`rules/moe_packed.py` writes them):

- the prefill's per-expert product over its run-time rows: 16-row tiles of x, the weight the left operand
  (IREE's own form for a run-time row count);
- the decode step's product per routed row (one static row, its expert's strips read at a run-time offset): the
  narrow 1x16x1 tile, one row computed where a run-time count of 0 or 1 computes 16.

Both are `fx_rewrites::packed_matmul(x, packed)`, spliced (`splice`) as `linalg.pack` of x, `linalg.mmt4d` with the
packed weight as it lies and `linalg.unpack`: the form IREE's data tiling writes for a matmul, less the weight's
pack. IREE compiles the mmt4d with its microkernel: the same sums, bit for bit, as its data-tiled product.

Before, the decode step multiplied per expert over a run-time row count (0 or 1), which IREE 3.13 gives the 16-row
tile on AVX-512: the step ran at 0.72x eager at Qwen3-30B-A3B's layer (docs/iree-3.13-findings.md sections 66, 67).
"""

from __future__ import annotations

import re

import torch

from fx_rewrites.backends.iree import spliced

OP, MARK = "fx_rewrites::packed_matmul", "torch.fx_rewrites.packed_matmul"
MARKS = (MARK,)
#: output channels a strip: the N0 of IREE 3.13's float32 `mmt4d` tiles on AVX-512 (16x16x1 and the narrow 1x16x1)
STRIP = 16
#: rows a tile of x for a run-time row count (IREE's own M0 for it); a few static rows take the narrow tile that fits
ROWS = 16

_CALL = re.compile(rf'^(\s*)(%[\w]+) = torch\.operator "{re.escape(MARK)}"\((%[\w]+), (%[\w]+)\) : \((.*)\) -> (.*)$')


def pack(weight: torch.Tensor, strip: int = STRIP) -> torch.Tensor:
    """[..., N, K] as [..., N/strip, K, strip] (a view and a transpose: the graph's form, not contiguous)."""
    *lead, n, k = weight.shape
    return weight.view(*lead, n // strip, strip, k).transpose(-1, -2)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., N/strip, K, strip] back to [..., N, K]."""
    *lead, strips, k, strip = packed.shape
    return packed.transpose(-1, -2).reshape(*lead, strips * strip, k)


@torch.library.custom_op(OP, mutates_args=())
def packed_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W.T for W [N, K] held as `pack(W)` [N/16, K, 16] (eager: torch's matmul of the unpacked W)."""
    return x @ unpack(packed).t()


@packed_matmul.register_fake
def _(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0] * packed.shape[2])


PACKED_MATMUL = torch.ops.fx_rewrites.packed_matmul.default


def _rows_tile(rows: str) -> int:
    """x's tile rows: ROWS for a run-time count, else the least power of two at or above it, up to ROWS (IREE's
    narrow tiles for a few static rows: 1, 2, 4, 8)."""
    if rows == "?":
        return ROWS
    return min(ROWS, 1 << max(0, int(rows) - 1).bit_length())


def _linalg(v: str, x: str, w: str, rows: str, k: int, strips: int, strip: int) -> list[str]:
    """The pack of x, the mmt4d with the packed weight and the unpack, as MLIR lines naming values `%{v}_...`.

    A run-time or large row count takes IREE's own form for it: the weight as the left operand (its strips the outer
    loop, each read from memory once for all of x's tiles, which stay in cache: 0.69x the time of x on the left at 64
    rows), the product unpacked transposed. A few static rows (a decode step's row) take the narrow tile that fits,
    x on the left (one tile of x)."""
    m0, n = _rows_tile(rows), strips * strip
    dyn, wide = rows == "?", m0 == ROWS
    xt, ot = f"tensor<{rows}x{k}xf32>", f"tensor<{rows}x{n}xf32>"
    m1 = "?" if dyn else str(-(-int(rows) // m0))
    lt = f"tensor<{m1}x{k}x{m0}x1xf32>"
    at = f"tensor<{strips}x{m1}x{strip}x{m0}xf32>" if wide else f"tensor<{m1}x{strips}x{m0}x{strip}xf32>"
    wt, w4 = f"tensor<{strips}x{k}x{strip}xf32>", f"tensor<{strips}x{k}x{strip}x1xf32>"
    lines = [
        f"%{v}_w4 = tensor.expand_shape {w} [[0], [1], [2, 3]] output_shape [{strips}, {k}, {strip}, 1] "
        f": {wt} into {w4}",
        f"%{v}_z = arith.constant 0.0 : f32",
    ]
    sizes_m, sizes_m1 = "", ""
    if dyn:
        lines += [
            f"%{v}_c0 = arith.constant 0 : index",
            f"%{v}_m = tensor.dim {x}, %{v}_c0 : {xt}",
            f"%{v}_m1 = affine.apply affine_map<()[s0] -> (s0 ceildiv {m0})>()[%{v}_m]",
        ]
        sizes_m, sizes_m1 = f"%{v}_m", f"%{v}_m1"
    operands = f"%{v}_w4, %{v}_l : {w4}, {lt}" if wide else f"%{v}_l, %{v}_w4 : {lt}, {w4}"
    unpack = (
        f"outer_dims_perm = [1, 0] inner_dims_pos = [1, 0] inner_tiles = [{strip}, {m0}]"
        if wide
        else f"inner_dims_pos = [0, 1] inner_tiles = [{m0}, {strip}]"
    )
    return [
        *lines,
        f"%{v}_le = tensor.empty({sizes_m1}) : {lt}",
        f"%{v}_l = linalg.pack {x} padding_value(%{v}_z : f32) inner_dims_pos = [0, 1] inner_tiles = [{m0}, 1] "
        f"into %{v}_le : {xt} -> {lt}",
        f"%{v}_ae = tensor.empty({sizes_m1}) : {at}",
        f"%{v}_a = linalg.fill ins(%{v}_z : f32) outs(%{v}_ae : {at}) -> {at}",
        f"%{v}_p = linalg.mmt4d ins({operands}) outs(%{v}_a : {at}) -> {at}",
        f"%{v}_oe = tensor.empty({sizes_m}) : {ot}",
        f"%{v}_o = linalg.unpack %{v}_p {unpack} into %{v}_oe : {at} -> {ot}",
    ]


def splice(mlir: str) -> str:
    """`mlir` with every `fx_rewrites.packed_matmul` call replaced by IREE's pack, mmt4d and unpack over its operands
    (no dispatch of our own: IREE compiles the mmt4d with its microkernel). ValueError where a call has another
    form."""
    out, found_any = [], False
    for line in mlir.splitlines():
        found = _CALL.match(line)
        if not found:
            if MARK in line:
                raise ValueError(f"a packed_matmul call of an unknown form: {line.strip()[:200]}")
            out.append(line)
            continue
        pad, res, x, w, types, otype = found.groups()
        vx, vw = re.findall(r"!torch\.vtensor<[^>]*>", types)[:2]
        (tx, sx), (tw, sw) = spliced._tensor(vx), spliced._tensor(vw)
        if len(sx) != 2 or len(sw) != 3 or "?" in sw + sx[1:]:
            raise ValueError(f"a packed_matmul call with operands {sx} and {sw}, not [M, K] and static [N/S, K, S]")
        k, strips, strip = int(sx[1]), int(sw[0]), int(sw[2])
        v = f"pmm{res[1:]}"
        out += [
            f"{pad}%{v}_x = torch_c.to_builtin_tensor {x} : {vx} -> {tx}",
            f"{pad}%{v}_w = torch_c.to_builtin_tensor {w} : {vw} -> {tw}",
            *(pad + s for s in _linalg(v, f"%{v}_x", f"%{v}_w", sx[0], k, strips, strip)),
            f"{pad}{res} = torch_c.from_builtin_tensor %{v}_o : tensor<{sx[0]}x{strips * strip}xf32> "
            f"-> {otype.strip()}",
        ]
        found_any = True
    if not found_any:
        raise ValueError("no packed_matmul call in the module")
    return "\n".join(out)
