"""NaN through clamp, maximum/minimum and sort on IREE (backends/iree/rules/nan_guards.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules.nan_guards import clamp_keeps_nan_for_iree, sort_values_keep_nan_last_for_iree

SPECIALS = (3.0, math.nan, -1.0, math.inf, -math.inf, 0.5, -0.0, 2.0, math.nan, -2.5)


class Clamps(torch.nn.Module):
    def forward(self, x, y):
        return (
            x.clamp(-1, 1),
            x.clamp_min(0),
            x.clamp_max(0),
            x.clamp(min=y),
            F.hardtanh(x),
            F.relu6(x),
            torch.maximum(x, y),
            torch.minimum(x, y),
        )


class Sorts(torch.nn.Module):
    def forward(self, x):
        return x.sort(dim=-1).values, x.sort(dim=0, descending=True).values


class SortsAndMsort(Sorts):
    """msort as exported IREE rejects (loud); legalized it is a sort, which the guard then fixes."""

    def forward(self, x):
        return (*super().forward(x), torch.msort(x))


def _values(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    specials = torch.tensor(SPECIALS)
    x = specials[torch.randint(0, len(SPECIALS), (rows, 6), generator=g)]
    return x, torch.randn(rows, 6, generator=g).masked_fill(torch.rand(rows, 6, generator=g) < 0.2, math.nan)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(((got == want) | (got.isnan() & want.isnan())).all())


def _wrong_somewhere(compiled, module, inputs) -> bool:
    return any(not _same(g, w) for g, w in zip(compiled(*inputs), module(*inputs), strict=True))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_clamps_keep_nan_on_iree(dynamic):
    inputs = [_values(4, 0), _values(5 if dynamic else 4, 1)]
    rows = Dim("rows")
    ep = rt.export(Clamps(), *inputs[0], dynamic_shapes=({0: rows}, {0: rows}) if dynamic else None)
    iree = backends.get("iree")
    assert _wrong_somewhere(iree.compile(ep, inputs[0]), Clamps(), inputs[0]), "IREE keeps NaN now: drop the guard"
    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, clamp_keeps_nan_for_iree, times=8)
    rt.assert_idempotent(result, clamp_keeps_nan_for_iree)
    compiled = iree.compile(result.program, inputs[0])
    for args in inputs:
        for got, want in zip(compiled(*args), Clamps()(*args), strict=True):
            assert _same(got, want), (got, want)


def test_sort_values_put_nan_where_torch_does():
    inputs = [_values(5, 2)[0], _values(5, 3)[0]]
    ep = rt.export(Sorts(), inputs[0])
    iree = backends.get("iree")
    assert _wrong_somewhere(iree.compile(ep, (inputs[0],)), Sorts(), (inputs[0],)), "IREE sorts NaN right now"
    result = rt.apply_rules(rt.export(SortsAndMsort(), inputs[0]), iree.rules)
    rt.assert_fired(result, sort_values_keep_nan_last_for_iree, times=3)
    rt.assert_idempotent(result, sort_values_keep_nan_last_for_iree)
    compiled = iree.compile(result.program, (inputs[0],))
    for x in inputs:
        for got, want in zip(compiled(x), SortsAndMsort()(x), strict=True):
            assert _same(got, want), (got, want)


def test_sort_with_indices_read_and_integer_clamps_are_left_alone():
    class Left(torch.nn.Module):
        def forward(self, x, i):
            return x.sort().indices, i.clamp(0, 3)

    ep = rt.export(Left(), torch.randn(6), torch.arange(6))
    result = rt.apply_rules(ep, clamp_keeps_nan_for_iree, sort_values_keep_nan_last_for_iree, explain=True)
    assert not result.report.rewrites
    reasons = {a.rule: a.reason for a in result.report.explain()}
    assert "indices are read" in reasons["sort_values_keep_nan_last_for_iree"]
    assert "not a floating-point tensor" in reasons["clamp_keeps_nan_for_iree"]
