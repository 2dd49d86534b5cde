"""float64 math written out for IREE (backends/iree/rules/float64_math.py), against torch's float64."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules import float64_atan, float64_math

F64 = torch.float64
EPS = torch.finfo(F64).eps
OPS = ("sin", "cos", "tan", "tanh", "log2", "log10", "expm1", "log1p", "sinh", "atan", "asin", "acos")
#: the most each op's result may be off torch's float64, in float64 steps relative to the result (measured:
#: 1.04 sin and cos, 1.99 tan, 1.00 tanh and log2, 2.00 log10, 1.57 expm1, 1.85 log1p, 1.94 sinh, 1.00 atan and
#: atan2, 1.12 asin, 1.44 acos)
ULPS = 4.0


class AllOps(torch.nn.Module):
    def forward(self, x):
        positive = x.abs()
        unit = x.clamp(-1, 1)  # asin, acos: [-1, 1], both ends included
        picked = {"log": positive, "asi": unit, "aco": unit}
        return (
            *(getattr(torch, op)(picked.get(op[:3], x)) for op in OPS),
            torch.atan2(x, torch.flip(x, [0])),
            torch.atan2(x, positive),
        )


class PositionTable(torch.nn.Module):
    """The issue's form: a sin-cos table built in float64 (the arange has no input)."""

    def forward(self, x):
        angles = torch.arange(8, dtype=F64)[:, None] * torch.logspace(0, -4, 4, dtype=F64)
        return x + torch.cat([angles.cos(), angles.sin()], dim=-1)


def _inputs(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    wide = torch.logspace(-300, 2.8, n, dtype=F64)  # tiny arguments: where expm1, log1p, sinh cancelled
    spread = (torch.rand(n, generator=g, dtype=F64) - 0.5) * 2e8  # large arguments: the pi/2 reduction
    near = (torch.rand(n, generator=g, dtype=F64) - 0.5) * 40
    return torch.cat([wide, -wide, spread, near])


def _assert_within_ulps(op: str, got: torch.Tensor, want: torch.Tensor) -> None:
    normal = want.abs() > torch.finfo(F64).tiny  # IREE flushes subnormals (docs/iree-3.13-findings.md)
    if op == "sinh":  # torch's own sinh is inf or finite on (709.78, 710.48), by the element's position
        normal &= want.isfinite()
    else:
        assert torch.equal(got[~want.isfinite()], want[~want.isfinite()]), f"{op}: overflow unlike torch's"
    normal &= want.isfinite()
    ulps = ((got - want).abs() / want.abs() / EPS)[normal]
    assert ulps.max() <= ULPS, f"{op}: {ulps.max():.2f} ulp off torch's float64"


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_float64_math_compiles_and_matches_float64_torch(dynamic):
    """Before the rules: 'iree-lld: undefined symbol: sin' (and cos, tan, tanh, log2, log10), and expm1,
    log1p, sinh of 1e-8 tens of millions of float64 steps off (0 below 1e-16)."""
    inputs = [_inputs(400, 0), _inputs(500 if dynamic else 400, 1)]
    ep = rt.export(AllOps(), inputs[0], dynamic_shapes=({0: Dim("n")},) if dynamic else None)
    iree = backends.get("iree")
    result = rt.apply_rules(ep, iree.rules)
    for op in OPS:
        rt.assert_fired(result, f"float64_{op}_written_out_for_iree", times=1)
    rt.assert_fired(result, "float64_atan2_written_out_for_iree", times=2)
    compiled = iree.compile(result.program, (inputs[0],))
    for x in inputs:
        for op, got, want in zip((*OPS, "atan2", "atan2"), compiled(x), AllOps()(x), strict=True):
            _assert_within_ulps(op, got, want)


def test_float64_math_special_values_are_torch_s():
    """NaN, infinities and signed zeros as torch's; past |x| = 2^29 pi/2 sin, cos and tan are NaN (the
    reduction would be inexact there), never a wrong number. A NaN's sign is not compared: torch documents
    none, and IREE's sinh of a NaN comes back with the sign bit set on an AVX2 (Zen 3) CPU, clear here."""
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1e-300, 8.4e8, -8.5e8, 1e300], dtype=F64)
    iree = backends.get("iree")
    compiled = iree.compile(rt.apply_rules(rt.export(AllOps(), x), iree.rules).program, (x,))
    for op, got, want in zip((*OPS, "atan2", "atan2"), compiled(x), AllOps()(x), strict=True):
        beyond = (x.abs() > float64_math.LARGEST_N * math.pi / 2) & torch.tensor(op in ("sin", "cos", "tan"))
        assert got[beyond].isnan().all(), op
        torch.testing.assert_close(got[~beyond], want[~beyond], rtol=4 * EPS, atol=0, equal_nan=True, msg=op)
        signed = ~beyond & ~want.isnan()  # zeros and infinities keep their sign; NaN is NaN
        assert torch.equal(got[signed].signbit(), want[signed].signbit()), op


def test_float64_position_table_compiles_on_iree():
    """The issue's reproduction: `torch.arange(8, dtype=torch.float64).cos()` on IREE; its frequencies from a
    float64 logspace, which IREE computed to float32's precision (4.2e-9 off) before its linspace was
    decomposed."""
    x = torch.randn(8, 8, dtype=F64, generator=torch.Generator().manual_seed(0))
    iree = backends.get("iree")
    result = rt.apply_rules(rt.export(PositionTable(), x), iree.rules)
    rt.assert_fired(result, "decompose_float64_linspace_for_iree")
    compiled = iree.compile(result.program, (x,))
    torch.testing.assert_close(compiled(x), PositionTable()(x), rtol=4 * EPS, atol=0)


def test_float32_math_is_left_to_iree():
    x = torch.randn(16)
    result = rt.apply_rules(rt.export(AllOps(), x), float64_math.RULES, float64_atan.RULES, explain=True)
    assert not result.report.rewrites
    assert all("not a float64 tensor" in a.reason for a in result.report.explain())


def test_pi_over_two_parts_sum_to_pi_over_two():
    """The reduction's constants, checked against mpmath at 400 bits: their sum is pi/2 to far below any
    float64 argument's need, and each of the first six has at most 24 significant bits (n * part exact)."""
    mpmath.mp.prec = 400
    total = sum((mpmath.mpf(p) for p in float64_math.PIO2_PARTS), mpmath.mpf(0))
    assert abs(total - mpmath.pi / 2) < mpmath.mpf(2) ** -195
    for part in float64_math.PIO2_PARTS[:-1]:
        mantissa = int(part.hex().split("p")[0].replace("0x1.", ""), 16)
        assert mantissa % (1 << (52 - 23)) == 0, part.hex()
    assert float(2 / mpmath.pi) == float64_math.TWO_OVER_PI
