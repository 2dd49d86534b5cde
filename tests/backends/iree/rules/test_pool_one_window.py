"""One pooling window over a longer map on IREE 3.13 (backends/iree/rules/pooling.py, pool_single_window_for_iree).

`F.max_pool2d(x, 6)` on a map of 7..11 has one window per map (output 1, the
last rows and columns unread). IREE 3.13 fails to compile it with static
sizes; with Dim sizes and a user typed 1 (export types `pool * 2` as
[b, c, 1, 1] while the pool is [b, c, h//6, w//6]) it rejects those maps at
run time or, with indices, returns wrong values and indices. 6x6 maps are
right. The "without the guard" tests show IREE wrong (they fail once IREE is
fixed and the guard can go); the guarded tests compare with eager on two
input sets in torch and on IREE at map sizes across the Dim range.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.errors import IreeUnsupportedError
from fx_rewrites.backends.iree.rules.pooling import pool_single_window_for_iree

aten = torch.ops.aten
IREE = backends.get("iree")
#: IREE itself: the wrong-forms check off
RAW_IREE = attrs.evolve(IREE, refuse_wrong_forms=False)
GUARD = pool_single_window_for_iree.name


def _doubled(pooled):
    """The pooled values times 2 (the user export types with static 1s), indices as they are."""
    return (pooled[0] * 2, pooled[1]) if isinstance(pooled, tuple) else pooled * 2


class Pool(torch.nn.Module):
    def __init__(self, fn, *args, **kwargs) -> None:
        super().__init__()
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def forward(self, x: torch.Tensor):
        return _doubled(self.fn(x, *self.args, **self.kwargs))


#: name: (module, spatial dims, Dim range of each, map sizes to run on IREE)
CASES = {
    "max2d_indices": (Pool(F.max_pool2d, 6, return_indices=True), 2, (6, 11), [6, 7, 9, 11]),
    "max2d": (Pool(F.max_pool2d, 6), 2, (6, 11), [6, 7, 9, 11]),
    "avg2d": (Pool(F.avg_pool2d, 6), 2, (6, 11), [6, 7, 9, 11]),
    "max1d_indices": (Pool(F.max_pool1d, 6, return_indices=True), 1, (6, 11), [6, 7, 11]),
    "avg3d": (Pool(F.avg_pool3d, 6), 3, (6, 8), [6, 7, 8]),
    "max3d_indices": (Pool(F.max_pool3d, 6, return_indices=True), 3, (6, 8), [6, 7, 8]),
    # (h + 2 - 5)//4 + 1 == 1 on [3, 6]: the window reads the padding, and past the end of a 3-map
    "max2d_padded_indices": (Pool(F.max_pool2d, 5, 4, 1, return_indices=True), 2, (3, 6), [3, 4, 5, 6]),
    "avg2d_padded": (Pool(F.avg_pool2d, 5, 4, 1), 2, (3, 6), [3, 4, 5, 6]),
    # torch divides by the 4 real positions the window reads (the input is at least that long)
    "avg2d_padded_real_count": (Pool(F.avg_pool2d, 5, 4, 1, count_include_pad=False), 2, (4, 6), [4, 5, 6]),
    # a dilated window: span 5 of kernel 3
    "max2d_dilated_indices": (Pool(F.max_pool2d, 3, 5, dilation=2, return_indices=True), 2, (5, 9), [5, 6, 9]),
    # one window along h only: w pooled as usual (its size symbolic in the index arithmetic)
    "max2d_h_only_indices": (Pool(F.max_pool2d, (6, 2), return_indices=True), 2, (6, 11), [6, 7, 11]),
}


def _x(nsp: int, size: int, *, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, *[size] * nsp, generator=g),)


def _dims(nsp: int, lo: int, hi: int) -> tuple[dict[int, Dim]]:
    return ({0: Dim("b"), 1: Dim("c"), **{2 + i: Dim(f"s{i}", min=lo, max=hi) for i in range(nsp)}},)


def _pairs(got, expected):
    return list(zip(got, expected)) if isinstance(expected, tuple) else [(got, expected)]


def _assert_iree_matches(fn, module, inputs) -> None:
    for args in inputs:
        for got, expected in _pairs(fn(*args), module(*args)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _iree_wrong_or_error(fn, module, args) -> bool:
    try:
        return any(not torch.equal(g, e) for g, e in _pairs(fn(*args), module(*args)))
    except Exception:  # IREE's run-time shape check ("expected 6 but have 11")
        return True


@pytest.mark.parametrize("case", ["max2d_indices", "max2d", "avg2d", "max2d_padded_indices", "avg2d_padded_real_count"])
def test_dim_sizes_wrong_on_iree_without_the_guard(case):
    module, nsp, (lo, hi), sizes = CASES[case]
    ep = rt.export(module, *_x(nsp, lo), dynamic_shapes=_dims(nsp, lo, hi))
    unguarded = fx_rewrites.apply(ep, IREE.rules.without(GUARD)).program
    fn = RAW_IREE.compile(unguarded, _x(nsp, lo))
    _assert_iree_matches(fn, module, [_x(nsp, lo, seed=1)])  # the Dim's minimum is right
    assert all(_iree_wrong_or_error(fn, module, _x(nsp, s, seed=1)) for s in sizes if s != lo)
    # IREE as shipped refuses it, naming the fix
    with pytest.raises(IreeUnsupportedError, match=r"one window over a longer map.*fix: apply the backend's rules"):
        IREE.compile(unguarded, _x(nsp, lo))


@pytest.mark.parametrize("case", sorted(CASES))
def test_guarded_with_dim_sizes_matches_eager(case):
    module, nsp, (lo, hi), sizes = CASES[case]
    ep = rt.export(module, *_x(nsp, lo), dynamic_shapes=_dims(nsp, lo, hi))
    result = fx_rewrites.apply(ep, IREE.rules)
    rt.assert_fired(result, GUARD, times=1)
    rt.assert_idempotent(result, pool_single_window_for_iree)
    rt.assert_matches_eager(result, module, [_x(nsp, hi, seed=1), _x(nsp, lo + 1, batch=3, seed=2)])
    fn = IREE.compile(result.program, _x(nsp, lo))
    _assert_iree_matches(fn, module, [_x(nsp, s, seed=s) for s in sizes])


STATIC = {"max2d_indices": 7, "avg2d": 11, "max2d_padded_indices": 4, "max2d_h_only_indices": 9}


@pytest.mark.parametrize("case", sorted(STATIC))
def test_static_fails_on_iree_without_the_guard_and_matches_with_it(case):
    module, nsp, _, _ = CASES[case]
    inputs = [_x(nsp, STATIC[case], seed=1), _x(nsp, STATIC[case], seed=2)]
    ep = rt.export(module, *inputs[0])
    unguarded = fx_rewrites.apply(ep, IREE.rules.without(GUARD)).program
    with pytest.raises(Exception, match=r"linalg\.generic.*inferred input/output operand"):
        IREE.compile(unguarded, inputs[0])
    result = fx_rewrites.apply(ep, IREE.rules)
    rt.assert_fired(result, GUARD, times=1)
    rt.assert_matches_eager(result, module, inputs)
    _assert_iree_matches(IREE.compile(result.program, inputs[0]), module, inputs)


def test_count_include_pad_false_with_padding_is_refused():
    """A form the guard leaves (the divisor counts the real positions only, 3 on a 3-map, 4 on longer ones):
    refused, not wrong."""
    module = Pool(F.avg_pool2d, 5, 4, 1, count_include_pad=False)
    ep = rt.export(module, *_x(2, 3), dynamic_shapes=_dims(2, 3, 6))
    result = fx_rewrites.apply(ep, IREE.rules, explain=True)
    rt.assert_not_fired(result, GUARD)
    fn = RAW_IREE.compile(result.program, _x(2, 3))
    assert any(_iree_wrong_or_error(fn, module, _x(2, s, seed=s)) for s in (5, 6))
    with pytest.raises(
        IreeUnsupportedError, match=r"no rule rewrites this form \(padding on a one-window dim.*the divisor varies"
    ):
        IREE.compile(result.program, _x(2, 3))


@pytest.mark.parametrize(
    ("module", "shape", "dims"),
    [
        (Pool(F.max_pool2d, 6), (2, 3, 6, 6), None),  # the window is the map
        (Pool(F.max_pool2d, 3), (2, 3, 6, 6), _dims(2, 6, 8)),  # two windows (h//3 on [6, 8])
        (Pool(F.avg_pool2d, 2), (2, 3, 6, 6), _dims(2, 4, 11)),  # many
    ],
    ids=["exact", "two-windows", "many"],
)
def test_pools_left_alone(module, shape, dims):
    ep = rt.export(module, torch.randn(*shape), dynamic_shapes=dims)
    rt.assert_not_fired(fx_rewrites.apply(ep, IREE.rules), GUARD)
