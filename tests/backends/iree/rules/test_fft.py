"""rfft, irfft and complex arithmetic between FFTs on IREE (backends/iree/rules/fft.py)."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.errors import IreeCompileError
from fx_rewrites.backends.iree.rules.fft import inverse_real_fft_to_matmul_for_iree, real_fft_to_matmul_for_iree

aten = torch.ops.aten


class CircularCorrelation(torch.nn.Module):
    """Issue 27's reproduction: a circular correlation of q and k along dim 1 through real FFTs."""

    def forward(self, q, k):
        return torch.fft.irfft(torch.fft.rfft(q, dim=1) * torch.conj(torch.fft.rfft(k, dim=1)), n=16, dim=1)


class Variants(torch.nn.Module):
    """An odd output size, norm="ortho", a trimmed spectrum (n below 2 (L - 1)), a sum and a difference of
    spectra, a spectrum times a real tensor, and the real part of an rfft."""

    def forward(self, x, w):
        spectrum = torch.fft.rfft(x, norm="ortho")  # [.., 7] of 12
        odd = torch.fft.irfft(spectrum + torch.fft.rfft(w, norm="ortho"), n=11, norm="ortho")
        trimmed = torch.fft.irfft(spectrum * w[..., :7] - torch.fft.rfft(w, norm="ortho"), n=8, norm="ortho")
        return odd, trimmed, torch.fft.rfft(x).real


def _pairs(seed: int, batch: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, *shape, generator=g), torch.randn(batch, *shape, generator=g)


def _float64_error(module: torch.nn.Module, got: torch.Tensor, args: tuple[torch.Tensor, ...]) -> tuple:
    """(got's error, torch float32's error) against torch in float64."""
    exact = module(*(a.double() for a in args))
    return (got.double() - exact).abs().max().item(), (module(*args).double() - exact).abs().max().item()


@pytest.mark.parametrize("route", ["static", "dim", "aot"])
def test_circular_correlation_compiles_and_matches(route):
    inputs = [_pairs(0, 2, (16, 4)), _pairs(1, 3 if route == "dim" else 2, (16, 4))]
    shapes = ({0: Dim("b")}, {0: Dim("b")}) if route == "dim" else None
    ep = rt.export(CircularCorrelation(), *inputs[0], dynamic_shapes=shapes)
    if route == "aot":
        ep = ep.run_decompositions()  # _fft_r2c(onesided), _conj, clone, mul, _fft_c2r
    iree = backends.get("iree")
    with pytest.raises(IreeCompileError, match="fft"):
        iree.compile(ep, inputs[0])
    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, inverse_real_fft_to_matmul_for_iree, times=1)
    rt.assert_ops(result, absent=[aten.fft_rfft.default, aten._fft_r2c.default, aten._fft_c2r.default])
    compiled = iree.compile(result.program, inputs[0])
    for args in inputs:
        got = compiled(*args)
        torch.testing.assert_close(got, CircularCorrelation()(*args), rtol=1e-4, atol=1e-5)
        # a DFT as matmuls sums n products where the FFT sums log n: measured 1.4-2.0x torch's float32 error
        ours, torchs = _float64_error(CircularCorrelation(), got, args)
        assert ours <= 4 * torchs, (ours, torchs)


def test_inverse_real_fft_variants_match():
    inputs = [_pairs(2, 2, (3, 12)), _pairs(3, 2, (3, 12))]
    ep = rt.export(Variants(), *inputs[0])
    iree = backends.get("iree")
    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, inverse_real_fft_to_matmul_for_iree, times=2)
    rt.assert_fired(result, real_fft_to_matmul_for_iree, times=1)
    rt.assert_matches_eager(result, Variants(), inputs, rtol=1e-4, atol=1e-5)
    compiled = iree.compile(result.program, inputs[0])
    for args in inputs:
        for got, want in zip(compiled(*args), Variants()(*args), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_inverse_fft_of_an_untracked_complex_value_declines():
    """A complex input the rule cannot write in real parts (a complex placeholder) stays, named."""
    z = torch.randn(2, 9, dtype=torch.complex64)
    ep = rt.export(_Irfft(), z)
    result = rt.apply_rules(ep, inverse_real_fft_to_matmul_for_iree, explain=True)
    rt.assert_not_fired(result, inverse_real_fft_to_matmul_for_iree)
    (attempt,) = result.report.explain(inverse_real_fft_to_matmul_for_iree.name)
    assert "not an FFT" in attempt.reason, attempt


class _Irfft(torch.nn.Module):
    def forward(self, z):
        return torch.fft.irfft(z)
