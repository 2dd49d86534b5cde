"""Numbers in graphs: which nodes hold a SymInt/SymFloat/SymBool, where one sits in a Tensor slot of a
schema, and which input size a number-valued placeholder is.

Shared by the symbolic rule pack (`rules/symbolic.py`) and the backends that check a graph before importing
it (IREE recomputes SymInt inputs from tensor shapes; ttnn refuses a number in a tensor slot).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import OpOverload
from torch.fx import Graph, GraphModule, Node

from fx_rewrites import schema

SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def is_tensor_type(t: Any) -> bool:
    """A schema argument type that takes a Tensor (`Tensor`, `Tensor?`)."""
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


def is_tensor_list_type(t: Any) -> bool:
    """A schema argument type that takes a list of Tensors (`Tensor[]`, `Tensor?[]`)."""
    return isinstance(t, torch.ListType) and is_tensor_type(t.getElementType())


def is_scalar_type(t: Any) -> bool:
    """A schema argument type that takes a number (`Scalar`, `Scalar?`)."""
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.NumberType)


def is_scalar_value(arg: Any) -> bool:
    """`arg` is a graph value holding a number (SymInt/SymFloat/SymBool, or
    a plain int/float/bool a symbolic value was specialised to)."""
    if not isinstance(arg, Node):
        return False
    val = arg.meta.get("val", arg.meta.get("example_value"))
    return isinstance(val, (*SYM_TYPES, int, float, bool))


def sym_in_tensor_slots(graph: Graph | GraphModule) -> list[str]:
    """Every place a number-valued node is passed where the op's schema
    declares a Tensor (or Tensor?, Tensor[]), as readable lines. Empty when
    the graph is clean. Backends can call this before importing a graph."""
    graph = graph.graph if isinstance(graph, GraphModule) else graph
    found: list[str] = []
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, OpOverload):
            continue
        bound = schema.arguments(node)
        for a in node.target._schema.arguments:
            value = bound.get(a.name)
            if is_tensor_type(a.type):
                items = [value]
            elif is_tensor_list_type(a.type) and isinstance(value, (list, tuple)):
                items = list(value)
            else:
                continue
            for item in items:
                if is_scalar_value(item):
                    val = item.meta.get("val", item.meta.get("example_value"))
                    found.append(
                        f"{node.name}: {schema.op_name(node.target)} argument {a.name!r} ({a.type}) "
                        f"gets {type(val).__name__} {val} from {item.name!r}"
                    )
    return found


def sym_placeholder_sources(graph: Graph | GraphModule) -> dict[str, tuple[str, int] | None]:
    """For each number-valued placeholder (the SymInt inputs dynamo puts
    first in `torch.compile(dynamic=True)` graphs), a (tensor placeholder,
    dim) whose size it is, or None when no input dim is exactly that symbol.

    Backend glue can compute these inputs from the tensors' shapes instead
    of handing them to a compiler that expects tensors (seed 001:
    "aten::clone() Expected a value of type 'Tensor' for argument 'self' but
    instead found type 'SymInt'")."""
    graph = graph.graph if isinstance(graph, GraphModule) else graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    dims: dict[Any, tuple[str, int]] = {}
    for p in placeholders:
        val = p.meta.get("val", p.meta.get("example_value"))
        if isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt):
                    dims.setdefault(size.node.expr, (p.name, d))
    sources: dict[str, tuple[str, int] | None] = {}
    for p in placeholders:
        if is_scalar_value(p):
            val = p.meta.get("val", p.meta.get("example_value"))
            sources[p.name] = dims.get(val.node.expr) if isinstance(val, torch.SymInt) else None
    return sources


__all__ = [
    "SYM_TYPES",
    "is_scalar_type",
    "is_scalar_value",
    "is_tensor_list_type",
    "is_tensor_type",
    "sym_in_tensor_slots",
    "sym_placeholder_sources",
]
