"""Rule kinds driven by the op schema: FillDefaults, Substitute, Forward."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import attrs
from torch._ops import OpOverload
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds.base import RuleBase, as_tuple


@attrs.frozen
class FromArg:
    """A value taken from another argument of the same node, by name."""

    name: str


def from_arg(name: str) -> FromArg:
    """`fill={"stride": from_arg("kernel_size")}`: copy another argument."""
    return FromArg(name)


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, (list, tuple)) and len(value) == 0)


def _resolve(value: Any, bound: Mapping[str, Any]) -> Any:
    if isinstance(value, FromArg):
        return bound[value.name]
    if callable(value):
        return value(bound)
    return value


@attrs.frozen(kw_only=True)
class FillDefaults(RuleBase):
    """Spell out an op's arguments and fill the ones left unset.

    `fill` maps an argument name to its value when the node leaves it
    absent, None or `[]`: a constant, `from_arg("other")`, or a function of
    the bound arguments. With `explicit` (the default) every defaulted
    argument is written out, and one-element lists of an `int[N]` argument
    are widened to N, so importers that index these lists see all of them.
    """

    ops: tuple[Any, ...] = attrs.field(converter=as_tuple)
    fill: Mapping[str, Any] = attrs.field(factory=dict)
    explicit: bool = True

    def _build(self) -> tuple[Hashable, ...]:
        self._set("ops", schema.resolve_ops(self.ops))
        for op in self.ops:
            schema.require_args(op, self.fill, who="fill")
            for value in self.fill.values():
                if isinstance(value, FromArg):
                    schema.require_args(op, [value.name], who="from_arg")
        return self.ops

    def _default_name(self) -> str:
        return f"fill_defaults_{self.ops[0]._opname}"

    def _match(self, node: Node) -> Any:
        op: OpOverload = node.target  # type: ignore[assignment]
        bound = schema.bind(op, node.args, dict(node.kwargs))
        for name, value in self.fill.items():
            if _unset(bound.get(name)):
                bound[name] = _resolve(value, bound)
        if self.explicit:
            for a in op._schema.arguments:
                n = getattr(a, "N", None)
                v = bound.get(a.name)
                if n and n > 1 and isinstance(v, (list, tuple)) and len(v) == 1:
                    bound[a.name] = list(v) * n
        args, kwargs = schema.unbind(op, bound, explicit=self.explicit)
        if args == tuple(node.args) and kwargs == dict(node.kwargs):
            return Miss("every argument is already explicit and set")
        return args, kwargs

    def rewrite(self, node: Node, match: Any, rw: Rewriter) -> None:
        args, kwargs = match
        rw.replace(node, rw.call(node.target, *args, **kwargs))


@attrs.frozen(kw_only=True)
class Substitute(RuleBase):
    """Replace `op` by `to`, passing arguments on by name.

    `args` gives `to`'s arguments that `op` lacks (or renames): a constant,
    `from_arg("name_in_op")`, or a function of `op`'s bound arguments.
    """

    op: Any = attrs.field()
    to: Any = attrs.field()
    args: Mapping[str, Any] = attrs.field(factory=dict)

    def _build(self) -> tuple[Hashable, ...]:
        sources = schema.resolve_op(self.op)
        targets = schema.resolve_op(self.to)
        if len(targets) != 1 or not isinstance(targets[0], OpOverload):
            raise ValueError(f"to={self.to!r} must name one overload, e.g. torch.ops.aten.clone.default")
        to = targets[0]
        self._set("to", to)
        schema.require_args(to, self.args, who="args")
        for src in sources:
            have = schema.arg_names(src)
            for a in to._schema.arguments:
                if a.name in self.args or a.has_default_value() or a.name in have:
                    continue
                raise ValueError(
                    f"{schema.op_name(to)} needs {a.name!r}, which {schema.op_name(src)} lacks; map it in args="
                )
            for value in self.args.values():
                if isinstance(value, FromArg):
                    schema.require_args(src, [value.name], who="from_arg")
        return tuple(sources)

    def _default_name(self) -> str:
        return f"substitute_{self.roots[0]._opname}_to_{self.to._opname}"

    def rewrite(self, node: Node, match: Any, rw: Rewriter) -> None:
        bound = schema.arguments(node)
        wanted = set(schema.arg_names(self.to))
        named = {k: v for k, v in bound.items() if k in wanted}
        named.update({k: _resolve(v, bound) for k, v in self.args.items()})
        args, kwargs = schema.unbind(self.to, named, explicit=False)
        rw.replace(node, rw.call(self.to, *args, **kwargs))


@attrs.frozen(kw_only=True)
class Forward(RuleBase):
    """Drop identity-like ops: users of the node read `arg` instead.

    Ops that return nothing (`aten._assert_tensor_metadata`,
    `torch._C._set_grad_enabled`) are simply removed.
    """

    ops: tuple[Any, ...] = attrs.field(converter=as_tuple)
    arg: str | int = 0

    def _build(self) -> tuple[Hashable, ...]:
        self._set("ops", schema.resolve_ops(self.ops))
        for op in self.ops:
            if isinstance(op, OpOverload) and op._schema.returns:
                if isinstance(self.arg, str):
                    schema.require_args(op, [self.arg], who="arg")
                elif self.arg >= len(op._schema.arguments):
                    raise ValueError(f"{schema.op_name(op)} has no argument {self.arg}")
        return self.ops

    def _default_name(self) -> str:
        return f"forward_{getattr(self.ops[0], '_opname', getattr(self.ops[0], '__name__', 'op'))}"

    def rewrite(self, node: Node, match: Any, rw: Rewriter) -> Any:
        op = node.target
        returns_nothing = isinstance(op, OpOverload) and not op._schema.returns
        if returns_nothing or (not isinstance(op, OpOverload) and not node.users):
            rw.erase(node)
            return None
        if isinstance(self.arg, str):
            source = schema.bind(op, node.args, dict(node.kwargs)).get(self.arg)
        else:
            source = node.args[self.arg] if self.arg < len(node.args) else None
        if not isinstance(source, Node):
            return Miss(f"argument {self.arg!r} is not a graph value")
        rw.replace(node, source)
        return None
