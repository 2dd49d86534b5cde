"""Statically empty tensors reshaped: iree-compile 3.13 crashes on them.

`x.view(0, 32)` of an x of shape [0, 24, 32] (what dynamo specialises for an
empty adapter batch) crashes iree-compile with no diagnostic, alone or read
by anything; element-wise ops on the same empty tensor compile. An empty
tensor holds no values, so the reshape is a fresh empty tensor of the new
shape (`aten.zeros`), which IREE compiles.
"""

from __future__ import annotations

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


RULES = RuleSet([empty_reshape_as_fresh_for_iree], name="iree-empty")
