"""What a rewrite run did to one graph, for a person: text or one HTML page.

    result = fx_rewrites.apply(program, rules, explain=True)
    e = explanation(program, result, rules, title="net.py:make", backend="iree")
    print(render_text(e))
    Path("net.html").write_text(render_html(e))

`explanation` reads the graph before the rules, the graph after them (each
created node carries its provenance in `meta["rewrites"]`) and the run's
match attempts (`Report.explain()`, so `apply(..., explain=True)`) into
plain data; `render_text` and `render_html` turn that into a string. All
three are pure: they neither change the graphs nor print. The page is
self-contained (inline CSS, no scripts, no external assets) and escapes
every name, repr and reason it shows.
"""

from __future__ import annotations

import difflib
import html
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from fx_rewrites.engine import Attempt, Report
from fx_rewrites.schema import op_name

#: longest argument text shown for one node before it is cut with "…"
MAX_ARGS = 200
#: candidate nodes listed per near-miss before the rest are folded away (all with `rule=`)
SHOWN_CANDIDATES = 12


# ----------------------------------------------------------------------------- data


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


# ----------------------------------------------------------------------------- building


def explanation(
    before: ExportedProgram | GraphModule,
    result: Any,
    rules: Iterable[Any],
    *,
    title: str = "",
    backend: str = "",
    rule: str | None = None,
) -> Explanation:
    """Read `before` (the graph the rules were given), `result` (what
    `fx_rewrites.apply(before, rules, explain=True)` returned) and `rules` into
    an Explanation. With `rule`, the rewrites and near-misses are that rule's
    only (and its near-misses are shown even where it fired elsewhere)."""
    report: Report = result.report
    attempts = report.explain()
    rule_names = [r.name for r in rules]
    if rule is not None and rule not in rule_names:
        raise ValueError(f"no rule named {rule!r} in this rule set; known: {', '.join(rule_names)}")
    before_gm = before.graph_module if isinstance(before, ExportedProgram) else before
    after_gm = result.graph_module
    before_inputs = _input_kinds(before)
    after_inputs = _input_kinds(result.program) if result.program is not None else before_inputs

    after_nodes = list(after_gm.graph.nodes)
    after_names = {n.name for n in after_nodes}
    before_names = {n.name for n in before_gm.graph.nodes}
    chains = {n.name: _chain(n) for n in after_nodes}
    # original node name -> final nodes descended from it
    derived: dict[str, list[str]] = defaultdict(list)
    for name, chain in chains.items():
        for _, source in chain:
            if name not in derived[source]:
                derived[source].append(name)
    fired_on: dict[str, list[str]] = defaultdict(list)
    for a in attempts:
        if a.fired and a.rule not in fired_on[a.node]:
            fired_on[a.node].append(a.rule)

    after_text = {n.name: _args(n) for n in after_nodes}
    before_lines = []
    for n in before_gm.graph.nodes:
        args = _args(n)
        rules_here = tuple(fired_on.get(n.name, ()))
        if n.name not in after_names:
            status = "rewritten" if rules_here and derived.get(n.name) else "removed"
        elif rules_here:
            status = "rewritten"
        else:
            status = "rewired" if after_text[n.name] != args else "kept"
        before_lines.append(Line(n.name, _op(n, before_inputs), args, _value(n), status, rules_here))
    after_lines = []
    before_text = {line.name: line.args for line in before_lines}
    for n in after_nodes:
        chain = chains[n.name]
        if n.name not in before_names:
            status = "new"
        else:
            status = "rewired" if before_text[n.name] != after_text[n.name] else "kept"
        rules_here = tuple(dict.fromkeys(r for r, _ in chain))
        after_lines.append(Line(n.name, _op(n, after_inputs), after_text[n.name], _value(n), status, rules_here, chain))

    fired = tuple(
        Rewrite(a.rule, a.node, a.op, tuple(derived.get(a.node, ())), a.node not in after_names)
        for a in _unique(a for a in attempts if a.fired)
        if rule is None or a.rule == rule
    )
    made_by = {name: {r for r, _ in chain} for name, chain in chains.items()}
    fired_rules = {r for r, count in report.rewrites.items() if count}
    misses: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    for a in _unique(attempts):
        if a.fired or a.rule in fired_on.get(a.node, ()) or a.rule in made_by.get(a.node, ()):
            continue  # fired there, or a node the rule made itself
        wanted = (rule is None and a.rule not in fired_rules) or a.rule == rule
        if wanted and (a.node, a.op) not in misses[a.rule, a.reason]:
            misses[a.rule, a.reason].append((a.node, a.op))
    tried = {a.rule for a in attempts}
    untried = tuple(r for r in rule_names if r not in tried and (rule is None or r == rule))
    return Explanation(
        title=title,
        backend=backend,
        stop_reason=report.stop_reason,
        rewrites=tuple(sorted((k, v) for k, v in report.rewrites.items() if v and (rule is None or k == rule))),
        nodes_before=report.nodes_before,
        nodes_after=report.nodes_after,
        milliseconds=report.total_seconds * 1e3,
        before=tuple(before_lines),
        after=tuple(after_lines),
        rows=tuple(_align(before_lines, after_lines)),
        fired=fired,
        near_misses=tuple(NearMiss(r, why, tuple(nodes)) for (r, why), nodes in misses.items()),
        untried=untried,
        skips=tuple((s.rule, s.node, s.cause) for s in report.skips if rule is None or s.rule == rule),
        notes=tuple(report.notes),
        rule=rule,
    )


def _unique(attempts: Iterable[Attempt]) -> list[Attempt]:
    """Attempts without repeats (a node is offered again after its inputs change)."""
    return list(dict.fromkeys(attempts))


def _chain(node: Node) -> tuple[tuple[str, str], ...]:
    return tuple((str(p.get("rule", "?")), str(p.get("source", "?"))) for p in node.meta.get("rewrites", ()))


def _input_kinds(program: ExportedProgram | GraphModule | None) -> dict[str, str]:
    """placeholder name -> "user input", "parameter conv1.weight", ..."""
    if not isinstance(program, ExportedProgram):
        return {}
    kinds = {}
    for spec in program.graph_signature.input_specs:
        name = getattr(spec.arg, "name", None)
        if name is not None:
            kind = spec.kind.name.lower().replace("_", " ").replace("constant tensor", "constant")
            kinds[name] = f"{kind} {spec.target}" if spec.target else kind
    return kinds


def _op(node: Node, inputs: dict[str, str]) -> str:
    if node.op == "placeholder":
        return f"input: {inputs.get(node.name, 'input')}"
    if node.op == "call_function":
        return op_name(node.target)
    if node.op == "output":
        return "output"
    return f"{node.op} {node.target}"


def _args(node: Node) -> str:
    if node.op in ("placeholder", "get_attr"):
        return ""
    if node.op == "output":
        text = _fmt(node.args[0]) if node.args else ""
    else:
        parts = [_fmt(a) for a in node.args] + [f"{k}={_fmt(v)}" for k, v in node.kwargs.items()]
        text = f"({', '.join(parts)})"
    return text if len(text) <= MAX_ARGS else text[: MAX_ARGS - 1] + "…"


def _fmt(a: Any) -> str:
    if isinstance(a, Node):
        return a.name
    if isinstance(a, list):
        return f"[{', '.join(_fmt(x) for x in a)}]"
    if isinstance(a, tuple):
        return f"({', '.join(_fmt(x) for x in a)}{',' if len(a) == 1 else ''})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_fmt(v)}" for k, v in a.items()) + "}"
    if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(a)
    if callable(a) and not isinstance(a, torch.Tensor):
        return op_name(a)
    text = repr(a)
    return text if len(text) <= 60 else text[:59] + "…"


def _value(node: Node) -> str:
    return format_value(node.meta.get("val"))


def format_value(v: Any) -> str:
    """A node's value as torch prints graphs: f32[2, 3], Sym(s0), (f32[2], i64[])."""
    from torch.fx.graph import dtype_abbrs

    if isinstance(v, torch.Tensor):
        return f"{dtype_abbrs.get(v.dtype, str(v.dtype))}[{', '.join(str(d) for d in v.shape)}]"
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"Sym({v})"
    if isinstance(v, (list, tuple)):
        return f"({', '.join(format_value(x) for x in v)})"
    if v is None:
        return ""
    text = repr(v)
    return text if len(text) <= 40 else text[:39] + "…"


def _align(before: Sequence[Line], after: Sequence[Line]) -> list[tuple[Line | None, tuple[str, ...], Line | None]]:
    """Pair unchanged nodes by name, a rewritten node with what it became,
    and leave a side empty where a node is only on the other."""
    rows: list[tuple[Line | None, tuple[str, ...], Line | None]] = []
    matcher = difflib.SequenceMatcher(None, [b.name for b in before], [a.name for a in after], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            rows += [(b, b.rules, a) for b, a in zip(before[i1:i2], after[j1:j2])]
            continue
        news = list(after[j1:j2])
        for b in before[i1:i2]:
            mine = [a for a in news if any(source == b.name for _, source in a.chain)]
            for a in mine:
                news.remove(a)
            rows.append((b, b.rules, mine[0] if mine else None))
            rows += [(None, (), a) for a in mine[1:]]
        rows += [(None, (), a) for a in news]
    return rows


# ----------------------------------------------------------------------------- text


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
        text += f"    # {_chain_text(line.chain, '->')}"
    return text


def _chain_text(chain: Sequence[tuple[str, str]], arrow: str, rule: bool = True) -> str:
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


# ----------------------------------------------------------------------------- html

#: rule colours (background tint, accent), by the order rules first fired
_PALETTE = (
    ("#e3f0ff", "#1f6feb"),
    ("#fdebd3", "#c2620a"),
    ("#e6f5e9", "#1f883d"),
    ("#f3e8fd", "#8250df"),
    ("#fde7ef", "#bf3989"),
    ("#e0f5f5", "#0b7b7b"),
    ("#fff6cc", "#9a6700"),
    ("#ececec", "#57606a"),
)

_CSS = """
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI","DejaVu Sans","Liberation Sans",sans-serif;
 color:#1f2328;background:#f6f8fa}
main{max-width:1600px;margin:0 auto;padding:18px 22px 40px}
code,.mono{font-family:ui-monospace,"DejaVu Sans Mono","Liberation Mono",Menlo,Consolas,monospace;font-size:12.5px}
h1{font-size:20px;margin:0 0 4px;font-weight:600}
h1 code{font-size:18px;background:#eaeef2;padding:1px 6px;border-radius:5px}
h2{font-size:15px;margin:26px 0 8px;font-weight:600}
.sub{color:#59636e;margin:0 0 10px}
.status{display:inline-block;padding:1px 8px;border-radius:10px;font-weight:600;font-size:12.5px}
.status.ok{background:#dafbe1;color:#116329}.status.bad{background:#ffebe9;color:#a40e26}
.chips{display:flex;flex-wrap:wrap;gap:6px;margin:8px 0 0;padding:0;list-style:none}
.rule{display:inline-block;padding:1px 7px;border-radius:5px;font-family:ui-monospace,"DejaVu Sans Mono",monospace;
 font-size:12px;font-weight:600;white-space:nowrap;border:1px solid currentColor}
.legend{color:#59636e;font-size:12.5px;margin:10px 0 0}
.legend > span{display:inline-block;margin-right:14px}
.sw{display:inline-block;width:11px;height:11px;border-radius:2px;vertical-align:-1px;margin-right:4px}
.card{background:#fff;border:1px solid #d1d9e0;border-radius:8px;overflow:hidden}
table{border-collapse:collapse;width:100%}
table.graphs{table-layout:fixed}
th{background:#f0f3f6;text-align:left;font-weight:600;font-size:12.5px;padding:6px 8px;border-bottom:1px solid #d1d9e0}
td{padding:3px 8px;vertical-align:top;border-bottom:1px solid #eef1f4;overflow-wrap:anywhere}
table.graphs th.side{font-size:13.5px}
td.name{font-weight:600}
td.val{color:#59636e}
td.gut{text-align:center;background:#fafbfc;border-left:1px solid #d1d9e0;border-right:1px solid #d1d9e0}
td.gut .rule{font-size:11px;margin:1px 0;white-space:normal;overflow-wrap:anywhere}
.args{color:#59636e}
.ns{color:#8c959f}
.empty{background:repeating-linear-gradient(135deg,#fafbfc 0 6px,#f3f5f7 6px 12px)}
.removed td.b{background:#ffebe9}
.removed td.b.name{text-decoration:line-through;text-decoration-color:#cf222e}
.args .gone{color:#a40e26;text-decoration:line-through;text-decoration-color:#cf222e80}
.args .made{color:#116329;font-weight:600}
.legend .gone{color:#a40e26;text-decoration:line-through}.legend .made{color:#116329}
.chain{display:block;font-size:11.5px;font-weight:400;color:#59636e;margin-top:1px}
.kind{color:#8250df}
table.list td,table.list th{padding:5px 10px}
.cand{white-space:nowrap}
details{display:inline}
summary{display:inline;cursor:pointer;color:#1f6feb;margin-left:6px}
table.list td.why{font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:12.5px}
.muted{color:#59636e}
.fail{background:#ffebe9}
.note{background:#fff8c5;border:1px solid #eac54f;border-radius:6px;padding:6px 10px;margin:4px 0}
footer{color:#8c959f;font-size:12px;margin-top:28px}
"""


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _op_html(op: str) -> str:
    """aten.max_pool2d.default with the namespace and overload dimmed."""
    parts = op.split(".")
    if len(parts) == 3 and parts[0] in ("aten", "prims", "quantized", "higher_order"):
        return f'<span class="ns">{_e(parts[0])}.</span>{_e(parts[1])}<span class="ns">.{_e(parts[2])}</span>'
    if op.startswith("input: "):
        return f'<span class="kind">{_e(op[len("input: ") :])}</span>'
    return _e(op)


def render_html(e: Explanation) -> str:
    """One self-contained page: a summary, both graphs side by side (each
    rewritten node next to what it became, tinted with the rule that made
    it), the rewrites, and the near-misses."""
    order = [r for r, _ in e.rewrites] + [f.rule for f in e.fired]
    colours = {r: _PALETTE[i % len(_PALETTE)] for i, r in enumerate(dict.fromkeys(order))}

    def badge(rule: str, arrow: str = "") -> str:
        tint, accent = colours.get(rule, _PALETTE[-1])
        name = _e(rule).replace("_", "_<wbr>")  # a long name wraps at its underscores
        return f'<span class="rule" style="background:{tint};color:{accent}">{name}{arrow}</span>'

    def tint(rules: Sequence[str], bar: bool) -> str:
        if not rules:
            return ""
        bg, accent = colours.get(rules[-1], _PALETTE[-1])
        return f' style="background:{bg}' + (f';box-shadow:inset 4px 0 0 {accent}"' if bar else '"')

    gone = {line.name for line in e.before if line.status in ("rewritten", "removed")}
    made = {line.name for line in e.after if line.status == "new"}

    def refs(args: str, side: str) -> str:
        """Arguments, with references to rewritten or removed nodes (before) and to new ones (after) marked."""
        marked, cls = (gone, "gone") if side == "b" else (made, "made")
        return "".join(
            f'<span class="{cls}">{_e(part)}</span>' if part in marked else _e(part)
            for part in re.split(r"(\w+)", args)
        )

    def cells(line: Line | None, side: str) -> str:
        if line is None:
            return f'<td class="{side} empty" colspan="3"></td>'
        tinted = (side == "a" and line.status == "new") or (side == "b" and line.status == "rewritten")
        first, style = (tint(line.rules, True), tint(line.rules, False)) if tinted else ("", "")
        name = _e(line.name)
        if side == "a" and line.chain:
            name += f'<span class="chain">{_e(_chain_text(line.chain, "→", rule=False))}</span>'
        op = f'{_op_html(line.op)}<span class="args">{refs(line.args, side)}</span>'
        return (
            f'<td class="{side} name mono"{first}>{name}</td>'
            f'<td class="{side} mono"{style}>{op}</td>'
            f'<td class="{side} val mono" title="{_e(line.value)}"{style}>{_e(line.value)}</td>'
        )

    body = []
    for b, rules, a in e.rows:
        classes = " ".join(
            c
            for c in (
                b.status if b is not None else "",
                "new" if a is not None and a.status == "new" else "",
                "rewired" if a is not None and a.status == "rewired" else "",
            )
            if c
        )
        if b is not None and b.status in ("rewritten", "removed") and rules:
            gutter = "".join(badge(r, " →") for r in rules)
        elif b is not None and b.status == "removed":
            gutter = '<span class="muted">unused</span>'
        else:
            gutter = ""
        body.append(f'<tr class="{classes}">{cells(b, "b")}<td class="gut">{gutter}</td>{cells(a, "a")}</tr>')

    total = sum(c for _, c in e.rewrites)
    ok = e.stop_reason == "converged"
    chips = "".join(f"<li>{badge(r)} <span class='muted'>×{c}</span></li>" for r, c in e.rewrites)
    if not chips:
        chips = f"<li class='muted'>no rule fired{' (' + _e(e.rule) + ')' if e.rule else ''}</li>"

    fired_rows = "".join(
        f"<tr><td>{badge(f.rule)}</td><td class='mono'>{_e(f.node)}</td><td class='mono'>{_op_html(f.op)}</td>"
        f"<td class='mono'>{_e(', '.join(f.into)) if f.into else ('<i>removed</i>' if f.gone else 'kept')}</td></tr>"
        for f in e.fired
    ) + "".join(
        f"<tr class='fail'><td>{badge(r)}</td><td class='mono'>{_e(n)}</td><td colspan='2'>failed, skipped: "
        f"{_e(c)}</td></tr>"
        for r, n, c in e.skips
    )

    def candidates(nodes: Sequence[tuple[str, str]]) -> str:
        items = [f"<span class='cand'>{_e(n)} <span class='ns'>{_e(op)}</span></span>" for n, op in nodes]
        if len(items) <= SHOWN_CANDIDATES:
            return ", ".join(items)
        rest = ", ".join(items[SHOWN_CANDIDATES:])
        return (
            ", ".join(items[:SHOWN_CANDIDATES])
            + f"<details><summary>{len(items) - SHOWN_CANDIDATES} more</summary>{rest}</details>"
        )

    miss_rows = [
        f"<tr><td class='mono'><b>{_e(m.rule)}</b></td><td class='why'>{_e(m.reason)}</td>"
        f"<td class='mono'>{candidates(m.nodes)}</td></tr>"
        for m in e.near_misses
    ]
    miss_heading = (
        f"Near-misses of {_e(e.rule)}" if e.rule else "Near-misses: rules that did not fire, each candidate and why not"
    )
    misses = (
        "<div class='card'><table class='list'><thead><tr><th style='width:20%'>rule</th>"
        "<th style='width:30%'>why not</th><th>candidate nodes</th></tr></thead><tbody>"
        + "".join(miss_rows)
        + "</tbody></table></div>"
        if miss_rows
        else "<p class='muted'>None: every rule that met a candidate node fired on it.</p>"
    )
    untried = (
        f"<p class='muted'>No candidate node (root ops absent from this graph): "
        f"<span class='mono'>{_e(', '.join(e.untried))}</span></p>"
        if e.untried
        else ""
    )
    notes = "".join(f"<div class='note'>{_e(n)}</div>" for n in e.notes)
    scope = f" · rule <code>{_e(e.rule)}</code>" if e.rule else ""
    status = f'<span class="status {"ok" if ok else "bad"}">{_e(e.stop_reason)}</span>'
    summary = (
        f"backend <b>{_e(e.backend)}</b>{scope} · {status} · {total} rewrite{'s' if total != 1 else ''} · "
        f"{e.nodes_before} → {e.nodes_after} nodes · {e.milliseconds:.1f} ms"
    )
    legend = (
        '<span><i class="sw" style="background:#e3f0ff;box-shadow:inset 3px 0 0 #1f6feb"></i>tinted: rewritten '
        "(left) and made (right) by the rule of that colour</span>"
        '<span><i class="sw" style="background:#ffebe9"></i>removed</span>'
        '<span><span class="gone">struck</span> / <b class="made">bold</b> arguments: nodes that went / came</span>'
        "<span>“from b”: made from node b (→: through the nodes between)</span>"
    )
    widths = (11, 20, 11, 14, 11, 22, 11)
    graphs = (
        '<div class="card"><table class="graphs"><colgroup>'
        + "".join(f'<col style="width:{w}%">' for w in widths)
        + f'</colgroup><thead><tr><th class="side" colspan="3">Before ({len(e.before)} nodes)</th><th>rule</th>'
        f'<th class="side" colspan="3">After the rules ({len(e.after)} nodes)</th></tr></thead>\n<tbody>\n'
        + "\n".join(body)
        + "\n</tbody></table></div>"
    )
    rewrites = (
        "<div class='card'><table class='list'><thead><tr><th style='width:22%'>rule</th>"
        "<th style='width:16%'>on node</th><th style='width:30%'>op</th><th>became</th></tr></thead><tbody>"
        + fired_rows
        + "</tbody></table></div>"
        if fired_rows
        else "<p class='muted'>None.</p>"
    )
    parts = [
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>fx-rewrites explain {_e(e.title)}</title>",
        f"<style>{_CSS}</style></head>",
        "<body><main>",
        f"<h1>fx-rewrites explain <code>{_e(e.title)}</code></h1>",
        f'<p class="sub">{summary}</p>',
        f'<ul class="chips">{chips}</ul>',
        f'<p class="legend">{legend}</p>',
        notes,
        "<h2>Graph before and after the rules</h2>",
        graphs,
        f"<h2>Rewrites{' by ' + _e(e.rule) if e.rule else ''}</h2>",
        rewrites,
        f"<h2>{miss_heading}</h2>",
        misses,
        untried,
        '<footer>Made by <code>fx-rewrites explain</code>. Provenance from <code>node.meta["rewrites"]</code>; '
        "near-misses from <code>apply(..., explain=True)</code>.</footer>",
        "</main></body></html>",
    ]
    return "\n".join(p for p in parts if p) + "\n"
