"""Argument forms IREE 3.13 cannot take, written as the same op in a form it takes.

- `torch.topk(x, k, sorted=False)` (MoE routers): IREE lowers topk only sorted; the importer leaves
  the `sorted=False` flag as a `torch.constant.bool` it cannot legalize. Unsorted means any order,
  so the sorted result is one torch allows.
- `x.scatter(-1, index, value)` (a hard Gumbel one-hot: `zeros_like(x).scatter(-1, argmax, 1.0)`):
  iree-compile crashes with no diagnostic on a negative scatter dim; the same dim counted from the
  front compiles and matches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


def _unsorted(node: Node, args: Mapping[str, Any]) -> bool | Miss:
    return args.get("sorted", True) is False or Miss("sorted=True (IREE lowers it)")


@rule(
    roots=(aten.topk.default,),
    when=_unsorted,
    tags={"iree"},
    doc=(
        "torch.topk(x, k, sorted=False) (MoE routers) becomes topk with sorted=True: unsorted allows any "
        "order, sorted is one of them. IREE 3.13: \"failed to legalize operation 'torch.constant.bool'\" "
        "(the sorted flag of aten.topk)."
    ),
)
def topk_unsorted_as_sorted_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    rw.modify(node, *schema.unbind(node.target, {**args, "sorted": True}, explicit=False))


#: the scatters whose `dim` IREE 3.13 crashes on when negative
SCATTERS = (
    aten.scatter.src,
    aten.scatter.value,
    aten.scatter.reduce,
    aten.scatter.value_reduce,
    aten.scatter_add.default,
    aten.scatter_reduce.two,
)


def _negative_dim(node: Node, args: Mapping[str, Any]) -> bool | Miss:
    dim = args["dim"]
    return (isinstance(dim, int) and dim < 0) or Miss(f"dim {dim} is not negative")


@rule(
    roots=SCATTERS,
    when=_negative_dim,
    tags={"iree"},
    doc=(
        "A scatter along a negative dim (`zeros_like(x).scatter(-1, x.argmax(-1, keepdim=True), 1.0)`, a "
        "hard one-hot) gets the same dim counted from the front. iree-compile 3.13 crashes on it with no "
        "diagnostic (a segfault in-process); the positive dim compiles and matches."
    ),
)
def scatter_negative_dim_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    dim = args["dim"] + node.meta["val"].dim()
    rw.modify(node, *schema.unbind(node.target, {**args, "dim": dim}, explicit=False))


RULES = RuleSet([topk_unsorted_as_sorted_for_iree, scatter_negative_dim_for_iree], name="iree-arguments")
