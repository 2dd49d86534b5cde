"""Values computed from the program's constants only: they stay on the host, in float32, computed once.

A value is constant when it is a parameter, buffer or lifted constant of the
ExportedProgram (a get_attr in a GraphModule), or the result of a pure op
(no random numbers, no mutation) whose inputs are all constant. The ttnn
lowering leaves such nodes on the host (`checks.lowering` declines them):
the ttnn backend evaluates them once per compiled function in float32 and
uploads the result once (`backends/ttnn/constants.py`), instead of
recomputing them in bfloat16 on the device on every call. Folded
convolution weights (`fold.py`) are such values.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._ops import OpOverload
from torch.export.graph_signature import InputKind
from torch.fx import Node

from fx_rewrites.program import input_spec

#: the placeholders a program feeds from its own state
CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
#: how far back `from_constants` looks; a deeper constant chain is treated as not constant (it is then lowered
#: like any other value, which is correct, only not computed once on the host)
MAX_DEPTH = 24


def cacheable(target: Any) -> bool:
    """`target`'s result depends on its inputs only: no random numbers, no mutation (from the op's schema and
    tags), so a result computed from constants can be kept."""
    if target is operator.getitem:
        return True
    if not isinstance(target, OpOverload):
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags and not target._schema.is_mutable


def is_constant_input(node: Node) -> bool:
    """A parameter, buffer or lifted constant placeholder of the program, or a get_attr."""
    if node.op == "get_attr":
        return True
    if node.op != "placeholder":
        return False
    spec = input_spec(node)
    return spec is not None and spec.kind in CONSTANT_KINDS


def from_constants(value: Any) -> bool:
    """`value` (a node) is computed from the program's constants only: a constant input, or a cacheable op
    with at least one input, all of them computed from constants. Stops at the first input that is not."""
    return isinstance(value, Node) and _constant(value, MAX_DEPTH, {})


def _constant(node: Node, depth: int, seen: dict[Node, bool]) -> bool:
    if node in seen:
        return seen[node]
    if node.op in ("placeholder", "get_attr"):
        result = is_constant_input(node)
    elif node.op != "call_function" or not cacheable(node.target) or depth == 0:
        result = False
    else:
        inputs = node.all_input_nodes
        # a program input among the direct inputs answers at once, before walking deeper
        result = bool(inputs) and not any(i.op == "placeholder" and not is_constant_input(i) for i in inputs)
        result = result and all(_constant(i, depth - 1, seen) for i in inputs)
    seen[node] = result
    return result


def constant_reason(node: Node) -> str | None:
    """Why a lowering rule leaves `node` on the host when it is computed from constants only, else None."""
    if node.all_input_nodes and from_constants(node):
        return (
            "computed from the program's constants only: evaluated once on the host in float32, "
            "its result uploaded once (not recomputed in bfloat16 on every call)"
        )
    return None
