"""What a run did: convergence, rewrites and time per rule, skips, notes."""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict

import attrs


@attrs.frozen
class Skip:
    """A rule that failed on a node under on_error='skip'."""

    rule: str
    node: str
    cause: str


@attrs.frozen
class Attempt:
    """One (rule, node) pairing seen by `explain`: fired, or why not."""

    rule: str
    node: str
    op: str
    fired: bool
    reason: str


@attrs.define
class Report:
    """The outcome of one engine run.

    `stop_reason` is "converged", "rewrite budget" or "non-convergence: ..."
    and `converged` is True only for the first.
    """

    stop_reason: str = "converged"
    rewrites: Counter = attrs.field(factory=Counter)
    seconds: defaultdict = attrs.field(factory=lambda: defaultdict(float))
    visits: int = 0
    budget: int = 0
    nodes_before: int = 0
    nodes_after: int = 0
    skips: list[Skip] = attrs.field(factory=list)
    notes: list[str] = attrs.field(factory=list)
    attempts: list[Attempt] | None = None
    total_seconds: float = 0.0
    #: the phases run, in order, when the rules came in phases (see `merged`)
    phases: list[str] = attrs.field(factory=list)

    @classmethod
    def merged(cls, runs: list[tuple[str, Report]]) -> Report:
        """One report for runs made one after another on one graph (phases).

        It converged when every phase did; otherwise its stop reason is the
        first phase's that did not, and a note names that phase.
        """
        first_stop = next(((name, r) for name, r in runs if not r.converged), None)
        out = cls(
            stop_reason=first_stop[1].stop_reason if first_stop else "converged",
            visits=sum(r.visits for _, r in runs),
            budget=sum(r.budget for _, r in runs),
            nodes_before=runs[0][1].nodes_before if runs else 0,
            nodes_after=runs[-1][1].nodes_after if runs else 0,
            total_seconds=sum(r.total_seconds for _, r in runs),
            attempts=None if any(r.attempts is None for _, r in runs) else [a for _, r in runs for a in r.attempts],
            phases=[name for name, _ in runs],
        )
        for _, r in runs:
            out.rewrites.update(r.rewrites)
            for rule, seconds in r.seconds.items():
                out.seconds[rule] += seconds
            out.skips.extend(r.skips)
            out.notes.extend(r.notes)
        if first_stop:
            out.notes.append(f"phase {first_stop[0]!r} stopped: {first_stop[1].stop_reason}")
        return out

    @property
    def converged(self) -> bool:
        return self.stop_reason == "converged"

    @property
    def total_rewrites(self) -> int:
        return sum(self.rewrites.values())

    def warn_unless_converged(self, backend: str, stacklevel: int = 3) -> None:
        """A RuntimeWarning when the rules stopped short of their fixpoint, before `backend` compiles the
        program: it may then lack rewrites the backend needs, a guard against a wrong result among them."""
        if not self.converged:
            warnings.warn(
                f"the {backend} backend's rules stopped before their fixpoint ({self.stop_reason}), so the "
                "program it compiles may lack rewrites it needs. Run fx_rewrites.apply(program, backend.rules, "
                "strict=True) to raise here instead, and report the rules named.",
                RuntimeWarning,
                stacklevel=stacklevel,
            )

    def explain(self, rule: str | None = None) -> list[Attempt]:
        """Each candidate node a rule (or every rule) met, and why it did or
        did not fire. Needs the run to have been made with explain=True."""
        if self.attempts is None:
            raise ValueError("this run kept no match attempts; run it with explain=True")
        return [a for a in self.attempts if rule is None or a.rule == rule]

    def summary(self) -> str:
        """A few lines for a person."""
        lines = [
            f"{self.stop_reason}: {self.total_rewrites} rewrites, {self.visits} node visits, "
            f"{self.nodes_before} -> {self.nodes_after} nodes, {self.total_seconds * 1e3:.1f} ms"
        ]
        if len(self.phases) > 1:
            lines.append(f"  phases: {' -> '.join(self.phases)}")
        for name, count in sorted(self.rewrites.items()):
            lines.append(f"  {name}: {count} rewrites, {self.seconds[name] * 1e3:.1f} ms")
        lines += [f"  skipped {s.rule} on {s.node}: {s.cause}" for s in self.skips]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
