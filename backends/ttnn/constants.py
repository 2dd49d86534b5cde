"""Weights once: device values computed only from the program's constants are kept across calls.

A device region's placeholder is constant when the top-level graph feeds it a
parameter, buffer or constant of the ExportedProgram; a stand-in node is
constant when all its tensor inputs are. `ConstantCache` keeps the values of
constant nodes (the `from_torch` of a weight, a bias reshaped to `[1, N]`, a
host conv weight) for the compiled function's life, so weights reach the
device once, as torch-ttnn does. The cache is dropped when a constant tensor
changes (its identity or in-place version counter) or another ttnn module or
device is used.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node

from fx_rewrites.rules.ttnn.ops import is_standin

_CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def constant_placeholders(top: GraphModule, program: ExportedProgram | None) -> dict[str, frozenset[int]]:
    """Per region submodule: the indices of its placeholders that receive one of the program's constants."""
    if program is None:
        return {}
    kinds = {s.arg.name: s.kind for s in program.graph_signature.input_specs if hasattr(s.arg, "name")}
    constant = {n for n in top.graph.nodes if n.op == "placeholder" and kinds.get(n.name) in _CONSTANT_KINDS}
    out: dict[str, frozenset[int]] = {}
    for node in top.graph.nodes:
        if node.op == "call_module":
            out[str(node.target)] = frozenset(i for i, a in enumerate(node.args) if a in constant)
    return out


def constant_nodes(region: GraphModule, placeholders: frozenset[int]) -> frozenset[str]:
    """Names of the region's nodes whose values depend on constant placeholders only."""
    constant: set[Node] = set()
    index = 0
    for node in region.graph.nodes:
        if node.op == "placeholder":
            if index in placeholders:
                constant.add(node)
            index += 1
        elif (
            node.op == "call_function"
            and is_standin(node.target)
            and all(i in constant for i in node.all_input_nodes)  # factories (no inputs) too
        ):
            constant.add(node)
    return frozenset(n.name for n in constant if n.op != "placeholder")


class ConstantCache:
    """The values of constant nodes, per region, valid while the constants and the device stay the same."""

    def __init__(self) -> None:
        self._values: dict[str, dict[str, Any]] = {}
        self._stamp: dict[str, tuple] = {}

    def region(self, name: str, constants: list[torch.Tensor], ttnn: Any, device: Any) -> dict[str, Any]:
        """Region `name`'s cached values by node name (a dict to fill), emptied when its inputs changed."""
        stamp = (id(ttnn), id(device), *((id(t), getattr(t, "_version", 0)) for t in constants))
        if self._stamp.get(name) != stamp:
            self._stamp[name], self._values[name] = stamp, {}
        return self._values[name]
