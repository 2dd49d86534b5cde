"""Statically empty tensors reshaped or sorted: iree-compile 3.13 crashes on them.

`x.view(0, 32)` of an x of shape [0, 24, 32] (what dynamo specialises for an
empty adapter batch) crashes iree-compile with no diagnostic, alone or read
by anything; element-wise ops on the same empty tensor compile. An empty
tensor holds no values, so the reshape is a fresh empty tensor of the new
shape (`aten.zeros`), which IREE compiles. A sort of an empty tensor whose
indices are unused (`x[:, :0].sort(1)[0]`) crashes iree-compile the same way
(with the indices used, and argsort, it compiles); its values are an empty
tensor of their shape too.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: the reshapes of torch.export and aot graphs (their size argument may hold a -1)
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.view_copy.default)


def _statically_empty(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and any(isinstance(s, int) and s == 0 for s in value.shape)


def _empty_reshape(node: Node) -> bool | Miss:
    source, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not _statically_empty(source):
        return Miss("the input is not statically empty")
    if not all(isinstance(s, int) for s in out.shape):
        return Miss("the result has a symbolic size")
    return True


@rule(
    roots=RESHAPES,
    when=_empty_reshape,
    tags={"iree", "guard"},
    doc=(
        "A view or reshape of a statically empty tensor (`x.view(0, 32)` of a [0, 24, 32] x, an empty adapter "
        "batch) becomes aten.zeros of the new shape: an empty tensor holds no values. iree-compile 3.13 "
        "crashes on the reshape with no diagnostic."
    ),
)
def empty_reshape_as_fresh_for_iree(node: Node, rw: Rewriter) -> Any:
    out = node.meta["val"]
    rw.replace(node, rw.call(aten.zeros.default, list(out.shape), dtype=out.dtype, device=out.device))


#: the sort IREE lowers (legalize decomposes sort.stable)
SORTS = (aten.sort.default,)


def _empty_sort(node: Node) -> bool | Miss:
    if not _statically_empty(node.args[0].meta.get("val")):
        return Miss("the input is not statically empty")
    if any(user.target is operator.getitem and user.args[1] == 1 and user.users for user in node.users):
        return Miss("its indices are used (IREE compiles that form)")
    return True


@rule(
    roots=SORTS,
    when=_empty_sort,
    tags={"iree", "guard"},
    doc=(
        "A sort of a statically empty tensor, its indices unused (`x[:, :0].sort(1)[0]`), becomes aten.zeros of "
        "each result's shape and dtype: there is nothing to sort. iree-compile 3.13 crashes on it with no "
        "diagnostic (with the indices used it compiles)."
    ),
)
def empty_sort_as_fresh_for_iree(node: Node, rw: Rewriter) -> Any:
    x = node.args[0]
    sizes = [rw.size(x, d) for d in range(x.meta["val"].dim())]
    outputs = node.meta["val"]
    fresh = [
        rw.call(aten.zeros.default, sizes, dtype=v.dtype, device=v.device)
        for v in (outputs if isinstance(outputs, (list, tuple)) else (outputs,))
    ]
    rw.replace(node, fresh if isinstance(outputs, (list, tuple)) else fresh[0])


RULES = RuleSet([empty_reshape_as_fresh_for_iree, empty_sort_as_fresh_for_iree], name="iree-empty")
