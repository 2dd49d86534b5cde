"""Node insertion and graph copying at the speed large graphs need.

torch 2.13's `Graph.create_node` walks every new node's arguments with
pytree to warn about raw SymInts; on graphs of 10k-100k nodes that walk was
half the cost of inserting a node (cProfile of benchmarks/engine_scaling.py).
`insert_node` does what `create_node` does without it, through the same
`Graph` internals (namespace, insert point, find-nodes table, length); the
engine's nodes get their arguments from rules, which pass nodes, not raw
SymInts. Where those internals are missing (another torch), it falls back
to `create_node`.
"""

from __future__ import annotations

import copy
from typing import Any

from torch.fx import Graph, Node
from torch.fx.node import map_arg

_FAST = all(hasattr(Graph(), a) for a in ("_graph_namespace", "_insert", "_find_nodes_lookup_table", "_len"))


def insert_node(
    graph: Graph,
    op: str,
    target: Any,
    args: tuple,
    kwargs: dict,
    name: str | None = None,
    type_expr: Any = None,
) -> Node:
    """`graph.create_node(...)` at the graph's insert point, minus the pytree scan."""
    if not _FAST or getattr(graph.owning_module, "_create_node_hooks", None):
        return graph.create_node(op, target, args, kwargs, name, type_expr)
    namespace = graph._graph_namespace
    name = namespace.create_name(name if name is not None else graph._target_to_str(target), None)
    node = Node(graph, name, op, target, args, kwargs, type_expr)
    namespace.associate_name_with_obj(name, node)
    graph._insert(node)
    graph._find_nodes_lookup_table.insert(node)
    graph._len += 1
    return node


def copy_nodes(src: Graph, dst: Graph) -> tuple[dict[Node, Node], Node]:
    """Copy every node of `src` but the output into `dst`, keeping names
    (export's names are what a graph signature refers to; `Graph.graph_copy`
    renames nodes that shadow builtins, "input" -> "input_1") and copying
    meta shallowly. Returns the node map and `src`'s output node."""
    env: dict[Node, Node] = {}
    output = None
    for node in src.nodes:
        if node.op == "output":
            output = node
            break
        args = map_arg(node.args, env.__getitem__)
        kwargs = map_arg(node.kwargs, env.__getitem__)
        new = insert_node(dst, node.op, node.target, args, kwargs, node.name, node.type)
        if new.name != node.name:  # create_name avoided a builtin's name
            new.name = node.name
            dst._graph_namespace._used_names.add(node.name)
        new.meta = copy.copy(node.meta)
        env[node] = new
    if output is None:
        raise ValueError("the graph has no output node")
    return env, output
