"""MoE experts on AVX-512 and AVX2 through one packed copy of their weights: the prefill's and the decode's
products both read it (issue 34; docs/iree-3.13-findings.md sections 61, 66, 67).

`rules/moe.py` writes transformers' `grouped_mm_fallback(input, weight, offs)` per expert (a matmul over the
expert's run-time rows, its weight packed by IREE's data tiling once at load) in prefill and decode alike, so that
the module holds each weight once (findings 61). On AVX-512 IREE 3.13 gives a run-time row count the 16-row tile:
a decode step's expert (0 or 1 rows) computes 16 rows, and Qwen3-30B-A3B's layer decoded at 0.72x eager (findings
66). These rules, first on AVX-512 (`targets.CpuIsa.first_rules`), write the experts' [E, N, K] weight once as
`packed_experts.pack` lays it out ([E, N/16, K, 16], the bytes IREE's data tiling packs an expert into) and read it
in place twice:

- `grouped_mm_packed_as_dispatch_for_iree` (many or run-time rows: prefill; N a multiple of 32, K of 4): one
  hand-written dispatch over all experts (`grouped_experts_dispatch`, findings 70): each expert's row range read from
  the offsets on the device, f32_dispatch.py's 12x32 register block over two strips of 16 at a time; no per-expert
  dispatches, packs, unpacks or host reads (the 30B layer's prefill 0.85-0.88x, the small model's 0.80x);
  `grouped_mm_packed_as_dispatch_for_iree_avx2` (AVX2's one rule here; any rows, N a multiple of 16, K of 4): the
  same dispatch with AVX2's 6x16 block (a strip of 16 as two ymm of 8), for the prefill and the decode step alike
  (on AVX2 the per-row form below decoded at 0.86-1.00x eager, the dispatch over a step's 8 rows 2.1-2.3x);
- `grouped_mm_packed_per_expert_for_iree` (many or run-time rows, where the dispatch declines): per expert,
  `packed_matmul(rows, packed[e])`, spliced as IREE's pack of the rows, `linalg.mmt4d` and unpack
  (`packed_experts.splice`); the expert index read at run time (with a constant one IREE hoists each expert's slice into
  a global of its own: beside the decode's whole tensor the experts twice, a saved one-layer Qwen3-MoE's archive 1.81x
  its weights);
- `grouped_mm_packed_per_row_for_iree` (static rows, at most as many as experts: a decode step's batch x top_k):
  each row's expert read at run time, `packed_matmul(row, packed[e])` with one static row: IREE's narrow 1x16x1
  `mmt4d` tile over the expert's strips where they lie.

The per-expert and per-row forms give moe.py's results through IREE bit for bit (the same microkernel sums); the
dispatch sums K in blocks (as f32_dispatch.py), nearer float64 than the microkernel's K-order sums. Float32 weights
stored [E, N, K] (transformers' experts, passed transposed), N a multiple of 16; else `moe.py`'s.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.iree.f32_dispatch import BLOCKS, KU
from fx_rewrites.backends.iree.grouped_experts_dispatch import GROUPED_PACKED_MATMUL
from fx_rewrites.backends.iree.packed_experts import PACKED_MATMUL, STRIP
from fx_rewrites.backends.iree.rules.moe import (
    Grouped,
    _grouped,
    _integer,
    _k_contiguous,
    _nondecreasing_ends,
    _not_registered,
    _OnRegisteredOp,
)
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: static row counts up to this many times the number of experts take the per-row form (a decode step: batch x
#: top_k rows); more, or a run-time count, the per-expert form
PER_ROW_LIMIT = 1.0


def _packable(node: Node) -> Grouped | Miss:
    found = _grouped(node)
    if isinstance(found, Miss):
        return found
    wv = found.weight.meta["val"]
    if wv.dtype != torch.float32 or found.x.meta["val"].dtype != torch.float32:
        return Miss(f"{wv.dtype} weights: the packed form is float32's (IREE's 16x16x1 tile)")
    if not _k_contiguous(found.weight):
        return Miss("a weight not stored [E, N, K] (transformers' layout, passed transposed)")
    if not isinstance(found.out_features, int) or found.out_features % STRIP:
        return Miss(f"{found.out_features} output features, not a multiple of {STRIP}")
    return found


def _few(found: Grouped) -> bool:
    return isinstance(found.rows, int) and found.rows <= PER_ROW_LIMIT * found.experts


def _many_rows(node: Node) -> Grouped | Miss:
    found = _packable(node)
    if isinstance(found, Grouped) and _few(found):
        return Miss(f"{found.rows} static rows for {found.experts} experts: the per-row form")
    return found


def _few_rows(node: Node) -> Grouped | Miss:
    found = _packable(node)
    if isinstance(found, Grouped) and not _few(found):
        return Miss(f"rows {found.rows} (run-time, or over {PER_ROW_LIMIT} x {found.experts}): the per-expert form")
    return found


def _in_blocks(found: Grouped | Miss, isa: str) -> Grouped | Miss:
    strip = BLOCKS[isa].strip
    if isinstance(found, Grouped) and found.out_features % strip:
        return Miss(f"{found.out_features} output features, not a multiple of the dispatch's {strip} ({isa})")
    if isinstance(found, Grouped) and found.x.meta["val"].shape[1] % KU:
        return Miss(f"{found.x.meta['val'].shape[1]} input features, not a multiple of the dispatch's {KU} K steps")
    return found


def _many_rows_in_pairs(node: Node) -> Grouped | Miss:
    """Many or run-time rows (prefill) in AVX-512's block: N a multiple of 32 (two strips of 16)."""
    return _in_blocks(_many_rows(node), "avx512")


def _rows_in_strips(node: Node) -> Grouped | Miss:
    """Any rows (prefill and a decode step alike) in AVX2's block: N a multiple of 16 (one strip as two ymm of 8)."""
    return _in_blocks(_packable(node), "avx2")


def _packed(rw: Rewriter, g: Grouped) -> Node:
    """The [E, K, N] weight (a transpose of the [E, N, K] parameter) as [E, N/16, K, 16]: a view and a transpose."""
    stored = rw.call(aten.transpose.int, g.weight, 1, 2)  # [E, N, K], contiguous
    k = g.weight.meta["val"].shape[1]
    strips = rw.call(aten.view.default, stored, [g.experts, g.out_features // STRIP, STRIP, k])
    return rw.call(aten.transpose.int, strips, 2, 3)


def _expert(rw: Rewriter, index: Node, r: int, experts: int) -> Any:
    """`index[r]` read at run time, told to lie in [0, experts)."""
    e = _integer(rw, index, r)
    torch._check(e.meta["val"] >= 0)
    torch._check(e.meta["val"] < experts)
    return e


@rule(
    roots=(_not_registered,),
    when=_many_rows,
    tags={"iree", "moe"},
    priority=20,  # before moe.py's per-expert form of the same op
    doc=(
        "AVX-512: transformers' `grouped_mm_fallback(input, weight, offs)` with many or run-time rows (prefill) "
        "becomes one `packed_matmul` per expert over its rows (IREE's pack, mmt4d and unpack, spliced) reading "
        "the expert's strips of the weight laid out once as [E, N/16, K, 16], the expert index read at run time; "
        "rows past the last offset are 0 as in the op."
    ),
)
def grouped_mm_packed_per_expert_for_iree(node: Node, rw: Rewriter, *, found: Grouped) -> Any:
    xv = found.x.meta["val"]
    rows = rw.size(found.x, 0)
    ends = _nondecreasing_ends(rw, found)
    packed = _packed(rw, found)
    # e + min(ends[e], 0) = e (ends >= 0), a value IREE cannot fold: each product reads the packed tensor at a
    # run-time offset instead of a slice IREE would hoist into a copy of its own
    index = rw.call(
        aten.add.Tensor,
        rw.call(aten.arange.default, found.experts, dtype=torch.int64, device=xv.device),
        rw.call(aten.clamp.default, ends, None, 0),
    )
    dynamic = not isinstance(rows, int)
    if not dynamic:  # IREE 3.13 fails on a concatenation of dynamic pieces into a static shape (as in moe.py)
        out = rw.call(aten.zeros.default, [rows, found.out_features], dtype=xv.dtype, device=xv.device)
    products, start = [], 0
    for e in range(found.experts):
        end = _integer(rw, ends, e)
        torch._check(end.meta["val"] >= (start.meta["val"] if isinstance(start, Node) else start))
        torch._check(end.meta["val"] <= xv.shape[0])
        weight = rw.call(aten.select.int, packed, 0, _expert(rw, index, e, found.experts))
        product = rw.call(PACKED_MATMUL, rw.call(aten.slice.Tensor, found.x, 0, start, end), weight)
        if dynamic:
            products.append(product)
        else:
            out = rw.call(aten.slice_scatter.default, out, product, 0, start, end)
        start = end
    if dynamic:
        size = [rw.call(operator.sub, rows, start), found.out_features]
        tail = rw.call(aten.zeros.default, size, dtype=xv.dtype, device=xv.device)
        out = rw.call(aten.cat.default, [*products, tail])
    rw.replace(node, out)


_DISPATCH_DOC = (
    "{isa}: transformers' `grouped_mm_fallback(input, weight, offs)` with {rows} "
    "becomes one hand-written dispatch over all experts (`grouped_packed_matmul`, grouped_experts_dispatch.py: "
    "a workgroup per expert and 128 channels, {block} register blocks) reading each expert's row range from "
    "`offs` (clamped, non-decreasing) and its strips of the weight laid out once as [E, N/16, K, 16] (the "
    "decode's tensor); no per-expert dispatches, packs, unpacks or host reads; rows past the last offset 0."
)


def _dispatch(node: Node, rw: Rewriter, found: Grouped, isa: str) -> None:
    ends = rw.call(aten._to_copy.default, _nondecreasing_ends(rw, found), dtype=torch.int32)
    rw.replace(node, rw.call(GROUPED_PACKED_MATMUL, found.x, _packed(rw, found), ends, BLOCKS[isa].tile))


@rule(
    roots=(_not_registered,),
    when=_many_rows_in_pairs,
    tags={"iree", "moe"},
    priority=30,  # before the per-expert form below
    doc=_DISPATCH_DOC.format(isa="AVX-512", rows="many or run-time rows (prefill)", block="12 x 32"),
)
def grouped_mm_packed_as_dispatch_for_iree(node: Node, rw: Rewriter, *, found: Grouped) -> Any:
    _dispatch(node, rw, found, "avx512")


@rule(
    roots=(_not_registered,),
    when=_rows_in_strips,
    tags={"iree", "moe"},
    priority=30,  # before the per-expert form below
    doc=_DISPATCH_DOC.format(isa="AVX2", rows="any rows (prefill and decode)", block="6 x 16 (two ymm of 8 a strip)"),
)
def grouped_mm_packed_as_dispatch_for_iree_avx2(node: Node, rw: Rewriter, *, found: Grouped) -> Any:
    _dispatch(node, rw, found, "avx2")


@rule(
    roots=(_not_registered,),
    when=_few_rows,
    tags={"iree", "moe"},
    priority=20,  # before moe.py's per-expert form of the same op
    doc=(
        "AVX-512: transformers' `grouped_mm_fallback(input, weight, offs)` with few static rows (a decode step: "
        "batch x top_k) becomes one `packed_matmul` a row (IREE's narrow mmt4d tile): the row's expert read at run "
        "time, its strips of the weight laid out as [E, N/16, K, 16] read in place (the prefill's operand, one "
        "tensor); rows past the last offset are 0 as in the op."
    ),
)
def grouped_mm_packed_per_row_for_iree(node: Node, rw: Rewriter, *, found: Grouped) -> Any:
    xv = found.x.meta["val"]
    packed = _packed(rw, found)
    index = rw.call(aten.arange.default, found.rows, dtype=torch.int64, device=xv.device)
    started = rw.call(
        aten.ge.Tensor, rw.call(aten.unsqueeze.default, index, 1), rw.call(aten.unsqueeze.default, found.offs, 0)
    )
    expert = rw.call(aten.sum.dim_IntList, started, [1], dtype=torch.int64)  # E for a row past the last offset
    inside = rw.call(aten.lt.Scalar, expert, found.experts)
    expert = rw.call(aten.clamp.default, expert, None, found.experts - 1)
    products = []
    for r in range(int(found.rows)):
        strips = rw.call(aten.select.int, packed, 0, _expert(rw, expert, r, found.experts))  # [N/16, K, 16]
        products.append(rw.call(PACKED_MATMUL, rw.call(aten.slice.Tensor, found.x, 0, r, r + 1), strips))
    out = rw.call(aten.cat.default, products)
    zero = rw.call(aten.scalar_tensor.default, 0.0, dtype=xv.dtype)
    rw.replace(node, rw.call(aten.where.self, rw.call(aten.unsqueeze.default, inside, 1), out, zero))


packed_as_dispatch_for_iree = _OnRegisteredOp(grouped_mm_packed_as_dispatch_for_iree)
packed_as_dispatch_for_iree_avx2 = _OnRegisteredOp(grouped_mm_packed_as_dispatch_for_iree_avx2)
packed_per_expert_for_iree = _OnRegisteredOp(grouped_mm_packed_per_expert_for_iree)
packed_per_row_for_iree = _OnRegisteredOp(grouped_mm_packed_per_row_for_iree)

RULES = RuleSet(
    [
        packed_as_dispatch_for_iree,
        packed_as_dispatch_for_iree_avx2,
        packed_per_expert_for_iree,
        packed_per_row_for_iree,
    ],
    name="iree-moe-packed",
)
