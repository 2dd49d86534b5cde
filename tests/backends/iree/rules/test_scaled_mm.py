"""aten._scaled_mm for IREE (backends/iree/rules/scaled_mm.py). Before the rule, by form: "'torch.aten._scaled_mm'
op expected mat2 non-contracting dimension to be divisible by 16" / "... bias to have bf16 or f16 dtype", or
"failed to legalize operation 'torch.constant.bool'" ('torch.constant.int')."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeCompileError
from fx_rewrites.backends.iree.rules.scaled_mm import scaled_mm_in_float32_for_iree

aten = torch.ops.aten
IREE = backends.get("iree")
F8 = torch.float8_e4m3fn


class Float8Linear(torch.nn.Module):
    """A float8 weight [N, K] with its scale; the input quantized to float8 in the graph (IREE's runtime takes
    no float8 arguments), by one scale or one per row."""

    def __init__(self, n: int, *, rowwise: bool, bias: bool, out_dtype: torch.dtype) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("weight", (torch.randn(n, 32, generator=g) * 4).to(F8))
        scale = torch.rand(1, n, generator=g) + 0.5 if rowwise else torch.tensor(1.3)
        self.register_buffer("weight_scale", scale)
        self.bias = torch.nn.Parameter(torch.randn(n, generator=g).to(out_dtype)) if bias else None
        self.rowwise, self.out_dtype = rowwise, out_dtype

    def forward(self, x):
        amax = x.abs().amax(-1, keepdim=True) if self.rowwise else x.abs().amax()
        scale = amax / 448.0
        q = (x / scale).to(F8)
        return torch._scaled_mm(q, self.weight.t(), scale, self.weight_scale, bias=self.bias, out_dtype=self.out_dtype)


def _float64(module: Float8Linear, x: torch.Tensor, magnitude: bool = False) -> torch.Tensor:
    """The same product in float64 from the same float8 operands (`magnitude`: of their absolute values)."""
    amax = x.abs().amax(-1, keepdim=True) if module.rowwise else x.abs().amax()
    scale = amax / 448.0
    q = (x / scale).to(F8)
    a, w = q.double() * scale.double(), module.weight.double().t() * module.weight_scale.double()
    bias = None if module.bias is None else module.bias.double()
    if magnitude:
        a, w, bias = a.abs(), w.abs(), None if bias is None else bias.abs()
    y = a @ w
    return y if bias is None else y + bias


def _torch_error(module: Float8Linear, x: torch.Tensor, exact: torch.Tensor) -> float:
    """How far torch's own `_scaled_mm` is from float64; where torch cannot run it on this CPU (oneDNN without its
    float8 kernels: "could not create a primitive descriptor", met with the suite held to AVX2 on an AVX-512
    host, README), float32's bound for the sum instead: gamma_n sum |a w|, n = K products + the scalings + bias."""
    try:
        return (module(x).double() - exact).abs().max().item()
    except RuntimeError as e:
        if "primitive descriptor" not in str(e):
            raise
    n, unit = x.shape[-1] + 3, 2.0**-24
    return (_float64(module, x, magnitude=True) * (n * unit / (1 - n * unit))).max().item()


CASES = {
    "per-tensor-bias": dict(n=16, rowwise=False, bias=True, out_dtype=torch.float32),
    "rowwise": dict(n=16, rowwise=True, bias=False, out_dtype=torch.float32),
    "bfloat16-out-n8": dict(n=8, rowwise=False, bias=True, out_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("name", list(CASES))
def test_scaled_mm_as_float32_matmul(name, dynamic):
    module = Float8Linear(**CASES[name]).eval()
    g = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(6, 32, generator=g) * 5,), (torch.randn(9 if dynamic else 6, 32, generator=g) * 50,)]
    ep = rt.export(module, *inputs[0], dynamic_shapes=[{0: Dim("m")}] if dynamic else None)
    without = rt.apply_rules(ep, IREE.rules.without(scaled_mm_in_float32_for_iree.name)).program
    with pytest.raises(
        IreeCompileError, match=r"_scaled_mm.*(op expected|failed to legalize operation 'torch\.constant\.)"
    ):
        IREE.compile(without, inputs[0])
    result = rt.apply_rules(ep, IREE.rules)
    rt.assert_fired(result, scaled_mm_in_float32_for_iree, times=1)
    rt.assert_ops(result, present=[aten.mm.default], absent=[aten._scaled_mm.default])
    compiled = IREE.compile(result.program, inputs[0])
    for (x,) in inputs:
        exact = _float64(module, x)
        torch_error = _torch_error(module, x, exact)
        step = torch.finfo(module.out_dtype).eps * exact.abs().max().item()  # one rounding of the result
        for got in (result.program.module()(x), compiled(x)):  # the rewritten program on torch, and on IREE
            assert got.shape == exact.shape and got.dtype == module.out_dtype
            # torch's kernel sums in another order: as near float64 as torch's, within a rounding step
            assert (got.double() - exact).abs().max().item() <= torch_error + step
