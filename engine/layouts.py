"""Strides after a replacement: a view the new layout no longer allows becomes a reshape.

torch writes `reshape` as `aten.view` where the traced value's strides allow a view (`run_decompositions`
does it for every reshape; user code's `.view` and a `.contiguous()` traced away on an already contiguous
value leave the same). A rule that replaces a node by the same values laid out otherwise breaks such a view
downstream on torch eager ("view size is not compatible with input tensor's size and stride"), though not
on value-semantics backends (IREE): CPU `scaled_dot_product_attention` returns [b, h, s, d] laid out as
[b, s, h, d], so `sdpa.transpose(1, 2).view(b, s, h * d)` is a view; written out as matmuls, the output is
contiguous and that view fails. `follow` recomputes the fake values downstream of the replaced ones as far
as their strides change, and turns each `view` that no longer holds into `aten.reshape` (the same values
in a functional graph: a view where the strides allow one, a copy where not). A view an op writes through
(a graph not functionalized) stays: as a copy the write would be lost, a wrong number where torch names it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node
from torch.utils import _pytree as pytree

from fx_rewrites.engine import values

aten = torch.ops.aten

#: views whose sizes need strides that allow them; each becomes `aten.reshape` where they do not
STRICT_VIEWS = (aten.view.default, aten._unsafe_view.default)


def _layout(val: Any) -> Any:
    """The strides of each tensor in `val` (symbolic ones by their expressions)."""
    if isinstance(val, torch.Tensor):
        return values._sym_key(val.stride())
    if isinstance(val, (tuple, list)):
        return tuple(_layout(v) for v in val)
    return None


def follow(fake_mode: Any, relaid: dict[Node, Any], provenance: Any = None) -> list[Node]:
    """`relaid`: replacement nodes -> their values, where those strides differ from the values their users
    were traced against. Walks the graph forward from them, re-evaluating each user of a value whose strides
    changed; a strict view that fails on the new strides becomes `aten.reshape`, unless an op writes through
    it. Updates `meta["val"]` of the nodes whose strides changed; a retargeted view records `provenance` (the
    rule that relaid its input) in `meta["rewrites"]`. Returns the views it retargeted."""
    if not relaid:
        return []
    fresh = dict(relaid)
    pending = {u for n in fresh for u in n.users}
    retargeted: list[Node] = []
    node = min(fresh)  # fx nodes order as in their graph
    while pending and node.op != "output":
        node = node.next
        if node not in pending:
            continue
        pending.discard(node)
        if node.op != "call_function" or "unbacked_bindings" in node.meta:
            continue  # re-evaluating would make new unbacked symbols: leave its value as it was
        val = _evaluate(fake_mode, node, fresh)
        if val is None and node.target in STRICT_VIEWS and not _written_through(node):
            node.target = aten.reshape.default
            if provenance is not None:
                node.meta["rewrites"] = (*node.meta.get("rewrites", ()), provenance)
            retargeted.append(node)
            val = _evaluate(fake_mode, node, fresh)
        old = node.meta.get("val")
        if val is None or _layout(val) == _layout(old):
            continue  # the layout is back to what the users saw: nothing further changes
        node.meta["val"] = values.users_view(old, val)
        fresh[node] = val
        pending.update(node.users)
    return retargeted


def _written_through(view: Node) -> bool:
    """Whether an op writes into `view` (or a view of it): a reshape that copies would lose that write, so the
    view stays and fails on torch, as a program that cannot run there should."""
    todo, seen = [view], set()
    while todo:
        for user in todo.pop().users:
            schema = getattr(user.target, "_schema", None)
            if user in seen or schema is None:
                continue
            seen.add(user)
            if schema.is_mutable:
                return True
            if any(r.alias_info is not None for r in schema.returns):
                todo.append(user)
    return False


def _evaluate(fake_mode: Any, node: Node, fresh: dict[Node, Any]) -> Any:
    """`node`'s value on the recomputed values of its inputs; None when it fails."""

    def value(n: Node) -> Any:
        return fresh.get(n, n)

    args, kwargs = pytree.tree_map_only(Node, value, (node.args, node.kwargs))
    try:
        return values.evaluate(fake_mode, node.target, args, kwargs)
    except Exception:  # a view the strides do not allow, or an op that cannot run on fake values here
        return None


def changed(seen: Any, new: Any) -> bool:
    """Whether `new` (a tensor) is laid out otherwise than `seen`, the value its users were traced against."""
    return isinstance(seen, torch.Tensor) and isinstance(new, torch.Tensor) and _layout(seen) != _layout(new)
