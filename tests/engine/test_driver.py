"""The engine's promises, each on a real torch.export graph."""

from __future__ import annotations

import pytest
import torch

import fx_rewrites
from fx_rewrites import engine
from fx_rewrites import testing as rt
from fx_rewrites.program import copy_graph_module
from tests.conftest import AddRelu, ReluChain
from tests.engine import rules as r

aten = torch.ops.aten


def test_fixpoint_in_one_call(relu_chain_ep):
    result = rt.apply_rules(relu_chain_ep, r.collapse_relu)
    assert result.report.converged
    assert rt.targets(result).count(aten.relu.default) == 1
    rt.assert_fired(result, "collapse_relu", times=15)
    rt.assert_matches_eager(result, ReluChain(16), [(torch.randn(4, 5),), (torch.randn(4, 5) - 1,)])
    rt.assert_idempotent(result, r.collapse_relu)


def test_worklist_does_not_rescan(relu_chain_ep):
    result = rt.apply_rules(relu_chain_ep, r.collapse_relu)
    # 16 relus visited once each, plus one visit per node a rewrite created.
    assert result.report.visits <= 16 + 15


def _clamp_rule(name: str, priority: int):
    @fx_rewrites.rule(roots=(aten.relu.default,), name=name, priority=priority)
    def relu_to_clamp(node, rw):
        rw.replace(node, rw.call(aten.clamp_min.default, node.args[0], 0.0 if name == "b" else 0))

    return relu_to_clamp


def test_priority_orders_rules_on_one_root(add_relu_ep):
    low, high = _clamp_rule("a", 0), _clamp_rule("b", 5)
    for order in ([low, high], [high, low]):
        result = rt.apply_rules(add_relu_ep, *order)
        rt.assert_fired(result, "b", times=1)
        rt.assert_not_fired(result, "a")


def test_ties_go_to_the_rule_given_first(add_relu_ep):
    a, b = _clamp_rule("a", 0), _clamp_rule("b", 0)
    rt.assert_fired(rt.apply_rules(add_relu_ep, a, b), "a", times=1)
    rt.assert_fired(rt.apply_rules(add_relu_ep, b, a), "b", times=1)


def test_deterministic():
    runs = []
    for _ in range(3):
        ep = rt.export(ReluChain(16), torch.randn(4, 5))
        result = rt.apply_rules(ep, r.collapse_relu, r.add_to_sub)
        runs.append((result.graph_module.code, dict(result.report.rewrites)))
    assert runs[0] == runs[1] == runs[2]


def test_raising_rule_is_rolled_back(add_relu_ep):
    gm = copy_graph_module(add_relu_ep.graph_module)
    before = str(gm.graph)
    with pytest.raises(engine.RuleError) as info:
        engine.run(gm.graph, [r.raises_midway])
    message = str(info.value)
    assert "raises_midway" in message and "'relu'" in message and "boom" in message
    assert info.value.rule == "raises_midway" and info.value.node == "relu"
    assert str(gm.graph) == before
    gm.graph.lint()


def test_skip_policy_lists_the_failure_and_goes_on(add_relu_ep):
    result = rt.apply_rules(add_relu_ep, r.raises_midway, r.add_to_sub, on_error="skip")
    assert [(s.rule, s.node) for s in result.report.skips] == [("raises_midway", "relu")]
    rt.assert_fired(result, "add_to_sub", times=1)
    assert aten.neg.default in rt.targets(result)  # from add_to_sub, not from the skipped rule
    rt.assert_matches_eager(result, AddRelu(), [(torch.randn(3, 4), torch.randn(3, 4))])


@pytest.mark.parametrize(("bad_rule", "words"), [(r.changes_dtype, "dtype changed"), (r.changes_shape, "rank changed")])
def test_replacement_that_changes_the_value_is_refused(add_relu_ep, bad_rule, words):
    gm = copy_graph_module(add_relu_ep.graph_module)
    before = str(gm.graph)
    with pytest.raises(engine.RuleError, match=words):
        engine.run(gm.graph, [bad_rule])
    assert str(gm.graph) == before


def test_rules_that_undo_each_other_are_named(add_relu_ep):
    result = rt.apply_rules(add_relu_ep, r.add_to_sub, r.sub_to_add)
    assert not result.report.converged
    reason = result.report.stop_reason
    assert reason.startswith("non-convergence:")
    assert "'add_to_sub'" in reason and "'sub_to_add'" in reason and "'add'" in reason
    # every rewrite was correct, so the stopped graph still computes the same
    rt.assert_matches_eager(result, AddRelu(), [(torch.randn(3, 4), torch.randn(3, 4))])
    with pytest.raises(engine.NonConvergence, match="undo each other"):
        rt.apply_rules(add_relu_ep, r.add_to_sub, r.sub_to_add, strict=True)


def test_budget_stop_is_reported(add_relu_ep):
    result = rt.apply_rules(add_relu_ep, r.bump_scalar, budget=20)
    assert result.report.stop_reason == "rewrite budget"
    assert not result.report.converged
    assert result.report.total_rewrites == 20
    assert any("bump_scalar" in note for note in result.report.notes)
    with pytest.raises(engine.NonConvergence, match="budget"):
        rt.apply_rules(add_relu_ep, r.bump_scalar, budget=20, strict=True)


def test_default_budget_grows_with_the_graph(add_relu_ep):
    result = rt.apply_rules(add_relu_ep, r.bump_scalar)
    n = result.report.nodes_before
    assert result.report.budget == engine.driver.BUDGET_PER_NODE * n + engine.driver.BUDGET_FLOOR
    assert result.report.stop_reason == "rewrite budget"
    assert result.report.total_rewrites == result.report.budget


def test_rule_that_regrows_its_own_match_is_named(add_relu_ep):
    result = rt.apply_rules(add_relu_ep, r.mul_grows)
    assert result.report.stop_reason == (
        "non-convergence: rule 'mul_grows' keeps rewriting the same form of node 'mul'"
    )


@fx_rewrites.rule(roots=(aten.relu.default,), name="relu_as_two_halves")
def _relu_as_two_halves(node, rw):
    """relu(x) as clamp_min(x, 0) * 0.5 + clamp_min(x, 0) * 0.5: two equal nodes of one origin, as a
    decomposition may write them (exact: halves of a float add back to it)."""
    halves = [rw.call(aten.mul.Tensor, rw.call(aten.clamp_min.default, node.args[0], 0), 0.5) for _ in range(2)]
    rw.replace(node, rw.call(aten.add.Tensor, *halves))


@fx_rewrites.rule(
    roots=(aten.clamp_min.default,),
    name="int_bound_as_float",
    when=lambda node: True if type(node.args[1]) is int else fx_rewrites.Miss("a float bound"),
)
def _int_bound_as_float(node, rw):
    rw.replace(node, rw.call(aten.clamp_min.default, node.args[0], float(node.args[1])))


def test_equal_nodes_of_one_origin_are_not_a_cycle(add_relu_ep):
    """Each of two equal nodes is rewritten once: the second repeats the first's form, but it was not made
    by that rewrite, so it is no cycle (it stopped the run as one until the repeat was checked for that)."""
    result = rt.apply_rules(add_relu_ep, _relu_as_two_halves, _int_bound_as_float)
    assert result.report.converged, result.report.stop_reason
    rt.assert_fired(result, "int_bound_as_float", times=2)
    bounds = [n.args[1] for n in result.graph_module.graph.nodes if n.target is aten.clamp_min.default]
    assert len(bounds) == 2 and all(type(b) is float for b in bounds)
    rt.assert_matches_eager(result, AddRelu(), [(torch.randn(3, 4), torch.randn(3, 4)) for _ in range(2)])


def test_provenance_on_created_nodes(add_relu_ep):
    result = rt.apply_rules(add_relu_ep, r.add_to_sub)
    created = [n for n in result.graph_module.graph.nodes if "rewrites" in n.meta]
    assert {n.target for n in created} == {aten.sub.Tensor, aten.neg.default}
    for node in created:
        assert node.meta["rewrites"][-1] == {"rule": "add_to_sub", "source": "add"}
        assert "val" in node.meta
    untouched = [n for n in result.graph_module.graph.nodes if n.target is aten.relu.default]
    assert untouched and all("rewrites" not in n.meta for n in untouched)


def test_input_program_is_not_modified(add_relu_ep):
    before = str(add_relu_ep.graph)
    rt.apply_rules(add_relu_ep, r.add_to_sub)
    assert str(add_relu_ep.graph) == before


def test_explain_says_why_not(add_relu_ep):
    result = rt.apply_rules(add_relu_ep, r.sub_to_add, r.add_to_sub, explain=True)
    attempts = result.report.explain("sub_to_add")
    assert attempts and all(a.fired for a in attempts)
    plain = rt.export(lambda x, y: x - y, torch.randn(2), torch.randn(2))
    miss = rt.apply_rules(plain, r.sub_to_add, explain=True).report.explain("sub_to_add")
    assert [(a.node, a.fired, a.reason) for a in miss] == [("sub", False, "second operand is not neg")]
    with pytest.raises(ValueError, match="explain=True"):
        rt.apply_rules(plain, r.sub_to_add).report.explain()


def test_duplicate_rule_names_are_refused():
    with pytest.raises(ValueError, match="collapse_relu"):
        engine.run(
            torch.fx.Graph(),
            [r.collapse_relu, fx_rewrites.Pattern(name="collapse_relu", pattern=r.relu_relu, replacement=r.relu)],
        )


def test_rule_index_is_built_once_per_rule_list(add_relu_ep, monkeypatch):
    """The index (by root target) is cached per list of rules: functionalize_inplace alone has 1,537 roots."""
    from fx_rewrites.engine import driver

    built = []
    real = driver.index_rules
    monkeypatch.setattr(driver, "index_rules", lambda rules: built.append(rules) or real(rules))
    a, b = _clamp_rule("a", 0), _clamp_rule("b", 0)
    for _ in range(3):
        rt.assert_fired(rt.apply_rules(add_relu_ep, a, b), "a", times=1)
    assert len(built) == 1
    rt.assert_fired(rt.apply_rules(add_relu_ep, b, a), "b", times=1)  # another order: another index
    assert len(built) == 2


class _LateRoot:
    """A rule rooted on an op that does not exist yet (as the MoE rule roots on transformers' op, registered
    when transformers' MoE code is first imported): `roots` looks the op up each time it is read."""

    def __init__(self, namespace: str, op: str) -> None:
        self.namespace, self.op = namespace, op
        self.name, self.priority = "late_op_to_mul", 0

    @property
    def roots(self):
        packet = getattr(getattr(torch.ops, self.namespace), self.op, None)
        return (packet.default,) if packet is not None else (_LateRoot,)

    def match(self, node):
        return True

    def rewrite(self, node, match, rw):
        rw.replace(node, rw.call(aten.mul.Tensor, node.args[0], 2.0))


def test_rule_index_follows_roots_registered_after_it_was_built(add_relu_ep):
    """An index built while a rule's op was not registered yet must not hide the op once it is."""
    late = _LateRoot("fxr_test_late", "twice")
    clamp = _clamp_rule("a", 0)
    rt.assert_fired(rt.apply_rules(add_relu_ep, clamp, late), "a", times=1)  # the index is built and cached

    @torch.library.custom_op("fxr_test_late::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    twice.register_fake(lambda x: torch.empty_like(x))

    class Twice(torch.nn.Module):
        def forward(self, x):
            return torch.ops.fxr_test_late.twice(x).relu()

    inputs = [(torch.randn(3, 4),), (torch.randn(5, 4) - 1,)]
    for dynamic in (None, ({0: torch.export.Dim("n")},)):
        ep = rt.export(Twice(), *inputs[0], dynamic_shapes=dynamic)
        result = rt.apply_rules(ep, clamp, late)
        rt.assert_fired(result, "late_op_to_mul", times=1)
        assert torch.ops.fxr_test_late.twice.default not in rt.targets(result)
        rt.assert_matches_eager(result, Twice(), inputs if dynamic else [inputs[0], (torch.randn(3, 4) + 1,)])


def _failing_bookkeeping(ran: list[str]):
    """relu(x + w) -> clamp_min(w + x, 0): a replacement and an in-place modify, then an on_commit that raises."""

    @fx_rewrites.rule(roots=(aten.relu.default,), name="bookkeeping_raises")
    def bookkeeping_raises(node, rw):
        add = node.args[0]
        rw.modify(add, args=(add.args[1], add.args[0]))
        rw.replace(node, rw.call(aten.clamp_min.default, add, 0.0))
        rw.on_commit(lambda: ran.append("first"))

        def fail() -> None:
            raise RuntimeError("bookkeeping failed")

        rw.on_commit(fail)

    return bookkeeping_raises


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_on_commit_that_raises_rolls_the_rewrite_back(dynamic):
    """Issue 27: on_commit callbacks ran after the graph had changed and were not rolled back when they raised.
    They run inside the transaction now: one that raises leaves the graph as before, under both policies."""
    shapes = ({0: torch.export.Dim("n")}, {0: torch.export.Dim("n")}) if dynamic else None
    ep = rt.export(AddRelu(), torch.randn(3, 4), torch.randn(3, 4), dynamic_shapes=shapes)
    inputs = [(torch.randn(3, 4), torch.randn(3, 4)), (torch.randn(5 if dynamic else 3, 4), torch.randn(3, 4) - 1)]
    if dynamic:
        inputs[1] = (inputs[1][0], torch.randn(5, 4))
    ran: list[str] = []
    gm = copy_graph_module(ep.graph_module)
    before = str(gm.graph)
    with pytest.raises(engine.RuleError, match="bookkeeping failed") as info:
        engine.run(gm.graph, [_failing_bookkeeping(ran)])
    assert info.value.rule == "bookkeeping_raises" and info.value.node == "relu"
    assert str(gm.graph) == before  # add keeps its operand order, relu its users
    gm.graph.lint()
    gm.recompile()
    for args in inputs:
        torch.testing.assert_close(gm(*args)[0], AddRelu()(*args), rtol=0, atol=0)

    result = rt.apply_rules(ep, _failing_bookkeeping(ran), r.add_to_sub, on_error="skip")
    assert [(s.rule, s.node) for s in result.report.skips] == [("bookkeeping_raises", "relu")]
    assert "bookkeeping failed" in result.report.skips[0].cause
    rt.assert_not_fired(result, "bookkeeping_raises")
    rt.assert_fired(result, "add_to_sub", times=1)
    assert aten.clamp_min.default not in rt.targets(result) and aten.relu.default in rt.targets(result)
    rt.assert_matches_eager(result, AddRelu(), inputs)
