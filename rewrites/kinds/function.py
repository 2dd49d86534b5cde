"""The escape hatch: a rule written as a Python function.

The body is `fn(node, rw, *, args, found)`, each keyword declared only when used: `found` is what the
rule's `when` returned when that was more than a yes (a tuple of the parts it took apart, a plan), so the
body does not compute it again; `args` is the node's arguments by schema name (`schema.arguments`), never
bound by hand. A `when` that declares `args` receives them too:

    def reflect(node, *, args):
        return args.get("mode") == "reflect" or Miss(f"mode {args.get('mode')!r}")

    @rule(roots=(aten.pad.default,), when=reflect)
    def reflect_pad(node, rw, *, args): ...

(`fn(node, rw, found)`, with `found` positional, is the older spelling of the same.)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import attrs
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Rewriter
from fx_rewrites.kinds.base import ARGS, RuleBase, as_tuple, takes_args

Body = Callable[[Node, Rewriter], Any] | Callable[[Node, Rewriter, Any], Any]


FOUND = "found"


def _takes_found(fn: Callable[..., Any]) -> str:
    """How `fn` takes what `when` found: "keyword" (`*, found`), "positional" (a third positional parameter)
    or "" (not at all)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return ""
    if any(p.kind is p.KEYWORD_ONLY and p.name == FOUND for p in params):
        return "keyword"
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return "positional"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != ARGS]
    if len(positional) not in (2, 3):
        raise TypeError(f"a rule body takes (node, rw, *, args, found), not {inspect.signature(fn)}")
    return "positional" if len(positional) == 3 else ""


@attrs.frozen(kw_only=True)
class FunctionRule(RuleBase):
    """`fn(node, rw, *, args, found)` rewrites `node` through `rw`, or returns a Miss.

    `found` (declared only when used) is what `when(node)` returned (True when there is no `when`); `args`
    the node's arguments by schema name.
    """

    fn: Body = attrs.field(validator=attrs.validators.is_callable())
    ops: tuple[Any, ...] = attrs.field(converter=as_tuple)
    takes_found: str = attrs.field(init=False, default="", repr=False)
    takes_args: bool = attrs.field(init=False, default=False, repr=False)

    def _build(self) -> tuple[Hashable, ...]:
        ops = schema.resolve_ops(self.ops)
        self._set("ops", ops)
        self._set("takes_found", _takes_found(self.fn))
        self._set("takes_args", takes_args(self.fn))
        return ops

    def _default_name(self) -> str:
        return getattr(self.fn, "__name__", "function_rule")

    def match(self, node: Node) -> Any:
        return self._when(node)

    def rewrite(self, node: Node, match: Any, rw: Rewriter) -> Any:
        extra = {ARGS: schema.arguments(node)} if self.takes_args else {}
        if self.takes_found == "keyword":
            extra[FOUND] = match
        elif self.takes_found == "positional":
            return self.fn(node, rw, match, **extra)  # type: ignore[call-arg]
        return self.fn(node, rw, **extra)  # type: ignore[call-arg]


def rule(
    *,
    roots: Iterable[Any],
    name: str = "",
    priority: int = 0,
    when: Callable[[Node], Any] | None = None,
    doc: str = "",
    tags: Iterable[str] = (),
) -> Callable[[Body], FunctionRule]:
    """Decorator: `@rule(roots=(aten.pow.Tensor_Scalar,), when=...)` over `fn(node, rw, *, args, found)`
    (each keyword declared only when used; `found`: what `when` returned).

    The function's name and docstring are the rule's name and doc unless
    given.
    """

    def wrap(fn: Body) -> FunctionRule:
        return FunctionRule(
            fn=fn,
            ops=tuple(roots),
            name=name or fn.__name__,
            priority=priority,
            when=when,
            doc=doc or (fn.__doc__ or "").strip(),
            tags=frozenset(tags),
        )

    return wrap
