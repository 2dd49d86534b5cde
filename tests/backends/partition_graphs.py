"""Graphs and independent checks for the partitioner tests (networkx and brute force, not the code under test)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import networkx as nx
import torch
from torch.fx import Graph, GraphModule, Node

from fx_rewrites.backends.partition import PARTITIONED_OPS, Partitioning


def mix(*values: torch.Tensor) -> torch.Tensor:
    """The op of every node in a random DAG: exact in float32 for small integers."""
    return sum(values) * 2 - 1


def dag_module(inputs: Sequence[Sequence[int]]) -> GraphModule:
    """A GraphModule with node i = mix(x, *nodes[inputs[i]]) returning every node (inputs index earlier nodes)."""
    graph = Graph()
    x = graph.placeholder("x")
    nodes: list[Node] = []
    for i, ins in enumerate(inputs):
        args = tuple(nodes[j] for j in ins) or (x,)
        nodes.append(graph.call_function(mix, args, name=f"n{i}"))
    graph.output(tuple(nodes))
    return GraphModule(torch.nn.Module(), graph)


def call_edges(graph: Graph) -> Iterator[tuple[Node, Node]]:
    for node in graph.nodes:
        if node.op in PARTITIONED_OPS:
            for value in node.all_input_nodes:
                if value.op in PARTITIONED_OPS:
                    yield value, node


def region_graph(graph: Graph, partitioning: Partitioning) -> nx.DiGraph:
    quotient = nx.DiGraph()
    quotient.add_nodes_from(range(partitioning.num_regions))
    for u, v in call_edges(graph):
        ru, rv = partitioning.region_of[u], partitioning.region_of[v]
        if ru != rv:
            quotient.add_edge(ru, rv)
    return quotient


def mergeable_pairs(graph: Graph, partitioning: Partitioning) -> list[tuple[str, str]]:
    """Pairs of same-kind regions whose union keeps the region graph acyclic (should be none)."""
    quotient = region_graph(graph, partitioning)
    found = []
    for a, b in itertools.combinations(partitioning.regions, 2):
        if a.kind == b.kind and nx.is_directed_acyclic_graph(nx.contracted_nodes(quotient, a.index, b.index)):
            found.append((a.name, b.name))
    return found


def _set_partitions(n: int) -> Iterator[list[int]]:
    """Every partition of range(n) as a restricted growth string (block label per element)."""

    def grow(prefix: list[int], blocks: int) -> Iterator[list[int]]:
        if len(prefix) == n:
            yield prefix
            return
        for label in range(blocks + 1):
            yield from grow([*prefix, label], max(blocks, label + 1))

    yield from grow([], 0)


def brute_force_optimum(inputs: Sequence[Sequence[int]], on_device: Sequence[bool]) -> tuple[int, int]:
    """(fewest regions, fewest device regions among those) over monochrome set partitions with an acyclic
    quotient graph, by trying every set partition."""
    n = len(inputs)
    best = (n + 1, n + 1)
    for labels in _set_partitions(n):
        blocks = max(labels, default=-1) + 1
        if blocks > best[0]:
            continue
        if any(on_device[i] != on_device[j] for i in range(n) for j in range(i) if labels[i] == labels[j]):
            continue
        quotient = nx.DiGraph()
        quotient.add_nodes_from(range(blocks))
        quotient.add_edges_from(
            (labels[j], labels[i]) for i, ins in enumerate(inputs) for j in ins if labels[j] != labels[i]
        )
        if nx.is_directed_acyclic_graph(quotient):
            device_blocks = len({label for label, dev in zip(labels, on_device) if dev})
            best = min(best, (blocks, device_blocks))
    return best
