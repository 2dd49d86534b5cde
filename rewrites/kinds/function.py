"""The escape hatch: a rule written as a Python function.

The body is `fn(node, rw)`, or `fn(node, rw, found)` to receive what the
rule's `when` returned when that was more than a yes (a tuple of the parts
it took apart, a plan): the body then does not compute it again. A body (and
a `when`) that declares a keyword parameter `args` receives the node's
arguments by schema name (`schema.arguments`), never bound by hand:

    @rule(roots=(aten.pad.default,), when=lambda node, args: args.get("mode") == "reflect")
    def reflect_pad(node, rw, *, args): ...
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


def _takes_found(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes a third positional parameter (what `when` found)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != ARGS]
    if len(positional) not in (2, 3):
        raise TypeError(f"a rule body takes (node, rw) or (node, rw, found), not {inspect.signature(fn)}")
    return len(positional) == 3


@attrs.frozen(kw_only=True)
class FunctionRule(RuleBase):
    """`fn(node, rw)` rewrites `node` through `rw`, or returns a Miss.

    `fn(node, rw, found)` also receives what `when(node)` returned (True when
    there is no `when`).
    """

    fn: Body = attrs.field(validator=attrs.validators.is_callable())
    ops: tuple[Any, ...] = attrs.field(converter=as_tuple)
    takes_found: bool = attrs.field(init=False, default=False, repr=False)
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
        if self.takes_found:
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
    """Decorator: `@rule(roots=(aten.pow.Tensor_Scalar,))` over `fn(node, rw)`
    or `fn(node, rw, found)` (`found`: what `when` returned).

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
