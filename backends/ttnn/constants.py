"""Weights once: values computed only from the program's constants are kept across calls.

A region's placeholder is constant when the top-level graph feeds it a
parameter, buffer or constant of the ExportedProgram, or a value an earlier
region computed from constants only; a node is constant when all its inputs
are (a stand-in, or on the host an op without random numbers or mutation:
the folded convolution weights of `rules/ttnn/fold.py`, which the lowering
leaves on the host). `ConstantCache` keeps the values of constant nodes (the
`from_torch` of a weight, a bias reshaped to `[1, N]`, a host conv weight, a
folded weight computed in float32) for the compiled function's life, so they
are computed once and reach the device once, as torch-ttnn does. The cache is dropped when a constant tensor
changes (its identity or in-place version counter) or another ttnn module or
device is used.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from fx_rewrites.backends.ttnn.rules.constants import CONSTANT_KINDS, cacheable
from fx_rewrites.backends.ttnn.rules.ops import is_standin


def region_plans(top: GraphModule, program: ExportedProgram | None) -> dict[str, tuple[frozenset[int], frozenset[str]]]:
    """Per region submodule of the split module (host and device, in order): the indices of its placeholders
    that receive constants (the program's, or values earlier regions computed from them only), and the names
    of its nodes computed from constants only."""
    kinds = (
        {}
        if program is None
        else {s.arg.name: s.kind for s in program.graph_signature.input_specs if hasattr(s.arg, "name")}
    )
    constant: set[Node] = {
        n
        for n in top.graph.nodes
        if n.op == "get_attr" or (n.op == "placeholder" and kinds.get(n.name) in CONSTANT_KINDS)
    }
    plans: dict[str, tuple[frozenset[int], frozenset[str]]] = {}
    constant_outputs: dict[Node, frozenset[int]] = {}
    for node in top.graph.nodes:
        if node.op == "call_module":
            region = top.get_submodule(str(node.target))
            placeholders = frozenset(i for i, a in enumerate(node.args) if a in constant)
            names = constant_nodes(region, placeholders)
            plans[str(node.target)] = (placeholders, names)
            outputs = region.graph.output_node().args[0]
            constant_outputs[node] = frozenset(
                i for i, o in enumerate(outputs) if isinstance(o, Node) and o.name in names
            )
        elif node.target is operator.getitem and node.args[1] in constant_outputs.get(node.args[0], ()):
            constant.add(node)
    return plans


def program_constants(program: ExportedProgram | GraphModule) -> set[Node]:
    """The call nodes of a program's graph computed from its constants only (ops without random numbers or
    mutation whose inputs are all constant, factories with none included): what the compiled function
    computes once, on the host or the device (`constant_nodes` caches the same nodes per region)."""
    if isinstance(program, GraphModule):
        kinds, graph = {}, program.graph
    else:
        kinds = {s.arg.name: s.kind for s in program.graph_signature.input_specs if hasattr(s.arg, "name")}
        graph = program.graph
    constant: set[Node] = set()
    for node in graph.nodes:
        if (
            node.op == "get_attr"
            or (node.op == "placeholder" and kinds.get(node.name) in CONSTANT_KINDS)
            or (
                node.op == "call_function"
                and cacheable(node.target)
                and all(i in constant for i in node.all_input_nodes)
            )
        ):
            constant.add(node)
    return {n for n in constant if n.op == "call_function"}


def constant_nodes(region: GraphModule, placeholders: frozenset[int]) -> frozenset[str]:
    """Names of the region's nodes whose values depend on constant placeholders only: stand-ins (factories,
    which have no inputs, too) and, in host regions, any op without random numbers or mutation."""
    constant: set[Node] = set()
    index = 0
    for node in region.graph.nodes:
        if node.op == "placeholder":
            if index in placeholders:
                constant.add(node)
            index += 1
        elif node.op == "get_attr" or (
            node.op == "call_function"
            and (is_standin(node.target) or cacheable(node.target))
            and all(i in constant for i in node.all_input_nodes)
        ):
            constant.add(node)
    return frozenset(n.name for n in constant if n.op == "call_function")


class ConstantCache:
    """The values of constant nodes, per region, valid while the constants and the device stay the same."""

    def __init__(self) -> None:
        self._values: dict[str, dict[str, Any]] = {}
        self._stamp: dict[str, tuple[tuple[Any, ...], tuple[int, ...]]] = {}

    def region(self, name: str, constants: list[torch.Tensor], ttnn: Any, device: Any) -> dict[str, Any]:
        """Region `name`'s cached values by node name (a dict to fill), emptied when its inputs changed."""
        # The stamp holds the objects and compares them by identity: an id() of a freed tensor or device can be
        # given to a new one, which would then read stale values (see the IREE importer's bug, iree findings 12).
        held = (ttnn, device, *constants)
        versions = tuple(getattr(t, "_version", 0) for t in constants)
        old = self._stamp.get(name)
        if (
            old is None
            or old[1] != versions
            or len(old[0]) != len(held)
            or any(a is not b for a, b in zip(old[0], held))
        ):
            self._stamp[name], self._values[name] = (held, versions), {}
        return self._values[name]
