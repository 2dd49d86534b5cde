"""The engine's fast paths: the fake-value memo and node insertion without
`Graph.create_node`'s pytree scan must give what the slow paths give."""

from __future__ import annotations

import torch
from torch.export import Dim

from engine import fxgraph, values
from rewrites import testing as rt
from rewrites.program import copy_graph_module

aten = torch.ops.aten


def _graph(fn, *args, dynamic=None):
    return rt.graph_module(rt.export(fn, *args, dynamic_shapes=dynamic))


def _node(gm, target):
    return next(n for n in gm.graph.nodes if n.target is target)


def test_memo_returns_the_first_value_for_equal_metadata():
    gm = _graph(lambda x, y: (x + y).relu() * y, torch.randn(3, 4), torch.randn(3, 4))
    mode = values.find_fake_mode(gm.graph)
    add = _node(gm, aten.add.Tensor)
    first = values.evaluate(mode, aten.sub.Tensor, add.args, {})
    again = values.evaluate(mode, aten.sub.Tensor, add.args, {})
    assert again is first
    assert tuple(first.shape) == (3, 4) and first.dtype == torch.float32
    # other metadata, other value: alpha=2 is a different key, int 1 is not float 1.0
    assert values.evaluate(mode, aten.sub.Tensor, add.args, {"alpha": 2}) is not first
    assert values.evaluate(mode, aten.mul.Scalar, (add.args[0], 1), {}) is not values.evaluate(
        mode, aten.mul.Scalar, (add.args[0], 1.0), {}
    )


def test_memo_keys_symbolic_sizes_by_expression():
    batch = Dim("batch", min=2, max=64)
    gm = _graph(lambda x, y: (x + y).relu(), torch.randn(3, 4), torch.randn(3, 4), dynamic=({0: batch}, {0: batch}))
    mode = values.find_fake_mode(gm.graph)
    add = _node(gm, aten.add.Tensor)
    first = values.evaluate(mode, aten.mul.Tensor, add.args, {})
    assert values.evaluate(mode, aten.mul.Tensor, add.args, {}) is first
    assert not isinstance(first.shape[0], int)  # still symbolic


def test_views_and_data_dependent_ops_are_not_memoised():
    gm = _graph(lambda x: x[x > 0], torch.randn(6))
    mode = values.find_fake_mode(gm.graph)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    view = values.evaluate(mode, aten.view.default, (x, [2, 3]), {})
    assert values.evaluate(mode, aten.view.default, (x, [2, 3]), {}) is not view
    for op in (aten.nonzero.default, aten.index.Tensor, aten.add_.Tensor, aten._local_scalar_dense.default):
        assert not values._memoisable(op), op
    assert values._memoisable(aten.logical_not.default)


def test_insert_node_matches_create_node():
    gm = _graph(lambda x: x.relu(), torch.randn(3))
    relu = _node(gm, aten.relu.default)
    with gm.graph.inserting_before(relu):
        fast = fxgraph.insert_node(gm.graph, "call_function", aten.neg.default, (relu.args[0],), {}, "neg")
        slow = gm.graph.create_node("call_function", aten.neg.default, (relu.args[0],), {}, "neg")
    assert (fast.name, slow.name) == ("neg", "neg_1")
    assert list(gm.graph.nodes).index(fast) == list(gm.graph.nodes).index(relu) - 2
    assert gm.graph.find_nodes(op="call_function", target=aten.neg.default) == [fast, slow]
    assert len(gm.graph.nodes) == len(list(gm.graph.nodes))
    gm.graph.lint()


def test_copy_keeps_names_meta_and_code():
    class M(torch.nn.Module):
        def forward(self, input):  # shadows a builtin: Graph.graph_copy would rename it input_1
            return input.relu() + 1

    ep = rt.export(M(), torch.randn(3))
    copy = copy_graph_module(ep.graph_module)
    old, new = list(ep.graph_module.graph.nodes), list(copy.graph.nodes)
    assert [n.name for n in new] == [n.name for n in old]
    assert [n.target for n in new] == [n.target for n in old]
    assert all(a.meta == b.meta and a.meta is not b.meta for a, b in zip(old, new))
    copy.graph.lint()
    x = torch.randn(3)
    torch.testing.assert_close(copy(x), ep.graph_module(x))
