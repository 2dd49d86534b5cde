"""Targeted decomposition: replace one op by its `torch._decomp` body.

Unlike `ExportedProgram.run_decompositions`, only the nodes of the named
ops are touched: the decomposition is traced with `make_fx` on the node's
own fake values and inlined in place of the node.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import attrs
from torch.fx import Node
from torch.fx.experimental.proxy_tensor import make_fx

from fx_rewrites import decompositions, schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds.base import RuleBase, as_tuple


def _decomposition(op: Any, table: Mapping[Any, Callable[..., Any]] | None) -> Callable[..., Any] | None:
    """`table[op]`; without a table, `fx_rewrites.decompositions`: torch's table, the ones torch lacks,
    then the op's own CompositeImplicitAutograd kernel (`aten.diff`, `aten.to.dtype`)."""
    if table is not None:
        return table.get(op)
    return decompositions.decomposition(op)


@attrs.frozen(kw_only=True)
class Decompose(RuleBase):
    """Inline the decomposition of each op in `ops`.

    `table` maps ops to decomposition functions; by default torch's own
    (`torch._decomp.decomposition_table`), then the op's
    CompositeImplicitAutograd kernel. Every op must have one.
    """

    ops: tuple[Any, ...] = attrs.field(converter=as_tuple)
    table: Mapping[Any, Callable[..., Any]] | None = attrs.field(default=None, eq=False, repr=False)

    def _build(self) -> tuple[Hashable, ...]:
        ops = schema.resolve_ops(self.ops)
        table = {op: fn for op in ops if (fn := _decomposition(op, self.table)) is not None}
        missing = [schema.op_name(op) for op in ops if op not in table]
        if missing:
            raise ValueError(f"no decomposition for {missing}; pass table={{op: fn}}")
        self._set("ops", ops)
        self._set("table", table)
        return ops

    def _default_name(self) -> str:
        return f"decompose_{self.ops[0]._opname}"

    def rewrite(self, node: Node, match: Any, rw: Rewriter) -> Any:
        body, graph_values = schema.over_graph_values(node, self.table[node.target])
        with rw.fake_mode:
            traced = make_fx(body, tracing_mode="real")(*[n.meta["val"] for n in graph_values])
        out = next(n for n in traced.graph.nodes if n.op == "output").args[0]
        if out is NotImplemented or (isinstance(out, (list, tuple)) and NotImplemented in out):
            return Miss("the decomposition declined these arguments")
        new = rw.inline(traced, graph_values)
        rw.replace(node, new)
        return None
