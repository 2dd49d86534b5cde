"""The scatters that undo a view, for IREE 3.13, which lowers neither `aten.diagonal_scatter` nor
`aten.as_strided_scatter` ("failed to legalize operation 'torch.constant.int'", docs/opinfo.md) while
torch's decompositions of both write through the view in place (`clone`, view, `copy_`), which
functionalizes back into the same scatter (the legalize phase declines them: "calls itself").

Where the in-place pack writes a mutation back through `diagonal` or `as_strided`, torch's
functionalization emits these scatters. Written out here with ops IREE lowers:

- `diagonal_scatter`: `where` over the two dims' positions `col - row == offset`, the source padded
  (`cat` with zeros) to the dim's length and broadcast along the other one (bit-exact: values are
  selected, never computed);
- `as_strided_scatter` on a contiguous input: its flat storage `index_put` at the linear offsets
  `storage_offset + sum(arange(size[d]) * stride[d])` (a non-contiguous input's storage order is not its
  row-major order: declined, and IREE's compile error names the op).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch._prims_common import is_contiguous_or_false
from torch.fx import Node

from fx_rewrites.engine import Miss
from fx_rewrites.kinds import Decompose
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


def _diagonal_scatter(
    input: torch.Tensor, src: torch.Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1
) -> torch.Tensor:
    n = input.dim()
    d1, d2 = dim1 % n, dim2 % n
    rows = torch.arange(input.shape[d1], device=input.device)
    cols = torch.arange(input.shape[d2], device=input.device)
    on_diagonal = (cols.unsqueeze(0) - rows.unsqueeze(1)) == offset
    # element k sits at (k, k + offset): row k takes src[..., k]; with a negative offset, column k does
    length = input.shape[d1 if offset >= 0 else d2]
    values = torch.cat((src, src.new_zeros((*src.shape[:-1], length - src.shape[-1]))), -1)
    values = values.unsqueeze(-1 if offset >= 0 else -2)
    order = [d for d in range(n) if d not in (d1, d2)] + [d1, d2]  # diagonal()'s layout: the two dims last
    out = torch.where(on_diagonal, values, input.permute(order))
    return out.permute([order.index(d) for d in range(n)])


def _as_strided_scatter(
    input: torch.Tensor, src: torch.Tensor, size: Sequence[Any], stride: Sequence[Any], storage_offset: Any = None
) -> torch.Tensor:
    index = torch.full((), 0 if storage_offset is None else storage_offset, dtype=torch.int64, device=input.device)
    for d, (n, step) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        index = index + (torch.arange(n, device=input.device) * step).view(shape)
    flat = input.reshape(-1).index_put((index.reshape(-1),), src.reshape(-1))
    return flat.view(input.shape)


def _contiguous_input(node: Node) -> bool | Miss:
    val = node.args[0].meta.get("val")
    if isinstance(val, torch.Tensor) and is_contiguous_or_false(val):
        return True
    return Miss("the input is not (provably) contiguous: its storage order is not its row-major order")


diagonal_scatter_for_iree = Decompose(
    ops=aten.diagonal_scatter.default,
    table={aten.diagonal_scatter.default: _diagonal_scatter},
    name="diagonal_scatter_for_iree",
    tags={"views"},
    doc=(
        "aten.diagonal_scatter (the in-place pack's write-back through a diagonal view) becomes a where over "
        'col - row == offset with the padded source; IREE 3.13: "failed to legalize operation '
        "'torch.constant.int'\", and torch's decomposition functionalizes back into diagonal_scatter."
    ),
)

as_strided_scatter_for_iree = Decompose(
    ops=aten.as_strided_scatter.default,
    table={aten.as_strided_scatter.default: _as_strided_scatter},
    name="as_strided_scatter_for_iree",
    when=_contiguous_input,
    tags={"views"},
    doc=(
        "aten.as_strided_scatter of a contiguous input (the in-place pack's write-back through as_strided) "
        "becomes an index_put into its flat storage at the view's linear offsets; IREE 3.13: \"failed to "
        "legalize operation 'torch.constant.int'\", and torch's decomposition functionalizes back into "
        "as_strided_scatter."
    ),
)

RULES = RuleSet([diagonal_scatter_for_iree, as_strided_scatter_for_iree], name="iree_scatters")
