"""`where(c, a, a)` with `a` broadcast against `c`: an expand of `a`, which IREE 3.13 compiles.

torch-mlir folds `aten.where.self(c, a, a)` to `a` itself, at `a`'s own shape: where `c` broadcasts `a` to a larger
shape ([1, 4, 1, 1] against [2, 4, 3, 3]) the function then returns a tensor of the wrong type and iree-compile fails
("type of return operand ... doesn't match function result type"). The value is `a` broadcast to the result's shape
whatever `c` holds, so the rule writes that expand; at `a`'s own shape the fold is right and the rule leaves it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


def _same(a: Any, b: Any) -> bool:
    return statically_known_true(a == b)


def _sources(a: torch.Tensor, c: torch.Tensor, out: torch.Tensor) -> list[tuple[str, int]] | None:
    """Where each of the result's sizes is read: ("a", j) (a's own) or ("c", k); None where one is in neither."""
    found = []
    for i, size in enumerate(out.shape):
        j, k = i - (out.dim() - a.dim()), i - (out.dim() - c.dim())
        if j >= 0 and _same(a.shape[j], size):
            found.append(("a", j))
        elif k >= 0 and _same(c.shape[k], size):
            found.append(("c", k))
        else:
            return None
    return found


def _one_value_broadcast(node: Node, *, args: Mapping[str, Any]) -> bool | Miss:
    value, other, cond = args["self"], args["other"], args["condition"]
    if value is not other or not isinstance(value, Node) or not isinstance(cond, Node):
        return Miss("the two branches are different values")
    a, c, out = (n.meta.get("val") for n in (value, cond, node))
    if not all(isinstance(t, torch.Tensor) for t in (a, c, out)):
        return Miss("no tensor value on the branch, the condition or the result")
    if a.dim() == out.dim() and all(_same(x, y) for x, y in zip(a.shape, out.shape, strict=True)):
        return Miss(f"the branch has the result's shape {tuple(out.shape)} (torch-mlir's fold is right there)")
    if _sources(a, c, out) is None:
        return Miss(f"a result size of {tuple(out.shape)} not known to be the branch's or the condition's")
    return True


@rule(
    roots=(aten.where.self,),
    when=_one_value_broadcast,
    tags={"iree"},
    doc=(
        "aten.where.self(c, a, a), a broadcast by c to a larger shape, becomes aten.expand(a, the result's "
        "shape): the same values whatever c holds. IREE 3.13 (torch-mlir) folds the where to a at a's own shape "
        'and fails: "type of return operand ... doesn\'t match function result type".'
    ),
)
def where_of_one_value_as_expand_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    value, cond = args["self"], args["condition"]
    a, c, out = value.meta["val"], cond.meta["val"], node.meta["val"]
    # -1: a's own size; the condition's read from it (a Dim stays symbolic)
    sizes = [-1 if of == "a" else rw.size(cond, dim) for of, dim in _sources(a, c, out) or []]
    expanded = rw.call(aten.expand.default, value, sizes)
    if expanded.meta["val"].dtype != out.dtype:
        expanded = rw.call(aten._to_copy.default, expanded, dtype=out.dtype)
    rw.replace(node, expanded)


RULES = RuleSet([where_of_one_value_as_expand_for_iree], name="iree-one-value-where")
