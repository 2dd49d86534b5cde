"""Capability partitioning: device and host regions of an fx graph, in linear time.

`partition(graph, is_supported)` puts every call node (call_function,
call_method, call_module) in exactly one region, `device` (all nodes
supported) or `host`, with the fewest regions any acyclic partitioning has;
`split(gm, partitioning)` turns that into a GraphModule calling one submodule
per region (`device_0`, `host_1`, ...). Placeholders, get_attr and output stay
at the top level.

The algorithm and its proof (more in docs/partitioner.md):

Fix which kind comes first, `first`. Give each node a level: the smallest
integer >= every input's level whose parity is 0 when the node's kind is
`first` and 1 otherwise. Region i is the set of nodes at level i (all of one
kind, by parity).

- Acyclic: an edge never goes to a lower level, so regions in level order
  are a topological order of the region graph.
- Fewest regions: take any valid partitioning (monochrome regions, acyclic
  region graph) with m regions and a topological order of its regions.
  Merging two neighbours of the same kind in that order keeps it valid, so
  some optimum alternates kinds: position p(n) of a node's region is
  nondecreasing along edges and has the parity its kind asks for, starting
  with `first` for one of the two choices. By induction in topological order,
  level(n) <= p(n) (level is the least value with the right parity above
  the inputs' levels, which are <= their positions), so at most m levels are
  used. Running both choices of `first` and keeping the one with fewer
  regions gives the optimum (on a tie, the one with fewer device regions).
- Hence no two regions of the same kind can be merged without a cycle:
  a merge that stayed acyclic would beat the optimum.

Each pass is O(nodes + edges). torch's CapabilityBasedPartitioner keeps a
downstream set per partition and is quadratic (minutes at 6k nodes).

`operator.getitem` of a partitioned node goes with its producer whatever
`is_supported` says, so a tuple never crosses a region boundary; moving such
a getitem into its producer's region keeps any partitioning valid, so this
never adds a region.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import attrs
from torch.fx import Graph, GraphModule, Node
from torch.fx._lazy_graph_module import _LazyGraphModule

from fx_rewrites.program import quiet_torch_pytree

Kind = Literal["device", "host"]
DEVICE: Kind = "device"
HOST: Kind = "host"
#: node ops that are partitioned; placeholder, get_attr and output stay at the top level
PARTITIONED_OPS = frozenset({"call_function", "call_method", "call_module"})


class PartitionError(ValueError):
    """The graph, the predicate or a partitioning given to split() is not usable."""


@attrs.frozen
class Region:
    """Nodes run together, on the device or on the host, in graph order."""

    index: int
    kind: Kind
    nodes: tuple[Node, ...] = attrs.field(repr=lambda nodes: f"<{len(nodes)} nodes>")

    @property
    def name(self) -> str:
        """The submodule name split() gives this region: `device_0`, `host_1`, ..."""
        return f"{self.kind}_{self.index}"

    @property
    def is_device(self) -> bool:
        return self.kind == DEVICE


@attrs.frozen
class Partitioning:
    """Regions in topological order (run region i before i + 1) and where each node went."""

    regions: tuple[Region, ...]
    region_of: Mapping[Node, int] = attrs.field(repr=False)

    @property
    def num_regions(self) -> int:
        return len(self.regions)

    @property
    def device_regions(self) -> tuple[Region, ...]:
        return tuple(r for r in self.regions if r.is_device)

    @property
    def host_regions(self) -> tuple[Region, ...]:
        return tuple(r for r in self.regions if not r.is_device)

    @property
    def num_device_nodes(self) -> int:
        return sum(len(r.nodes) for r in self.device_regions)

    @property
    def num_host_nodes(self) -> int:
        return sum(len(r.nodes) for r in self.host_regions)

    @property
    def device_share(self) -> float:
        """Share of partitioned nodes placed on the device (1.0 for a graph without call nodes)."""
        total = len(self.region_of)
        return self.num_device_nodes / total if total else 1.0

    def region(self, node: Node) -> Region:
        """The region `node` was placed in."""
        try:
            return self.regions[self.region_of[node]]
        except KeyError:
            raise PartitionError(
                f"node {node.name!r} ({node.op}) is in no region: only {sorted(PARTITIONED_OPS)} nodes of the "
                "partitioned graph are"
            ) from None

    def summary(self) -> str:
        return (
            f"{self.num_regions} regions ({len(self.device_regions)} device, {len(self.host_regions)} host); "
            f"{self.num_device_nodes} of {len(self.region_of)} nodes on device ({self.device_share:.1%})"
        )


def _kinds(nodes: list[Node], index: dict[Node, int], is_supported: Callable[[Node], bool]) -> list[bool]:
    """Per node: True for device. getitem of a partitioned node follows its producer."""
    on_device: list[bool] = []
    for node in nodes:
        if node.target is operator.getitem and isinstance(node.args[0], Node) and node.args[0] in index:
            on_device.append(on_device[index[node.args[0]]])
            continue
        try:
            on_device.append(bool(is_supported(node)))
        except Exception as exc:
            raise PartitionError(
                f"is_supported raised {type(exc).__name__} on node {node.name!r} (target {node.target}): {exc}"
            ) from exc
    return on_device


def _levels(nodes: list[Node], index: dict[Node, int], on_device: list[bool]) -> tuple[list[int], list[int]]:
    """Both level assignments in one pass: device first (device levels even) and host first.

    A plain loop without per-node lists: 7x faster at 100k nodes than max() over
    a list of the inputs' levels per node (measured, docs/partitioner.md).
    """
    device_first: list[int] = []
    host_first: list[int] = []
    for position, (node, dev) in enumerate(zip(nodes, on_device)):
        d = h = 0
        for value in node.all_input_nodes:
            i = index.get(value)
            if i is None:
                continue
            if i >= position:
                raise PartitionError(
                    f"node {node.name!r} reads {value.name!r}, defined after it: the graph is not in topological "
                    "order (graph.lint() says where)"
                )
            if device_first[i] > d:
                d = device_first[i]
            if host_first[i] > h:
                h = host_first[i]
        if dev:  # device wants even levels device-first, odd levels host-first
            d += d & 1
            h += 1 - (h & 1)
        else:
            d += 1 - (d & 1)
            h += h & 1
        device_first.append(d)
        host_first.append(h)
    return device_first, host_first


def partition(graph: Graph | GraphModule, is_supported: Callable[[Node], bool]) -> Partitioning:
    """The fewest device/host regions of `graph` (or a GraphModule's graph) with an acyclic region graph.

    `is_supported(node)` says whether a call node can run on the device; it is
    called once per node (not for getitem of a partitioned node, which goes
    with its producer). O(nodes + edges).
    """
    if isinstance(graph, GraphModule):
        graph = graph.graph
    nodes = [n for n in graph.nodes if n.op in PARTITIONED_OPS]
    index = {n: i for i, n in enumerate(nodes)}
    on_device = _kinds(nodes, index, is_supported)
    device_first, host_first = _levels(nodes, index, on_device)
    used = sorted(set(device_first))
    host_used = sorted(set(host_first))
    levels = device_first
    # fewest regions; on a tie, fewer device regions (each is a device program and its transfers)
    device_regions = sum(1 for level in used if level % 2 == 0)
    host_first_device_regions = sum(1 for level in host_used if level % 2 == 1)
    if (len(host_used), host_first_device_regions) < (len(used), device_regions):
        levels, used = host_first, host_used
    compact = {level: i for i, level in enumerate(used)}
    members: list[list[Node]] = [[] for _ in used]
    kinds: list[Kind] = [HOST] * len(used)
    region_of: dict[Node, int] = {}
    for node, level, dev in zip(nodes, levels, on_device):
        r = compact[level]
        members[r].append(node)
        kinds[r] = DEVICE if dev else HOST
        region_of[node] = r
    regions = tuple(Region(i, kind, tuple(ns)) for i, (kind, ns) in enumerate(zip(kinds, members)))
    return Partitioning(regions, region_of)


def _external_reads(region: Region, region_of: Mapping[Node, int]) -> Iterator[Node]:
    """Values a region reads from outside itself, once each, in first-use order."""
    seen: set[Node] = set()
    for node in region.nodes:
        for value in node.all_input_nodes:
            if value not in seen and region_of.get(value) != region.index:
                seen.add(value)
                yield value


def _region_graph(region: Region, region_of: Mapping[Node, int]) -> tuple[Graph, list[Node], list[Node]]:
    """The region's own graph, the outside values it reads (its inputs) and the values read outside (its outputs)."""
    graph = Graph()
    env: dict[Node, Node] = {}
    inputs: list[Node] = []
    for value in _external_reads(region, region_of):
        if value.op == "get_attr":  # constants and subgraphs are copied in, so a backend sees them
            env[value] = graph.node_copy(value)
        else:
            env[value] = graph.placeholder(value.name)
            env[value].meta = dict(value.meta)
            inputs.append(value)
    outputs: list[Node] = []
    for node in region.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
        if any(region_of.get(user) != region.index for user in node.users):
            outputs.append(node)
    graph.output(tuple(env[n] for n in outputs))
    return graph, inputs, outputs


def split(gm: GraphModule, partitioning: Partitioning) -> GraphModule:
    """A GraphModule that calls one submodule per region, in order; same results as `gm`.

    Each submodule (`device_0`, `host_1`, ...) takes the values its region reads
    from placeholders and earlier regions (get_attr values are copied into it)
    and returns a tuple of the values read after it. Node names and
    `meta` are kept. Written here rather than with torch.fx.passes.split_module
    to keep region order and names, copy get_attrs into regions and keep
    `meta["val"]` on every boundary value (see docs/partitioner.md for timings).
    """
    region_of = partitioning.region_of
    for node in gm.graph.nodes:
        if node.op in PARTITIONED_OPS and node not in region_of:
            raise PartitionError(
                f"node {node.name!r} of the graph module is in no region: the partitioning was made for another "
                "graph; call partition(gm.graph, is_supported) on this one"
            )
    top = Graph()
    with quiet_torch_pytree():  # copying its TreeSpecs makes torch 2.13 warn about its own pytree code
        top._codegen = copy.deepcopy(gm.graph._codegen)  # keeps export's pytree calling convention
    env: dict[Node, Node] = {}
    root: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = top.node_copy(node)
    for region in partitioning.regions:
        graph, inputs, outputs = _region_graph(region, region_of)
        root[region.name] = _LazyGraphModule(gm, graph, class_name=region.name)
        call = top.call_module(region.name, tuple(env[v] for v in inputs))
        call.meta["partition_region"] = region.name
        if all("val" in v.meta for v in outputs):
            call.meta["val"] = tuple(v.meta["val"] for v in outputs)
        for i, value in enumerate(outputs):
            env[value] = top.call_function(operator.getitem, (call, i), name=value.name)
            env[value].meta = dict(value.meta)
    output = gm.graph.output_node()
    for value in output.all_input_nodes:
        if value.op == "get_attr" and value not in env:
            env[value] = top.node_copy(value)
            root[str(value.target)] = _fetch(gm, value)
    top.node_copy(output, env.__getitem__)
    return _LazyGraphModule(root, top, class_name="PartitionedModule")


def _fetch(gm: GraphModule, node: Node) -> Any:
    obj: Any = gm
    for atom in str(node.target).split("."):
        obj = getattr(obj, atom)
    return obj
