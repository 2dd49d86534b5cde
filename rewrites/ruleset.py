"""RuleSet: a named, ordered, immutable collection of rules."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import attrs

from fx_rewrites.engine import Rule
from fx_rewrites.kinds.base import RuleDefinitionError


def _rules(value: Iterable[Any]) -> tuple[Rule, ...]:
    out: list[Rule] = []
    for item in value:
        out.extend(item if isinstance(item, RuleSet) else [item])
    return tuple(out)


@attrs.frozen
class RuleSet:
    """Rules in the order they were given (it breaks priority ties).

    Compose with `a | b` (union; two different rules with one name is an
    error),
    `without("name", ...)`, `tagged("tag")` and `untagged("tag")`.
    """

    rules: tuple[Rule, ...] = attrs.field(converter=_rules)
    name: str = "rules"

    def __attrs_post_init__(self) -> None:
        seen: dict[str, Rule] = {}
        for rule in self.rules:
            if not isinstance(rule, Rule):
                raise RuleDefinitionError(
                    f"RuleSet {self.name!r}: {rule!r} is not a rule (it needs name, roots, priority, match, rewrite)"
                )
            if rule.name in seen and seen[rule.name] is not rule:
                raise RuleDefinitionError(f"RuleSet {self.name!r}: two different rules are named {rule.name!r}")
            seen[rule.name] = rule
        unique = tuple({id(r): r for r in self.rules}.values())
        object.__setattr__(self, "rules", unique)

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def __contains__(self, name: object) -> bool:
        return any(r.name == name for r in self.rules)

    def __getitem__(self, name: str) -> Rule:
        for rule in self.rules:
            if rule.name == name:
                return rule
        raise KeyError(f"no rule named {name!r} in RuleSet {self.name!r}; it has {self.names()}")

    def __or__(self, other: RuleSet | Iterable[Rule]) -> RuleSet:
        other_name = other.name if isinstance(other, RuleSet) else "rules"
        return RuleSet((*self.rules, *_rules(other)), name=f"{self.name}+{other_name}")

    def names(self) -> list[str]:
        return [r.name for r in self.rules]

    def without(self, *names: str) -> RuleSet:
        unknown = [n for n in names if n not in self]
        if unknown:
            raise KeyError(f"RuleSet {self.name!r} has no rules named {unknown}")
        return RuleSet([r for r in self.rules if r.name not in names], name=self.name)

    def tagged(self, *tags: str) -> RuleSet:
        """The rules carrying any of `tags`."""
        return RuleSet([r for r in self.rules if set(getattr(r, "tags", ())) & set(tags)], name=self.name)

    def untagged(self, *tags: str) -> RuleSet:
        """The rules carrying none of `tags`."""
        return RuleSet([r for r in self.rules if not set(getattr(r, "tags", ())) & set(tags)], name=self.name)
