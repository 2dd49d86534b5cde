"""torch.distributed's functional collectives in a rank's graph: which run on the host, and how.

A model split with torch's tensor-parallel API (`parallelize_module` with `ColwiseParallel` /
`RowwiseParallel`, or transformers' `tp_plan`) traces, on each rank, into local matmuls between
functional collectives: `_c10d_functional.all_reduce(x, "sum", group)` then `wait_tensor` (a
`RowwiseParallel` output), `all_gather_into_tensor` (+ `split` and `cat` for a shard along a dim other
than 0), `reduce_scatter_tensor`, `all_to_all_single`, `broadcast`. A compiler such as IREE has no
lowering for them and needs none: the collective runs on torch.distributed (gloo on CPUs, NCCL on GPUs,
across hosts with torchrun's rendezvous) and the compute between collectives on the backend
(`backends/segments.py` splits a graph so).

`HANDLED` is what the host runs: the functional collectives (they write none of their arguments and
return new tensors, which `wait_tensor` completes). Any other op of torch.distributed's namespaces in a
graph (an in-place or `out=` collective, point-to-point `isend`/`irecv`, a c10d op that returns a `Work`
handle) is an `UnhandledCollective`, an error that names the op (`.op`, which torch.compile's fallback
warning quotes). Host steps are data (`HostCall`): saved with a rank's module as JSON and run again by
looking the op up among `HANDLED`, never by unpickling.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch._ops import OpOverload
from torch.export import ExportedProgram
from torch.fx import Graph, GraphModule, Node

from fx_rewrites.engine import RewriteError

_F = torch.ops._c10d_functional

#: the functional collectives a rank's graph may hold, all run on the host by torch.distributed
COLLECTIVES: tuple[OpOverload, ...] = (
    _F.all_reduce.default,
    _F.all_reduce_coalesced.default,
    _F.all_gather_into_tensor.default,
    _F.all_gather_into_tensor_coalesced.default,
    _F.reduce_scatter_tensor.default,
    _F.reduce_scatter_tensor_coalesced.default,
    _F.all_to_all_single.default,
    _F.broadcast.default,
)
#: what completes a collective's result (a collective's output is read only after it)
WAIT = _F.wait_tensor.default
#: everything the host runs: the collectives and their wait
HANDLED: frozenset[OpOverload] = frozenset((*COLLECTIVES, WAIT))
_BY_NAME: dict[str, OpOverload] = {str(op): op for op in HANDLED}

#: torch.distributed's op namespaces: an op of one of these that is not in HANDLED is an UnhandledCollective
NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d", "_dtensor"})


class UnhandledCollective(RewriteError):
    """A torch.distributed op in a graph that the collective rules do not run (named in `.op`)."""

    def __init__(self, message: str, *, op: str = "", node: str = "") -> None:
        super().__init__(message)
        self.op = op
        self.node = node


def is_collective(node: Node) -> bool:
    """Whether `node` is a collective or its wait (runs on the host), or a getitem of one."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem and isinstance(node.args[0], Node):
        return is_collective(node.args[0])
    return node.target in HANDLED


def _namespace(target: Any) -> str:
    return getattr(target, "namespace", "") if isinstance(target, OpOverload) else ""


def _why_not(op: OpOverload) -> str:
    schema = op._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "it writes into its argument (an in-place or out= collective)"
    if op.namespace == "c10d":
        return "it is a c10d process-group call that returns a Work handle, not a functional collective"
    if "send" in op.name() or "recv" in op.name() or "p2p" in op.name():
        return "it is point-to-point (pipeline parallelism), which the host steps do not order across ranks"
    if op.namespace == "_c10d_functional_autograd":
        return "it is the autograd-aware form, which appears in training graphs only"
    return "it is not among the functional collectives the host runs"


def check(graph: Graph | GraphModule) -> list[Node]:
    """The collective nodes of `graph` (HANDLED ops and their getitems), in graph order; an
    UnhandledCollective for the first op of torch.distributed's namespaces that is not handled."""
    if isinstance(graph, GraphModule):
        graph = graph.graph
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if is_collective(node):
            found.append(node)
        elif _namespace(node.target) in NAMESPACES:
            op = str(node.target)
            raise UnhandledCollective(
                f"node {node.name!r} calls `{op}`, a torch.distributed op the collective rules do not handle: "
                f"{_why_not(node.target)}. Handled (run on the host by torch.distributed between the backend's "
                f"segments): {', '.join(sorted(str(o) for o in COLLECTIVES))}, each completed by `{WAIT}`. Fix: "
                "write the model with torch.distributed._functional_collectives (funcol.all_reduce, "
                "all_gather_tensor, reduce_scatter_tensor) or DTensor redistributions, which trace to those",
                op=op,
                node=node.name,
            )
    return found


def has_collectives(graph: Graph | GraphModule | ExportedProgram) -> bool:
    """Whether `graph` (or a program's) holds a torch.distributed op (handled or not)."""
    if isinstance(graph, (GraphModule, ExportedProgram)):
        graph = graph.graph
    return any(
        node.op == "call_function" and (node.target in HANDLED or _namespace(node.target) in NAMESPACES)
        for node in graph.nodes
    )


# ----------------------------------------------------------------------------------------- host calls as data


@attrs.frozen
class Ref:
    """A value of the run: slot `slot` of the runner's values."""

    slot: int


@attrs.frozen
class HostCall:
    """One host op: `op` (a HANDLED op, or "getitem") over `args` (Ref, constants, lists of either), its
    result stored in slot `out`."""

    op: str
    args: tuple[Any, ...]
    out: int

    def run(self, values: list[Any]) -> None:
        args = [_resolve(a, values) for a in self.args]
        if self.op == "getitem":
            values[self.out] = args[0][args[1]]
        else:
            values[self.out] = _BY_NAME[self.op](*args)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "args": [_encode(a) for a in self.args], "out": self.out}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> HostCall:
        op = doc["op"]
        if op != "getitem" and op not in _BY_NAME:
            raise UnhandledCollective(
                f"a saved host step calls `{op}`, which is not among the collectives the host runs "
                f"({sorted(_BY_NAME)}); the file was written by another version or altered. Fix: save it again",
                op=op,
            )
        return cls(op, tuple(_decode(a) for a in doc["args"]), int(doc["out"]))


def group_names(calls: Sequence[HostCall]) -> set[str]:
    """The process groups (`group_name` arguments) `calls` run their collectives on."""
    names = set()
    for call in calls:
        if call.op == "getitem":
            continue
        arguments = [a.name for a in _BY_NAME[call.op]._schema.arguments]
        if "group_name" in arguments and arguments.index("group_name") < len(call.args):
            names.add(str(call.args[arguments.index("group_name")]))
    return names


def _resolve(arg: Any, values: list[Any]) -> Any:
    if isinstance(arg, Ref):
        return values[arg.slot]
    if isinstance(arg, (list, tuple)):
        return [_resolve(a, values) for a in arg]
    return arg


def _encode(arg: Any) -> Any:
    if isinstance(arg, Ref):
        return {"slot": arg.slot}
    if isinstance(arg, (list, tuple)):
        return {"list": [_encode(a) for a in arg]}
    if arg is None or isinstance(arg, (bool, int, float, str)):
        return arg
    raise TypeError(f"a host step's argument {arg!r} ({type(arg).__name__}) cannot be saved")


def _decode(doc: Any) -> Any:
    if isinstance(doc, dict):
        if "slot" in doc:
            return Ref(int(doc["slot"]))
        return tuple(_decode(a) for a in doc["list"])
    return doc


def host_calls(nodes: Sequence[Node], slot_of: Mapping[Node, int], first_free: int) -> tuple[list[HostCall], int]:
    """`nodes` (one host region's collectives, waits and getitems, in order) as HostCalls reading the slots
    `slot_of` gives their inputs and writing new slots from `first_free` (recorded into `slot_of`)."""
    calls: list[HostCall] = []
    slots = dict(slot_of)
    next_slot = first_free

    def arg(a: Any) -> Any:
        if isinstance(a, Node):
            return Ref(slots[a])
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        if isinstance(a, torch.SymInt):
            raise UnhandledCollective(
                f"a collective's argument is a symbolic size ({a}): the host steps take sizes that are constant. "
                "Fix: static sizes for the collective's split sizes"
            )
        return a

    for node in nodes:
        if node.kwargs:
            raise UnhandledCollective(
                f"node {node.name!r} ({node.target}) has keyword arguments {sorted(node.kwargs)}; the host steps "
                "take a collective's arguments by position (as traces give them)",
                op=str(node.target),
                node=node.name,
            )
        op = "getitem" if node.target is operator.getitem else str(node.target)
        calls.append(HostCall(op, tuple(arg(a) for a in node.args), next_slot))
        slots[node] = next_slot
        next_slot += 1
    if isinstance(slot_of, dict):
        slot_of.update(slots)
    return calls, next_slot


__all__ = [
    "COLLECTIVES",
    "HANDLED",
    "NAMESPACES",
    "WAIT",
    "HostCall",
    "Ref",
    "UnhandledCollective",
    "check",
    "group_names",
    "has_collectives",
    "host_calls",
    "is_collective",
]
