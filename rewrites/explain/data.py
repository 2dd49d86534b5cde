"""What an explanation holds: plain, frozen data that `render_text` and `render_html` read."""

from __future__ import annotations

import attrs

#: longest argument text shown for one node before it is cut with "…"
MAX_ARGS = 200
#: candidate nodes listed per near-miss before the rest are folded away (all with `rule=`)
SHOWN_CANDIDATES = 12


@attrs.frozen
class Line:
    """One node, as shown.

    `status` is, before the rules: "kept", "rewired" (same node, an input
    replaced), "rewritten" (a rule fired on it and it was replaced), or
    "removed" (gone, by a rule in `rules` or as dead code); after them:
    "kept", "rewired" or "new" (made by a rule). `rules` are the rules that
    fired on the node (before) or made it (after); `chain` is a new node's
    provenance, (rule, source node) oldest first.
    """

    name: str
    op: str
    args: str = ""
    value: str = ""
    status: str = "kept"
    rules: tuple[str, ...] = ()
    chain: tuple[tuple[str, str], ...] = ()


@attrs.frozen
class Rewrite:
    """One firing: `rule` on node `node` (`op`), which became `into` (nodes of the final graph)."""

    rule: str
    node: str
    op: str
    into: tuple[str, ...] = ()
    gone: bool = False


@attrs.frozen
class NearMiss:
    """Candidate nodes a rule declined for one reason."""

    rule: str
    reason: str
    nodes: tuple[tuple[str, str], ...]  # (node, op)


@attrs.frozen
class Explanation:
    """Everything `render_text` and `render_html` show."""

    title: str
    backend: str
    stop_reason: str
    rewrites: tuple[tuple[str, int], ...]
    nodes_before: int
    nodes_after: int
    milliseconds: float
    before: tuple[Line, ...]
    after: tuple[Line, ...]
    #: side by side: (before line or None, rules that turned one into the other, after line or None)
    rows: tuple[tuple[Line | None, tuple[str, ...], Line | None], ...]
    fired: tuple[Rewrite, ...]
    near_misses: tuple[NearMiss, ...]
    #: rules with no candidate node in the graph (their root ops do not occur)
    untried: tuple[str, ...]
    skips: tuple[tuple[str, str, str], ...]  # (rule, node, cause)
    notes: tuple[str, ...]
    #: the one rule asked about (`--rule`), or None for all
    rule: str | None = None
