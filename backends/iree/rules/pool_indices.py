"""A max pooling whose indices nothing reads, without them (the torch.compile route's form).

aot_autograd hands the torch.compile route `max_pool2d_with_indices(x, ...)[0]` where export gives
`max_pool2d(x, ...)`: IREE 3.13 computes and stores the indices it is not asked for (a `linalg.generic` with two
results). ResNet's stem pooling (64 channels, 112x112 -> 56x56, AVX2 `znver3`, one thread) ran 2.24 ms with them
against 1.67 ms without (docs/performance.md, "A second host, both ISAs; the torch.compile route's convolutions as
the export route's").
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

#: a pooling with indices -> the same pooling without them (the same arguments)
_WITHOUT = {
    aten.max_pool1d_with_indices.default: aten.max_pool1d.default,
    aten.max_pool2d_with_indices.default: aten.max_pool2d.default,
    aten.max_pool3d_with_indices.default: aten.max_pool3d.default,
}


def _values_only(node: Node) -> bool | Miss:
    """Every user a getitem of the values, or of the indices read by nothing (export leaves that one)."""
    if not node.users:
        return Miss("nothing reads the pooling")
    for user in node.users:
        if user.target is not operator.getitem or (user.args[1] != 0 and user.users):
            return Miss(f"{user.name} reads the indices (or the tuple)")
    return True


@rule(
    roots=tuple(_WITHOUT),
    when=_values_only,
    tags={"iree", "performance"},
    doc=(
        "max_pool{1,2,3}d_with_indices whose indices nothing reads (what aot_autograd gives the torch.compile "
        "route) becomes max_pool{1,2,3}d, as export gives it: IREE 3.13 computes and stores the indices otherwise "
        "(ResNet's stem pooling 2.24 ms against 1.67 ms on AVX2)."
    ),
)
def max_pool_without_unread_indices(node: Node, rw: Rewriter) -> Any:
    pooled = rw.call(_WITHOUT[node.target], *node.args, **node.kwargs)
    for user in list(node.users):
        if user.args[1] == 0:
            rw.replace(user, pooled)
        else:  # the indices' getitem, read by nothing
            rw.erase(user)


RULES = RuleSet([max_pool_without_unread_indices], name="iree-pool-indices")
