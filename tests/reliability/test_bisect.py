"""apply(..., check=inputs): the results before and after the rules are compared, and
a difference is traced to the first rewrite that made it (rewrites/bisect.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.engine.errors import NumericMismatch
from fx_rewrites.rules import DEFAULT

aten = torch.ops.aten


@fx_rewrites.rule(roots=(aten.relu.default,))
def relu_to_abs(node, rw):
    """Deliberately wrong: relu(x) -> abs(x)."""
    rw.replace(node, rw.call(aten.abs.default, node.args[0]))


@fx_rewrites.rule(roots=(aten.neg.default,))
def neg_to_mul(node, rw):
    """Correct: neg(x) -> mul(x, -1)."""
    rw.replace(node, rw.call(aten.mul.Tensor, node.args[0], -1))


class Net(torch.nn.Module):
    """Pooling without stride, a lifted constant, a neg and a relu: DEFAULT and neg_to_mul fire
    before and after the wrong rule does."""

    def __init__(self, act=torch.relu):
        super().__init__()
        self.act = act

    def forward(self, x):
        y = F.max_pool2d(-x, 2) + torch.tensor([0.5, -0.5, 1.0]).view(1, 3, 1, 1)
        return self.act(y) * 3 - y.neg()


def _ep():
    return rt.export(Net(), torch.randn(2, 3, 8, 8))


WITH_WRONG = fx_rewrites.RuleSet([*DEFAULT.rules, neg_to_mul, relu_to_abs])


def test_correct_rules_pass_the_check():
    x = torch.randn(2, 3, 8, 8)
    result = fx_rewrites.apply(_ep(), fx_rewrites.RuleSet([*DEFAULT.rules, neg_to_mul]), check=(x,))
    assert result.report.total_rewrites >= 4
    rt.assert_matches_eager(result, Net(), [(x,)])


def test_wrong_rule_is_named_with_node_op_and_difference():
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(NumericMismatch) as info:
        fx_rewrites.apply(_ep(), WITH_WRONG, check=(x,))
    error = info.value
    assert (error.rule, error.node, error.op) == ("relu_to_abs", "relu", "aten.relu.default")
    expected = float((Net(torch.abs)(x) - Net()(x)).abs().max())  # eager, with abs where relu was
    assert expected > 0.1
    assert error.max_difference == pytest.approx(expected, rel=1e-5)
    total = fx_rewrites.apply(_ep(), WITH_WRONG).report.total_rewrites
    assert 1 <= error.step <= total and total >= 5
    message = str(error)
    for words in (
        "rule 'relu_to_abs' changed the results",
        "node 'relu' (aten.relu.default)",
        f"rewrite {error.step} of {total}",
        "input set 0",
        "Fix the rule",
        "leave 'relu_to_abs' out",
    ):
        assert words in message, message


def test_the_blamed_rewrite_is_the_first_that_changes_results():
    # replay by hand: the first step-1 rewrites match eager, the first `step` do not
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(NumericMismatch) as info:
        fx_rewrites.apply(_ep(), WITH_WRONG, check=(x,))
    step = info.value.step
    if step > 1:
        good = fx_rewrites.apply(_ep(), WITH_WRONG, budget=step - 1)
        assert "relu_to_abs" not in good.report.rewrites
        rt.assert_matches_eager(good, Net(), [(x,)])
    bad = fx_rewrites.apply(_ep(), WITH_WRONG, budget=step)
    assert bad.report.rewrites["relu_to_abs"] == 1
    with pytest.raises(AssertionError):
        rt.assert_matches_eager(bad, Net(), [(x,)])


def test_only_the_input_set_that_shows_the_bug_is_named():
    # max_pool2d(-x) + c stays positive for these inputs, so relu == abs there
    harmless = -torch.rand(2, 3, 8, 8) - 2
    fx_rewrites.apply(_ep(), WITH_WRONG, check=(harmless,))
    with pytest.raises(NumericMismatch, match="input set 1"):
        fx_rewrites.apply(_ep(), WITH_WRONG, check=[(harmless,), (torch.randn(2, 3, 8, 8),)])


def test_check_on_a_graph_module_rewritten_in_place():
    def f(x):
        return aten.relu.default(aten.neg.default(x))

    gm = torch.fx.symbolic_trace(f)
    x = torch.tensor([-2.0, -0.5, 0.0, 1.0, 3.0])
    with pytest.raises(NumericMismatch) as info:
        fx_rewrites.apply(gm, [neg_to_mul, relu_to_abs], example_inputs=(x,), inplace=True, check=(x,))
    assert info.value.rule == "relu_to_abs"
    assert info.value.max_difference == pytest.approx(3.0)  # abs(-3) - relu(-3)


@pytest.mark.parametrize("bad", ["x", 3, None.__class__])
def test_check_takes_input_tuples(bad):
    with pytest.raises(fx_rewrites.GraphInputError, match=r"check= takes the program's positional inputs.*Fix: pass"):
        fx_rewrites.apply(_ep(), DEFAULT, check=bad)


def test_inputs_the_program_cannot_take_are_named():
    with pytest.raises(fx_rewrites.GraphInputError, match=r"check= input set 0 does not run on the graph before"):
        fx_rewrites.apply(_ep(), DEFAULT, check=(torch.randn(2, 5),))


def test_check_lets_no_torch_pytree_warning_escape(recwarn):
    """apply(check=...) copies the program to run it, and torch 2.13 warned about its own pytree code
    (`isinstance(treespec, LeafSpec)` is deprecated) on each copy: silenced there, and only there.
    (recwarn records every warning, the LeafSpec one that pyproject's filterwarnings ignores included.)"""
    ep = rt.export(Net(), torch.randn(1, 3, 4, 4))
    recwarn.clear()
    result = fx_rewrites.apply(ep, check=[(torch.randn(1, 3, 4, 4),), (torch.randn(1, 3, 4, 4),)])
    assert result.report.converged
    assert [str(w.message) for w in recwarn if issubclass(w.category, FutureWarning)] == []
