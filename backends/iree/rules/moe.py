"""transformers' grouped matmul of MoE experts, written out for IREE without copying an expert's weight.

transformers 5 routes the tokens of its MoE layers (Mixtral, Qwen2/3-MoE) to their experts with the custom op
`transformers::grouped_mm_fallback(input, weight, offs)`: rows of `input` sorted by expert, `offs[i]` the end of
expert i's rows, each block multiplied by its expert's weight in a Python loop (an opaque op to torch.export;
IREE has no lowering of it, and torch no decomposition). The op exists only once transformers has registered
it, so the rules find it when the rules run.

Two forms, both reading each expert's weight where it lies in the [E, K, N] tensor (a slice at an offset the
dispatch reads, never a gathered copy), both exact in their work:

- `grouped_mm_per_expert_for_iree` (prefill, rows dynamic or many): the E row ranges read from `offs` as
  integers (`item`), one matmul per expert over its rows, the products concatenated (IREE writes each into the
  result in place; `slice_scatter` into zeros when the rows are static). The expert index is a constant, so
  IREE's data tiling packs each expert's weight once, when the module loads (a copy of the experts' weights
  for the module's lifetime), or at `save(params=)`, into the archive the loaded module maps; an expert without
  rows costs dispatches that do nothing.
- `grouped_mm_per_row_for_iree` (a few static rows, where `PER_ROW_LIMIT` lets it): each row's expert read as
  an integer, the row multiplied by that expert's weight as a multiply and a sum along the dimension the weight
  holds contiguously (one matrix-vector dispatch a row, the weight read at a dynamic offset and not packed).

`PER_ROW_LIMIT` is 0: a decode step takes the per-expert form too, so that prefill and decode read the same
packed expert weights. With the per-row form the decode read the [E, K, N] tensor as it is and the prefill its
packed slices: the module held both (the experts twice: in memory at load, or both in the archive
`save(params=)` writes), and a saved Qwen3-30B-A3B layer ran at 1.9x eager's peak. The per-row form
stays for a caller that sets the limit (a module never saved: its decode was 5-15% faster).

On AVX-512 `rules/moe_packed.py`'s forms come first (float32, the weight stored [E, N, K], N a multiple of 16): the
experts laid out once by the graph as IREE's tile reads them, the decode's rows in the narrow tile (findings 67).

Measured in benchmarks/moe_block.py and benchmarks/moe_sort.py; docs/performance.md (MoE sections, "MoE
memory: the experts packed once").
"""

from __future__ import annotations

import operator
from collections.abc import Hashable
from typing import Any

import attrs
import torch
from torch.fx import Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule
from fx_rewrites.kinds.function import FunctionRule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: the custom op transformers 5 registers (transformers/integrations/moe.py)
GROUPED_MM = ("transformers", "grouped_mm_fallback", "default")

#: static row counts up to this many times the number of experts take the per-row form (a dispatch per row
#: reading one expert's weight); more rows, or a dynamic count, the per-expert form (pack, mmt4d, unpack per expert).
#: 0: every count the per-expert form, so the decode reads the prefill's packed weights (one copy; module docstring)
PER_ROW_LIMIT = 0.0

#: the most experts written out (E dispatches per grouped matmul, each compiled as its own code)
MAX_EXPERTS = 1024


def _grouped_mm() -> Any | None:
    """transformers' grouped matmul op, None while transformers has not registered it."""
    try:
        packet = getattr(getattr(torch.ops, GROUPED_MM[0]), GROUPED_MM[1])
    except (AttributeError, RuntimeError):
        return None
    return getattr(packet, GROUPED_MM[2], None)


def _not_registered() -> None:
    """The root of the rules while the op does not exist: no node calls it."""


@attrs.frozen
class Grouped:
    """A grouped matmul the rules can write out: `input` [rows, K], `weight` [experts, K, N], `offs` [experts]."""

    x: Node
    weight: Node
    offs: Node
    rows: int | torch.SymInt
    experts: int
    out_features: int | torch.SymInt

    @property
    def few_rows(self) -> bool:
        """Static rows, few enough for a dispatch a row."""
        return isinstance(self.rows, int) and self.rows <= PER_ROW_LIMIT * self.experts


def _grouped(node: Node) -> Grouped | Miss:
    """The operands, when the op can be written out; else a Miss saying why not."""
    x, weight, offs = node.args[:3]
    vals = [fake_value(a) for a in (x, weight, offs)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return Miss("an argument without a tensor value")
    xv, wv, ov = vals
    if xv.dim() != 2 or wv.dim() != 3 or ov.dim() != 1:
        return Miss(f"input/weight/offs of ranks {xv.dim()}/{wv.dim()}/{ov.dim()}, not 2/3/1")
    experts = wv.shape[0]
    if not isinstance(experts, int):
        return Miss("a symbolic number of experts (the rewrite writes one matmul per expert)")
    if experts > MAX_EXPERTS:
        return Miss(f"{experts} experts, more than {MAX_EXPERTS} written out")
    if ov.dtype.is_floating_point or ov.dtype.is_complex or ov.dtype == torch.bool:
        return Miss(f"offs of dtype {ov.dtype}, not an integer type")
    return Grouped(x, weight, offs, xv.shape[0], experts, wv.shape[2])  # type: ignore[arg-type]


def _many_rows(node: Node) -> Grouped | Miss:
    found = _grouped(node)
    if isinstance(found, Grouped) and found.few_rows:
        return Miss(f"{found.rows} static rows for {found.experts} experts: the per-row form")
    return found


def _few_rows(node: Node) -> Grouped | Miss:
    found = _grouped(node)
    if isinstance(found, Grouped) and not found.few_rows:
        return Miss(
            f"rows {found.rows} (dynamic, or over {PER_ROW_LIMIT} x {found.experts} experts): the per-expert form"
        )
    return found


def _k_contiguous(weight: Node) -> bool:
    """Whether the [E, K, N] `weight` holds K contiguously (a transpose of an [E, N, K] tensor, as transformers
    passes its experts' weights), by the strides torch.export recorded."""
    val = weight.meta["val"]
    return val.stride(1) == 1 and val.stride(2) != 1


def _integer(rw: Rewriter, tensor: Node, index: int) -> Node:
    """`tensor[index].item()`: an integer the program reads at run time (an unbacked symbol)."""
    return rw.call(aten.item.default, rw.call(aten.select.int, tensor, 0, index))


def _nondecreasing_ends(rw: Rewriter, g: Grouped) -> Node:
    """`offs` as int64, clamped to [0, rows] and made non-decreasing (a running max, as an [E, E] masked max:
    E is small): every row range read from it lies inside `input`, whatever `offs` holds. transformers'
    offsets (a cumsum of counts) are unchanged by it."""
    ends = rw.call(aten.clamp.default, rw.call(aten._to_copy.default, g.offs, dtype=torch.int64), 0, rw.size(g.x, 0))
    index = rw.call(aten.arange.default, g.experts, dtype=torch.int64, device=g.offs.meta["val"].device)
    before = rw.call(
        aten.le.Tensor, rw.call(aten.unsqueeze.default, index, 0), rw.call(aten.unsqueeze.default, index, 1)
    )
    zero = rw.call(aten.scalar_tensor.default, 0, dtype=torch.int64)
    masked = rw.call(aten.where.self, before, rw.call(aten.unsqueeze.default, ends, 0), zero)  # [e, j]: j <= e
    return rw.call(aten.amax.default, masked, [1])


@rule(
    roots=(_not_registered,),
    when=_many_rows,
    tags={"iree", "moe"},
    doc=(
        "transformers' `grouped_mm_fallback(input, weight, offs)` (the experts' matmuls of Mixtral and Qwen2/3-MoE "
        "in transformers 5) with many or dynamic rows (prefill) becomes one matmul per expert over its rows: "
        "the row ranges read from `offs` at run time (`item`), `input[start:end] @ weight[e]` written into a zero "
        "output (`slice_scatter`; rows past the last offset stay 0 as in the op). Each expert's weight is read in "
        "place (IREE's data tiling packs it once, at load); time and memory follow the routed rows. IREE 3.13: "
        "\"failed to legalize operation 'torch.operator'\" (transformers.grouped_mm_fallback)."
    ),
)
def grouped_mm_per_expert_for_iree(node: Node, rw: Rewriter, *, found: Grouped) -> Any:
    xv = found.x.meta["val"]
    rows = rw.size(found.x, 0)
    ends = _nondecreasing_ends(rw, found)
    dynamic = not isinstance(rows, int)
    if not dynamic:  # IREE 3.13 fails on a concatenation of dynamic pieces into a static shape (flow.tensor.reshape)
        out = rw.call(aten.zeros.default, [rows, found.out_features], dtype=xv.dtype, device=xv.device)
    products, start = [], 0
    for e in range(found.experts):
        end = _integer(rw, ends, e)
        # what `_nondecreasing_ends` guarantees at run time, told to the shape environment for the slice's size
        torch._check(end.meta["val"] >= (start.meta["val"] if isinstance(start, Node) else start))
        torch._check(end.meta["val"] <= xv.shape[0])
        product = rw.call(
            aten.mm.default,
            rw.call(aten.slice.Tensor, found.x, 0, start, end),
            rw.call(aten.select.int, found.weight, 0, e),
        )
        if dynamic:
            products.append(product)
        else:
            out = rw.call(aten.slice_scatter.default, out, product, 0, start, end)
        start = end
    if dynamic:  # the pieces written in place into the concatenation (no zeroed output, no copies); 0 after the last
        tail = rw.call(
            aten.zeros.default,
            [rw.call(operator.sub, rows, start), found.out_features],
            dtype=xv.dtype,
            device=xv.device,
        )
        out = rw.call(aten.cat.default, [*products, tail])
    rw.replace(node, out)


@rule(
    roots=(_not_registered,),
    when=_few_rows,
    tags={"iree", "moe"},
    doc=(
        "transformers' `grouped_mm_fallback(input, weight, offs)` with few static rows (decode: batch x top_k, at "
        "most as many as experts) becomes one matrix-vector product a row: the row's expert (the number of "
        "offsets at or before it) read at run time (`item`), `(weight[e] * row[:, None]).sum(0)`, which IREE "
        "runs as one dispatch reading that expert's weight in place (not packed: a matmul of one row would pack "
        "the whole weight per call); rows past the last offset are 0 as in the op."
    ),
)
def grouped_mm_per_row_for_iree(node: Node, rw: Rewriter, *, found: Grouped) -> Any:
    xv = found.x.meta["val"]
    index = rw.call(aten.arange.default, found.rows, dtype=torch.int64, device=xv.device)
    started = rw.call(
        aten.ge.Tensor, rw.call(aten.unsqueeze.default, index, 1), rw.call(aten.unsqueeze.default, found.offs, 0)
    )
    expert = rw.call(aten.sum.dim_IntList, started, [1], dtype=torch.int64)  # E for a row past the last offset
    inside = rw.call(aten.lt.Scalar, expert, found.experts)
    expert = rw.call(aten.clamp.default, expert, None, found.experts - 1)
    # the sum runs along the dimension the weight holds contiguously: transformers stores [E, N, K] and passes
    # its transpose, and a sum over K as the outer dimension of [K, N] reads the weight strided (IREE 3.13:
    # 2.3-4.3x slower, benchmarks/moe_rows.py)
    stored_nk = _k_contiguous(found.weight)
    weights = rw.call(aten.transpose.int, found.weight, 1, 2) if stored_nk else found.weight
    products = []
    for r in range(int(found.rows)):
        e = _integer(rw, expert, r)
        torch._check(e.meta["val"] >= 0)
        torch._check(e.meta["val"] < found.experts)
        weight = rw.call(aten.select.int, weights, 0, e)  # [N, K] or [K, N], read at a run-time offset
        row = rw.call(aten.unsqueeze.default, rw.call(aten.select.int, found.x, 0, r), 0 if stored_nk else 1)
        products.append(rw.call(aten.sum.dim_IntList, rw.call(aten.mul.Tensor, weight, row), [1 if stored_nk else 0]))
    out = rw.call(aten.stack.default, products)
    zero = rw.call(aten.scalar_tensor.default, 0.0, dtype=xv.dtype)
    rw.replace(node, rw.call(aten.where.self, rw.call(aten.unsqueeze.default, inside, 1), out, zero))


class _OnRegisteredOp:
    """A rule whose root is transformers' op as soon as it exists (looked up each time the engine runs its
    rules, which rebuilds their index when it changed), the placeholder `_not_registered` before; everything
    else is the wrapped rule's."""

    def __init__(self, inner: FunctionRule) -> None:
        self._inner = inner

    @property
    def roots(self) -> tuple[Hashable, ...]:
        op = _grouped_mm()
        return (op,) if op is not None else self._inner.roots

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return repr(self._inner)


per_expert_for_iree = _OnRegisteredOp(grouped_mm_per_expert_for_iree)
per_row_for_iree = _OnRegisteredOp(grouped_mm_per_row_for_iree)

RULES = RuleSet([per_expert_for_iree, per_row_for_iree], name="iree-moe")
