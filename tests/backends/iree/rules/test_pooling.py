"""Guards against IREE's ceil-mode pooling with a one-wide window (backends/iree/rules/pooling.py).

The "fails on IREE" test compiles the program after every rule of the IREE
backend but this guard and asserts IREE 3.13 rejects it, so it fails once
IREE is fixed and the guard can go. The guarded tests compare with eager on
two input sets, static and with Dim sizes, in torch and through IREE.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules.pooling import RULES, avg_pool_ceil_mode_for_iree, max_pool_ceil_mode_for_iree

aten = torch.ops.aten


@pytest.fixture(scope="module")
def iree():
    return backends.get("iree")


class FunnelPool(torch.nn.Module):
    """Funnel's pool_tensor (mode "mean"): stride 2 along time, the hidden dim untouched."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(x, (2, 1), stride=(2, 1), ceil_mode=True)


class PaddedPools(torch.nn.Module):
    """Padding with and without count_include_pad, a divisor_override, a 1d and a 3d pool."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            F.avg_pool2d(x, (3, 1), stride=(2, 1), padding=(1, 0), ceil_mode=True),
            F.avg_pool2d(x, (3, 1), stride=(2, 1), padding=(1, 0), ceil_mode=True, count_include_pad=False),
            F.avg_pool2d(x, (2, 1), stride=(2, 1), ceil_mode=True, divisor_override=3),
            F.avg_pool1d(x[:, 0], 1, stride=1, ceil_mode=True),
            F.avg_pool3d(x.unsqueeze(1), (2, 1, 2), stride=(2, 1, 2), ceil_mode=True),
        )


class DroppedWindow(torch.nn.Module):
    """Stride 2 > kernel 1: ceil mode's extra window would start past the input, and torch drops it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(x, (1, 1), stride=(2, 1), ceil_mode=True)


class WidePools(torch.nn.Module):
    """Windows wider than the input (transformers' EfficientNet pooler: `nn.AvgPool2d(1280, ceil_mode=True)`)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            F.avg_pool2d(x, 16, ceil_mode=True),
            F.avg_pool2d(x, (10, 2), padding=(1, 0), ceil_mode=True, count_include_pad=False),
        )


class MaxPools(torch.nn.Module):
    """Funnel's "max" and "min" modes, 1d and 3d, a window wider than the input, a dilated window."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            F.max_pool2d(x, (2, 1), stride=(2, 1), ceil_mode=True),
            -F.max_pool2d(-x, (2, 1), stride=(2, 1), ceil_mode=True),
            F.max_pool1d(x[:, 0], 1, stride=1, ceil_mode=True),
            F.max_pool3d(x.unsqueeze(1), (2, 1, 2), stride=(2, 1, 2), ceil_mode=True),
            F.max_pool2d(x, 8, ceil_mode=True),
            F.max_pool2d(x, (2, 1), stride=(2, 1), padding=(1, 0), dilation=(2, 1), ceil_mode=True),
        )


def _x(*shape: int, seed: int) -> tuple[torch.Tensor]:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)),)


_AVG, _MAX = avg_pool_ceil_mode_for_iree, max_pool_ceil_mode_for_iree
#: module, two input sets, (guard, times it fires)
CASES = {
    # odd time: ceil mode's last window is half outside
    "funnel": (FunnelPool(), [_x(2, 1, 9, 8, seed=0), _x(2, 1, 9, 8, seed=1)], (_AVG, 1)),
    "padded": (PaddedPools(), [_x(2, 3, 7, 6, seed=0), _x(2, 3, 7, 6, seed=1)], (_AVG, 5)),
    "dropped": (DroppedWindow(), [_x(2, 3, 8, 5, seed=0), _x(2, 3, 8, 5, seed=1)], (_AVG, 1)),
    "wide": (WidePools(), [_x(2, 3, 7, 5, seed=0), _x(2, 3, 7, 5, seed=1)], (_AVG, 2)),
    "max": (MaxPools(), [_x(2, 3, 7, 6, seed=0), _x(2, 3, 7, 6, seed=1)], (_MAX, 6)),
}
#: torch.export specialises a dim that ceil mode pools (its guards test the size's parity): the Dim sizes are
#: the batch and the one-wide window's dim
DYNAMIC = {
    "funnel": ([_x(2, 1, 9, 8, seed=0), _x(3, 1, 9, 5, seed=1)], ({0: Dim("b"), 3: Dim("h")},)),
    "padded": ([_x(2, 3, 7, 6, seed=0), _x(4, 3, 7, 6, seed=1)], ({0: Dim("b")},)),
    "wide": ([_x(2, 3, 7, 5, seed=0), _x(3, 4, 7, 5, seed=1)], ({0: Dim("b"), 1: Dim("c")},)),
    "max": ([_x(2, 3, 7, 6, seed=0), _x(4, 3, 7, 6, seed=1)], ({0: Dim("b")},)),
}


def _pairs(got, expected) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(got, expected)] if isinstance(expected, torch.Tensor) else list(zip(got, expected))


@pytest.mark.parametrize("case", sorted(CASES))
def test_fails_on_iree_without_the_guard(iree, case):
    module, inputs, _ = CASES[case]
    ep = rt.export(module, *inputs[0])
    unguarded = fx_rewrites.apply(ep, iree.rules.without(*(r.name for r in RULES))).program
    with pytest.raises(Exception, match=r"linalg\.generic.*inferred input/output operand"):
        iree.compile(unguarded, inputs[0])


GUARDED = [(case, False) for case in sorted(CASES)] + [(case, True) for case in sorted(DYNAMIC)]


@pytest.mark.parametrize(("case", "dynamic"), GUARDED, ids=[f"{c}-{'dim' if d else 'static'}" for c, d in GUARDED])
def test_guarded_matches_eager(iree, case, dynamic):
    module, inputs, (guard, fires) = CASES[case]
    shapes = None
    if dynamic:
        inputs, shapes = DYNAMIC[case]
    ep = rt.export(module, *inputs[0], dynamic_shapes=shapes)
    result = fx_rewrites.apply(ep, iree.rules)
    rt.assert_fired(result, guard, times=fires)
    rt.assert_matches_eager(result, module, inputs)
    rt.assert_idempotent(result, guard)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        for got, expected in _pairs(fn(*args), module(*args)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_pools_iree_takes_left_alone():
    def pools(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            F.avg_pool2d(x, 2, ceil_mode=True),
            F.avg_pool2d(x, (2, 1), stride=(2, 1)),
            F.max_pool2d(x, 3, stride=2, ceil_mode=True),
        )

    result = rt.apply_rules(rt.export(pools, torch.randn(1, 2, 5, 5)), *RULES)
    for guard in RULES:
        rt.assert_not_fired(result, guard)
