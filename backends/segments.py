"""A rank's graph cut at its collectives: segments for the backend, collectives on the host, as data.

    plan, graphs = segment_graph(gm)           # torch.compile's graphs: a GraphModule per segment
    plan, programs = segment_program(ep)       # the export route: an ExportedProgram per segment
    run = Segmented(plan, {name: backend.compile(g, ...) for name, g in graphs.items()})
    run(*inputs)                               # segment 0 on the backend, all_reduce on the host, segment 1 ...

The linear partitioner (`partition.py`, the fewest regions any acyclic split has) puts the collectives and
their waits (`collectives.HANDLED`) on the host and everything else on the device; a collective and its
wait read nothing from the device between them, so they share one host region: one host round trip per
collective (fewer where independent collectives share a level). A symbolic size (`sym_size`, arithmetic on
sizes) read across a boundary is recomputed inside each segment that reads it, never passed between them.

The `Plan` (`segment_plan.py`, with `Segmented`, which runs one) is data (JSON): which values (slots) each step
reads and writes, the host steps as `collectives.HostCall`s and the outputs; a rank's saved module carries it,
so `load` needs no pickle.

For an ExportedProgram each device segment is a program of its own over the same state: a parameter or
buffer it reads is a state input (the same tensor, so a module of several segments holds one copy), a
buffer the program updates is a BUFFER_MUTATION output of the segment computing its new value (a KV cache
stays in the module between segments and calls), and values from other segments are user inputs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx import Graph, GraphModule, Node

from fx_rewrites.backends import collectives
from fx_rewrites.backends.collectives import Ref, UnhandledCollective
from fx_rewrites.backends.partition import PARTITIONED_OPS, Partitioning, Region, partition
from fx_rewrites.backends.segment_plan import DeviceStep, HostStep, Plan, Segmented
from fx_rewrites.program import quiet_torch_pytree

#: what each device segment function is named: segment_0, segment_2, ... (the region's index)
PREFIX = "segment_"


class SegmentError(ValueError):
    """A program that cannot be cut at its collectives (the message says which value and why)."""


# ----------------------------------------------------------------------------------------------- cutting


def _is_size(node: Node) -> bool:
    """A call node whose value is a symbolic size (recomputed where read, never passed between segments)."""
    return node.op == "call_function" and isinstance(
        node.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat)
    )


def _partition(gm: GraphModule) -> Partitioning:
    collectives.check(gm)
    return partition(gm.graph, lambda node: not collectives.is_collective(node))


@attrs.frozen
class _Region:
    graph: Graph
    inputs: list[Node]  # values of the original graph each placeholder stands for, in order
    outputs: list[Node]  # values of the original graph the region returns, in order


def _region_graph(region: Region, region_of: Mapping[Node, int], read_outside: set[Node]) -> _Region:
    """`region`'s nodes as a graph: what it reads from outside as placeholders (sizes recomputed from what
    they are computed from, get_attrs copied), and returning its values read outside it (`read_outside`)."""
    graph = Graph()
    env: dict[Node, Node] = {}
    inputs: list[Node] = []

    def value(v: Node) -> Node:
        if v in env:
            return env[v]
        if v.op == "get_attr":
            env[v] = graph.node_copy(v)
        elif _is_size(v) and region_of.get(v) != region.index:
            env[v] = graph.node_copy(v, value)
        else:
            env[v] = graph.placeholder(v.name)
            env[v].meta = dict(v.meta)
            inputs.append(v)
        return env[v]

    outputs: list[Node] = []
    for node in region.nodes:
        for v in node.all_input_nodes:
            value(v)
        env[node] = graph.node_copy(node, value)
        if node in read_outside:
            outputs.append(node)
    graph.output(tuple(env[n] for n in outputs))
    # placeholders first, in the order they were met (fx needs them before the body)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for p in [n for n in graph.nodes if n.op == "placeholder"]:
        first.prepend(p)
    return _Region(graph, inputs, outputs)


def _read_outside(gm: GraphModule, parts: Partitioning, extra: set[Node]) -> set[Node]:
    """Nodes read by another region or by the output (sizes excepted: recomputed), and `extra`."""
    out = set(extra)
    for node in gm.graph.nodes:
        if node.op not in PARTITIONED_OPS or _is_size(node):
            continue
        home = parts.region_of[node]
        if any(user.op == "output" or parts.region_of.get(user, home) != home for user in node.users):
            out.add(node)
    return out


def _cut(
    gm: GraphModule,
    inputs: list[Node],
    outputs: list[Any],
    extra: set[Node] = frozenset(),
    state: set[Node] = frozenset(),
) -> tuple[Plan, dict[str, _Region]]:
    """The plan over `gm` (flat inputs `inputs`, flat outputs `outputs`: nodes or constants) and each device
    region's graph, by function name. `state`: placeholders the device segments hold themselves (a program's
    weights and buffers: slot -1 in the plan until `_device_inputs_user_only` drops them)."""
    parts = _partition(gm)
    read_outside = _read_outside(gm, parts, set(extra))
    slot_of: dict[Node, int] = {node: i for i, node in enumerate(inputs)}
    next_slot = len(inputs)
    steps: list[DeviceStep | HostStep] = []
    regions: dict[str, _Region] = {}
    for region in parts.regions:
        if region.is_device:
            built = _region_graph(region, parts.region_of, read_outside)
            missing = [v for v in built.inputs if v not in slot_of and v not in state]
            if missing:
                raise SegmentError(
                    f"segment {region.name} reads {missing[0].name!r} ({missing[0].op}), which is neither an input "
                    "nor computed by an earlier step"
                )
            name = f"{PREFIX}{region.index}"
            outs = tuple(range(next_slot, next_slot + len(built.outputs)))
            slot_of.update(zip(built.outputs, outs))
            next_slot += len(outs)
            steps.append(DeviceStep(name, tuple(slot_of.get(v, -1) for v in built.inputs), outs))
            regions[name] = built
        else:
            for node in region.nodes:
                for v in node.all_input_nodes:
                    if v not in slot_of and parts.region_of.get(v) != region.index:
                        raise SegmentError(
                            f"collective {node.name!r} reads {v.name!r} ({v.op}), which the host does not hold "
                            "(a weight or constant read by a collective directly)"
                        )
            calls, next_slot = collectives.host_calls(region.nodes, slot_of, next_slot)
            steps.append(HostStep(tuple(calls)))
    flat_out: list[Any] = []
    for o in outputs:
        if isinstance(o, Node):
            if o not in slot_of:
                raise SegmentError(f"output {o.name!r} ({o.op}) is computed by no step (a constant attribute)")
            flat_out.append(Ref(slot_of[o]))
        else:
            flat_out.append(o)
    return Plan(tuple(range(len(inputs))), tuple(steps), tuple(flat_out), next_slot), regions


def segment_graph(gm: GraphModule) -> tuple[Plan, dict[str, GraphModule], pytree.TreeSpec]:
    """`gm` (a functional ATen graph: torch.compile's) cut at its collectives: the plan (its inputs are
    `gm`'s placeholders, in order), a GraphModule per device segment (sharing `gm`'s attributes) and the
    tree of `gm`'s output (the plan's outputs are its leaves)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    leaves, spec = pytree.tree_flatten(gm.graph.output_node().args[0])
    plan, regions = _cut(gm, placeholders, leaves)
    graphs = {name: GraphModule(gm, r.graph, class_name=name) for name, r in regions.items()}
    return plan, graphs, spec


# ------------------------------------------------------------------------------------- ExportedProgram


def _spec_by_name(program: ExportedProgram) -> dict[str, InputSpec]:
    return {s.arg.name: s for s in program.graph_signature.input_specs if hasattr(s.arg, "name")}


def _segment_program(
    program: ExportedProgram, name: str, region: _Region, mutations: Mapping[Node, list[str]]
) -> ExportedProgram:
    """`region` as an ExportedProgram over `program`'s state; its user inputs are the region's inputs that are
    not state, in order."""
    specs = _spec_by_name(program)
    graph = region.graph
    placeholders = graph.find_nodes(op="placeholder")
    state = [(p, v) for p, v in zip(placeholders, region.inputs) if not _is_user(v, specs)]
    user = [(p, v) for p, v in zip(placeholders, region.inputs) if _is_user(v, specs)]
    # state placeholders first, in the program's order
    order = {s.arg.name: i for i, s in enumerate(program.graph_signature.input_specs)}
    state.sort(key=lambda pv: order[pv[1].name])
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for p, _ in (*state, *user):
        first.prepend(p)
    input_specs = [
        InputSpec(specs[v.name].kind, TensorArgument(p.name), specs[v.name].target, specs[v.name].persistent)
        for p, v in state
    ] + [InputSpec(InputKind.USER_INPUT, TensorArgument(p.name), None) for p, _ in user]
    # outputs: this segment's buffer writes first, then the values read elsewhere
    output = graph.output_node()
    returned = list(output.args[0])
    by_value = dict(zip(region.outputs, returned))
    writes = [(target, by_value[v]) for v in region.outputs for target in mutations.get(v, [])]
    output.args = (tuple(n for _, n in writes) + tuple(returned),)
    output_specs = [OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(n.name), t) for t, n in writes] + [
        OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(n.name), None) for n in returned
    ]
    gm = GraphModule(program.graph_module, graph, class_name=name)
    targets = {s.target for s in input_specs if s.target is not None}
    with quiet_torch_pytree():
        in_spec = pytree.tree_flatten(((None,) * len(user), {}))[1]
        out_spec = pytree.tree_flatten((None,) * len(returned))[1]
        segment = ExportedProgram(
            root=gm,
            graph=gm.graph,
            graph_signature=ExportGraphSignature(input_specs=input_specs, output_specs=output_specs),
            state_dict={k: v for k, v in program.state_dict.items() if k in targets},
            range_constraints=copy.copy(program.range_constraints),
            module_call_graph=[ModuleCallEntry("", ModuleCallSignature([], [], in_spec, out_spec))],
            constants={k: v for k, v in program.constants.items() if k in targets},
            verifiers=program.verifiers,
        )
    return segment


def segment_program(program: ExportedProgram) -> tuple[Plan, dict[str, ExportedProgram]]:
    """`program` (rules applied) cut at its collectives: the plan (its inputs the program's flat user inputs,
    its outputs the flat user outputs) and an ExportedProgram per device segment."""
    gm = program.graph_module
    signature = program.graph_signature
    specs = _spec_by_name(program)
    placeholders = {p.name: p for p in gm.graph.find_nodes(op="placeholder")}
    user_inputs = [placeholders[s.arg.name] for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
    leaves = list(pytree.tree_leaves(gm.graph.output_node().args[0]))
    mutations: dict[Node, list[str]] = {}
    user_outputs: list[Any] = []
    for spec, leaf in zip(signature.output_specs, leaves, strict=True):
        if spec.kind == OutputKind.USER_OUTPUT:
            user_outputs.append(leaf)
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            if not isinstance(leaf, Node) or leaf.op not in PARTITIONED_OPS or collectives.is_collective(leaf):
                raise SegmentError(
                    f"buffer {spec.target!r} is updated with {getattr(leaf, 'name', leaf)!r}, which no device segment "
                    "computes (a collective's result or an input written to a buffer as is)"
                )
            mutations.setdefault(leaf, []).append(spec.target)
        else:
            raise SegmentError(
                f"the program writes {spec.kind.name} {spec.target!r}; cut at collectives, a program may update its "
                "buffers only (a KV cache, a counter)"
            )
    state = {p for name, p in placeholders.items() if specs[name].kind != InputKind.USER_INPUT}
    plan, regions = _cut(gm, user_inputs, user_outputs, set(mutations), state)
    programs: dict[str, ExportedProgram] = {}
    written = {t: name for name, r in regions.items() for v in r.outputs for t in mutations.get(v, [])}
    for index, (name, region) in enumerate(regions.items()):
        for v in region.inputs:  # a buffer read after an earlier segment wrote it would read the new value
            spec = specs.get(v.name)
            if spec is not None and spec.target in written and list(regions).index(written[spec.target]) < index:
                raise SegmentError(
                    f"{name} reads buffer {spec.target!r} as it was before the call, after {written[spec.target]} "
                    "wrote it: the segments share one copy of the buffer"
                )
        programs[name] = _segment_program(program, name, region, mutations)
    return _device_inputs_user_only(plan, regions, specs), programs


def _is_user(value: Node, specs: Mapping[str, InputSpec]) -> bool:
    spec = specs.get(value.name) if value.op == "placeholder" else None
    return spec is None or spec.kind == InputKind.USER_INPUT


def _device_inputs_user_only(plan: Plan, regions: Mapping[str, _Region], specs: Mapping[str, InputSpec]) -> Plan:
    """`plan` with each device step reading only its segment's user inputs (state lives in the module)."""
    steps: list[DeviceStep | HostStep] = []
    for step in plan.steps:
        if isinstance(step, DeviceStep):
            region = regions[step.function]
            kept = tuple(slot for slot, v in zip(step.inputs, region.inputs) if _is_user(v, specs))
            step = DeviceStep(step.function, kept, step.outputs)
        steps.append(step)
    return attrs.evolve(plan, steps=tuple(steps))


def compile_graph(
    gm: GraphModule, compile_segment: Callable[[GraphModule, list[Any]], Callable[..., Any]]
) -> Segmented:
    """`gm` cut at its collectives, each device segment compiled by `compile_segment(graph, example_inputs)`
    (the fake values its placeholders carry); called with `gm`'s inputs, returns what `gm` returns."""
    plan, graphs, spec = segment_graph(gm)
    functions = {}
    for name, graph in graphs.items():
        example = [p.meta.get("val") for p in graph.graph.find_nodes(op="placeholder")]
        functions[name] = compile_segment(graph, example)
    return Segmented(plan, functions, spec)


__all__ = [
    "PREFIX",
    "DeviceStep",
    "HostStep",
    "Plan",
    "SegmentError",
    "Segmented",
    "UnhandledCollective",
    "compile_graph",
    "segment_graph",
    "segment_program",
]
