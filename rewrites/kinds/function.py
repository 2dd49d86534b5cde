"""The escape hatch: a rule written as a Python function."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

import attrs
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Rewriter
from fx_rewrites.kinds.base import RuleBase, as_tuple


@attrs.frozen(kw_only=True)
class FunctionRule(RuleBase):
    """`fn(node, rw)` rewrites `node` through `rw`, or returns a Miss."""

    fn: Callable[[Node, Rewriter], Any] = attrs.field(validator=attrs.validators.is_callable())
    ops: tuple[Any, ...] = attrs.field(converter=as_tuple)

    def _build(self) -> tuple[Hashable, ...]:
        ops = schema.resolve_ops(self.ops)
        self._set("ops", ops)
        return ops

    def _default_name(self) -> str:
        return getattr(self.fn, "__name__", "function_rule")

    def rewrite(self, node: Node, match: Any, rw: Rewriter) -> Any:
        return self.fn(node, rw)


def rule(
    *,
    roots: Iterable[Any],
    name: str = "",
    priority: int = 0,
    when: Callable[[Node], Any] | None = None,
    doc: str = "",
    tags: Iterable[str] = (),
) -> Callable[[Callable[[Node, Rewriter], Any]], FunctionRule]:
    """Decorator: `@rule(roots=(aten.pow.Tensor_Scalar,))` over `fn(node, rw)`.

    The function's name and docstring are the rule's name and doc unless
    given.
    """

    def wrap(fn: Callable[[Node, Rewriter], Any]) -> FunctionRule:
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
