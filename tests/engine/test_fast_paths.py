"""The engine's fast paths: the fake-value memo and node insertion without
`Graph.create_node`'s pytree scan must give what the slow paths give."""

from __future__ import annotations

import torch
from torch.export import Dim

from fx_rewrites import testing as rt
from fx_rewrites.engine import fxgraph, values
from fx_rewrites.program import copy_graph_module

aten = torch.ops.aten


def _graph(fn, *args, dynamic=None):
    return rt.graph_module(rt.export(fn, *args, dynamic_shapes=dynamic))


def _node(gm, target):
    return next(n for n in gm.graph.nodes if n.target is target)


def _hits(monkeypatch) -> list:
    """Record the memo's hits (each is rebuilt by `values._fresh`)."""
    hits: list = []
    fresh = values._fresh

    def spy(mode, hit):
        hits.append(hit)
        return fresh(mode, hit)

    monkeypatch.setattr(values, "_fresh", spy)
    return hits


def test_memo_returns_the_first_value_for_equal_metadata(monkeypatch):
    hits = _hits(monkeypatch)
    gm = _graph(lambda x, y: (x + y).relu() * y, torch.randn(3, 4), torch.randn(3, 4))
    mode = values.find_fake_mode(gm.graph)
    add = _node(gm, aten.add.Tensor)
    first = values.evaluate(mode, aten.sub.Tensor, add.args, {})
    again = values.evaluate(mode, aten.sub.Tensor, add.args, {})
    assert hits == [first]
    assert tuple(first.shape) == (3, 4) and first.dtype == torch.float32
    assert (again.shape, again.stride(), again.dtype) == (first.shape, first.stride(), first.dtype)
    # other metadata, other value: alpha=2 is a different key, int 1 is not float 1.0
    values.evaluate(mode, aten.sub.Tensor, add.args, {"alpha": 2})
    values.evaluate(mode, aten.mul.Scalar, (add.args[0], 1), {})
    values.evaluate(mode, aten.mul.Scalar, (add.args[0], 1.0), {})
    assert hits == [first]


def test_a_memo_hit_is_a_distinct_fake_tensor():
    """Two nodes must never share one fake value: make_fx tells its inputs
    apart by identity, and a decomposition traced on two shared values read
    one input for both (instance_norm used its bias as its weight)."""
    gm = _graph(lambda x, y: (x + y).relu() * y, torch.randn(3, 4), torch.randn(3, 4))
    mode = values.find_fake_mode(gm.graph)
    add = _node(gm, aten.add.Tensor)
    first = values.evaluate(mode, aten.sub.Tensor, add.args, {})
    again = values.evaluate(mode, aten.sub.Tensor, add.args, {})
    assert again is not first
    pair = values.evaluate(mode, aten.var_mean.correction, (add,), {"dim": [1]})
    other = values.evaluate(mode, aten.var_mean.correction, (add,), {"dim": [1]})
    assert type(other) is type(pair) and all(a is not b for a, b in zip(pair, other))


def test_memo_keys_symbolic_sizes_by_expression(monkeypatch):
    hits = _hits(monkeypatch)
    batch = Dim("batch", min=2, max=64)
    gm = _graph(lambda x, y: (x + y).relu(), torch.randn(3, 4), torch.randn(3, 4), dynamic=({0: batch}, {0: batch}))
    mode = values.find_fake_mode(gm.graph)
    add = _node(gm, aten.add.Tensor)
    first = values.evaluate(mode, aten.mul.Tensor, add.args, {})
    again = values.evaluate(mode, aten.mul.Tensor, add.args, {})
    assert hits == [first] and again.shape == first.shape
    assert not isinstance(first.shape[0], int) and not isinstance(again.shape[0], int)  # still symbolic


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


class _SubThenRelu(torch.nn.Module):
    def forward(self, x, w):
        return torch.relu(x - w) * 2


def test_modify_changes_arguments_in_place_and_keeps_numerics():
    from fx_rewrites import rule

    @rule(roots=(aten.sub.Tensor,))
    def sub_as_add_of_neg(node, rw):
        """x - w -> x - (-w) * -1: the same sub node, new arguments."""
        x, w = node.args[:2]
        rw.modify(node, (x, rw.call(aten.neg.default, w)), {"alpha": -1})

    x, w = torch.randn(3, 4), torch.randn(3, 4)
    ep = rt.export(_SubThenRelu(), x, w)
    sub = _node(rt.graph_module(ep), aten.sub.Tensor)
    result = rt.apply_rules(ep, sub_as_add_of_neg, budget=1)
    new_sub = _node(result.graph_module, aten.sub.Tensor)
    assert new_sub.name == sub.name and new_sub.kwargs == {"alpha": -1}
    assert new_sub.args[1].target is aten.neg.default
    assert new_sub.meta["rewrites"][-1]["rule"] == "sub_as_add_of_neg"
    rt.assert_matches_eager(result, _SubThenRelu(), [(x, w)])


def test_modify_that_changes_the_value_is_refused_and_rolled_back():
    import pytest

    from fx_rewrites import rule
    from fx_rewrites.engine import RuleError

    @rule(roots=(aten.sub.Tensor,))
    def sub_of_sums(node, rw):
        x, w = node.args[:2]
        rw.modify(node, (rw.call(aten.sum.default, x), rw.call(aten.sum.default, w)))

    ep = rt.export(_SubThenRelu(), torch.randn(3, 4), torch.randn(3, 4))
    with pytest.raises(RuleError, match=r"modified 'sub' does not match what it was: rank changed from 2 to 0"):
        rt.apply_rules(ep, sub_of_sums)
    skipped = rt.apply_rules(ep, sub_of_sums, on_error="skip")
    assert str(skipped.graph_module.graph) == str(rt.graph_module(ep).graph)  # the sums were rolled back too
    assert [s.rule for s in skipped.report.skips] == ["sub_of_sums"]


def test_fake_constants_are_not_memoised():
    """Fake mode propagates small constants' data; two constants with equal
    metadata must not share a memoised result."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx import Graph

    mode = FakeTensorMode()
    graph = Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    a.meta["val"] = mode.from_tensor(torch.tensor([1, 2, 3]), static_shapes=True)
    b.meta["val"] = mode.from_tensor(torch.tensor([4, 5, 6]), static_shapes=True)
    a.meta["val"].constant, b.meta["val"].constant = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    first = values.evaluate(mode, aten.add.Tensor, (a, 1), {})
    second = values.evaluate(mode, aten.add.Tensor, (b, 1), {})
    assert first is not second
