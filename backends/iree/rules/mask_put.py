"""`x[mask] = v` with one value row per True of the mask, for IREE 3.13.

`x[mask] = v` (aten.index_put(x, [mask], v), a bool mask over x's leading dims) where v holds one row per
selected element, its leading size a static count k >= 2 (`x[[True, False, True, True, False]] = v` with v of
shape [3, 4]): IREE lowers the bool index through nonzero to a scatter of a dynamic number of indices and
static updates, and rejects it: "'iree_linalg_ext.scatter' op mismatch in shape of indices and update value
at dim#0" (static sizes and every Dim placement but a Dim on k itself, which compiles). A v that does not
vary per element is `masks.mask_index_put_to_where`'s.

Written without a data-dependent size: the element at flat mask position i takes row `cumsum(mask)[i] - 1`
of v, so `where(mask, index_select(v, 0, clamp(cumsum(mask) - 1, 0, k - 1)), x)` (accumulate: x + the
gathered rows), the values torch writes. Torch raises when the mask holds another number of Trues than k;
the rewritten program does not check it (the clamp keeps every read inside v).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


def _per_element_values(node: Node, *, args: Mapping[str, Any]) -> dict[str, Any] | Miss:
    indices = args["indices"]
    if not isinstance(indices, (list, tuple)) or len(indices) != 1 or not isinstance(indices[0], Node):
        return Miss("not one index tensor before x's other dims (x[mask] = v with the mask first)")
    mask, x, values = indices[0].meta.get("val"), args["self"].meta.get("val"), args["values"].meta.get("val")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() == 0:
        return Miss("the index is not a bool mask of rank >= 1")
    rest = x.dim() - mask.dim()
    if not isinstance(values, torch.Tensor) or values.dim() != rest + 1:
        return Miss("v does not hold one row per selected element (masks.mask_index_put_to_where's form)")
    count = values.shape[0]
    if not isinstance(count, int) or count < 2:
        return Miss(f"v's leading size {count} is not a static count >= 2 (1 broadcasts; a Dim compiles)")
    return {"x": args["self"], "mask": indices[0], "values": args["values"], "rest": rest, "count": count}


@rule(
    roots=(aten.index_put.default,),
    when=_per_element_values,
    tags={"iree", "masks"},
    doc=(
        "x[mask] = v with v one row per True of a bool mask (its leading size a static count >= 2) -> "
        "where(mask, index_select(v, 0, clamp(cumsum(mask) - 1, 0, k - 1)), x): each selected element takes its row "
        "of v, no data-dependent size. IREE 3.13: \"'iree_linalg_ext.scatter' op mismatch in shape of indices "
        'and update value at dim#0".'
    ),
)
def mask_put_rows_as_gather_for_iree(
    node: Node, rw: Rewriter, *, args: Mapping[str, Any], found: dict[str, Any]
) -> Any:
    x, mask, values, rest = found["x"], found["mask"], found["values"], found["rest"]
    mask_shape = list(mask.meta["val"].shape)
    flat = mask if len(mask_shape) == 1 else rw.call(aten.reshape.default, mask, [-1])
    position = rw.call(aten.sub.Tensor, rw.call(aten.cumsum.default, flat, 0, dtype=torch.int64), 1)
    rows = rw.call(aten.index_select.default, values, 0, rw.call(aten.clamp.default, position, 0, found["count"] - 1))
    if len(mask_shape) > 1:
        row_sizes = [rw.size(values, d) for d in range(1, rest + 1)]
        rows = rw.call(aten.reshape.default, rows, [rw.size(mask, d) for d in range(len(mask_shape))] + row_sizes)
    dtype = x.meta["val"].dtype
    if values.meta["val"].dtype != dtype:
        rows = rw.call(aten._to_copy.default, rows, dtype=dtype)
    if args.get("accumulate", False):
        rows = rw.call(aten.add.Tensor, x, rows)
    cond = mask
    for _ in range(rest):
        cond = rw.call(aten.unsqueeze.default, cond, -1)
    rw.replace(node, rw.call(aten.where.self, cond, rows, x))


RULES = RuleSet([mask_put_rows_as_gather_for_iree], name="iree-mask-put")
