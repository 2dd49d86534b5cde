"""An explanation as plain text for a terminal."""

from __future__ import annotations

from collections.abc import Sequence

from fx_rewrites.explain.data import SHOWN_CANDIDATES, Explanation, Line


def _headline(e: Explanation) -> str:
    total = sum(count for _, count in e.rewrites)
    what = f"rule {e.rule!r}: " if e.rule else ""
    return (
        f"{e.stop_reason}: {what}{total} rewrite{'s' if total != 1 else ''}, "
        f"{e.nodes_before} -> {e.nodes_after} nodes, {e.milliseconds:.1f} ms"
    )


def _line_text(line: Line, side: str, width: int) -> str:
    mark = {"kept": " ", "rewired": " ", "rewritten": "~", "removed": "-", "new": "+"}[line.status]
    text = f"  {mark} {line.name.ljust(width)}  {line.op}{line.args}"
    if line.value:
        text += f"  : {line.value}"
    if side == "before" and line.status in ("rewritten", "removed") and line.rules:
        text += f"    # {line.status} by {', '.join(line.rules)}"
    elif side == "before" and line.status == "removed":
        text += "    # removed (no longer used)"
    elif side == "after" and line.chain:
        text += f"    # {chain_text(line.chain, '->')}"
    return text


def chain_text(chain: Sequence[tuple[str, str]], arrow: str, rule: bool = True) -> str:
    """A new node's lineage: "cond_to_where from cond -> cond_1" (one rule), else
    "a on x -> b on y" (each rule fired on that node and made the next)."""
    rules = list(dict.fromkeys(r for r, _ in chain))
    sources = f" {arrow} ".join(s for _, s in chain)
    if len(rules) == 1:
        return f"{rules[0]} from {sources}" if rule else f"from {sources}"
    return f" {arrow} ".join(f"{r} on {s}" for r, s in chain)


def render_text(e: Explanation) -> str:
    """Plain text for a terminal: both graphs one node a line (+ new, ~ rewritten,
    - removed), the rewrites with the nodes they made, and the near-misses."""
    width = max((len(line.name) for line in (*e.before, *e.after)), default=4)
    out = [f"fx-rewrites explain {e.title} on {e.backend}".rstrip(), _headline(e), ""]
    out.append("before (as given to the rules):")
    out += [_line_text(line, "before", width) for line in e.before]
    out += ["", "after the rules:"]
    out += [_line_text(line, "after", width) for line in e.after]
    out += ["", "rewrites (rule: node -> what it became, from node provenance):"]
    if e.fired:
        rw = max(len(f.rule) for f in e.fired)
        for f in e.fired:
            became = ", ".join(f.into) if f.into else ("removed" if f.gone else "kept")
            out.append(f"  {f.rule.ljust(rw)}  {f.node} ({f.op}) -> {became}")
    else:
        out.append("  none" + (f" by {e.rule}" if e.rule else ""))
    for rule, node, cause in e.skips:
        out.append(f"  FAILED {rule} on {node}: {cause}")
    heading = (
        f"near-misses of {e.rule}" if e.rule else "near-misses (rules that did not fire: each candidate and why not)"
    )
    out += ["", f"{heading}:"]
    if e.near_misses:
        for m in e.near_misses:
            shown = m.nodes if e.rule else m.nodes[:SHOWN_CANDIDATES]
            nodes = ", ".join(f"{n} ({op})" for n, op in shown)
            if len(shown) < len(m.nodes):
                nodes += f" and {len(m.nodes) - len(shown)} more (--rule {m.rule} lists them all)"
            out.append(f"  {m.rule}: {m.reason}")
            out.append(f"      on {nodes}")
    else:
        out.append("  none")
    if e.untried:
        out += ["", "no candidate node (root ops absent from the graph):", "  " + ", ".join(e.untried)]
    if e.notes:
        out += ["", "notes:"] + [f"  {n}" for n in e.notes]
    return "\n".join(out) + "\n"
