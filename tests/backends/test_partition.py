"""The capability partitioner: valid, optimal regions on random DAGs and real exports; split() keeps results."""

from __future__ import annotations

import operator

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx import Graph, GraphModule, Node

from fx_rewrites import testing as rt
from fx_rewrites.backends.partition import DEVICE, HOST, PARTITIONED_OPS, PartitionError, Partitioning, partition, split
from tests.backends.models import MLP, PoolNet
from tests.backends.partition_graphs import (
    brute_force_optimum,
    call_edges,
    dag_module,
    mergeable_pairs,
    region_graph,
)

aten = torch.ops.aten


@st.composite
def dags(draw: st.DrawFn, max_nodes: int) -> tuple[list[list[int]], list[bool]]:
    """Random DAGs: node i reads up to 3 earlier nodes; each node supported or not."""
    n = draw(st.integers(1, max_nodes))
    inputs = [sorted(set(draw(st.lists(st.integers(0, i - 1), max_size=3)))) if i else [] for i in range(n)]
    on_device = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return inputs, on_device


def _by_name(on_device: list[bool]):
    return lambda node: on_device[int(node.name[1:])]


def assert_valid(graph: Graph, partitioning: Partitioning, is_supported) -> None:
    """Every call node in one region, regions monochrome and true to the predicate, region graph a DAG in order."""
    calls = [n for n in graph.nodes if n.op in PARTITIONED_OPS]
    placed = [n for r in partitioning.regions for n in r.nodes]
    assert sorted(placed, key=calls.index) == calls, "every call node is placed exactly once"
    assert len(placed) == len(set(placed))
    for region in partitioning.regions:
        assert region.nodes, f"{region.name} is empty"
        for node in region.nodes:
            assert partitioning.region_of[node] == region.index
            if node.target is not operator.getitem:
                assert bool(is_supported(node)) == region.is_device, f"{node.name} in {region.name}"
    assert nx.is_directed_acyclic_graph(region_graph(graph, partitioning))
    for u, v in call_edges(graph):
        assert partitioning.region_of[u] <= partitioning.region_of[v], "regions are listed in topological order"


@settings(max_examples=150, deadline=None)
@given(dags(max_nodes=7))
def test_random_dags_get_the_brute_force_optimum_regions_then_device_regions(dag):
    inputs, on_device = dag
    gm = dag_module(inputs)
    result = partition(gm.graph, _by_name(on_device))
    assert_valid(gm.graph, result, _by_name(on_device))
    assert (result.num_regions, len(result.device_regions)) == brute_force_optimum(inputs, on_device)


@settings(max_examples=60, deadline=None)
@given(dags(max_nodes=40))
def test_no_two_regions_of_a_kind_could_merge_without_a_cycle(dag):
    inputs, on_device = dag
    gm = dag_module(inputs)
    result = partition(gm.graph, _by_name(on_device))
    assert_valid(gm.graph, result, _by_name(on_device))
    assert mergeable_pairs(gm.graph, result) == []


@settings(max_examples=40, deadline=None)
@given(dags(max_nodes=25))
def test_split_random_dags_returns_every_value_unchanged(dag):
    inputs, on_device = dag
    gm = dag_module(inputs)
    parts = split(gm, partition(gm.graph, _by_name(on_device)))
    x = torch.arange(6.0).reshape(2, 3)
    for got, want in zip(parts(x), gm(x), strict=True):
        assert torch.equal(got, want)


def test_host_first_when_it_saves_a_region():
    # n0 device, n1 host source, n2 = device(n1): device-first levels need 3 regions, host-first 2
    gm = dag_module([[], [], [1]])
    result = partition(gm.graph, _by_name([True, False, True]))
    assert [(r.kind, [n.name for n in r.nodes]) for r in result.regions] == [(HOST, ["n1"]), (DEVICE, ["n0", "n2"])]


def test_opposite_chains_need_four_regions():
    # d0 -> h1 -> d2 and h3 -> d4 -> h5: three regions would put h3, h5 or d0, d2 together around a cycle
    gm = dag_module([[], [0], [1], [], [3], [4]])
    on_device = [True, False, True, False, True, False]
    result = partition(gm.graph, _by_name(on_device))
    assert result.num_regions == 4 == brute_force_optimum([[], [0], [1], [], [3], [4]], on_device)[0]


def test_all_supported_is_one_device_region():
    gm = dag_module([[], [0], [0], [1, 2]])
    result = partition(gm.graph, lambda node: True)
    assert [r.kind for r in result.regions] == [DEVICE]
    assert result.device_share == 1.0
    assert result.summary() == "1 regions (1 device, 0 host); 4 of 4 nodes on device (100.0%)"


class Attention(torch.nn.Module):
    """A transformer-ish block: layer_norm, projections, softmax attention, gelu MLP, residuals."""

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


class TopK(torch.nn.Module):
    """Tuple outputs: max.dim and topk, read through getitem."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = torch.max(torch.relu(x), dim=1)
        top, _ = torch.topk(x * 2, 2)
        return values + top.sum(1), indices


def not_op(*ops):
    return lambda node: node.target not in ops


REAL = [
    pytest.param(MLP(), (torch.randn(2, 16),), not_op(aten.relu.default), 3, id="mlp-not-relu"),
    pytest.param(PoolNet(), (torch.randn(1, 3, 8, 8),), not_op(aten.relu.default), 3, id="poolnet-not-relu"),
    pytest.param(Attention(), (torch.randn(2, 5, 16),), not_op(aten.softmax.int), 3, id="attention-not-softmax"),
    pytest.param(Attention(), (torch.randn(2, 5, 16),), not_op(aten.gelu.default), 3, id="attention-not-gelu"),
    pytest.param(TopK(), (torch.randn(3, 4),), not_op(aten.topk.default), 3, id="topk-not-topk"),
]


@pytest.mark.parametrize(("model", "args", "is_supported", "regions"), REAL)
def test_real_exports_split_and_match(model, args, is_supported, regions):
    ep = rt.export(model, *args)
    gm = ep.module()
    result = partition(gm.graph, is_supported)
    assert_valid(gm.graph, result, is_supported)
    assert mergeable_pairs(gm.graph, result) == []
    assert result.num_regions == regions, result.summary()
    parts = split(gm, result)
    assert [name for name, _ in parts.named_children()] == [r.name for r in result.regions]
    torch.testing.assert_close(parts(*args), gm(*args), rtol=0, atol=0)
    torch.testing.assert_close(parts(*args), model(*args), rtol=1e-6, atol=1e-6)


def test_split_of_an_export_graph_module_keeps_meta_val_on_boundaries():
    ep = rt.export(MLP(), torch.randn(2, 16))
    gm = ep.graph_module  # parameters are placeholders here
    parts = split(gm, partition(gm.graph, not_op(aten.relu.default)))
    host = parts.get_submodule("host_1")
    (relu_input,) = [n for n in host.graph.nodes if n.op == "placeholder"]
    assert relu_input.meta["val"].shape == (2, 32)
    (call,) = [n for n in parts.graph.nodes if n.target == "host_1"]
    assert [v.shape for v in call.meta["val"]] == [(2, 32)]
    params = [p for _, p in ep.named_parameters()]
    x = torch.randn(2, 16)
    torch.testing.assert_close(parts(*params, x), gm(*params, x), rtol=0, atol=0)


def test_getitem_goes_with_its_producer_whatever_the_predicate_says():
    gm = rt.export(TopK(), torch.randn(3, 4)).module()
    result = partition(gm.graph, lambda node: node.target not in (aten.topk.default, operator.getitem))
    for node in gm.graph.nodes:
        if node.target is operator.getitem:
            assert result.region(node) is result.region(node.args[0]), node.name
    topk = next(n for n in gm.graph.nodes if n.target is aten.topk.default)
    assert result.region(topk).kind == HOST


def test_symbolic_trace_with_call_module_nodes():
    model = MLP()
    gm = torch.fx.symbolic_trace(model)
    assert {n.op for n in gm.graph.nodes} >= {"call_module", "call_function"}
    result = partition(gm.graph, lambda node: node.op == "call_module")
    assert [r.kind for r in result.regions] == [DEVICE, HOST, DEVICE]
    x = torch.randn(3, 16)
    torch.testing.assert_close(split(gm, result)(x), model(x), rtol=0, atol=0)


def test_a_raising_predicate_is_named_with_the_node():
    gm = dag_module([[], [0]])

    def flaky(node: Node) -> bool:
        raise RuntimeError("no schema")

    with pytest.raises(PartitionError, match=r"is_supported raised RuntimeError on node 'n0'.*no schema"):
        partition(gm.graph, flaky)


def test_split_refuses_a_partitioning_of_another_graph():
    gm, other = dag_module([[], [0]]), dag_module([[], [0]])
    with pytest.raises(PartitionError, match=r"node 'n0' .* is in no region.*partition\(gm.graph"):
        split(gm, partition(other.graph, lambda node: True))


def test_region_of_a_placeholder_says_which_nodes_have_regions():
    gm = dag_module([[]])
    result = partition(gm.graph, lambda node: True)
    x = next(iter(gm.graph.nodes))
    with pytest.raises(PartitionError, match="node 'x' \\(placeholder\\) is in no region"):
        result.region(x)


def test_output_reading_a_constant_directly():
    graph = Graph()
    x = graph.placeholder("x")
    c = graph.get_attr("c")
    y = graph.call_function(torch.relu, (x,))
    graph.output((y, c))
    root = torch.nn.Module()
    root.register_buffer("c", torch.tensor([1.0, 2.0]))
    gm = GraphModule(root, graph)
    parts = split(gm, partition(gm.graph, lambda node: True))
    got = parts(torch.tensor([-1.0]))
    assert torch.equal(got[0], torch.tensor([0.0])) and torch.equal(got[1], torch.tensor([1.0, 2.0]))


class Cond(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x)
        return torch.cond(y.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (y,)) + 1


@pytest.mark.parametrize("cond_on_device", [False, True])
def test_cond_subgraphs_are_copied_into_the_region_that_calls_them(cond_on_device):
    gm = rt.export(Cond(), torch.randn(3)).module()
    cond = torch.ops.higher_order.cond
    result = partition(gm, lambda node: (node.target is cond) == cond_on_device)
    assert result.num_regions == 3
    parts = split(gm, result)
    (cond_node,) = [n for n in gm.graph.nodes if n.target is cond]
    region = parts.get_submodule(result.region(cond_node).name)
    assert {n.target for n in region.graph.nodes if n.op == "get_attr"} == {"true_graph_0", "false_graph_0"}
    for x in (torch.randn(3), -torch.ones(3), torch.ones(3)):
        assert torch.equal(parts(x), gm(x))


def test_on_a_tie_fewer_device_regions():
    # n0 device, n1 host, n2 = device(n1), n3 = host(n0): D H D and H D H both take 3 regions; H D H has 1 device one
    inputs, on_device = [[], [], [1], [0]], [True, False, True, False]
    gm = dag_module(inputs)
    result = partition(gm.graph, _by_name(on_device))
    assert brute_force_optimum(inputs, on_device) == (3, 1)
    assert [(r.kind, [n.name for n in r.nodes]) for r in result.regions] == [
        (HOST, ["n1"]),
        (DEVICE, ["n0", "n2"]),
        (HOST, ["n3"]),
    ]


def test_a_graph_out_of_topological_order_is_refused():
    gm = dag_module([[], []])
    n0, n1 = (n for n in gm.graph.nodes if n.op == "call_function")
    n0.args = (n1,)  # n0 now reads n1, which comes after it
    with pytest.raises(PartitionError, match=r"node 'n0' reads 'n1', defined after it: .* not in topological order"):
        partition(gm.graph, lambda node: True)


def test_split_lets_no_torch_pytree_warning_escape(recwarn):
    """split() copies the export's pytree calling convention, on which torch 2.13 warned about its own pytree
    code (`isinstance(treespec, LeafSpec)` is deprecated): silenced there, and only there."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    gm = torch.export.export(model, (torch.randn(2, 4),)).module()
    parts = partition(gm.graph, lambda node: node.target is not torch.ops.aten.relu.default)
    recwarn.clear()
    runner = split(gm, parts)
    x = torch.randn(2, 4)
    torch.testing.assert_close(runner(x), model(x))
    assert [str(w.message) for w in recwarn if issubclass(w.category, FutureWarning)] == []
