"""aten.conv_tbc for IREE (backends/iree/rules/conv_tbc.py). Before the rule: "type of return operand 0 ...
doesn't match function result type"."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeCompileError
from fx_rewrites.backends.iree.rules.conv_tbc import conv_tbc_as_convolution_for_iree

aten = torch.ops.aten


class TimeBatchChannels(torch.nn.Module):
    """fairseq's ConvTBC: weight [K, C, O], bias [O], input [T, B, C]."""

    def __init__(self, pad: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(3, 4, 6, generator=g))
        self.bias = torch.nn.Parameter(torch.randn(6, generator=g))
        self.pad = pad

    def forward(self, x):
        return torch.conv_tbc(x, self.weight, self.bias, self.pad)


def _error_and_bound(got: torch.Tensor, module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each output's distance from float64, and the float32 bound of a sum of n products in any order:
    gamma_n * sum |x_i w_i| (+ |bias|), gamma_n = n u / (1 - n u), u = 2**-24, n = taps * channels + 1 (the bias)."""
    weight, bias = module.weight.double(), module.bias.double()
    exact = torch.conv_tbc(x.double(), weight, bias, module.pad)
    magnitude = torch.conv_tbc(x.double().abs(), weight.abs(), bias.abs(), module.pad)
    n = weight.shape[0] * weight.shape[1] + 1
    unit = 2.0**-24
    return (got.double() - exact).abs(), magnitude * (n * unit / (1 - n * unit))


def test_conv_tbc_exports_with_every_size_specialised():
    """torch 2.13 exports conv_tbc with static sizes only (its meta reads them as ints); the Dim case of the rule's
    test waits for that: this fails once torch keeps a Dim, and the rule's test should then take one."""
    with pytest.raises(torch._dynamo.exc.UserError, match=r"specialized it to be a constant"):
        rt.export(TimeBatchChannels(1).eval(), torch.randn(7, 2, 4), dynamic_shapes=({1: Dim("b")},))


@pytest.mark.parametrize("pad", [0, 1])
def test_conv_tbc_as_convolution(pad):
    module = TimeBatchChannels(pad).eval()
    g = torch.Generator().manual_seed(1)  # seeded: no input (and no error bound) depends on what ran before
    inputs = [(torch.randn(7, 2, 4, generator=g),), (torch.randn(7, 2, 4, generator=g) * 3 - 1,)]  # static sizes
    ep = rt.export(module, *inputs[0])
    iree = backends.get("iree")
    with pytest.raises(IreeCompileError, match="doesn't match function result type"):
        iree.compile(ep, inputs[0])
    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, conv_tbc_as_convolution_for_iree, times=1)
    rt.assert_ops(result, absent=[aten.conv_tbc.default])
    compiled = iree.compile(result.program, inputs[0])
    for (x,) in inputs:
        want = module(x)
        torch_error, bound = _error_and_bound(want, module, x)
        assert (torch_error <= bound).all()  # the bound holds for torch's own kernel
        for got in (result.program.module()(x), compiled(x)):  # the rewritten program on torch, and on IREE
            assert got.shape == want.shape
            # another summation order than torch's kernel: each output within float32's bound for its sum
            error, _ = _error_and_bound(got, module, x)
            assert (error <= bound).all(), (error - bound).max().item()
