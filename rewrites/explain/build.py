"""Reading a rewrite run into an `Explanation`: the graphs before and after, provenance, near-misses."""

from __future__ import annotations

import difflib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from fx_rewrites.engine import Attempt, Report
from fx_rewrites.explain.data import MAX_ARGS, Explanation, Line, NearMiss, Rewrite
from fx_rewrites.schema import op_name


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
