"""Quantized matmuls in the form IREE fuses: int8 weights read once per call, converted in registers.

torchao's weight-only schemes export a dequantize feeding a matmul: `Int8WeightOnlyConfig` as
`mm(x, _to_copy(t(w_int8), float32)) * scale`, `IntxWeightOnlyConfig` (int4 or int8 in groups) as
`linear(x, dequantize_affine(w, [1, g], scale, zero_point, ...))`. IREE 3.13 writes a float32 copy of the
whole weight per call and then runs a float matmul: int8 decodes 6x slower than float32 (issue 33).

These rules write the product as a reduction over the weight re-laid in blocks of 16 output channels
(`weight_layout.blocked_rows`, folded into a parameter of int8 bytes when the module is built), with the
dequantize (int8 -> float, minus the zero point, times the group's scale) inside it: one dispatch that reads
the int8 weight once. The dequantized values are torchao's own (the same float32 operations), only the
order of the sums differs from a matmul's.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.iree.weight_layout import BLOCKED_ROWS
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_tensor
from fx_rewrites.kinds import rule
from fx_rewrites.program import input_spec
from fx_rewrites.ruleset import RuleSet
from fx_rewrites.torchao_ops import torchao_ops

aten = torch.ops.aten

#: output channels side by side in a block: one AVX-512 vector of float32 (measured against 64, 128, 256)
BLOCK = 16
#: groups of a grouped weight interleaved in its layout, their 16 channels side by side: IREE 3.13's matvec over
#: them reads 4 x 16 bytes a step (measured against 2 and 8 on AVX-512: benchmarks/int4_forms.py)
GROUP_TILE = 4
#: the most rows x may have for the reduction above (a decode step); more rows (a prefill) take the matmul of the
#: dequantized weight, which IREE data-tiles: the reduction re-reads and converts the whole weight once per row.
#: 2816 x 1024, one thread, real AVX2 (Zen 3), ms, reduction / matmul / float32 matmul: int8 at 4 rows 3.4 / 3.7 /
#: 1.1, 16 rows 9.6 / 4.8-6.5 / 3.5, 128 rows 56 / 26 / 20; int4 g32 at 4 rows 6.6 / 7.1, 16 rows 14.5 / 8.6, 128
#: rows 129 / 24 (benchmarks/prefill_forms.py)
DECODE_ROWS = 2
#: the integer types a weight may be stored in
_INTEGER = (torch.int8, torch.uint8)
#: the dtypes of a grouped weight's scales: float32, or bfloat16 (`IntxWeightOnlyConfig(scale_dtype=)`), kept so and
#: converted in the kernel (torchao's dequantize multiplies by them in float32: the conversion is exact); bfloat16
#: scales take 2.42 ms against 2.80 on a 32000 x 1024 g32 weight (benchmarks/int4_forms.py)
_SCALES = (torch.float32, torch.bfloat16)


def _frozen_weight(node: Any, dtypes: tuple[torch.dtype, ...]) -> Miss | None:
    """None when `node` is a 2-D static program parameter/buffer/constant of `dtypes` whose rows come in
    blocks, read by one node: what `fold_blocked_rows` can re-lay."""
    value = fake_tensor(node)
    if value is None or node.op != "placeholder":
        return Miss("the weight is not a program input")
    spec = input_spec(node)
    if spec is None or spec.kind.name not in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
        return Miss(f"{node.name} is not a parameter, buffer or constant of the program")
    if value.dtype not in dtypes or value.dim() != 2:
        return Miss(f"{node.name} is {value.dtype} of rank {value.dim()}, not a 2-D {'/'.join(map(str, dtypes))}")
    if not all(isinstance(s, int) for s in value.shape) or value.shape[0] % BLOCK:
        return Miss(f"{node.name} has {tuple(value.shape)} rows x columns; the rows must be a multiple of {BLOCK}")
    if len(node.users) != 1:
        return Miss(f"{node.name} is read by {len(node.users)} nodes")
    return None


def _blocked_float(rw: Rewriter, weight: Node) -> Node:
    """`weight` [N, K] as float32 blocks [N/16, K, 16] (the int8 blocks are a parameter once folded)."""
    return rw.call(aten._to_copy.default, rw.call(BLOCKED_ROWS, weight, BLOCK), dtype=torch.float32)


def rows_bound(x: Node) -> int | None:
    """The most rows (product of all but the last dim) x may have, None where unbounded."""
    bound = 1
    for size in fake_tensor(x).shape[:-1]:
        if isinstance(size, int):
            bound *= size
            continue
        upper = size.node.shape_env.bound_sympy(size.node.expr).upper
        if not upper.is_finite:
            return None
        bound *= int(upper)
    return bound


def _prefill(x: Node) -> bool:
    """x may have more rows than a decode step's `DECODE_ROWS`: the product is a matmul of the dequantized weight."""
    bound = rows_bound(x)
    return bound is None or bound > DECODE_ROWS


def _as_matrix(rw: Rewriter, blocks: Node, order: list[int], k: int, n: int) -> Node:
    """Float blocks permuted by `order` to K's axes, then N's, as a contiguous [K, N] matrix (the matmul's operand:
    IREE fuses the conversion and this transpose into the dispatch that packs it for the data-tiled matmul)."""
    permuted = rw.call(aten.permute.default, blocks, order)
    contiguous = rw.call(aten.clone.default, permuted, memory_format=torch.contiguous_format)
    return rw.call(aten.view.default, contiguous, [k, n])


def _reduce(rw: Rewriter, x: Node, weights: Node, rows: Any, n: int, k_dims: list[int]) -> Node:
    """sum over K of x [rows, K...] against blocked weights [N/16, K..., 16]: [rows, N]."""
    shape = [rows, 1, *k_dims, 1]
    product = rw.call(aten.mul.Tensor, rw.call(aten.view.default, x, shape), weights)
    reduced = rw.call(aten.sum.dim_IntList, product, list(range(2, 2 + len(k_dims))))
    return rw.call(aten.view.default, reduced, [rows, n])


# ----------------------------------------------------------------------------- int8 weight-only (per channel)


def _int8_weight_mm(node: Node) -> Miss | Node:
    """mm(x, _to_copy(t(w), float32)) with `w` an int8 frozen [N, K] weight: returns w."""
    x, converted = node.args[:2]
    xv, cv = fake_tensor(x), fake_tensor(converted)
    if xv is None or cv is None or xv.dtype != torch.float32 or cv.dtype != torch.float32:
        return Miss("not a float32 matmul")
    if not (isinstance(converted, Node) and converted.target is aten._to_copy.default and len(converted.users) == 1):
        return Miss("the right operand is not a conversion read only here")
    transposed = converted.args[0]
    if not (isinstance(transposed, Node) and transposed.target is aten.t.default and len(transposed.users) == 1):
        return Miss("the converted operand is not a transposed weight")
    weight = transposed.args[0]
    why = _frozen_weight(weight, _INTEGER[:1])
    return why if why is not None else weight


@rule(
    roots=(aten.mm.default,),
    when=_int8_weight_mm,
    priority=10,
    tags={"iree", "quantized"},
    doc=(
        "An int8 weight-only matmul (`mm(x, _to_copy(t(w_int8), float32))`, torchao's `Int8WeightOnlyConfig`) "
        "becomes a reduction over the weight re-laid in blocks of 16 rows, the int8 -> float32 conversion "
        "inside it: IREE 3.13 otherwise writes a float32 copy of the weight per call (int8 decoding at 0.16x "
        "the float32 route, issue 33)."
    ),
)
def int8_weight_mm_as_blocked_reduction_for_iree(node: Node, rw: Rewriter, *, found: Node) -> None:
    x = node.args[0]
    n, k = fake_tensor(found).shape
    if _prefill(x):  # the same blocks converted, as [K, N]: a data-tiled matmul, the scale after it as before
        rw.replace(node, rw.call(aten.mm.default, x, _as_matrix(rw, _blocked_float(rw, found), [1, 0, 2], k, n)))
        return
    rw.replace(node, _reduce(rw, x, _blocked_float(rw, found), rw.size(x, 0), n, [k]))


# ----------------------------------------------------------------------------- grouped (IntxWeightOnlyConfig)


def _grouped_dequantize(node: Node) -> Miss | tuple[int, Node | None]:
    """torchao's `dequantize_affine` of a frozen int8 [N, K] weight in groups of g along K, float32 out, with
    frozen scales (and zero points) [N, K/g], every reader a `linear` taking it as its weight: (g, zero)."""
    args = node.args
    weight, block, scale, zero = args[0], args[1], args[2], args[3] if len(args) > 3 else None
    out_dtype = node.kwargs.get("output_dtype", args[7] if len(args) > 7 else torch.float32)
    why = _frozen_weight(weight, _INTEGER)
    if why is not None:
        return why
    n, k = fake_tensor(weight).shape
    if len(block) != 2 or block[0] != 1 or not isinstance(block[1], int) or k % block[1]:
        return Miss(f"block size {list(block)}: expected [1, g] with g dividing {k}")
    if out_dtype != torch.float32:
        return Miss(f"dequantizes to {out_dtype}, not float32")
    for part in (scale, zero):
        if part is None:
            continue
        why = _frozen_weight(part, (torch.float32, torch.bfloat16, torch.int8, torch.int32))
        if why is not None:
            return why
        if tuple(fake_tensor(part).shape) != (n, k // block[1]):
            return Miss(f"{part.name} has shape {tuple(fake_tensor(part).shape)}, not {(n, k // block[1])}")
    if fake_tensor(scale).dtype not in _SCALES:
        return Miss(f"the scales are {fake_tensor(scale).dtype}, not float32 or bfloat16")
    if not node.users or any(u.target is not aten.linear.default or u.args[1] is not node for u in node.users):
        return Miss("read by something other than linear's weight")
    if any(fake_tensor(u.args[0]) is None or fake_tensor(u.args[0]).dtype != torch.float32 for u in node.users):
        return Miss("a linear of a non-float32 input")
    before = set()
    for other in node.graph.nodes:  # the rewrite is inserted here: each linear's input must exist already
        if other is node:
            break
        before.add(other)
    if any(
        u.args[0] not in before or (len(u.args) > 2 and isinstance(u.args[2], Node) and u.args[2] not in before)
        for u in node.users
    ):
        return Miss("a linear's input is computed after the dequantize")
    return block[1], zero


def _grouped_ops() -> tuple[Any, ...]:
    ops = {op._opname: op for op in torchao_ops()}
    return (ops["dequantize_affine"],) if "dequantize_affine" in ops else ()


def _group_tile(groups: int) -> int:
    """How many groups the weight's layout interleaves (`GROUP_TILE`, or the largest power of 2 below it that
    divides `groups`)."""
    tile = GROUP_TILE
    while groups % tile:
        tile //= 2
    return tile


def _grouped_product(rw: Rewriter, node: Node, x: Node, rows: Any, group: int, zero: Node | None) -> Node:
    """x [rows, K] times torchao's dequantized weight ((w - zero) * scale per group of `group`) as [rows, N]:
    per group the int8 products are summed first, then the zero point's share (zero x the group's sum of x) is
    taken off and the group's scale applied, then the groups summed by halves. The weight is laid out
    [N/16, G/t, group, t, 16] (`blocked_rows(w, 16, group, t)`): IREE's matvec reduces t = 4 groups x 16
    channels side by side, the group's values in turn, so each tile reads one contiguous run of bytes, and the
    scaling runs in the partials' own [rows, N/16, G/t, t, 16] shape, fused into it. On a 32000x1024 int4 g32
    weight (the lm_head of issue 33's Llama) the groups in turn ([N/16, G, group, 16], read 512 bytes apart)
    took 7.9-11.4 ms, this layout 3.3-4.2 ms (int8 per channel 1.5-2.1); on 2816x1024 0.28 -> 0.19 ms
    (benchmarks/int4_forms.py). Zero points that turn out all 0 (torchao's symmetric default) are dropped with
    their share when the weight is folded (`weight_layout.fold_blocked_rows`: only there are the values known)."""
    weight, scale = node.args[0], node.args[2]
    n, k = fake_tensor(weight).shape
    groups = k // group
    tile = _group_tile(groups)
    layout = [n // BLOCK, groups // tile, tile, BLOCK]  # of the partials, scales and zero points
    blocks = rw.call(aten._to_copy.default, rw.call(BLOCKED_ROWS, weight, BLOCK, group, tile), dtype=torch.float32)
    values = rw.call(aten.view.default, blocks, [n // BLOCK, groups // tile, group, tile, BLOCK])

    def per_group(part: Node) -> Node:
        blocks = rw.call(aten._to_copy.default, rw.call(BLOCKED_ROWS, part, BLOCK), dtype=torch.float32)
        return rw.call(aten.view.default, blocks, layout)

    x_groups = rw.call(aten.view.default, x, [rows, 1, groups // tile, tile, group, 1])
    xs = rw.call(aten.permute.default, x_groups, [0, 1, 2, 4, 3, 5])  # [rows, 1, G/t, group, t, 1]
    partial = rw.call(aten.sum.dim_IntList, rw.call(aten.mul.Tensor, xs, values), [3])  # [rows, N/16, G/t, t, 16]
    if zero is not None:
        sums = rw.call(aten.sum.dim_IntList, rw.call(aten.view.default, x, [rows, 1, *layout[1:3], group]), [4], True)
        partial = rw.call(aten.sub.Tensor, partial, rw.call(aten.mul.Tensor, per_group(zero), sums))
    scaled = rw.call(aten.mul.Tensor, partial, per_group(scale))
    reduced = _sum_by_halves(rw, _sum_by_halves(rw, scaled, 2, groups // tile), 3, tile)
    return rw.call(aten.view.default, reduced, [rows, n])


def _dequantized_mm(rw: Rewriter, node: Node, x: Node, rows: Any, group: int, zero: Node | None) -> Node:
    """x [rows, K] times torchao's dequantized weight as a matmul ([rows, N]), for more rows than a decode's: the
    weight dequantized from the decode's blocks [N/16, G/t, group, t, 16] with torchao's float32 operations ((q -
    zero) * scale, so its values are torchao's), viewed [K, N]. IREE fuses the dequantize into the dispatch that
    packs the matmul's operand: a float32 copy of the weight in the matmul's tiles is written per call (not one of
    the weight in its own layout), and the weight is stored once, in the decode's blocks. A zero point's
    subtraction over zeros is dropped when the weight is folded, as the reduction's share is."""
    weight, scale = node.args[0], node.args[2]
    n, k = fake_tensor(weight).shape
    groups = k // group
    tile = _group_tile(groups)
    blocks = rw.call(aten._to_copy.default, rw.call(BLOCKED_ROWS, weight, BLOCK, group, tile), dtype=torch.float32)
    values = rw.call(aten.view.default, blocks, [n // BLOCK, groups // tile, group, tile, BLOCK])

    def per_group(part: Node) -> Node:
        floats = rw.call(aten._to_copy.default, rw.call(BLOCKED_ROWS, part, BLOCK), dtype=torch.float32)
        return rw.call(aten.view.default, floats, [n // BLOCK, groups // tile, 1, tile, BLOCK])

    if zero is not None:
        values = rw.call(aten.sub.Tensor, values, per_group(zero))
    weights = _as_matrix(rw, rw.call(aten.mul.Tensor, values, per_group(scale)), [1, 3, 2, 0, 4], k, n)
    return rw.call(aten.mm.default, rw.call(aten.view.default, x, [rows, k]), weights)


def _sum_by_halves(rw: Rewriter, t: Node, dim: int, size: int) -> Node:
    """`t` summed over `dim` (of `size`) by adding its halves until one is left (an odd one out is set aside and
    added last), that axis kept as 1. IREE fuses these adds of contiguous slices into the reduction before them
    and a few small elementwise dispatches, where a sum over the groups (a strided axis between the blocks and
    the 16 channels) compiles to a reduction that transposes: 0.08 ms of a 2816x1024 g32 weight's 0.18 ms, the
    halves 0.01 ms (benchmarks/int4_forms.py)."""
    aside = []
    while size > 1:
        half = size // 2
        if size % 2:
            aside.append(rw.call(aten.slice.Tensor, t, dim, 2 * half, size))
        low = rw.call(aten.slice.Tensor, t, dim, 0, half)
        t = rw.call(aten.add.Tensor, low, rw.call(aten.slice.Tensor, t, dim, half, 2 * half))
        size = half
    for part in aside:
        t = rw.call(aten.add.Tensor, t, part)
    return t


class _OnDequantize:
    """The grouped rule rooted at torchao's `dequantize_affine` once torchao has registered it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    @property
    def roots(self) -> tuple[Any, ...]:
        return _grouped_ops() or self._inner.roots

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return repr(self._inner)


def _never() -> None:
    """The root while torchao is not imported: no node calls it."""


@rule(
    roots=(_never,),
    when=_grouped_dequantize,
    priority=10,  # before DEFAULT's lowering of the same op
    tags={"iree", "quantized"},
    doc=(
        "torchao's grouped weight-only linear (`linear(x, dequantize_affine(w, [1, g], scale, zero))`, "
        "`IntxWeightOnlyConfig` int4/int8) becomes one reduction over the weight re-laid in blocks of 16 rows, "
        "torchao's dequantize inside it: no float32 copy of the weight per call."
    ),
)
def grouped_linear_as_blocked_reduction_for_iree(node: Node, rw: Rewriter, *, found: tuple[int, Node | None]) -> None:
    group, zero = found

    def product(x: Node, rows: Any) -> Node:
        form = _dequantized_mm if _prefill(x) else _grouped_product
        return form(rw, node, x, rows, group, zero)

    each_linear(rw, node, product)


def each_linear(rw: Rewriter, node: Node, product: Callable[[Node, Any], Any]) -> None:
    """Each `linear(x, node)` reading the dequantized weight `node` ([N, K]) replaced by `product(x, rows)` ([rows,
    N], rows the product of x's leading sizes: an int, or a node where one is a Dim) plus its bias, viewed back to
    x's leading sizes; `node` erased."""
    n = fake_tensor(node.args[0]).shape[0]
    for linear in list(node.users):
        x, bias = linear.args[0], linear.args[2] if len(linear.args) > 2 else None
        shape = list(fake_tensor(x).shape)
        rows = math.prod(shape[:-1]) if all(isinstance(s, int) for s in shape[:-1]) else None
        if rows is None:
            rows = rw.size(x, 0)
            for d in range(1, len(shape) - 1):
                rows = rw.call(operator.mul, rows, rw.size(x, d))
        out = product(x, rows)
        if bias is not None:
            out = rw.call(aten.add.Tensor, out, bias)
        out_shape = [rw.size(x, d) if not isinstance(s, int) else s for d, s in enumerate(shape[:-1])] + [n]
        rw.replace(linear, rw.call(aten.view.default, out, out_shape))
    rw.erase(node)


grouped_linear_for_iree = _OnDequantize(grouped_linear_as_blocked_reduction_for_iree)

RULES = RuleSet([int8_weight_mm_as_blocked_reduction_for_iree, grouped_linear_for_iree], name="iree-quantized")
