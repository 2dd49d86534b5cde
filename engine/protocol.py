"""The contract between the engine and the rules it runs.

The engine knows this protocol only; concrete rule kinds live in `rewrites`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch.fx import Node

    from fx_rewrites.engine.rewriter import Rewriter


class Miss:
    """A falsy answer to "does this rule match?" that says why not.

    Rules and `when` predicates return it instead of `False` so that
    `explain` can tell a user which condition failed on which node. The
    reason may be a function returning the text: it is called only when
    someone reads it (`explain=True`), so a rule tried on 100k nodes does not
    format 100k messages nobody reads.
    """

    __slots__ = ("_reason",)

    def __init__(self, reason: str | Callable[[], str]) -> None:
        self._reason = reason

    @property
    def reason(self) -> str:
        if callable(self._reason):
            self._reason = self._reason()
        return self._reason

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"Miss({self.reason!r})"


def is_miss(answer: Any) -> bool:
    """True when a match answer means "no match" (None, False or a Miss)."""
    return answer is None or answer is False or isinstance(answer, Miss)


def miss_reason(answer: Any) -> str:
    """The reason carried by a no-match answer, or a generic one."""
    return answer.reason if isinstance(answer, Miss) else "no match"


@runtime_checkable
class Rule(Protocol):
    """What the engine needs from a rule.

    - `name`: unique within a run; used in reports, provenance and errors.
    - `roots`: the `node.target` values the rule can match; the engine only
      offers a rule the call_function nodes whose target is one of them.
    - `priority`: higher runs first among rules sharing a root.
    - `match(node)`: pure (must not touch the graph); returns a Miss / None /
      False for no match, anything else is passed on to `rewrite`.
    - `rewrite(node, match, rw)`: builds the replacement through `rw`; it may
      still decline by returning a Miss (whatever it built is rolled back).
    """

    name: str
    roots: tuple[Hashable, ...]
    priority: int

    def match(self, node: Node) -> Any: ...

    def rewrite(self, node: Node, match: Any, rw: Rewriter) -> Any: ...
