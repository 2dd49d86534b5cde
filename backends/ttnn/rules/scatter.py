"""slice_scatter and select_scatter -> ttnn: the kept parts of the input and the new values, concatenated.

`slice_scatter(x, src, dim, start, end)` is `x` with `x[start:end]` (along
`dim`) replaced by `src`: on the device, `concat([x[:start], src, x[end:]],
dim)` with `ttnn.slice` and `ttnn.concat` (ttnn has no slice write). A
strided slice (step > 1) interleaves kept and new rows and is declined.
`select_scatter(x, src, dim, i)` is the same with `src` reshaped to hold a
`dim` of size 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.ttnn.rules import ops
from fx_rewrites.backends.ttnn.rules.boundary import device_value
from fx_rewrites.backends.ttnn.rules.checks import Bound, lowering, static, tensors_ok
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


def _window(bound: Bound, size: int) -> tuple[int, int] | Miss:
    """The `[start, end)` that slice_scatter (or select_scatter) writes along its dimension of `size`."""
    if "index" in bound:
        index = int(bound["index"])
        index += size if index < 0 else 0
        return index, index + 1
    if int(bound.get("step", 1)) != 1:
        return Miss(f"step={bound['step']}: a strided slice write interleaves kept and new rows")
    start, end = bound.get("start"), bound.get("end")
    start = 0 if start is None else int(start) + (size if int(start) < 0 else 0)
    end = size if end is None else int(end) + (size if int(end) < 0 else 0)
    return max(0, min(start, size)), max(0, min(end, size))


def _scatter_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    for key in ("start", "end", "index"):
        if isinstance(args.get(key), Node):
            return Miss(f"{key} is a graph value; ttnn.slice takes constants")
    found = tensors_ok("self", "src", static=True)(node, args)
    if isinstance(found, Miss):
        return found
    shape = static(args["self"].meta["val"])
    window = _window(args, shape[int(args.get("dim", 0)) % len(shape)])
    return window if isinstance(window, Miss) else (args, window)


def _lower_scatter(node: Node, rw: Rewriter, *, found: tuple[Bound, tuple[int, int]]) -> Node:
    bound, (start, end) = found
    shape = static(bound["self"].meta["val"])
    dim = int(bound.get("dim", 0)) % len(shape)
    x, src = device_value(rw, bound["self"]), device_value(rw, bound["src"])
    if "index" in bound:  # select_scatter: src lacks `dim`
        src = rw.call(ops.reshape, src, [*shape[:dim], 1, *shape[dim + 1 :]])
    pieces = []
    for lo, hi in ((0, start), (end, shape[dim])):
        if hi > lo:
            starts, ends = [0] * len(shape), list(shape)
            starts[dim], ends[dim] = lo, hi
            pieces.append(rw.call(ops.slice_, x, starts, ends, [1] * len(shape)))
    if start < end:
        pieces.insert(1 if start > 0 else 0, src)
    return pieces[0] if len(pieces) == 1 else rw.call(ops.concat, pieces, dim)


lower_slice_scatter = lowering(
    "ttnn_slice_scatter",
    [aten.slice_scatter.default, aten.select_scatter.default],
    _scatter_when,
    "slice_scatter / select_scatter -> ttnn.concat of ttnn.slice(x) before, src, ttnn.slice(x) after.",
)(_lower_scatter)

RULES = RuleSet([lower_slice_scatter], name="ttnn_scatter")
