"""Math IREE's own lowerings turn into libm calls (backends/iree/rules/libm_forms.py): polar, normal, float64
randn, float32 log10. Before the rules: 'iree-lld: undefined symbol: sin' (polar, float64), 'cos' (float64
randn and normal), 'log10f' (float32 log10), "failed to legalize operation 'torch.operator'" (normal)."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeCompileError
from fx_rewrites.backends.iree.rules.libm_forms import (
    float32_log10_via_float64_for_iree,
    float64_randn_by_box_muller_for_iree,
    normal_as_scaled_randn_for_iree,
    polar_written_out_for_iree,
)

aten = torch.ops.aten
F64 = torch.float64


def _dims(dynamic: bool, *specs: dict[int, Dim] | None) -> tuple | None:
    return tuple(specs) if dynamic else None


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest distance in float steps of `want`'s dtype, relative to `want` (both finite and normal)."""
    info = torch.finfo(want.dtype)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[want.isinf()], want[want.isinf()])
    normal = want.isfinite() & (want.abs() > info.tiny)
    return ((got.double() - want.double()).abs() / want.double().abs() / info.eps)[normal].max().item()


# ----------------------------------------------------------------------------- polar


def polar(magnitude, angle):
    return torch.polar(magnitude, angle)  # [3, 1] and [n]: the broadcast IREE's own polar fails on


def _polar_inputs(dtype: torch.dtype, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(3, 1, generator=g, dtype=dtype) * 4, (torch.rand(n, generator=g, dtype=dtype) - 0.5) * 60


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_polar_is_written_out_and_compiles(dtype, dynamic):
    inputs = [_polar_inputs(dtype, 64, 0), _polar_inputs(dtype, 80 if dynamic else 64, 1)]
    ep = rt.export(polar, *inputs[0], dynamic_shapes=_dims(dynamic, None, {0: Dim("n")}))
    iree = backends.get("iree")
    with pytest.raises(IreeCompileError, match=r"undefined symbol: (sin|cos)|expected operand #1 rank"):
        iree.compile(ep, inputs[0])
    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, polar_written_out_for_iree, times=1)
    # float64 cos and sin are written out by float64_math's rules in the same phase
    written_out = [aten.cos.default, aten.sin.default] if dtype == F64 else []
    rt.assert_ops(result, present=[aten.complex.default], absent=[aten.polar.default, *written_out])
    alone = rt.apply_rules(ep, polar_written_out_for_iree)
    # torch's own polar kernel rounds differently by up to a float step of the magnitude (at most 4)
    step = torch.finfo(dtype).eps
    rt.assert_matches_eager(alone, polar, inputs, rtol=2 * step, atol=4 * 4 * step)
    compiled = iree.compile(result.program, inputs[0])
    for args in inputs:
        got, want = compiled(*args), polar(*args)
        exact = polar(*(a.double() for a in args))
        for part in (torch.real, torch.imag):
            if dtype == F64:
                assert _ulps(part(got), part(want)) <= 4.0  # float64_math's bound on cos and sin
            else:  # IREE's float32 cos/sin against float64: no further off than torch's float32 plus one step
                torch_error = (part(want).double() - part(exact)).abs().max().item()
                iree_error = (part(got).double() - part(exact)).abs().max().item()
                assert iree_error <= torch_error + 4 * torch.finfo(dtype).eps, (iree_error, torch_error)


# ----------------------------------------------------------------------------- normal and randn


def normal_of_tensors(mean, std):
    return torch.normal(mean, std)


def normal_of_floats(mean, std):
    return torch.normal(1.5, 2.0, (3, mean.shape[1]), dtype=mean.dtype) + 0 * std[0]


def _moments_standard(z: torch.Tensor) -> None:
    """`z` looks standard normal: mean, variance and the share within one sigma, each within 6 standard
    errors (n = 60000: a false failure is below 1e-8)."""
    z = z.double().flatten()
    n = z.numel()
    assert abs(z.mean().item()) < 6 / n**0.5, z.mean()
    assert abs(z.var().item() - 1) < 6 * (2 / n) ** 0.5, z.var()
    p = 0.6826894921370859
    share = (z.abs() < 1).double().mean().item()
    assert abs(share - p) < 6 * (p * (1 - p) / n) ** 0.5, share


def _normal_inputs(dtype: torch.dtype, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, n, generator=g, dtype=dtype) * 5, torch.rand(n, generator=g, dtype=dtype) + 0.5


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("fn", [normal_of_tensors, normal_of_floats], ids=["tensors", "floats"])
def test_normal_is_scaled_randn(fn, dtype, dynamic):
    inputs = [_normal_inputs(dtype, 20000, 0), _normal_inputs(dtype, 20004 if dynamic else 20000, 1)]
    ep = rt.export(fn, *inputs[0], dynamic_shapes=_dims(dynamic, {1: Dim("n")}, {0: Dim("n")}))
    # the rule alone, on torch: the same draws as eager under one seed (torch's normal is randn * std + mean,
    # its kernel fusing the multiply-add: a float step apart)
    alone = rt.apply_rules(ep, normal_as_scaled_randn_for_iree)
    rt.assert_fired(alone, normal_as_scaled_randn_for_iree, times=1)
    for args in inputs:
        torch.manual_seed(7)
        want = fn(*args)
        torch.manual_seed(7)
        step = 2 * torch.finfo(dtype).eps * want.abs().max().item()
        torch.testing.assert_close(alone.program.module()(*args), want, rtol=0, atol=step)
    iree = backends.get("iree")
    with pytest.raises(IreeCompileError, match=r"aten\.normal"):
        iree.compile(ep, inputs[0])
    result = rt.apply_rules(ep, iree.rules)
    rt.assert_ops(result, absent=[aten.normal.Tensor_Tensor, aten.normal.float_float])
    if dtype == F64:  # IREE lowers float32 randn itself
        rt.assert_fired(result, float64_randn_by_box_muller_for_iree, times=1)
        rt.assert_ops(result, absent=[aten.randn.default, aten.randn_like.default])
    compiled = iree.compile(result.program, inputs[0])
    for mean, std in inputs:
        got = compiled(mean, std)
        assert got.dtype == dtype
        if fn is normal_of_tensors:
            _moments_standard((got - mean) / std)
        else:
            _moments_standard((got - 1.5) / 2.0)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_float64_randn_compiles_as_box_muller(dynamic):
    """torch.randn(..., dtype=float64) alone: IREE 3.13 links libm's cos for it."""

    def noise(x):
        return x + torch.randn_like(x), torch.randn(3, 20000, dtype=F64)

    inputs = [(torch.zeros(20000, dtype=F64),), (torch.zeros(30000 if dynamic else 20000, dtype=F64),)]
    ep = rt.export(noise, *inputs[0], dynamic_shapes=_dims(dynamic, {0: Dim("n")}))
    iree = backends.get("iree")
    with pytest.raises(IreeCompileError, match="undefined symbol: cos"):
        iree.compile(ep, inputs[0])
    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, float64_randn_by_box_muller_for_iree, times=2)
    rt.assert_ops(result, absent=[aten.randn.default, aten.randn_like.default])
    torch.manual_seed(0)
    for z in result.program.module()(*inputs[0]):  # the transform itself, on torch's uniform draws
        _moments_standard(z)
    compiled = iree.compile(result.program, inputs[0])
    for args in inputs:
        first, second = compiled(*args)
        assert first.shape == args[0].shape and first.dtype == second.dtype == F64
        _moments_standard(first)
        _moments_standard(second)
        assert not torch.equal(first[:20000], second[0])  # two draws, not one


# ----------------------------------------------------------------------------- float32 log10


def log10(x):
    return torch.log10(x)


def _log10_inputs(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    wide = torch.logspace(-37, 38, n)  # normal float32 only: IREE flushes subnormals
    near_one = 1 + (torch.rand(n, generator=g) - 0.5) * 1e-3
    special = torch.tensor([0.0, -1.0, float("inf"), float("nan"), 1.0, 10.0, 1e-3])
    return torch.cat([wide, near_one, special])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_float32_log10_links(dynamic):
    inputs = [(_log10_inputs(200, 0),), (_log10_inputs(260 if dynamic else 200, 1),)]
    ep = rt.export(log10, *inputs[0], dynamic_shapes=_dims(dynamic, {0: Dim("n")}))
    iree = backends.get("iree")
    with pytest.raises(IreeCompileError, match="undefined symbol: log10f"):
        iree.compile(ep, inputs[0])
    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, float32_log10_via_float64_for_iree, times=1)
    rt.assert_ops(result, absent=[aten.log10.default])
    rt.assert_matches_eager(result, log10, inputs, rtol=2 * torch.finfo().eps, atol=0)
    compiled = iree.compile(result.program, inputs[0])
    for (x,) in inputs:
        assert _ulps(compiled(x), log10(x)) <= 1.0
