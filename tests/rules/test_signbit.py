"""signbit and copysign through the legalize phase (fx_rewrites.decompositions.OVERRIDES).

torch 2.13 decomposes both into prims.signbit, whose fake value is float32 where the op returns bool, and
copysign into prims.abs too; IREE 3.13 lowers neither op itself ("failed to legalize operation
'torch.constant.int'"). The decompositions read the sign bit from the float's bits, exact for -0.0 and
NaN's sign.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeCompileError
from fx_rewrites.decompositions import OVERRIDES, decomposition

aten = torch.ops.aten
SPECIAL = [1.0, -1.0, 0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40]


@pytest.fixture(scope="module")
def iree():
    return backends.get("iree")


def _values(seed: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The special values (both zeros, both NaNs, infinities, subnormals) and random ones, shuffled."""
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.tensor(SPECIAL), torch.randn(n, generator=g)])[: max(n, len(SPECIAL))]
    return x[torch.randperm(len(x), generator=g)].to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_signbit_reads_the_bit(dtype):
    x = _values(0, 40, dtype)
    assert torch.equal(decomposition(aten.signbit.default)(x), torch.signbit(x))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.uint8, torch.bool])
def test_signbit_of_integers(dtype):
    x = torch.arange(-5, 6).to(dtype)
    assert torch.equal(decomposition(aten.signbit.default)(x), torch.signbit(x))


@pytest.mark.parametrize(
    "types",
    [
        (torch.float32, torch.float32),
        (torch.float64, torch.int64),
        (torch.int32, torch.float32),
        (torch.int64, torch.int64),
    ],
)
def test_copysign_promotes_as_torch(types):
    a, b = (torch.arange(-6, 6).to(t) if not t.is_floating_point else _values(1, 12, t) for t in types)
    got, want = decomposition(aten.copysign.Tensor)(a, b), torch.copysign(a, b)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got.signbit(), want.signbit())


def test_overrides_come_before_torchs_table():
    assert aten.signbit.default in torch._decomp.decomposition_table  # torch's lowers to prims.signbit
    for op, fn in OVERRIDES.items():
        assert decomposition(op) is fn


class Signs(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.copysign(a, b), torch.signbit(b), torch.copysign(a * 2, -b).sum(-1)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_signs_on_iree(iree, dynamic):
    def inputs(seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 12, generator=torch.Generator().manual_seed(seed)), _values(seed, batch * 12).view(
            batch, 12
        )

    sets = [inputs(0, 3), inputs(1, 5 if dynamic else 3)]
    shapes = ({0: Dim("b", min=2, max=16)}, {0: Dim("b", min=2, max=16)}) if dynamic else None
    ep = rt.export(Signs(), *sets[0], dynamic_shapes=shapes)
    rt.assert_ops(ep.graph_module, present=[aten.copysign.Tensor, aten.signbit.default])
    with pytest.raises(IreeCompileError, match=r"torch\.constant\.int"):  # IREE 3.13 on the ops as exported
        iree.compile(ep, sets[0])

    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, "legalize_for_iree", times=3)
    rt.assert_ops(result, absent=[aten.copysign.Tensor, aten.signbit.default], present=[aten.view.dtype])
    assert not [t for t in rt.targets(result) if str(t).startswith("prims.")]
    rt.assert_matches_eager(result, Signs(), sets, rtol=0, atol=0)
    fn = iree.compile(result.program, sets[0])
    for args in sets:
        got, want = fn(*args), Signs()(*args)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            exact = i < 2  # the sum's order is IREE's own
            torch.testing.assert_close(g, w, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5, equal_nan=True)
        assert torch.equal(got[0].signbit(), want[0].signbit())  # -0.0 is not 0.0 here


class ScalarSign(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.copysign(a, b), torch.signbit(b)


def test_a_0d_sign_on_iree(iree):
    # the bit is read through one element: iree-compile 3.13 crashes on the bitcast of a 0-d tensor
    sets = [(torch.randn(10, 5), torch.tensor(-0.0)), (torch.randn(10, 5), torch.tensor(2.5))]
    result = rt.apply_rules(rt.export(ScalarSign(), *sets[0]), iree.rules)
    rt.assert_fired(result, "legalize_for_iree", times=2)
    fn = iree.compile(result.program, sets[0])
    for args in sets:
        for got, want in zip(fn(*args), ScalarSign()(*args), strict=True):
            assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
