"""Every pack in DEFAULT on a program exported with `torch.export.Dim` sizes
(issue 12, item 4): its rule fires, the program's sizes stay symbolic (no
size is fixed to the example's), it matches eager on inputs of other sizes,
and IREE compiles it after the IREE backend's rules and matches eager too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.engine import values
from fx_rewrites.rules import PACKS


class Pool(torch.nn.Module):
    def forward(self, x):
        return F.max_pool2d(x, 2) + F.avg_pool2d(x, 2)


class Constant(torch.nn.Module):
    def forward(self, x):
        return x + torch.tensor([1.0, 2.0, 3.0, 4.0])


class EvalDropout(torch.nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.5, training=False) * 2


class NoGrad(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        with torch.no_grad():
            y.add_(1)
        return y * x


class Vmapped(torch.nn.Module):
    def forward(self, x):
        return torch.vmap(lambda row: row * row.sum())(x)


class Cond(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,))


class ContiguousWrite(torch.nn.Module):
    def forward(self, x):
        y = x.transpose(0, 1).contiguous()
        y[:, 0] += 3
        return y


class InPlace(torch.nn.Module):
    def forward(self, x):
        y = x.clone()
        y.mul_(2).add_(1)
        return y


class SymScalar(torch.nn.Module):
    def forward(self, x):
        return x * x.shape[0] + torch.tensor(x.shape[1]) * 2


class Mask(torch.nn.Module):
    def forward(self, x):
        return x + x[x > 0].sum()


class FakeQuantized(torch.nn.Module):
    """torchao's dynamic int8 activation steps (W8A8's): per-row scales, quantize, dequantize."""

    def forward(self, x):
        import torchao.quantization.quant_primitives  # noqa: F401  (registers the torchao ops)

        ops, block = torch.ops.torchao, [1, x.shape[1]]
        scale, zero = ops.choose_qparams_affine(x, "SYMMETRIC", block, torch.int8, -128, 127, 1e-7, None, None)
        q = ops.quantize_affine(x, block, scale, zero, torch.int8, -128, 127)
        return ops.dequantize_affine(q, block, scale, zero, torch.int8, -128, 127) * 2


#: pack -> (module, example input shape, dynamic dims, other input shape)
CASES = {
    "pooling": (Pool, (2, 3, 8, 6), {0: Dim("b"), 2: Dim("h", min=4), 3: Dim("w", min=4)}, (3, 3, 7, 9)),
    "constants": (Constant, (3, 4), {0: Dim("b")}, (5, 4)),
    "composites": (EvalDropout, (3, 4), {0: Dim("b"), 1: Dim("n")}, (5, 7)),
    "wrappers": (NoGrad, (3, 4), {0: Dim("b"), 1: Dim("n")}, (5, 7)),
    "vmap": (Vmapped, (3, 4), {0: Dim("b"), 1: Dim("n")}, (5, 7)),
    "control_flow": (Cond, (3, 4), {0: Dim("b"), 1: Dim("n")}, (5, 7)),
    "view_or_copy": (ContiguousWrite, (3, 4), {0: Dim("b"), 1: Dim("n")}, (5, 7)),
    "inplace": (InPlace, (3, 4), {0: Dim("b"), 1: Dim("n")}, (5, 7)),
    "symbolic": (SymScalar, (3, 4), {0: Dim("b"), 1: Dim("n")}, (5, 7)),
    "masks": (Mask, (3, 4), {0: Dim("b"), 1: Dim("n")}, (5, 7)),
    "quantized": (FakeQuantized, (3, 4), {0: Dim("b")}, (5, 4)),
}


def test_every_pack_has_a_case():
    assert set(CASES) == set(PACKS)


def _export(pack):
    module, shape, dims, other = CASES[pack]
    gen = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(shape, generator=gen),), (torch.randn(other, generator=gen) * 2,)]
    return module(), rt.export(module(), *inputs[0], dynamic_shapes=(dims,)), inputs


@pytest.mark.parametrize("pack", sorted(CASES))
def test_pack_keeps_dim_sizes(pack):
    module, ep, inputs = _export(pack)
    result = fx_rewrites.apply(ep)
    fired = {name for name, n in result.report.rewrites.items() if n}
    assert fired & set(PACKS[pack].names()), f"no {pack} rule fired: {dict(result.report.rewrites)}"
    assert result.report.converged and not result.report.skips
    x = next(n for n in result.graph_module.graph.nodes if n.op == "placeholder" and n.name == "x")
    dims = CASES[pack][2]
    assert all(not isinstance(x.meta["val"].shape[d], int) for d in dims), x.meta["val"].shape
    replaced = values.find_fake_mode(result.graph_module.graph).shape_env.replacements
    assert not [k for k, v in replaced.items() if v.is_number], replaced
    rt.assert_matches_eager(result, module, inputs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pack", sorted(CASES))
def test_pack_with_dim_sizes_on_iree(pack):
    module, ep, inputs = _export(pack)
    iree = backends.get("iree")
    fn = iree.compile(fx_rewrites.apply(ep, iree.rules).program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*[a.clone() for a in args]), module(*args), rtol=1e-4, atol=1e-5)
