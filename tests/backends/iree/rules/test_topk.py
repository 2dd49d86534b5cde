"""topk and sort as ranks on IREE (backends/iree/rules/topk.py): IREE 3.13 shares one in-place sorted iota
between two sort-like ops of the same shape (an MoE router per layer), and the second's indices come back
wrong (docs/iree-3.13-findings.md, section 22)."""

from __future__ import annotations

import functools

import attrs
import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.errors import IreeUnsupportedError
from fx_rewrites.backends.iree.rules.topk import RULES, sort_as_ranks_for_iree, topk_as_ranks_for_iree

aten = torch.ops.aten


class TwoRouters(torch.nn.Module):
    """Two MoE routers' top 2 of 4 experts, as two layers of Qwen3-MoE pick them."""

    def forward(self, x, y):
        a = torch.topk(torch.softmax(x, dim=-1), 2, dim=-1)
        b = torch.topk(torch.softmax(y, dim=-1), 2, dim=-1)
        return a.values, a.indices, b.values, b.indices


class TwoSorts(torch.nn.Module):
    """Two layers' expert ids sorted (transformers' grouped-mm experts), the first descending."""

    def __init__(self, stable: bool = False) -> None:
        super().__init__()
        self.sort = functools.partial(torch.sort, stable=True) if stable else torch.sort

    def forward(self, x, y):
        a = self.sort(x, descending=True)
        b = self.sort(y)
        return a.values, a.indices, b.values, b.indices


#: the reference: the ranks are a stable sort, one of the orders torch's sort may return (past 16 elements
#: torch's CPU sort puts equal values in another order; a grouped-mm MoE's result does not depend on it)
STABLE = TwoSorts(stable=True)


def _routers(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 4, generator=g)


def _ids(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: 4 experts' ids, many ties (the ranks order them by position); y: no ties (the sort left as it is
    orders ties as torch's CPU sort may not)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (rows,), generator=g), torch.randperm(rows, generator=g)


def _shapes(dynamic: bool, dim: int) -> tuple[dict[int, Dim], dict[int, Dim]] | None:
    rows = Dim("rows", min=1, max=64)
    return ({dim: rows}, {dim: rows}) if dynamic else None


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_two_topks_become_ranks_and_iree_matches_eager(dynamic):
    inputs = [_routers(7, 0), _routers(12 if dynamic else 7, 1), _routers(1 if dynamic else 7, 2)]
    ep = rt.export(TwoRouters(), *inputs[0], dynamic_shapes=_shapes(dynamic, 0))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, topk_as_ranks_for_iree, times=2)
    rt.assert_ops(result, present=[aten.gather.default], absent=[aten.topk.default, aten.sort.default])
    rt.assert_matches_eager(result, TwoRouters(), inputs, rtol=0, atol=0)
    rt.assert_idempotent(result, RULES)
    iree = backends.get("iree")
    compiled = iree.compile(rt.apply_rules(ep, iree.rules).program, inputs[0])
    for args in inputs:
        for got, expected in zip(compiled(*args), TwoRouters()(*args), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_two_sorts_become_ranks_and_iree_matches_eager(dynamic):
    inputs = [_ids(14, 0), _ids(24 if dynamic else 14, 1), _ids(2 if dynamic else 14, 2)]
    ep = rt.export(TwoSorts(), *inputs[0], dynamic_shapes=_shapes(dynamic, 0))
    result = rt.apply_rules(ep, RULES)
    # the first becomes ranks; the last left is alone (nothing shares its iota) and stays a sort
    rt.assert_fired(result, sort_as_ranks_for_iree, times=1)
    assert rt.targets(result).count(aten.sort.default) == 1
    rt.assert_matches_eager(result, STABLE, inputs, rtol=0, atol=0)
    rt.assert_idempotent(result, RULES)
    iree = backends.get("iree")
    compiled = iree.compile(rt.apply_rules(ep, iree.rules).program, inputs[0])
    for args in inputs:
        for got, expected in zip(compiled(*args), STABLE(*args), strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_ranks_order_nan_and_ties_as_torch_sorts():
    """NaN above every number (first descending, last ascending), equal values in the order of their
    positions (a stable sort); topk's tie order is torch's own choice: the indices must only
    point at the top values."""
    x = torch.tensor([[2.0, float("nan"), 1.0, 0.0, 2.0, 1.0, 0.0, 3.0], [1.0, 1.0, 1.0, 1.0, -1.0, 5.0, 5.0, 0.0]])
    y = -x
    ep = rt.export(TwoSorts(), x, y)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, sort_as_ranks_for_iree, times=1)
    rt.assert_matches_eager(result, STABLE, [(x, y)], rtol=0, atol=0)
    ep = rt.export(TwoRouters(), x, y)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, topk_as_ranks_for_iree, times=2)
    got, expected = rt._run(result, (x, y)), TwoRouters()(x, y)
    for values, indices, source in ((0, 1, x), (2, 3, y)):
        torch.testing.assert_close(got[values], expected[values], rtol=0, atol=0, equal_nan=True)
        gathered = torch.softmax(source, -1).gather(-1, got[indices])
        torch.testing.assert_close(gathered, expected[values], rtol=0, atol=0, equal_nan=True)


def test_a_wide_topk_and_a_lone_sort_are_left():
    class Wide(torch.nn.Module):
        def forward(self, x):
            return torch.topk(x, 3).indices, torch.sort(x[:, :8]).values

    ep = rt.export(Wide(), torch.randn(2, 300))
    result = rt.apply_rules(ep, RULES)
    # the topk is too wide (300 > 256); the sort is of another shape (no iota shared with the topk)
    rt.assert_not_fired(result, topk_as_ranks_for_iree)
    rt.assert_not_fired(result, sort_as_ranks_for_iree)

    class Lone(torch.nn.Module):
        def forward(self, x):
            return torch.sort(x).values

    rt.assert_not_fired(rt.apply_rules(rt.export(Lone(), torch.randn(2, 8)), RULES), sort_as_ranks_for_iree)


@pytest.mark.xfail(
    strict=True, raises=AssertionError, reason="IREE 3.13 shares the sorted iota of two topks (findings section 22)"
)
def test_iree_itself_computes_two_topks_wrong():
    """The bug the rules work around, compiled as exported: when IREE fixes it, this passes (strict xfail
    fails) and the rules can go."""
    args = _routers(7, 0)
    iree = attrs.evolve(backends.get("iree"), refuse_wrong_forms=False)
    compiled = iree.compile(rt.export(TwoRouters(), *args), args)
    for got, expected in zip(compiled(*args), TwoRouters()(*args), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_two_smallest_topks_become_ranks():
    """largest=False (kthvalue's rewrite): NaN last, as torch places it."""

    def smallest(x, y):
        return torch.topk(x, 3, largest=False), torch.topk(y, 3, largest=False)

    x, y = _routers(6, 3)
    x[0, 2] = float("nan")
    ep = rt.export(smallest, x, y, dynamic_shapes=_shapes(True, 0))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, topk_as_ranks_for_iree, times=2)
    rt.assert_matches_eager(result, smallest, [(x, y), _routers(9, 4)], rtol=0, atol=0)


def test_two_sorts_sharing_an_iota_are_refused():
    """As exported (no rules): refused, the fix named. Two topks too wide for the ranks (300 > 256), after the
    rules: refused, no rule to apply."""
    iree = backends.get("iree")
    args = _routers(7, 0)
    with pytest.raises(IreeUnsupportedError, match=r"aten\.topk.*shares that iota.*apply the backend's rules"):
        iree.compile(rt.export(TwoRouters(), *args), args)
    wide = (torch.randn(3, 300), torch.randn(3, 300))
    result = rt.apply_rules(rt.export(TwoRouters(), *wide), iree.rules)
    rt.assert_not_fired(result, topk_as_ranks_for_iree)
    with pytest.raises(IreeUnsupportedError, match=r"aten\.topk.*no rule rewrites this form \(width 300 > 256"):
        iree.compile(result.program, wide)
