"""Pattern rules in the `torch.fx.subgraph_rewriter` format.

The pattern and replacement are plain callables, traced once when the rule
is built; their parameters are wildcards. Write them with the ops of the
graphs they will meet (`torch.ops.aten.relu.default(x)` for exported
graphs). The match is anchored at the pattern's output node, so the rule
is indexed by that node's target and tried only where it can match.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import attrs
import torch
from torch.fx import Graph, GraphModule, Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds.base import RuleBase
from fx_rewrites.schema import op_name


def _trace(fn: Callable[..., Any], what: str) -> GraphModule:
    try:
        return torch.fx.symbolic_trace(fn)
    except Exception as e:
        raise ValueError(f"the {what} does not trace with torch.fx.symbolic_trace: {type(e).__name__}: {e}") from e


def _placeholders(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


@attrs.frozen(kw_only=True)
class Pattern(RuleBase):
    """Where `pattern(*wildcards)` matches, put `replacement(*wildcards)`."""

    pattern: Callable[..., Any] = attrs.field()
    replacement: Callable[..., Any] = attrs.field()
    pattern_gm: GraphModule = attrs.field(init=False, default=None, repr=False, eq=False)
    replacement_gm: GraphModule = attrs.field(init=False, default=None, repr=False, eq=False)
    anchor: Node = attrs.field(init=False, default=None, repr=False, eq=False)
    wildcards: tuple[Node, ...] = attrs.field(init=False, default=(), repr=False, eq=False)

    def _build(self) -> tuple[Hashable, ...]:
        pattern = _trace(self.pattern, "pattern")
        replacement = _trace(self.replacement, "replacement")
        (output,) = [n for n in pattern.graph.nodes if n.op == "output"]
        anchor = output.args[0]
        if not isinstance(anchor, Node) or anchor.op != "call_function":
            raise ValueError("the pattern must return the result of one op call (its anchor)")
        n_pat, n_rep = len(_placeholders(pattern.graph)), len(_placeholders(replacement.graph))
        if n_pat != n_rep:
            raise ValueError(f"the pattern takes {n_pat} wildcards but the replacement takes {n_rep}")
        for n in pattern.graph.nodes:
            if n.op not in ("placeholder", "call_function", "output"):
                raise ValueError(f"pattern node {n.format_node()} is a {n.op}; use only op calls")
        self._set("pattern_gm", pattern)
        self._set("replacement_gm", replacement)
        self._set("anchor", anchor)
        self._set("wildcards", tuple(_placeholders(pattern.graph)))
        return (anchor.target,)

    def _default_name(self) -> str:
        return f"pattern_{getattr(self.pattern, '__name__', 'fn')}"

    def _match(self, node: Node) -> Any:
        bindings: dict[Node, Any] = {}
        if _match_node(self.anchor, node, bindings, explain=False):
            return Miss(lambda: _match_node(self.anchor, node, {}, explain=True))
        return [bindings[p] for p in self.wildcards]

    def rewrite(self, node: Node, match: Any, rw: Rewriter) -> None:
        new = rw.inline(self.replacement_gm, match, modify=node)
        if new is not node:
            rw.replace(node, new)


#: what the matchers return for "no match" when nobody asked why
_NO = "no match"


def _match_node(p: Node, g: Any, bindings: dict[Node, Any], explain: bool) -> str | None:
    """None when pattern node `p` matches graph value `g`; else why not
    (with `explain`; a fixed text otherwise, formatting costs)."""
    if p.op == "placeholder":
        if p in bindings:
            seen = bindings[p]
            same = seen is g if isinstance(seen, Node) or isinstance(g, Node) else seen == g
            if same:
                return None
            return f"wildcard {p.name!r} would bind two different values" if explain else _NO
        bindings[p] = g
        return None
    if not isinstance(g, Node):
        return f"expected {op_name(p.target)}, found constant {g!r}" if explain else _NO
    if g.op != "call_function" or g.target != p.target:
        return f"expected {op_name(p.target)}, found {op_name(g.target)} ({g.name})" if explain else _NO
    if len(g.args) != len(p.args) or g.kwargs.keys() != p.kwargs.keys():
        return f"{g.name}: argument layout differs from the pattern" if explain else _NO
    for i, (pa, ga) in enumerate(zip(p.args, g.args)):
        why = _match_arg(pa, ga, bindings, explain)
        if why:
            return f"{g.name} arg {i}: {why}" if explain else _NO
    for k, pa in p.kwargs.items():
        why = _match_arg(pa, g.kwargs[k], bindings, explain)
        if why:
            return f"{g.name} {k}=: {why}" if explain else _NO
    return None


def _match_arg(pa: Any, ga: Any, bindings: dict[Node, Any], explain: bool) -> str | None:
    if isinstance(pa, Node):
        return _match_node(pa, ga, bindings, explain)
    if isinstance(pa, (list, tuple)):
        if not isinstance(ga, (list, tuple)) or len(ga) != len(pa):
            return f"expected {pa!r}, found {ga!r}" if explain else _NO
        for x, y in zip(pa, ga):
            why = _match_arg(x, y, bindings, explain)
            if why:
                return why
        return None
    if isinstance(ga, Node) or pa != ga:
        return f"expected {pa!r}, found {ga!r}" if explain else _NO
    return None
