"""Argument forms IREE 3.13 cannot take (backends/iree/rules/arguments.py): topk with sorted=False, a scatter
along a negative dim. Each "without the rule" test fails once IREE takes the form itself."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules.arguments import scatter_negative_dim_for_iree, topk_unsorted_as_sorted_for_iree

aten = torch.ops.aten
IREE = backends.get("iree")


class Router(torch.nn.Module):
    """An MoE router: the top 2 experts' weights, unsorted, and their indices."""

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = torch.topk(logits.softmax(-1), 2, dim=-1, sorted=False)
        return weights / weights.sum(-1, keepdim=True), experts


class HardOneHot(torch.nn.Module):
    """A straight-through Gumbel one-hot: ones where the argmax is, along the last dim."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hot = x.argmax(-1, keepdim=True)
        return torch.zeros_like(x).scatter(-1, hot, 1.0) + x.scatter_add(-1, hot, x.amax(-1, keepdim=True))


def _x(rows: int, seed: int, cols: int = 8) -> tuple[torch.Tensor]:
    return (torch.randn(3, rows, cols, generator=torch.Generator().manual_seed(seed)),)


CASES = {
    "topk": (Router(), topk_unsorted_as_sorted_for_iree, [aten.topk.default], r"torch\.constant\.bool"),
    "scatter": (HardOneHot(), scatter_negative_dim_for_iree, [aten.scatter.value, aten.scatter_add.default], ""),
}
SHAPES = ({1: Dim("rows", min=2, max=64)},)


def _by_row(outputs):
    """Unsorted topk allows any order of the k: compare each row's (weight, expert) pairs sorted by expert."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    weights, experts = outputs
    order = experts.argsort(-1)
    return weights.gather(-1, order), experts.gather(-1, order)


@pytest.mark.parametrize("case", sorted(CASES))
def test_iree_fails_without_the_rule(case):
    module, rule, _, error = CASES[case]
    # a topk over 8 would otherwise become ranks (rules/topk.py), which has no sorted flag
    others = ("topk_as_ranks_for_iree",) if case == "topk" else ()
    program = fx_rewrites.apply(rt.export(module, *_x(5, 0)), IREE.rules.without(rule.name, *others)).program
    with pytest.raises(Exception, match=error or r"without an error diagnostic|crash"):
        IREE.compile(program, _x(5, 0))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_rule_rewrites_and_iree_matches_eager(case, dynamic):
    module, rule, ops, _ = CASES[case]
    ep = rt.export(module, *_x(5, 0), dynamic_shapes=SHAPES if dynamic else None)
    result = rt.apply_rules(ep, rule)
    rt.assert_fired(result, rule, times=len(ops))
    rt.assert_idempotent(result, rule)
    rows = (5, 17) if dynamic else (5, 5)
    inputs = [_x(rows[0], 1), _x(rows[1], 2)]
    rt.assert_matches_eager(result, module, inputs)
    for node in result.graph_module.graph.nodes:
        if node.target in ops:
            assert node.kwargs.get("sorted", True) is True and all(a is not False for a in node.args[3:])
            if case == "scatter":
                assert node.args[1] == 2, node.format_node()
    fn = IREE.compile(fx_rewrites.apply(ep, IREE.rules).program, _x(5, 0))
    for args in inputs:
        got, want = _by_row(fn(*args)), _by_row(module(*args))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_sorted_topk_and_positive_dims_are_left_alone():
    fn = lambda x: (torch.topk(x, 2, sorted=True)[0], torch.zeros_like(x).scatter(1, x.argmax(1, keepdim=True), 1.0))
    result = rt.apply_rules(
        rt.export(fn, torch.randn(3, 8)),
        topk_unsorted_as_sorted_for_iree,
        scatter_negative_dim_for_iree,
        explain=True,
    )
    rt.assert_not_fired(result, topk_unsorted_as_sorted_for_iree)
    rt.assert_not_fired(result, scatter_negative_dim_for_iree)
    reasons = {a.reason for a in result.report.explain() if not a.fired}
    assert reasons == {"when: sorted=True (IREE lowers it)", "when: dim 1 is not negative"}
