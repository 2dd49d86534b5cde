"""Fields every declarative rule has, and the `when` hook."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from typing import Any

import attrs
from torch.fx import Node

from fx_rewrites.engine import Miss, Rule, is_miss
from fx_rewrites.engine.protocol import miss_reason
from fx_rewrites.ruleset import Phases, RuleDefinitionError, RuleSet
from fx_rewrites.schema import SchemaError, arguments


def as_tuple(ops: Any) -> tuple[Any, ...]:
    """`ops=x` or `ops=(x, y)`: one op or several."""
    return tuple(ops) if isinstance(ops, (list, tuple)) else (ops,)


#: the parameter name under which `when` and a function rule's body receive the node's bound arguments
ARGS = "args"


def takes_args(fn: Callable[..., Any] | None) -> bool:
    """Whether `fn` declares a parameter named `args` (it then receives `schema.arguments(node)`)."""
    if fn is None:
        return False
    try:
        return ARGS in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def _tags(value: Any) -> frozenset[str]:
    return frozenset([value] if isinstance(value, str) else value)


@attrs.frozen(kw_only=True)
class RuleBase:
    """Common fields. Subclasses set `roots` in `_build()` and implement
    `_match(node)` and `rewrite(node, match, rw)`.

    - `name`: unique in a RuleSet; derived from the kind and op if omitted.
    - `priority`: higher runs first among rules with the same root.
    - `when(node)`: extra condition; return False or `Miss("why")` to decline. A `when` that declares a
      parameter `args` gets the node's arguments by schema name too (`when(node, args)`).
    - `doc`: the failure the rule fixes, with the error text users search for.
    - `tags`: labels for `RuleSet.tagged(...)`.
    """

    name: str = attrs.field(default="")
    priority: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    when: Callable[[Node], Any] | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.is_callable())
    )
    doc: str = ""
    tags: frozenset[str] = attrs.field(default=frozenset(), converter=_tags)
    roots: tuple[Hashable, ...] = attrs.field(init=False, default=())
    when_takes_args: bool = attrs.field(init=False, default=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        try:
            roots = self._build()
        except (SchemaError, TypeError, ValueError) as e:
            raise RuleDefinitionError(f"rule {self.name or type(self).__name__!r}: {e}") from e
        object.__setattr__(self, "roots", tuple(roots))
        object.__setattr__(self, "when_takes_args", takes_args(self.when))
        if not self.name:
            object.__setattr__(self, "name", self._default_name())
        if not self.roots:
            raise RuleDefinitionError(f"rule {self.name!r}: it names no op to match")

    def _build(self) -> tuple[Hashable, ...]:
        raise NotImplementedError

    def _default_name(self) -> str:
        first = getattr(self.roots[0], "_opname", None) or getattr(self.roots[0], "__name__", "op")
        return f"{type(self).__name__.lower()}_{first}"

    def _set(self, field: str, value: Any) -> None:
        """Store a field normalised in `_build` (the class is frozen)."""
        object.__setattr__(self, field, value)

    def evaluate_when(self, node: Node) -> Any:
        """What `when` returns for `node`, called as the engine calls it (with the node's arguments by schema
        name where it declares `args`); True without a `when`."""
        if self.when is None:
            return True
        return self.when(node, **{ARGS: arguments(node)}) if self.when_takes_args else self.when(node)

    def _when(self, node: Node) -> Any:
        """What `when(node)` returned (True without a `when`), or a Miss saying why not."""
        found = self.evaluate_when(node)
        if is_miss(found):
            return Miss(f"when: {miss_reason(found)}" if isinstance(found, Miss) else "when() said no")
        return found

    def match(self, node: Node) -> Any:
        found = self._when(node)
        return found if is_miss(found) else self._match(node)

    def _match(self, node: Node) -> Any:
        return True

    def __or__(self, other: Any) -> Any:
        """`rule_a | rule_b` (or `+`): a RuleSet of both, in order; `other` may be a rule, RuleSet or list of
        rules. Two different rules with one name is an error, as in a RuleSet."""
        if isinstance(other, (RuleSet, Phases)):
            return NotImplemented  # theirs: `rule + DEFAULT` keeps DEFAULT's name, `rule + phases` stays Phases
        if isinstance(other, (Rule, list, tuple)):
            return RuleSet([self], name=self.name) | other
        return NotImplemented

    __add__ = __or__
