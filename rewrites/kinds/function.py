"""The escape hatch: a rule written as a Python function.

The body is `fn(node, rw, *, args, found)`, each keyword declared only when used: `found` is what the
rule's `when` returned when that was more than a yes (a tuple of the parts it took apart, a plan), so the
body does not compute it again; `args` is the node's arguments by schema name (`schema.arguments`), never
bound by hand. A `when` that declares `args` receives them too:

    def reflect(node, *, args):
        return args.get("mode") == "reflect" or Miss(f"mode {args.get('mode')!r}")

    @rule(roots=(aten.pad.default,), when=reflect)
    def reflect_pad(node, rw, *, args): ...

A body that takes `found` as a third positional parameter (the spelling before issue 36) is refused when the
rule is built, with the fix.
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

Body = Callable[..., Any]  # fn(node, rw, *, args, found)


FOUND = "found"


def _takes_found(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes what `when` found (keyword-only `found`); TypeError for any other signature than
    `(node, rw, *, args, found)` (each keyword optional)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    extra = [p for p in params if p.kind is p.VAR_POSITIONAL] + positional[2:]
    if len(positional) < 2 or extra:
        third = f" (its third parameter {extra[0].name!r} is positional)" if extra else ""
        raise TypeError(
            f"a rule body is def {getattr(fn, '__name__', 'fn')}(node, rw, *, args, found), not {sig}{third}. "
            "Fix: take what `when` returned as the keyword-only `found` (`def body(node, rw, *, found)`) and the "
            "node's arguments as the keyword-only `args`, each declared only when used"
        )
    unknown = [
        p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in (ARGS, FOUND) and p.default is p.empty
    ]
    if unknown:
        raise TypeError(f"a rule body's keyword-only parameters are args and found, not {', '.join(unknown)}")
    return any(p.kind is p.KEYWORD_ONLY and p.name == FOUND for p in params)


@attrs.frozen(kw_only=True)
class FunctionRule(RuleBase):
    """`fn(node, rw, *, args, found)` rewrites `node` through `rw`, or returns a Miss.

    `found` (declared only when used) is what `when(node)` returned (True when there is no `when`); `args`
    the node's arguments by schema name.
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
            extra[FOUND] = match
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
