"""`where(c, a, a)` with `a` broadcast by `c`, as an expand (backends/iree/rules/one_value_where.py). Before the rule
IREE 3.13 fails to compile it: torch-mlir folds the where to `a` at `a`'s own shape."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules.one_value_where import where_of_one_value_as_expand_for_iree

aten = torch.ops.aten


class OneValue(torch.nn.Module):
    """where(x > 0, w, w): w [1, 4, 1, 1] (or [4, 1, 1], of a lower rank) against x [n, 4, 3, 3]."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(4, dtype=torch.float32).reshape(shape).to(dtype) - 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, self.w, self.w)


def _inputs(dynamic: bool) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 4, 3, 3, generator=g),), (torch.randn(3 if dynamic else 2, 4, 3, 3, generator=g),)]


@pytest.mark.parametrize("shape", [(1, 4, 1, 1), (4, 1, 1)], ids=["same-rank", "lower-rank"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_a_broadcast_one_value_where_becomes_an_expand_and_compiles(shape, dynamic):
    module = OneValue(shape).eval()
    inputs = _inputs(dynamic)
    ep = rt.export(module, *inputs[0], dynamic_shapes=[{0: Dim("batch", max=8)}] if dynamic else None)
    wheres = [n for n in ep.graph.nodes if n.target is aten.where.self]
    assert len(wheres) == 1 and wheres[0].args[1] is wheres[0].args[2]  # the form export gives
    iree = backends.get("iree")
    with pytest.raises(Exception, match="doesn't match function result type"):
        iree.compile(rt.apply_rules(ep, iree.rules.without(where_of_one_value_as_expand_for_iree)).program, inputs[0])
    result = rt.apply_rules(ep, where_of_one_value_as_expand_for_iree)
    rt.assert_fired(result, where_of_one_value_as_expand_for_iree, times=1)
    targets = [n.target for n in result.program.graph.nodes if n.op == "call_function"]
    assert aten.where.self not in targets and aten.expand.default in targets
    rt.assert_matches_eager(result, module, inputs, rtol=0, atol=0)
    rt.assert_idempotent(result, where_of_one_value_as_expand_for_iree)
    compiled = iree.compile(rt.apply_rules(ep, iree.rules).program, inputs[0])
    for args in inputs:
        want = module(*args)
        got = compiled(*args)
        assert got.shape == want.shape and torch.equal(got, want)


def test_wheres_of_two_values_or_at_the_branch_shape_are_left_alone():
    x = torch.randn(2, 4, 3, 3)
    for fn in (
        lambda t: torch.where(t > 0, t, t),  # the branch has the result's shape: torch-mlir's fold is right
        lambda t: torch.where(t > 0, t[:1], t[1:]),  # two values
    ):
        result = rt.apply_rules(rt.export(fn, x), where_of_one_value_as_expand_for_iree)
        rt.assert_not_fired(result, where_of_one_value_as_expand_for_iree)
