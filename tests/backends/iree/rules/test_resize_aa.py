"""Anti-aliased resizes (F.interpolate(antialias=True)): decompositions torch lacks (fx_rewrites.decompositions).

torch 2.13 has no decomposition of `_upsample_{bilinear,bicubic,lanczos}2d_aa.default` and IREE 3.13 lowers
none of them (timm's ViT resizes its position table this way). The decomposition is checked against torch's
own kernel, then through the IREE backend's rules and IREE, static and with a Dim batch.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from fx_rewrites import backends, decompositions
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import legality
from fx_rewrites.backends.iree.rules import legalize as iree_legalize
from fx_rewrites.engine import RewriteError

aten = torch.ops.aten
KERNELS = {
    "bilinear": aten._upsample_bilinear2d_aa.default,
    "bicubic": aten._upsample_bicubic2d_aa.default,
    "lanczos": aten._upsample_lanczos2d_aa.default,
}
SIZES = [
    ((4, 4), (2, 2)),
    ((7, 5), (16, 16)),
    ((14, 14), (5, 7)),
    ((3, 9), (24, 3)),
    ((1, 6), (1, 3)),
    ((9, 9), (9, 9)),
]


@pytest.fixture(scope="module")
def iree():
    return backends.get("iree")


@pytest.mark.parametrize("mode", list(KERNELS))
@pytest.mark.parametrize("align_corners", [False, True])
def test_decomposition_is_torchs_kernel(mode, align_corners):
    """float64: the weights are torch's to rounding; float32 within its rounding; shrinking and growing."""
    fn = decompositions.decomposition(KERNELS[mode])
    assert fn is decompositions.MISSING[KERNELS[mode]]
    g = torch.Generator().manual_seed(0)
    for ((h, w), out), dtype in itertools.product(SIZES, (torch.float64, torch.float32)):
        x = torch.randn(2, 3, h, w, generator=g, dtype=dtype)
        expected = KERNELS[mode](x, list(out), align_corners)
        got = fn(x, list(out), align_corners)
        assert got.dtype == dtype and got.shape == expected.shape
        tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
        where = f"{mode} {(h, w)} -> {out} {dtype}"
        torch.testing.assert_close(got, expected, **tol, msg=lambda m, where=where: f"{where}: {m}")


@pytest.mark.parametrize("mode", list(KERNELS))
def test_decomposition_with_scale_factors(mode):
    """F.interpolate(scale_factor=...) passes the scales on: they, not the sizes' ratio, set the weights."""
    x = torch.randn(1, 2, 10, 12, dtype=torch.float64)
    fn = decompositions.MISSING[KERNELS[mode]]
    for scale in (0.5, 0.3, 1.5, 2.0):
        out = [int(10 * scale), int(12 * scale)]
        torch.testing.assert_close(fn(x, out, False, scale, scale), KERNELS[mode](x, out, False, scale, scale))


def test_decomposition_declines_integers():
    """uint8 resizes round in fixed point: left to the kernel."""
    x = torch.randint(0, 255, (1, 1, 8, 8), dtype=torch.uint8)
    with pytest.raises(NotImplementedError, match="fixed point"):
        decompositions.MISSING[KERNELS["bilinear"]](x, [4, 4], False)


class Resize(torch.nn.Module):
    """timm's position-table resize (bicubic, antialias) beside the other two anti-aliased modes."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            F.interpolate(x, size=(4, 3), mode="bicubic", antialias=True, align_corners=False),
            F.interpolate(x, size=(12, 10), mode="bilinear", antialias=True),
            F.interpolate(x, scale_factor=0.5, mode="bicubic", antialias=True, align_corners=True),
        )


def _inputs(n: int, seed: int) -> tuple[torch.Tensor]:
    return (torch.randn(n, 3, 8, 6, generator=torch.Generator().manual_seed(seed)),)


def test_iree_lowers_none_of_them(iree):
    """Why the ops are in the IREE legality's illegal set (the OpInfo corpus has no sample of two of them)."""
    ep = rt.export(Resize(), *_inputs(2, 0))
    with pytest.raises(RewriteError, match=r"_upsample_(bicubic|bilinear)2d_aa"):
        iree.compile(ep, _inputs(2, 0))
    for op in KERNELS.values():
        assert str(op) in legality.illegal_ops()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim_batch"])
def test_resize_aa_on_iree(iree, dynamic):
    shapes = ({0: Dim("n", min=1, max=8)},) if dynamic else None
    ep = rt.export(Resize(), *_inputs(2, 0), dynamic_shapes=shapes)
    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, iree_legalize.LEGALIZE_FOR_IREE)
    rt.assert_ops(result, absent=[*KERNELS.values(), aten._upsample_bicubic2d_aa.vec], present=[aten.mm.default])
    inputs = [_inputs(2, 1), _inputs(3 if dynamic else 2, 2)]
    rt.assert_matches_eager(result, Resize(), inputs, rtol=1e-5, atol=1e-5)
    compiled = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(compiled(*args), Resize()(*args), rtol=1e-5, atol=1e-5)


def test_symbolic_image_sizes_left_with_a_reason(iree):
    """A Dim height would be fixed by the branches on the scale: the op stays, `explain` says why, and IREE's
    error names it."""
    args = (torch.randn(2, 3, 8, 6),)
    ep = rt.export(Resize(), *args, dynamic_shapes=({2: Dim("h", min=4, max=32)},))
    result = rt.apply_rules(ep, iree.rules, explain=True)
    assert aten._upsample_bicubic2d_aa.default in rt.targets(result)
    reasons = {a.reason for a in result.report.explain(iree_legalize.LEGALIZE_FOR_IREE.name) if not a.fired}
    assert (
        "the decomposition of aten._upsample_bicubic2d_aa.default raised NotImplementedError: an anti-aliased "
        "resize decomposes with static image sizes only" in reasons
    )
    with pytest.raises(RewriteError, match=r"_upsample_(bicubic|bilinear)2d_aa"):
        iree.compile(result.program, args)
