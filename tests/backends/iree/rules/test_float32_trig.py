"""float32 sin and cos computed in float64 for IREE (backends/iree/rules/float32_trig.py), against float64."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules.float32_trig import float32_trig_via_float64_for_iree

aten = torch.ops.aten
#: half a float32 step of 1: a correctly rounded float32 result of |value| <= 1 is at most this far off
HALF_STEP = torch.finfo(torch.float32).eps / 2


def trig(x):
    return torch.sin(x), torch.cos(x)


def _angles(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([(torch.rand(n, generator=g) - 0.5) * 2 * scale for scale in (1.0, 30.0, 1e3, 1e5)])


def _largest_error(got: tuple[torch.Tensor, ...], x: torch.Tensor) -> float:
    return max((g.double() - e).abs().max().item() for g, e in zip(got, trig(x.double()), strict=True))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_float32_sin_cos_as_accurate_as_torch(dynamic):
    inputs = [(_angles(2000, 0),), (_angles(2500 if dynamic else 2000, 1),)]
    ep = rt.export(trig, *inputs[0], dynamic_shapes=({0: Dim("n")},) if dynamic else None)
    iree = backends.get("iree")
    torch_error = max(_largest_error(trig(x), x) for (x,) in inputs)
    assert torch_error <= HALF_STEP
    # IREE 3.13's own float32 sin/cos, its pi/2 reduction in float32: far off at |x| ~ 1e5 (measured 2.8e-3)
    as_is = iree.compile(ep, inputs[0])
    assert _largest_error(as_is(*inputs[0]), inputs[0][0]) > 100 * torch_error

    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, float32_trig_via_float64_for_iree, times=2)
    rt.assert_ops(result, absent=[aten.sin.default, aten.cos.default])  # the float64 ones are written out too
    alone = rt.apply_rules(ep, float32_trig_via_float64_for_iree)
    rt.assert_matches_eager(alone, trig, inputs, rtol=0, atol=HALF_STEP)
    compiled = iree.compile(result.program, inputs[0])
    for (x,) in inputs:
        assert _largest_error(compiled(x), x) <= HALF_STEP
