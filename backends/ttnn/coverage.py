"""What the ttnn lowering takes: per aten op, nodes on the device and nodes left on the host, and why.

    cov = coverage(program)
    print(cov.text())                      # the table `fx-rewrites check MODEL --backend ttnn` prints
    cov.device_share                       # lowered nodes / nodes after DEFAULT

Counted on the graph the ttnn phases receive (after DEFAULT), one count per
call node except `operator.getitem` (tuple plumbing): a node is on the
device when a lowering rule replaced it (a batch norm folded into the
convolution before it counts with that convolution). The reason a node
stayed on the host is what the lowering rule said when it declined
(`apply(..., explain=True)`), or that no rule lowers its op. Nodes computed
from the program's constants or factories only are counted apart (`once`):
the compiled function computes them on its first call (on the host, or a
lowered factory on the device), they are not per-call work, and the device
share leaves them out.
"""

from __future__ import annotations

import operator
from collections import Counter, defaultdict

import attrs
from torch.export import ExportedProgram
from torch.fx import Graph, GraphModule, Node

from fx_rewrites.api import apply
from fx_rewrites.backends.partition import Partitioning, partition
from fx_rewrites.backends.ttnn.constants import program_constants
from fx_rewrites.backends.ttnn.rules import FOLD, PHASES, is_device_node
from fx_rewrites.backends.ttnn.rules.ops import is_standin
from fx_rewrites.ruleset import Phases
from fx_rewrites.schema import op_name


@attrs.frozen
class OpCoverage:
    """One aten op: how many nodes went to the device, how many stayed, and the reasons (with counts)."""

    op: str
    on_device: int
    on_host: int
    reasons: tuple[tuple[str, int], ...] = ()
    #: nodes computed from the program's constants only: once, on the host (not in `total`)
    once: int = 0

    @property
    def total(self) -> int:
        return self.on_device + self.on_host


@attrs.frozen
class Coverage:
    label: str
    ops: tuple[OpCoverage, ...]
    partitioning: Partitioning = attrs.field(repr=False)

    @property
    def nodes(self) -> int:
        return sum(o.total for o in self.ops)

    @property
    def nodes_on_device(self) -> int:
        return sum(o.on_device for o in self.ops)

    @property
    def nodes_once(self) -> int:
        """Nodes computed from constants only (once per compiled function, on the host)."""
        return sum(o.once for o in self.ops)

    @property
    def device_share(self) -> float:
        """Device nodes over per-call nodes (constants-only nodes left out)."""
        return self.nodes_on_device / self.nodes if self.nodes else 1.0

    def summary(self) -> str:
        p = self.partitioning
        once = f"; {self.nodes_once} computed once from constants" if self.nodes_once else ""
        return (
            f"{self.nodes_on_device} of {self.nodes} nodes on device ({self.device_share:.1%}){once}; "
            f"{p.num_regions} regions ({len(p.device_regions)} device, {len(p.host_regions)} host)"
        )

    def text(self) -> str:
        """A plain-text table, widest reasons last."""
        rows = [("op", "device", "host", "why on host")]
        for o in self.ops:
            why = "; ".join(f"{r} (x{n})" if n > 1 else r for r, n in o.reasons)
            if o.once:
                why = "; ".join(w for w in (f"{o.once} computed once from constants", why) if w)
            rows.append((o.op, str(o.on_device), str(o.on_host), why or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}" for r in rows]
        return "\n".join([f"ttnn coverage of {self.label}: {self.summary()}", *lines])


def _counted(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


def _reason(text: str) -> str:
    return text.removeprefix("when: ")


def coverage(program: ExportedProgram | GraphModule, label: str = "model", phases: Phases = PHASES) -> Coverage:
    """Lower `program` through the ttnn backend's `phases` (DEFAULT, the folds, then the ttnn pack) and count
    what went where: on the graph after the first phase."""
    first = apply(program, phases.sets[0])
    before = first.program if first.program is not None else first.graph_module
    second = apply(before, Phases(*phases.sets[1:], name=phases.name), explain=True)
    attempts: dict[str, list[str]] = defaultdict(list)
    for a in second.report.explain():
        if not a.fired and a.rule != "fuse_round_trip" and a.rule not in FOLD:
            attempts[a.node].append(_reason(a.reason))
    once_nodes = program_constants(before)
    totals = Counter(op_name(n.target) for n in _counted(first.graph_module.graph) if n not in once_nodes)
    once = Counter(op_name(n.target) for n in _counted(first.graph_module.graph) if n in once_nodes)
    after = second.program if second.program is not None else second.graph_module
    constant_after = program_constants(after)
    host: Counter = Counter()
    reasons: dict[str, Counter] = defaultdict(Counter)
    for node in _counted(second.graph_module.graph):
        if is_standin(node.target) or node in constant_after:  # constants-only: counted in `once` (or made by a fold)
            continue
        name = op_name(node.target)
        host[name] += 1
        for why in dict.fromkeys(attempts.get(node.name) or [f"no ttnn lowering for {name}"]):
            reasons[name][why] += 1
    names = set(totals) | set(once)
    ops = tuple(
        OpCoverage(name, totals[name] - host[name], host[name], tuple(reasons[name].most_common()), once[name])
        for name in sorted(names, key=lambda k: (-host[k], -totals[k], -once[k], k))
    )
    return Coverage(label, ops, partition(second.graph_module.graph, is_device_node))
