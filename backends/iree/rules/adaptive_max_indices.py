"""adaptive_max_pool2d of a Dim-sized map with its indices used, for IREE 3.13.

IREE 3.13 fails to compile `F.adaptive_max_pool2d(x, out, return_indices=True)` when the map's height or width is
a Dim: "failed to legalize operation 'torch.aten.max_pool2d_with_indices'". torch's own decomposition declines
symbolic sizes it cannot prove divisible. To (1, 1) it is `legalize`'s (torch's decomposition); the values alone
are `pooling.adaptive_max_pool2d_values_for_iree`'s (a separable max). With the indices, each of torch's
adaptive windows [floor(i * H / oh), ceil((i + 1) * H / oh)) x [floor(j * W / ow), ceil((j + 1) * W / ow)) is
cut out with symbolic bounds and flattened; amax is its value, argmax (the first maximum in row-major order,
as torch's kernel keeps) its position, made a flat index of the whole map: (row0 + k // w) * W + col0 + k % w.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.iree.rules.pooling import per_dim, times, window_bounds
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


def _indices_used_on_dim_map(node: Node, *, args: Mapping[str, Any]) -> dict[str, Any] | Miss:
    x = args["self"].meta["val"]
    if all(isinstance(size, int) for size in x.shape[-2:]):
        return Miss("static map sizes (IREE lowers it)")
    output_size = per_dim(args["output_size"], 2, [])
    if not all(isinstance(size, int) for size in output_size) or output_size == [1, 1]:
        return Miss(f"output size {output_size}: (1, 1) is torch's decomposition's (legalize.PARTIAL_FORMS)")
    if not any(user.target is operator.getitem and user.args[1] == 1 and user.users for user in node.users):
        return Miss("its indices are unused (pooling.adaptive_max_pool2d_values_for_iree's form)")
    return {"x": args["self"], "output_size": output_size}


def _minus(rw: Rewriter, a: Any, b: Any) -> Any:
    if isinstance(b, int) and b == 0:
        return a
    return a - b if isinstance(a, int) and isinstance(b, int) else rw.call(operator.sub, a, b)


def _plus(rw: Rewriter, a: Any, b: Any) -> Any:
    if isinstance(a, int) and a == 0:
        return b
    if isinstance(b, int) and b == 0:
        return a
    return a + b if isinstance(a, int) and isinstance(b, int) else rw.call(operator.add, a, b)


@rule(
    roots=(aten.adaptive_max_pool2d.default,),
    when=_indices_used_on_dim_map,
    tags={"iree", "pooling"},
    doc=(
        "aten.adaptive_max_pool2d of a map with a Dim-sized height or width, its indices used: each of torch's "
        "adaptive windows (slices with symbolic bounds) flattened, amax its value, argmax made a flat index of "
        'the map. IREE 3.13 fails to compile it: "failed to legalize operation '
        "'torch.aten.max_pool2d_with_indices'\"."
    ),
)
def adaptive_max_pool2d_indices_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    x, (out_h, out_w) = found["x"], found["output_size"]
    rank = x.meta["val"].dim()
    lead = [rw.size(x, d) for d in range(rank - 2)]
    height, width = rw.size(x, rank - 2), rw.size(x, rank - 1)
    values, indices = [], []
    for top, bottom in window_bounds(rw, height, out_h):
        band = rw.call(aten.slice.Tensor, x, rank - 2, top, bottom)
        for left, right in window_bounds(rw, width, out_w):
            window = rw.call(aten.slice.Tensor, band, rank - 1, left, right)
            window = rw.call(aten.clone.default, window, memory_format=torch.contiguous_format)
            wide = _minus(rw, right, left)
            flat = rw.call(aten.reshape.default, window, [*lead, times(rw, _minus(rw, bottom, top), wide)])
            values.append(rw.call(aten.amax.default, flat, [-1], True))
            k = rw.call(aten.argmax.default, flat, -1, True)
            row = rw.call(aten.div.Scalar_mode, k, wide, rounding_mode="floor")
            col = rw.call(aten.remainder.Scalar, k, wide)
            index = rw.call(aten.add.Tensor, rw.call(aten.mul.Scalar, row, width), col)
            start = _plus(rw, 0 if top == 0 else times(rw, top, width), left)  # the window's first position
            indices.append(index if isinstance(start, int) and start == 0 else rw.call(aten.add.Scalar, index, start))

    def grid(cells: list[Node]) -> Node:
        return rw.call(aten.reshape.default, rw.call(aten.cat.default, cells, -1), [*lead, out_h, out_w])

    rw.replace(node, [grid(values), grid(indices)])


RULES = RuleSet([adaptive_max_pool2d_indices_for_iree], name="iree-adaptive-max-indices")
