"""Ops whose schema says "view" but that copy when they must.

`aten.contiguous(Tensor(a) self) -> Tensor(a)` promises an alias of its
input, yet it returns a fresh tensor whenever the input is not contiguous
(BEiT's `relative_coords = (...).permute(1, 2, 0).contiguous()`, written
into afterwards with `relative_coords[:, :, 0] += 3`). Rules that follow
view chains have to tell the two apart (the in-place pack once declined:
"contiguous is a aten.contiguous.default view, which this rule cannot write
back through"; it now replays the chain under torch's functionalization,
which reads the same strides).

The node's fake value says which case it is: `contiguous_view_or_copy`
turns a copying contiguous into `aten.clone(x, memory_format=...)` and an
aliasing one into `x` itself, where an in-place op writes into it (directly
or through views); other contiguous nodes are left as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


def _is_contiguous(node: Node) -> bool | Miss:
    """Whether `contiguous(x)` returns `x` itself, from x's fake value (a Miss when it depends on sizes)."""
    x = node.args[0]
    val = fake_value(x)
    if not isinstance(val, torch.Tensor):
        return Miss("the input has no tensor value")
    memory_format = node.kwargs.get("memory_format", torch.contiguous_format)
    try:
        return bool(val.is_contiguous(memory_format=memory_format))
    except Exception as e:  # a symbolic stride that would need a guard
        return Miss(f"whether {x.name} is contiguous depends on its sizes ({type(e).__name__})")


def _written_through(node: Node) -> bool | Miss:
    """An in-place op writes into `node`'s value, directly or through views of it."""
    todo, seen = list(node.users), set()
    while todo:
        user = todo.pop()
        if user in seen or not isinstance(user.target, torch._ops.OpOverload):
            continue
        seen.add(user)
        if user.target._schema.is_mutable:
            return True
        if user.target.is_view:
            todo.extend(user.users)
    return Miss("nothing writes into it in place; left as it is")


@rule(
    roots=(aten.contiguous.default,),
    when=_written_through,
    tags={"views"},
    doc=(
        "aten.contiguous is a copy (aten.clone) when its input is not contiguous and the input itself "
        "when it is; as a 'view' it stops the in-place rule: \"contiguous is a aten.contiguous.default "
        "view, which this rule cannot write back through\" (BEiT's relative position index)."
    ),
)
def contiguous_view_or_copy(node: Node, rw: Rewriter) -> Any:
    aliases = _is_contiguous(node)
    if isinstance(aliases, Miss):
        return aliases
    if aliases:
        rw.replace(node, node.args[0])
    else:
        memory_format = node.kwargs.get("memory_format", torch.contiguous_format)
        rw.replace(node, rw.call(aten.clone.default, node.args[0], memory_format=memory_format))
    return None


RULES = RuleSet([contiguous_view_or_copy], name="view_or_copy")
