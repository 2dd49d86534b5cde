"""Recording every node's value on torch, and rebuilding pieces of the graph as GraphModules of their own."""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Graph, GraphModule, Interpreter, Node
from torch.utils import _pytree as pytree

from fx_rewrites.app.localize.dynamic import is_symbolic, program_value, recompute_sizes

# ----------------------------------------------------------------------------- recording


def flat_inputs(program: ExportedProgram, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> list[Any]:
    """The graph module's placeholders' values: parameters, buffers, constants and the user's inputs."""
    from torch.fx import _pytree as fx_pytree

    user = iter(fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs or {})), program.call_spec.in_spec))
    signature = program.graph_signature
    mutated = {*signature.buffers_to_mutate.values(), *signature.user_inputs_to_mutate.values()}
    flat = []
    for spec in signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            value = next(user)
        elif spec.target in program.state_dict:
            value = program.state_dict[spec.target]
        else:
            value = program.constants[spec.target]
        # a copy of what a run writes back into (a compiled program may update the program's own buffers)
        mutable = spec.arg.name in mutated or spec.target in mutated
        flat.append(value.clone() if mutable and isinstance(value, torch.Tensor) else value)
    return flat


class _Recorder(Interpreter):
    def __init__(self, gm: GraphModule, clone: bool) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}
        self.clone = clone

    def run_node(self, n: Node) -> Any:
        value = super().run_node(n)
        keep = pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, value) if self.clone else value
        self.values[n.name] = keep
        return value


def record(gm: GraphModule, flat: Sequence[Any]) -> dict[str, Any]:
    """Every node's value on torch (tensors cloned where an op writes into its inputs)."""
    mutates = any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable for n in gm.graph.nodes)
    recorder = _Recorder(gm, clone=mutates)
    with torch.no_grad():
        recorder.run(*[a.clone() if mutates and isinstance(a, torch.Tensor) else a for a in flat])
    return recorder.values


# ----------------------------------------------------------------------------- pieces


def _has_tensor(value: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(value))


def units(gm: GraphModule, values: Mapping[str, Any]) -> list[Node]:
    """The nodes judged one by one: call_functions producing tensors (a getitem goes with its producer)."""
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem and _has_tensor(values.get(n.name))
    ]


def build_piece(
    nodes: Sequence[Node], values: Mapping[str, Any], *, symbolic: bool = False
) -> tuple[GraphModule, list[Any], list[tuple]]:
    """`nodes` as a GraphModule of their own: what they read from outside is a placeholder fed the recorded
    value (a tensor) or the recorded value inlined (a number, a list); every tensor they make is an output.
    With `symbolic`, the piece keeps the program's symbolic shapes (`dynamic`): its values are the program's
    FakeTensors with SymInts, and a dynamic size read from outside is recomputed or a placeholder.
    Returns the module, its inputs and, per output, (node, index in a tuple value or None)."""
    inside = {n for n in nodes}
    inside |= {u for n in nodes for u in n.users if u.target is operator.getitem}
    graph, root = Graph(), torch.nn.Module()
    env: dict[Node, Any] = {}
    held: list[tuple[Node, Any]] = []  # the placeholders and their recorded values, in order

    def placeholder(name: str, value: Any, source: Node, index: int | None = None) -> Node:
        p = graph.placeholder(name)
        if symbolic:
            p.meta["val"] = program_value(source, index)
        held.append((p, value))
        return p

    def outside(n: Node) -> Any:
        if n in env:
            return env[n]
        value = values[n.name]
        if isinstance(value, torch.Tensor):
            env[n] = placeholder(n.name, value, n)
        elif isinstance(value, torch.nn.Module):  # a higher-order op's subgraph
            setattr(root, n.name, value)
            env[n] = graph.get_attr(n.name)
        elif isinstance(value, (tuple, list)) and _has_tensor(value):
            env[n] = [outside_leaf(n, i, v) for i, v in enumerate(value)]
        elif symbolic and is_symbolic(n.meta.get("val")):  # a dynamic size: recomputed below where it can be
            env[n] = placeholder(n.name, value, n)
        else:
            env[n] = value
        return env[n]

    def outside_leaf(n: Node, i: int, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return placeholder(f"{n.name}_{i}", value, n, i)

    ordered = sorted(inside, key=_order(nodes))
    kept = ("stack_trace", "nn_module_stack", "val") if symbolic else ("stack_trace", "nn_module_stack")
    for n in ordered:
        copy = graph.node_copy(n, lambda a: env[a] if a in inside else outside(a))
        copy.meta = {k: v for k, v in n.meta.items() if k in kept}
        if symbolic:
            copy.meta["val"] = program_value(n)
        env[n] = copy
    outputs: list[tuple[Node, int | None]] = []
    for n in ordered:
        value = values[n.name]
        if isinstance(value, torch.Tensor):
            outputs.append((n, None))
        elif n.target is not operator.getitem:  # a tuple: the elements no getitem here takes
            taken = {u.args[1] for u in n.users if u.target is operator.getitem and u in inside}
            outputs += [(n, i) for i, v in enumerate(value) if isinstance(v, torch.Tensor) and i not in taken]
    results = []
    for n, i in outputs:
        result = env[n] if i is None else graph.call_function(operator.getitem, (env[n], i))
        if symbolic and i is not None:
            result.meta["val"] = program_value(n, i)
        results.append(result)
    graph.output(tuple(results))
    _placeholders_first(graph)
    if symbolic:
        held = recompute_sizes(graph, held)
        graph.lint()
    gm = GraphModule(root, graph)
    inputs = [value for _, value in held]
    if not symbolic:
        _propagate(gm, inputs)
    return gm, inputs, outputs


def _propagate(gm: GraphModule, inputs: Sequence[Any]) -> None:
    """Every node's meta["val"]: fake tensors of the recorded (static) sizes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    graph = gm.graph
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(v) for v in inputs]
    for p, fake in zip([p for p in graph.nodes if p.op == "placeholder"], fakes):
        p.meta["val"] = fake
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level, quiet.level = quiet.level, logging.CRITICAL  # it logs each failing op: the caller says why
    try:
        with mode:
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    finally:
        quiet.setLevel(level)


def _order(nodes: Sequence[Node]) -> Callable[[Node], int]:
    where = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return lambda n: where[n]


def _placeholders_first(graph: Graph) -> None:
    """Placeholders (made as the copies first read them) moved before every other node, in their order."""
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for p in [n for n in graph.nodes if n.op == "placeholder"]:
        first.prepend(p)
    graph.lint()
