"""Phases: rule sets run one after another, each to its fixpoint, by `fx_rewrites.apply`."""

from __future__ import annotations

import pytest
import torch

import fx_rewrites
from fx_rewrites import Forward, NumericMismatch, Phases, RuleDefinitionError, RuleSet, Substitute
from fx_rewrites import testing as rt

aten = torch.ops.aten


class Fresh(torch.nn.Module):
    """lift_fresh_copy (a constant), then a relu on the sum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + torch.tensor([1.0, -2.0, 3.0]))


lift_to_clone = Substitute(name="lift_to_clone", op=aten.lift_fresh_copy.default, to=aten.clone.default)
# only meaningful after the first phase: it needs the clone the first phase makes
clone_forward = Forward(name="clone_forward", ops=aten.clone.default)
relu_to_abs = Substitute(name="relu_to_abs", op=aten.relu.default, to=aten.abs.default)  # wrong on purpose


def _inputs():
    return [(torch.randn(3),), (torch.randn(3) * 4,)]


def test_phases_run_in_order_each_seeing_what_the_one_before_left():
    ep = rt.export(Fresh(), torch.randn(3))
    phases = Phases(RuleSet([lift_to_clone], name="first"), RuleSet([clone_forward], name="second"))
    result = fx_rewrites.apply(ep, phases)
    assert result.report.converged
    assert result.report.phases == ["first", "second"]
    assert dict(result.report.rewrites) == {"lift_to_clone": 1, "clone_forward": 1}
    assert "phases: first -> second" in result.report.summary()
    rt.assert_ops(result, absent=[aten.lift_fresh_copy.default, aten.clone.default])
    rt.assert_matches_eager(result, Fresh(), _inputs())


def test_one_rule_set_of_both_rules_is_not_the_same_as_phases():
    """In one set, clone_forward meets no clone when the set starts: the order of phases is what makes it fire."""
    ep = rt.export(Fresh(), torch.randn(3))
    backwards = fx_rewrites.apply(ep, Phases(RuleSet([clone_forward], name="a"), RuleSet([lift_to_clone], name="b")))
    assert dict(backwards.report.rewrites) == {"lift_to_clone": 1}
    rt.assert_ops(backwards, present=[aten.clone.default])


def test_budget_counts_the_rewrites_of_all_phases():
    ep = rt.export(Fresh(), torch.randn(3))
    phases = Phases([lift_to_clone], [clone_forward], name="two")
    result = fx_rewrites.apply(ep, phases, budget=1)
    assert result.report.total_rewrites == 1
    assert result.report.phases == ["rules"]  # the second phase had no budget left and did not run
    rt.assert_ops(result, present=[aten.clone.default])


def test_check_blames_a_wrong_rule_in_a_later_phase():
    ep = rt.export(Fresh(), torch.randn(3))
    phases = Phases([lift_to_clone], [clone_forward, relu_to_abs], name="wrong")
    with pytest.raises(NumericMismatch, match="rule 'relu_to_abs' changed the results") as caught:
        fx_rewrites.apply(ep, phases, check=_inputs())
    assert caught.value.rule == "relu_to_abs"


def test_phases_list_and_find_their_rules():
    phases = Phases(RuleSet([lift_to_clone], name="first"), [clone_forward], name="backend")
    assert phases.names() == ["lift_to_clone", "clone_forward"]
    assert [r.name for r in phases] == phases.names() and len(phases) == 2
    assert "clone_forward" in phases and phases["clone_forward"] is clone_forward
    assert phases.then([relu_to_abs]).names()[-1] == "relu_to_abs"
    with pytest.raises(KeyError, match="no rule named 'nope' in any phase of 'backend'"):
        phases["nope"]
    with pytest.raises(RuleDefinitionError, match="at least one rule set"):
        Phases()


def test_a_rule_added_to_phases_joins_the_first_phase_and_runs_there():
    later = Phases(RuleSet([], name="fix"), RuleSet([lift_to_clone], name="lower"), name="backend")
    for added in (later + clone_forward, later | clone_forward, [clone_forward] + later):
        assert isinstance(added, Phases) and added.name == "backend"
        assert added.sets[0].names() == ["clone_forward"] and added.sets[1].names() == ["lift_to_clone"]
    # in the first phase clone_forward meets no clone yet: the phase order holds after `+`
    result = fx_rewrites.apply(rt.export(Fresh(), torch.randn(3)), later + clone_forward)
    assert dict(result.report.rewrites) == {"lift_to_clone": 1}
    rt.assert_matches_eager(result, Fresh(), _inputs())
    assert (later + clone_forward).without("lift_to_clone", "clone_forward").names() == []
    assert (later + clone_forward).without(lift_to_clone).names() == ["clone_forward"]  # a rule, not only its name
    assert RuleSet([lift_to_clone, clone_forward]).without(clone_forward).names() == ["lift_to_clone"]
    with pytest.raises(KeyError, match=r"no phase of 'backend' has rules named \['nope'\]"):
        later.without("nope")


def test_testing_apply_rules_takes_phases_and_runs_them_in_order():
    ep = rt.export(Fresh(), torch.randn(3))
    phases = Phases(RuleSet([lift_to_clone], name="first"), RuleSet([clone_forward], name="second"))
    result = rt.apply_rules(ep, phases)
    assert result.report.phases == ["first", "second"]
    rt.assert_fired(result, "clone_forward", times=1)  # only the second phase sees the clone
    rt.assert_ops(result, absent=[aten.lift_fresh_copy.default, aten.clone.default])
    rt.assert_matches_eager(result, Fresh(), _inputs())
    rt.assert_idempotent(result, phases)
    with pytest.raises(TypeError, match="one Phases alone"):
        rt.apply_rules(ep, phases, lift_to_clone)


def test_reprs_name_the_rules_and_phases_not_every_root():
    """`print(backends.get("iree"))` printed ~700,000 characters: every field and root of every rule."""
    from fx_rewrites import backends

    pair = RuleSet([lift_to_clone, clone_forward, relu_to_abs, Forward(name="f", ops=aten.detach.default)], name="p")
    assert repr(pair) == "RuleSet('p', 4 rules: lift_to_clone, clone_forward, relu_to_abs, ...)"
    assert repr(RuleSet([lift_to_clone], name="one")) == "RuleSet('one', 1 rule: lift_to_clone)"
    phases = Phases(RuleSet([], name="fix"), RuleSet([lift_to_clone], name="lower"), name="backend")
    assert (
        repr(phases) == "Phases('backend', 2 phases: RuleSet('fix', 0 rules), RuleSet('lower', 1 rule: lift_to_clone))"
    )
    for name in backends.names():
        text = repr(backends.get(name))
        assert len(text) < 2000 and repr(backends.get(name).rules) in text, (name, len(text))


def test_rule_or_rule_is_a_rule_set_with_its_checks():
    """`rule | rule` raised TypeError: only a RuleSet on the left composed."""
    for both in (lift_to_clone | clone_forward, lift_to_clone + clone_forward, lift_to_clone + [clone_forward]):
        assert isinstance(both, RuleSet) and both.names() == ["lift_to_clone", "clone_forward"]
    assert (lift_to_clone | clone_forward).name == "lift_to_clone+clone_forward"
    assert (lift_to_clone | clone_forward | relu_to_abs).names()[-1] == "relu_to_abs"
    assert (lift_to_clone | lift_to_clone).names() == ["lift_to_clone"]  # the same rule twice is one rule
    named_alike = Substitute(name="lift_to_clone", op=aten.relu.default, to=aten.abs.default)
    with pytest.raises(RuleDefinitionError, match="two different rules are named 'lift_to_clone'"):
        lift_to_clone | named_alike
    default = fx_rewrites.rules.DEFAULT
    assert (relu_to_abs + default).name == "default" and (relu_to_abs + default).names()[0] == "relu_to_abs"
    phases = Phases(RuleSet([], name="fix"), RuleSet([lift_to_clone], name="lower"), name="backend")
    assert isinstance(relu_to_abs | phases, Phases) and (relu_to_abs | phases).sets[0].names() == ["relu_to_abs"]
    with pytest.raises(TypeError, match="unsupported operand"):
        lift_to_clone | 3
