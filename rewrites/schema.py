"""Operator lookup and argument binding through ATen schemas.

`torch.fx.operator_schemas.normalize_function` renames `self` to `input`
and builds an `inspect.Signature` on every call; rules need the schema's own
names and run on every candidate node, so binding is done here directly
from `OpOverload._schema`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.fx import Node
from torch.utils import _pytree as pytree

_MISSING = object()


class SchemaError(ValueError):
    """An op or argument a rule names does not exist."""


def resolve_op(op: Any) -> list[Any]:
    """The node targets an op spec stands for.

    Accepts an OpOverload, an OpOverloadPacket (every overload), a string
    "aten.max_pool2d.default" / "aten::max_pool2d" / "aten.max_pool2d", or
    any other callable (operator.getitem, a higher-order op) as itself.
    """
    if isinstance(op, OpOverload):
        return [op]
    if isinstance(op, OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    if isinstance(op, str):
        return resolve_op(_lookup(op))
    if callable(op):
        return [op]
    raise SchemaError(f"{op!r} is not an op: give an OpOverload such as torch.ops.aten.relu.default")


def resolve_ops(ops: Iterable[Any]) -> tuple[Any, ...]:
    out: list[Any] = []
    for op in ops:
        out.extend(t for t in resolve_op(op) if t not in out)
    return tuple(out)


def _lookup(text: str) -> Any:
    parts = text.replace("::", ".").split(".")
    if len(parts) not in (2, 3):
        raise SchemaError(f"cannot read op name {text!r}; write it as 'aten.max_pool2d.default'")
    try:
        obj: Any = getattr(torch.ops, parts[0])
        for part in parts[1:]:
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError):
        raise SchemaError(f"there is no op {text!r} in torch.ops") from None
    return obj


def op_name(target: Any) -> str:
    """Readable name of a node target ("aten.max_pool2d.default")."""
    if isinstance(target, (OpOverload, OpOverloadPacket)):
        return str(target)
    return getattr(target, "__name__", repr(target))


def schema(op: Any) -> torch.FunctionSchema:
    if not isinstance(op, OpOverload):
        raise SchemaError(f"{op_name(op)} has no ATen schema; name an OpOverload")
    return op._schema


def arg_names(op: Any) -> list[str]:
    return [a.name for a in schema(op).arguments]


def require_args(op: Any, names: Iterable[str], *, who: str) -> None:
    """Raise SchemaError naming `who` if `op` lacks any argument in `names`."""
    have = arg_names(op)
    for name in names:
        if name not in have:
            raise SchemaError(f"{who}: {op_name(op)} has no argument {name!r} (it has {have})")


def bind(op: OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments given to `op` by name; absent ones are left out."""
    bound: dict[str, Any] = {}
    for a, value in zip(schema(op).arguments, args):
        bound[a.name] = value
    bound.update(kwargs)
    return bound


def arguments(node: Node) -> Mapping[str, Any]:
    """`node`'s arguments by schema name (read-only; absent ones left out, as `bind` does): what a rule's
    `when` and body receive as `args` when they declare it."""
    return MappingProxyType(bind(node.target, node.args, dict(node.kwargs)))


def default(arg: torch.Argument) -> Any:
    """An argument's default as a node would spell it (int[2] 0 -> [0, 0])."""
    value = arg.default_value
    n = getattr(arg, "N", None)
    if n and isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value] * n
    return value


def unbind(op: OpOverload, named: dict[str, Any], *, explicit: bool) -> tuple[tuple, dict]:
    """(args, kwargs) for `op` from arguments by name: positional where the
    schema allows, keyword for kwarg-only ones. With `explicit`, every
    argument with a default is spelt out; otherwise trailing ones are left
    to their defaults."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    pending: list[Any] = []  # defaults held back until a given argument follows
    for a in schema(op).arguments:
        value = named.get(a.name, _MISSING)
        if value is _MISSING:
            if not a.has_default_value():
                raise SchemaError(f"{op_name(op)} needs argument {a.name!r}")
            if not explicit:
                if not a.kwarg_only:
                    pending.append(default(a))
                continue
            value = default(a)
        if a.kwarg_only:
            kwargs[a.name] = value
        else:
            args.extend(pending)
            pending.clear()
            args.append(value)
    return tuple(args), kwargs


def _plain(value: Any) -> Any:
    """`value` with fx's immutable lists and dicts made plain ones (a decomposition may write into its lists:
    `_unsafe_masked_index_put_accumulate`'s appends to its indices)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def over_graph_values(node: Node, fn: Callable[..., Any]) -> tuple[Callable[..., Any], list[Node]]:
    """`fn` called with `node`'s arguments as a function of the graph values among them (the rest fixed as
    the node has them), and those graph values in order: what make_fx traces to decompose one node."""
    leaves, spec = pytree.tree_flatten((_plain(node.args), _plain(dict(node.kwargs))))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Node)]

    def body(*vals: Any) -> Any:
        filled = list(leaves)
        for i, v in zip(where, vals):
            filled[i] = v
        args, kwargs = pytree.tree_unflatten(filled, spec)
        return fn(*args, **kwargs)

    return body, [leaves[i] for i in where]
