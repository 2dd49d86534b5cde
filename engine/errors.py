"""Errors raised by the engine. Each names the rule, the node and the fix."""

from __future__ import annotations


class RewriteError(Exception):
    """Base class of every error fx-rewrites raises on purpose."""


class RuleError(RewriteError):
    """A rule raised, or produced a replacement that failed the checks.

    The graph is left as it was before the rule ran (the rewrite is rolled
    back). `rule`, `node` and `cause` say what went wrong where.
    """

    def __init__(self, rule: str, node: str, cause: str, *, op: str = "") -> None:
        self.rule = rule
        self.node = node
        self.cause = cause
        self.op = op
        on = f"node {node!r}" + (f" ({op})" if op else "")
        super().__init__(
            f"rule {rule!r} failed on {on}: {cause}. The rewrite was rolled back; "
            f"fix the rule, or pass on_error='skip' to skip it on this node and go on."
        )


class NonConvergence(RewriteError):
    """The rules did not reach a fixpoint (raised only with strict=True)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"non-convergence: {reason}")


class GraphInputError(RewriteError, TypeError):
    """The object handed to the engine cannot be rewritten as it is."""


class NumericMismatch(RewriteError):
    """The rewritten graph computes other results than the graph before (`apply(..., check=inputs)`).

    `rule`, `node` and `op` name the first rewrite that changed the results
    ("" when no single rewrite could be blamed), `max_difference` the largest
    absolute difference it made, `step` its position among the run's rewrites.
    """

    def __init__(
        self, message: str, *, rule: str = "", node: str = "", op: str = "", max_difference: float = 0.0, step: int = 0
    ) -> None:
        self.rule = rule
        self.node = node
        self.op = op
        self.max_difference = max_difference
        self.step = step
        super().__init__(message)
