"""What a branch of a size cond costs, estimated from its ops and sizes: is it worth compiling each side apart?

`cond_to_where` computes both branches on every call and selects; a size dispatch computes one and pays a
fixed cost per call (the predicate on the host, one more call layer). The dispatch is worth it where the work
it saves (the branch the call's sizes rule out, and the select) exceeds that fixed cost on some side.

Costs are in element operations at the sizes of the example inputs the program was exported with (their
hints): an element-wise op costs the elements it writes; other ops the larger of the elements they read and
write; a matrix product or convolution its multiply-adds (torch's flop counter's formulas, halved); views and
size arithmetic nothing. `DISPATCH_COST` is the fixed cost in the same unit, measured on IREE
(`python benchmarks/size_dispatch.py`, docs/performance.md).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

from fx_rewrites.subgraphs import graph_outputs, subgraph, walk

aten = torch.ops.aten

#: a size dispatch's own cost per call, in element operations: its Python is 1.0 us a call (the guard as closures,
#: without the IREE call), one element operation of a fused element-wise chain of tanh, cos, mul and add 0.28-0.35
#: ns on IREE (llvm-cpu, local-sync, one thread, Sapphire Rapids): 10,000 is 3-4 us, with room for the call layer
#: (benchmarks/size_dispatch.py prints both; docs/performance.md)
DISPATCH_COST = 10_000

#: a size with no hint (an unbacked size): counted as this many
UNHINTED = 8192


def _hint(size: Any) -> int:
    return optimization_hint(size, fallback=UNHINTED) if isinstance(size, torch.SymInt) else int(size)


def _concrete(value: Any) -> Any:
    """`value` with tensors as their shapes and SymInts as ints (the sizes' hints)."""
    if isinstance(value, torch.Tensor):
        return torch.Size(_hint(s) for s in value.shape)
    if isinstance(value, torch.SymInt):
        return _hint(value)
    return value


def _elements(value: Any) -> int:
    return sum(math.prod(_hint(s) for s in t.shape) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def _is_view(target: Any) -> bool:
    returns = target._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def op_cost(node: Node) -> int:
    """The element operations `node` costs (module docstring); 0 for anything but an ATen op's call."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or _is_view(node.target):
        return 0
    out = node.meta.get("val")
    written = _elements(out)
    if written == 0:  # size arithmetic, or nothing written
        return 0
    concrete = lambda a: _concrete(a.meta.get("val")) if isinstance(a, Node) else a  # noqa: E731
    args, kwargs = pytree.tree_map(concrete, (node.args, node.kwargs))
    formula = flop_registry.get(node.target.overloadpacket)
    if formula is not None:
        try:
            return int(formula(*args, out_val=_concrete(out), **kwargs)) // 2
        except Exception:  # a formula that does not take this call's form: counted as the elements moved
            pass
    if node.target is aten.matmul.default:  # torch's flop counter has mm and bmm, not the matmul before them
        return written * int(args[0][-1])
    if torch.Tag.pointwise in node.target.tags:
        return written
    read = _elements([a.meta.get("val") for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, Node)])
    return max(written, read)


def branch_cost(branch: Node) -> int:
    """The element operations of a cond branch (the get_attr node naming its subgraph), nested ones included."""
    return sum(op_cost(n) for n in walk(subgraph(branch)))


@attrs.frozen
class DispatchCost:
    """A cond's costs in element operations: each branch, the select `cond_to_where` adds, and the verdict."""

    true_branch: int
    false_branch: int
    select: int

    @property
    def saved(self) -> int:
        """What dispatching saves on the call that rules out the costlier branch."""
        return max(self.true_branch, self.false_branch) + self.select

    @property
    def worth_dispatching(self) -> bool:
        return self.saved > DISPATCH_COST

    def __str__(self) -> str:
        verdict = "dispatch" if self.worth_dispatching else "compute both and select"
        return (
            f"branches {self.true_branch:,} and {self.false_branch:,} element ops, select {self.select:,}: saves "
            f"{self.saved:,} against the dispatch's {DISPATCH_COST:,}: {verdict}"
        )


def dispatch_cost(cond: Node) -> DispatchCost:
    """The costs of cond node `cond` (`torch.ops.higher_order.cond`) at its program's example sizes."""
    outputs = [getattr(v, "meta", {}).get("val") for v in graph_outputs(subgraph(cond.args[1]))]
    select = sum(_elements(v) for v in outputs if isinstance(v, torch.Tensor))
    return DispatchCost(branch_cost(cond.args[1]), branch_cost(cond.args[2]), select)


__all__ = ["DISPATCH_COST", "DispatchCost", "branch_cost", "dispatch_cost", "op_cost"]
