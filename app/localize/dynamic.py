"""Pieces that keep the program's symbolic shapes: faults a backend shows only with dynamic dims.

Static pieces are compiled with the recorded sizes. A fault that shows only where the backend sees a dim as
dynamic (IREE 3.13 lowers a view with two dynamic dims wrong, docs/iree-3.13-findings.md section 23) is right
in every static piece. The dynamic pass rebuilds the same pieces (`pieces.build_piece(symbolic=True)`) with
each placeholder's and node's value the program's own FakeTensor with its SymInts, so the backend compiles
them with dynamic dims. A SymInt a piece reads from outside (a `sym_size` node's value) is recomputed in the
piece as the size of an input's dim with the same expression, or else is a placeholder fed the recorded number.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.utils import _pytree as pytree

from fx_rewrites.explain import format_value


def is_symbolic(size: Any) -> bool:
    """A SymInt whose expression is not a number (a dim the program leaves dynamic)."""
    return isinstance(size, torch.SymInt) and not getattr(size.node.expr, "is_number", False)


def _symbolic_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and any(is_symbolic(s) for s in value.shape)


def has_symbolic_shapes(gm: GraphModule) -> bool:
    """Whether any placeholder of `gm` has a dynamic dim (a dynamic pass can differ from the static one)."""
    return any(
        _symbolic_tensor(v)
        for n in gm.graph.nodes
        if n.op == "placeholder"
        for v in pytree.tree_leaves(n.meta.get("val"))
    )


def program_value(node: Node, index: int | None = None) -> Any:
    """The program's value of `node` (of its `index`-th item): a FakeTensor with SymInts, or a SymInt."""
    val = node.meta.get("val")
    if index is not None:
        val = val[index] if isinstance(val, (list, tuple)) and index < len(val) else None
    if val is None:
        raise ValueError(
            f"the node {node.name} carries no meta['val']: a piece with the program's symbolic shapes needs "
            "every node's value (export the program, or run FakeTensorProp over it)"
        )
    return val


def recompute_sizes(graph: Graph, held: Sequence[tuple[Node, Any]]) -> list[tuple[Node, Any]]:
    """Replace each SymInt placeholder of `held` ((placeholder, recorded value) pairs, placeholders first in
    `graph`) whose expression is made of tensor placeholders' dims (`a * b + 1`) by that arithmetic on
    `aten.sym_size.int(tensor, dim)` nodes; the pairs left."""
    dims: dict[Any, tuple[Node, int]] = {}
    for p, _ in held:
        val = p.meta["val"]
        if isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                if is_symbolic(size):
                    dims.setdefault(size.node.expr, (p, d))
    body = next(n for n in graph.nodes if n.op != "placeholder")
    left = []
    for p, value in held:
        val = p.meta["val"]
        size = _size(graph, body, val.node.expr, val, dims) if isinstance(val, torch.SymInt) else None
        if size is None:
            left.append((p, value))
            continue
        p.replace_all_uses_with(size)
        graph.erase_node(p)
    return left


def _size(graph: Graph, body: Node, expr: Any, like: torch.SymInt, dims: dict[Any, tuple[Node, int]]) -> Any:
    """`expr` (a sympy expression of sizes) as nodes before `body`: an input's dim where one is `expr`, else
    the sum or product of its terms; None where a term is neither (a size no input has)."""
    import sympy

    if expr.is_Integer:
        return int(expr)
    if expr in dims:
        with graph.inserting_before(body):
            node = graph.call_function(torch.ops.aten.sym_size.int, dims[expr])
        node.meta["val"] = like.node.shape_env.create_symintnode(expr, hint=None)
        return node
    if not isinstance(expr, (sympy.Add, sympy.Mul)):
        return None
    terms = [_size(graph, body, term, like, dims) for term in expr.args]
    if any(t is None for t in terms):
        return None
    combine = operator.add if isinstance(expr, sympy.Add) else operator.mul
    result = terms[0]
    for i, term in enumerate(terms[1:], 2):
        with graph.inserting_before(body):
            result = graph.call_function(combine, (result, term))
        result.meta["val"] = like.node.shape_env.create_symintnode(type(expr)(*expr.args[:i]), hint=None)
    return result


def describe(piece: GraphModule) -> str:
    """The piece's inputs and outputs with their symbolic shapes: "x: f32[2, 16*s4, 4, 8] -> reshape: ..."."""

    def shown(nodes: Sequence[Any]) -> str:
        return ", ".join(f"{n.name}: {format_value(n.meta.get('val'))}" for n in nodes if isinstance(n, Node))

    placeholders = [n for n in piece.graph.nodes if n.op == "placeholder"]
    outputs = pytree.tree_leaves(piece.graph.output_node().args[0])
    return f"{shown(placeholders) or 'no inputs'} -> {shown(outputs)}"


def _dim(size: Any, symbols: dict[str, tuple[int, Any]]) -> str:
    """`size` as a torch.export Dim expression ("16 * s4 + 1"), its symbol's range put in `symbols`; raises
    ValueError where export cannot say it (a Dim is linear in one symbol)."""
    import sympy

    expr = size.node.expr
    if len(expr.free_symbols) != 1:
        raise ValueError(f"the size {expr} is not linear in one symbol (a torch.export Dim is)")
    (symbol,) = expr.free_symbols
    poly = sympy.Poly(expr, symbol)
    if poly.degree() != 1 or not all(c.is_integer for c in poly.all_coeffs()):
        raise ValueError(f"the size {expr} is not a * {symbol} + b with integers a, b (a torch.export Dim is)")
    a, b = (int(c) for c in poly.all_coeffs())
    ranges = size.node.shape_env.var_to_range.get(symbol)
    low, high = (ranges.lower, ranges.upper) if ranges is not None else (0, None)
    symbols[str(symbol)] = (max(_bound(low) or 0, 0), _bound(high))
    text = str(symbol) if a == 1 else f"{a} * {symbol}"
    return text if b == 0 else f"{text} + {b}" if b > 0 else f"{text} - {-b}"


def _bound(value: Any) -> int | None:
    """A range's bound as an int, None where it is infinite (torch's int_oo)."""
    return int(value) if getattr(value, "is_Integer", False) or isinstance(value, int) else None


def dims_source(piece: GraphModule) -> tuple[str, str]:
    """`def dynamic_shapes():` returning the piece's inputs' symbolic dims as torch.export Dims (the spec
    `torch.export.export(Program(), args, dynamic_shapes=...)` takes, `Program.forward(*args)`), and "";
    or, where export cannot say them, a function returning None and why not."""
    specs, symbols = [], {}
    try:
        for p in [n for n in piece.graph.nodes if n.op == "placeholder"]:
            val = p.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise ValueError(f"the piece reads the size {p.name} ({val}) as a number: no input dim is it")
            dims = {d: _dim(s, symbols) for d, s in enumerate(val.shape) if is_symbolic(s)}
            specs.append("{" + ", ".join(f"{d}: {text}" for d, text in dims.items()) + "}" if dims else "None")
    except ValueError as e:
        return "def dynamic_shapes():\n    return None  # static: " + " ".join(str(e).split()), str(e)
    lines = [
        f'{name} = Dim("{name}", min={low}{"" if high is None else f", max={high}"})'
        for name, (low, high) in sorted(symbols.items())
    ]
    lines.append(f"return (({', '.join(specs)}{',' if len(specs) == 1 else ''}),)")
    body = "\n".join("    " + line for line in lines)
    return "def dynamic_shapes():\n    from torch.export import Dim\n\n" + body, ""
