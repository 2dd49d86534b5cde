"""Partitioner scaling: backends.partition vs torch's CapabilityBasedPartitioner on the same graphs.

The graph is a chain of transformer blocks (layer_norm, linear, chunk,
matmul, softmax, gelu, residual adds: 18 call nodes each) exported once with
torch.export and copied end to end; softmax and gelu are "unsupported", so
two ops in every 18 stay on the host. Both partitioners get the same graph
and predicate in the same run; torch's `propose_partitions` (its partitioning
step; fusing comes after) runs in a forked child with a time limit per size.
torch's side counts device partitions only (unsupported nodes stay loose at
the top level); ours counts device and host regions. Times are CPU seconds
of the process (time.process_time): on a shared machine, wall time mostly
measures the other jobs. The time limit is wall time.

    nice -n 10 python benchmarks/partitioner.py [--sizes 1000 3000 6000] [--large 100000] [--limit 120]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import time
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.split_module import split_module

from fx_rewrites.backends.partition import partition, split

aten = torch.ops.aten
UNSUPPORTED = {aten.softmax.int, aten.gelu.default}


class Block(torch.nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
        x = x + self.proj(attn @ v)
        return x + self.down(F.gelu(self.up(self.norm(x))))


def chain(min_nodes: int) -> GraphModule:
    """Blocks copied end to end until the graph has at least `min_nodes` call nodes (weights shared)."""
    block = torch.export.export(Block().eval(), (torch.randn(2, 5, 16),)).graph_module
    placeholders = [n for n in block.graph.nodes if n.op == "placeholder"]
    *params, x_in = placeholders
    (result,) = block.graph.output_node().args[0]
    graph = Graph()
    shared = {p: graph.node_copy(p) for p in params}
    x = graph.node_copy(x_in)
    count = 0
    while count < min_nodes:
        env: dict[Node, Node] = {**shared, x_in: x}
        for node in block.graph.nodes:
            if node.op == "call_function":
                env[node] = graph.node_copy(node, env.__getitem__)
                count += 1
        x = env[result]
    graph.output((x,))
    return GraphModule(block, graph)


def is_supported(node: Node) -> bool:
    return node.target not in UNSUPPORTED


class Support(OperatorSupportBase):
    def is_node_supported(self, submodules: Mapping[str, torch.nn.Module], node: Node) -> bool:
        return node.op == "call_function" and is_supported(node)


def _torch_child(gm: GraphModule, conn) -> None:
    start = time.process_time()
    partitions = CapabilityBasedPartitioner(gm, Support(), allows_single_node_partition=True).propose_partitions()
    conn.send((time.process_time() - start, len(partitions)))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def torch_partitioner(gm: GraphModule, limit: float) -> tuple[float, int | None]:
    """CPU seconds and device partitions of CapabilityBasedPartitioner.propose_partitions.

    Runs in a forked child stopped after `limit` wall seconds; then the
    partitions are None and the seconds are the CPU time it had used.
    """
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    before = _children_cpu()
    proc = ctx.Process(target=_torch_child, args=(gm, child))
    proc.start()
    got = parent.recv() if parent.poll(limit) else None
    if got is None:
        proc.kill()
    proc.join()
    return got if got is not None else (_children_cpu() - before, None)


def best_of(repeat: int, fn: Callable[[], object]) -> tuple[float, object]:
    """Least CPU time of `repeat` calls (CPU, not wall: the machine is shared) and the last result."""
    times, out = [], None
    for _ in range(repeat):
        start = time.process_time()
        out = fn()
        times.append(time.process_time() - start)
    return min(times), out


def calls(gm: GraphModule) -> int:
    return sum(n.op == "call_function" for n in gm.graph.nodes)


def check_split(gm: GraphModule, parts) -> None:
    """split() of the benchmark graph gives the same result as the graph (exits if not)."""
    args = [torch.randn(p.meta["val"].shape) for p in gm.graph.nodes if p.op == "placeholder"]
    if not torch.equal(split(gm, parts)(*args)[0], gm(*args)[0]):
        raise SystemExit("split() changed the result of the benchmark graph")


def compare(sizes: list[int], limit: float) -> None:
    print("| call nodes | ours CPU s | ours regions (device/host) | torch CPU s | torch device parts | torch/ours |")
    print("|---|---|---|---|---|---|")
    for size in sizes:
        gm = chain(size)
        ours_s, parts = best_of(3, lambda gm=gm: partition(gm.graph, is_supported))
        if size == sizes[0]:
            check_split(gm, parts)
        regions = f"{parts.num_regions} ({len(parts.device_regions)}/{len(parts.host_regions)})"
        theirs_s, theirs_parts = torch_partitioner(gm, limit)
        if theirs_parts is None:
            torch_cells = f"> {theirs_s:.0f} (stopped after {limit:.0f} s wall) | - | > {theirs_s / ours_s:.0f}x"
        else:
            torch_cells = f"{theirs_s:.1f} | {theirs_parts} | {theirs_s / ours_s:.0f}x"
        print(f"| {calls(gm)} | {ours_s:.4f} | {regions} | {torch_cells} |")


def large(size: int, with_split_module: bool) -> None:
    built, gm = best_of(1, lambda: chain(size))
    part_s, parts = best_of(3, lambda: partition(gm.graph, is_supported))
    split_s, _ = best_of(1, lambda: split(gm, parts))
    print(f"\nours alone: {calls(gm)} call nodes (graph built in {built:.1f} s)")
    print(f"  partition(): {part_s:.3f} s, {parts.summary()}")
    print(f"  split():     {split_s:.2f} s ({parts.num_regions} submodules)")
    copy_s, _ = best_of(1, lambda: Graph().graph_copy(gm.graph, {}))
    print(f"  for scale, Graph.graph_copy of the same graph: {copy_s:.2f} s")
    if with_split_module:
        region_of = parts.region_of
        split_module_s, _ = best_of(1, lambda: split_module(gm, gm, lambda n: region_of[n], keep_original_order=True))
        print(f"  torch.fx.passes.split_module with the same regions: {split_module_s:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="*", default=[1000, 3000, 6000])
    parser.add_argument("--large", type=int, default=100_000)
    parser.add_argument("--limit", type=float, default=120.0, help="seconds torch's partitioner gets per size")
    parser.add_argument("--no-split-module", action="store_true", help="skip timing torch's split_module")
    args = parser.parse_args()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}; unsupported: {sorted(str(op) for op in UNSUPPORTED)}; load average {load}\n")
    compare(args.sizes, args.limit)
    if args.large:
        large(args.large, not args.no_split_module)


if __name__ == "__main__":
    main()
