"""An explanation as one self-contained HTML page (inline CSS, no scripts, every text escaped)."""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from typing import Any

import attrs

from fx_rewrites.explain.data import SHOWN_CANDIDATES, Explanation, Line
from fx_rewrites.explain.text import chain_text

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


#: the controls above the graphs: checkboxes the CSS reads (`:checked ~ .card ...`), so the page needs no script
_FILTER_CSS = """
.controls{display:flex;flex-wrap:wrap;align-items:center;gap:6px 18px;margin:0 0 8px;font-size:13px}
.controls label{cursor:pointer;user-select:none;color:#1f6feb}
.filter{position:absolute;opacity:0;pointer-events:none}
.controls label::before{content:"☐ "}
#changed-only:checked ~ .controls label[for=changed-only]::before,
#show-state:checked ~ .controls label[for=show-state]::before{content:"☑ "}
.controls .jumps a{font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:12px;margin-right:8px}
#changed-only:checked ~ .card tr.same{display:none}
#show-state:not(:checked) ~ .card tr.state{display:none}
#show-state:not(:checked) ~ .card tr.state-fold{display:table-row}
tr.state-fold{display:none}
#changed-only:checked ~ .card tr.state-fold{display:none}
tr.state-fold td{color:#59636e;font-style:italic;background:#fafbfc}
tr:target td{outline:2px solid #bf8700;outline-offset:-2px}
tr[id]{scroll-margin-top:40px}
"""


def _row_classes(b: Line | None, a: Line | None) -> list[str]:
    """The row's status classes; `same` (nothing changed on either side) and `state` (an unchanged
    parameter, buffer or constant input) are what the page's filters hide."""
    classes = [
        b.status if b is not None else "",
        "new" if a is not None and a.status == "new" else "",
        "rewired" if a is not None and a.status == "rewired" else "",
    ]
    same = (b is None or b.status == "kept") and (a is None or a.status == "kept")
    if same:
        classes.append("same")
        line = b or a
        if line is not None and line.op.startswith(_STATE_INPUTS):
            classes.append("state")
    return [c for c in classes if c]


#: placeholder kinds folded away by default (a big model's page would open on rows of parameters)
_STATE_INPUTS = ("input: parameter", "input: buffer", "input: constant")


@attrs.frozen
class _Painter:
    """Colours per rule and the nodes that went (before) and came (after), for the cells."""

    colours: dict[str, tuple[str, str]]
    gone: frozenset[str]
    made: frozenset[str]

    def badge(self, rule: str, arrow: str = "") -> str:
        tint, accent = self.colours.get(rule, _PALETTE[-1])
        name = _e(rule).replace("_", "_<wbr>")  # a long name wraps at its underscores
        return f'<span class="rule" style="background:{tint};color:{accent}">{name}{arrow}</span>'

    def tint(self, rules: Sequence[str], bar: bool) -> str:
        if not rules:
            return ""
        bg, accent = self.colours.get(rules[-1], _PALETTE[-1])
        return f' style="background:{bg}' + (f';box-shadow:inset 4px 0 0 {accent}"' if bar else '"')

    def refs(self, args: str, side: str) -> str:
        """Arguments, with references to rewritten or removed nodes (before) and to new ones (after) marked."""
        marked, cls = (self.gone, "gone") if side == "b" else (self.made, "made")
        return "".join(
            f'<span class="{cls}">{_e(part)}</span>' if part in marked else _e(part)
            for part in re.split(r"(\w+)", args)
        )

    def cells(self, line: Line | None, side: str) -> str:
        if line is None:
            return f'<td class="{side} empty" colspan="3"></td>'
        tinted = (side == "a" and line.status == "new") or (side == "b" and line.status == "rewritten")
        first, style = (self.tint(line.rules, True), self.tint(line.rules, False)) if tinted else ("", "")
        name = _e(line.name)
        if side == "a" and line.chain:
            name += f'<span class="chain">{_e(chain_text(line.chain, "→", rule=False))}</span>'
        op = f'{_op_html(line.op)}<span class="args">{self.refs(line.args, side)}</span>'
        return (
            f'<td class="{side} name mono"{first}>{name}</td>'
            f'<td class="{side} mono"{style}>{op}</td>'
            f'<td class="{side} val mono" title="{_e(line.value)}"{style}>{_e(line.value)}</td>'
        )


def _graphs(e: Explanation, paint: _Painter) -> tuple[str, dict[str, int], int]:
    """The side-by-side table; the row index of each before-node, and how many rows are folded state."""
    body, row_of, folded = [], {}, 0
    for i, (b, rules, a) in enumerate(e.rows):
        classes = _row_classes(b, a)
        folded += "state" in classes
        if b is not None:
            row_of.setdefault(b.name, i)
        if a is not None:
            row_of.setdefault(f"after:{a.name}", i)
        if b is not None and b.status in ("rewritten", "removed") and rules:
            gutter = "".join(paint.badge(r, " →") for r in rules)
        elif b is not None and b.status == "removed":
            gutter = '<span class="muted">unused</span>'
        else:
            gutter = ""
        row_id = "" if "same" in classes else f' id="row-{i}"'
        body.append(
            f'<tr{row_id} class="{" ".join(classes)}">{paint.cells(b, "b")}<td class="gut">{gutter}</td>'
            f"{paint.cells(a, 'a')}</tr>"
        )
    if folded:
        fold = (
            f'<tr class="state-fold"><td colspan="7"><label for="show-state">{folded} unchanged parameter, buffer '
            "and constant inputs hidden: show them</label></td></tr>"
        )
        body.insert(0, fold)
    widths = (11, 20, 11, 14, 11, 22, 11)
    table = (
        '<div class="card"><table class="graphs"><colgroup>'
        + "".join(f'<col style="width:{w}%">' for w in widths)
        + f'</colgroup><thead><tr><th class="side" colspan="3">Before ({len(e.before)} nodes)</th><th>rule</th>'
        f'<th class="side" colspan="3">After the rules ({len(e.after)} nodes)</th></tr></thead>\n<tbody>\n'
        + "\n".join(body)
        + "\n</tbody></table></div>"
    )
    return table, row_of, folded


def _row_link(node: str, row_of: dict[str, int]) -> str:
    """The node's name, linked to its row in the graphs table when it has one."""
    row = row_of.get(node, row_of.get(f"after:{node}"))
    return f'<a href="#row-{row}">{_e(node)}</a>' if row is not None else _e(node)


def _controls(e: Explanation, row_of: dict[str, int], folded: int) -> str:
    """Checkboxes (read by the CSS: changed rows only; show the folded inputs) and links to each rewritten node."""
    changed = sum(1 for b, _, a in e.rows if "same" not in _row_classes(b, a))
    boxes = (
        '<input type="checkbox" class="filter" id="changed-only"><input type="checkbox" class="filter" id="show-state">'
        if folded
        else '<input type="checkbox" class="filter" id="changed-only">'
    )
    labels = [f'<label for="changed-only">changed rows only ({changed} of {len(e.rows)})</label>']
    if folded:
        labels.append(f'<label for="show-state">show the {folded} unchanged parameter/buffer/constant inputs</label>')
    targets = list(dict.fromkeys(f.node for f in e.fired))
    if targets:
        links = " ".join(_row_link(n, row_of) for n in targets)
        labels.append(f'<span class="jumps">jump to a rewritten node: {links}</span>')
    return boxes + f'<div class="controls">{"".join(labels)}</div>'


def render_html(e: Explanation) -> str:
    """One self-contained page: a summary, both graphs side by side (each
    rewritten node next to what it became, tinted with the rule that made
    it; unchanged parameter inputs folded away, a filter for the changed
    rows, links to each rewritten node), the rewrites, and the near-misses."""
    order = [r for r, _ in e.rewrites] + [f.rule for f in e.fired]
    paint = _Painter(
        colours={r: _PALETTE[i % len(_PALETTE)] for i, r in enumerate(dict.fromkeys(order))},
        gone=frozenset(line.name for line in e.before if line.status in ("rewritten", "removed")),
        made=frozenset(line.name for line in e.after if line.status == "new"),
    )
    graphs, row_of, folded = _graphs(e, paint)
    total = sum(c for _, c in e.rewrites)
    ok = e.stop_reason == "converged"
    chips = "".join(f"<li>{paint.badge(r)} <span class='muted'>×{c}</span></li>" for r, c in e.rewrites)
    if not chips:
        chips = f"<li class='muted'>no rule fired{' (' + _e(e.rule) + ')' if e.rule else ''}</li>"

    fired_rows = "".join(
        f"<tr><td>{paint.badge(f.rule)}</td><td class='mono'>{_row_link(f.node, row_of)}</td>"
        f"<td class='mono'>{_op_html(f.op)}</td>"
        f"<td class='mono'>{_e(', '.join(f.into)) if f.into else ('<i>removed</i>' if f.gone else 'kept')}</td></tr>"
        for f in e.fired
    ) + "".join(
        f"<tr class='fail'><td>{paint.badge(r)}</td><td class='mono'>{_row_link(n, row_of)}</td>"
        f"<td colspan='2'>failed, skipped: {_e(c)}</td></tr>"
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
        f"<style>{_CSS}{_FILTER_CSS}</style></head>",
        "<body><main>",
        f"<h1>fx-rewrites explain <code>{_e(e.title)}</code></h1>",
        f'<p class="sub">{summary}</p>',
        f'<ul class="chips">{chips}</ul>',
        f'<p class="legend">{legend}</p>',
        notes,
        "<h2>Graph before and after the rules</h2>",
        _controls(e, row_of, folded),
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
