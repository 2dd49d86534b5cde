"""RuleSet: a named, ordered, immutable collection of rules."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import attrs

from fx_rewrites.engine import RewriteError, Rule


class RuleDefinitionError(RewriteError, ValueError):
    """A rule is wrong as written (a bad field, two different rules with one name); raised when it is built,
    naming it."""


def _names(items: tuple[str | Rule, ...]) -> tuple[str, ...]:
    """`without("name")` and `without(rule)` alike."""
    return tuple(item.name if isinstance(item, Rule) else item for item in items)


def _rules(value: Rule | Iterable[Any]) -> tuple[Rule, ...]:
    if isinstance(value, Rule) and not isinstance(value, RuleSet):
        return (value,)  # one rule: `DEFAULT + my_rule`
    out: list[Rule] = []
    for item in value:
        out.extend(item if isinstance(item, RuleSet) else [item])
    return tuple(out)


#: how many rule names a repr shows before "..."
_REPR_NAMES = 3


def _count(rules: tuple[Rule, ...]) -> str:
    """ "36 rules: a, b, c, ..." for a repr."""
    names = ", ".join(r.name for r in rules[:_REPR_NAMES]) + (", ..." if len(rules) > _REPR_NAMES else "")
    return f"{len(rules)} rule{'' if len(rules) == 1 else 's'}" + (f": {names}" if rules else "")


@attrs.frozen
class RuleSet:
    """Rules in the order they were given (it breaks priority ties).

    Compose with `a | b` or `a + b` (union, in order; `b` may be a RuleSet,
    one rule or a list of rules; two different rules with one name is an
    error): `fx_rewrites.apply(ep, DEFAULT + my_rule)`,
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

    def __repr__(self) -> str:
        """`RuleSet('default', 36 rules: pool_stride_defaults, ...)`: names, not every rule's fields and roots."""
        return f"RuleSet({self.name!r}, {_count(self.rules)})"

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

    def __or__(self, other: RuleSet | Rule | Iterable[Rule]) -> RuleSet:
        if not isinstance(other, (RuleSet, Rule, Iterable)):
            return NotImplemented
        if isinstance(other, RuleSet):
            other_name = other.name
        else:
            other_name = other.name if isinstance(other, Rule) else "rules"
        return RuleSet((*self.rules, *_rules(other)), name=f"{self.name}+{other_name}")

    __add__ = __or__

    def __radd__(self, other: Rule | Iterable[Rule]) -> RuleSet:
        """`my_rule + DEFAULT`: the rule first (it wins priority ties)."""
        if not isinstance(other, (Rule, Iterable)):
            return NotImplemented
        return RuleSet((*_rules(other), *self.rules), name=self.name)

    __ror__ = __radd__

    def names(self) -> list[str]:
        return [r.name for r in self.rules]

    def without(self, *rules: str | Rule) -> RuleSet:
        """This set less the rules given (by name or the rule itself)."""
        names = _names(rules)
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


@attrs.frozen(init=False)
class Phases:
    """Rule sets run one after another, each to its own fixpoint, on one graph.

    A backend whose lowering must see the graph DEFAULT leaves behind says
    so with phases: `Phases(DEFAULT, TTNN_LOWERING, name="ttnn")`.
    `fx_rewrites.apply(program, phases)` runs them in order; iterating gives
    every rule, phase by phase (what `fx-rewrites rules` lists).
    """

    sets: tuple[RuleSet, ...]
    name: str

    def __init__(self, *sets: RuleSet | Iterable[Rule], name: str = "phases") -> None:
        if not sets:
            raise RuleDefinitionError(f"Phases {name!r}: give at least one rule set")
        self.__attrs_init__(tuple(s if isinstance(s, RuleSet) else RuleSet(s) for s in sets), name)

    def __repr__(self) -> str:
        """`Phases('iree', 3 phases: RuleSet('default+iree', 90 rules: ...), ...)`, each phase as RuleSet's repr."""
        return f"Phases({self.name!r}, {len(self.sets)} phases: {', '.join(map(repr, self.sets))})"

    @property
    def rules(self) -> tuple[Rule, ...]:
        return tuple(rule for s in self.sets for rule in s)

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def __contains__(self, name: object) -> bool:
        return any(name in s for s in self.sets)

    def __getitem__(self, name: str) -> Rule:
        for s in self.sets:
            if name in s:
                return s[name]
        raise KeyError(f"no rule named {name!r} in any phase of {self.name!r}; they have {self.names()}")

    def names(self) -> list[str]:
        return [r.name for r in self.rules]

    def then(self, *more: RuleSet | Iterable[Rule]) -> Phases:
        """These phases followed by `more`."""
        return Phases(*self.sets, *more, name=self.name)

    def __or__(self, other: RuleSet | Rule | Iterable[Rule]) -> Phases:
        """`backend.rules + my_rule`: the rule joins the first phase.

        The first phase is the one that fixes the graph (DEFAULT or a
        backend's own pack); later ones lower or legalize what it left.
        A rule that must run after them is a phase of its own: `.then(...)`.
        """
        if not isinstance(other, (RuleSet, Rule, Iterable)):
            return NotImplemented
        return Phases(self.sets[0] | other, *self.sets[1:], name=self.name)

    __add__ = __or__

    def __radd__(self, other: Rule | Iterable[Rule]) -> Phases:
        """`my_rule + backend.rules`: the rule first in the first phase."""
        if not isinstance(other, (Rule, Iterable)):
            return NotImplemented
        return Phases(other + self.sets[0], *self.sets[1:], name=self.name)

    __ror__ = __radd__

    def without(self, *rules: str | Rule) -> Phases:
        """These phases less the rules given, by name or rule (in whichever phase they are)."""
        names = _names(rules)
        unknown = [n for n in names if n not in self]
        if unknown:
            raise KeyError(f"no phase of {self.name!r} has rules named {unknown}; they have {self.names()}")
        return Phases(*(RuleSet([r for r in s if r.name not in names], name=s.name) for s in self.sets), name=self.name)


def as_phases(rules: RuleSet | Phases | Rule | Iterable[Rule]) -> Phases:
    """What `apply` runs: phases, a rule set (one phase), a rule or rules."""
    if isinstance(rules, Phases):
        return rules
    if isinstance(rules, RuleSet):
        return Phases(rules, name=rules.name)
    if isinstance(rules, Rule):
        return Phases(RuleSet([rules], name=rules.name))
    return Phases(RuleSet(rules))
