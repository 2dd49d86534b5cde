"""Subgraphs of higher-order ops (`torch.cond`'s branches, wrapper bodies): find, walk, read their outputs.

A higher-order op names its bodies with `get_attr` nodes of GraphModules registered on the graph's module.
Rule packs (control flow, wrappers) and the layers above (the size dispatch) share these helpers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from fx_rewrites.engine import values


def subgraph(node: Any) -> GraphModule | None:
    """The GraphModule a get_attr node names, or None."""
    obj = values.attr_of(node)
    return obj if isinstance(obj, GraphModule) else None


def walk(gm: GraphModule) -> Iterator[Node]:
    """Every node of `gm` and, recursively, of the subgraphs it names."""
    for n in gm.graph.nodes:
        yield n
        if n.op == "get_attr":
            inner = subgraph(n)
            if inner is not None:
                yield from walk(inner)


def graph_outputs(gm: GraphModule) -> list[Any]:
    """The output values of `gm`, flattened."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return pytree.tree_leaves(out.args[0])


__all__ = ["graph_outputs", "subgraph", "walk"]
