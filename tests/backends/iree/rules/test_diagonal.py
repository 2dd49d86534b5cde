"""diagonal_as_gather_for_iree: IREE 3.13 returns `y` wrong when a diagonal of `y` is read by a broadcast
`where` (found by the view-write fuzzer); a gather of the same elements is right."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import CompileCache, IreeBackend, IreeUnsupportedError
from fx_rewrites.backends.iree.rules.views import diagonal_as_gather_for_iree

aten = torch.ops.aten


class DiagonalRead(torch.nn.Module):
    """`y` and a `where` of its diagonal broadcast against an identity mask, both returned."""

    def __init__(self, offset: int = 0, dim1: int = 0, dim2: int = 1) -> None:
        super().__init__()
        self.offset, self.dim1, self.dim2 = offset, dim1, dim2

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 0.5
        d = torch.diagonal(y, self.offset, self.dim1, self.dim2)
        mask = torch.eye(d.shape[-1], dtype=torch.bool)
        return y, torch.where(mask, d.unsqueeze(-1), 0.0)


class WriteThroughDiagonal(torch.nn.Module):
    """A write through a diagonal of a tensor whose source is also returned (the fuzzer's case)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 0.5
        b = y * 2
        b.diagonal().mul_(-1.5)
        return y, b


def _inputs(shape, seeds=(0, 1)) -> list[tuple[torch.Tensor]]:
    return [(torch.randn(*shape, generator=torch.Generator().manual_seed(s)),) for s in seeds]


def _assert_exact_on_iree(iree, result, module, inputs) -> None:
    """The rewritten program, and its IREE compile, give eager's values bit for bit on every input set."""
    rt.assert_matches_eager(result, module, inputs, rtol=0, atol=0)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        for got, expected in zip(fn(*args), module(*args), strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.fixture(scope="module")
def iree():
    return backends.get("iree")


def test_iree_returns_y_wrong_as_exported():
    """Pinned: this fails once IREE computes it right, and the rule can go."""
    module = DiagonalRead()
    (x,) = _inputs((2, 2, 2, 4))[0]
    unguarded = IreeBackend(cache=CompileCache(), refuse_wrong_forms=False)
    y, _ = unguarded.compile(rt.export(module, x), (x,))(x)
    assert not torch.allclose(y, module(x)[0]), "IREE computes y right now: drop diagonal_as_gather_for_iree"


def test_refused_without_the_rules(iree):
    """Compiled without the rules, a diagonal of a tensor read elsewhere is refused with the fix; a diagonal of a
    tensor nothing else reads is compiled."""
    (x,) = _inputs((2, 2, 2, 4))[0]
    with pytest.raises(IreeUnsupportedError, match=r"diagonal of a tensor that is read elsewhere.*apply the"):
        iree.compile(rt.export(DiagonalRead(), x), (x,))
    alone = rt.export(lambda x: torch.diagonal(x * 0.5) * 2.0, x)
    torch.testing.assert_close(iree.compile(alone, (x,))(x), torch.diagonal(x * 0.5) * 2.0, rtol=0, atol=0)


CASES = {
    "dims01": (DiagonalRead(), (2, 2, 2, 4)),
    "dims01_square3": (DiagonalRead(), (3, 3, 2, 4)),
    "offset1": (DiagonalRead(1), (3, 4, 2, 4)),
    "offset_minus1": (DiagonalRead(-1), (4, 3, 2, 4)),
    "dims23": (DiagonalRead(0, 2, 3), (2, 3, 4, 4)),
    "dims_negative": (DiagonalRead(0, -1, -2), (2, 3, 4, 4)),
    "write_through": (WriteThroughDiagonal(), (2, 2, 2, 4)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_gather_of_the_diagonal_matches_eager(iree, case):
    module, shape = CASES[case]
    inputs = _inputs(shape)
    result = rt.apply_rules(rt.export(module, *inputs[0]), iree.rules)
    rt.assert_fired(result, diagonal_as_gather_for_iree, times=1)
    rt.assert_ops(result, absent=[aten.diagonal.default])
    _assert_exact_on_iree(iree, result, module, inputs)


def test_with_a_dim_batch(iree):
    module = DiagonalRead(0, 2, 3)
    inputs = [(torch.randn(5, 3, 4, 4),), (torch.randn(2, 3, 4, 4),)]
    program = rt.export(module, *inputs[0], dynamic_shapes=({0: Dim("batch", min=2, max=16)},))
    result = rt.apply_rules(program, iree.rules)
    rt.assert_fired(result, diagonal_as_gather_for_iree, times=1)
    _assert_exact_on_iree(iree, result, module, inputs)


def test_a_diagonal_of_symbolic_length_is_left_alone(iree):
    module = DiagonalRead()
    (x,) = _inputs((4, 4, 2, 4))[0]
    program = rt.export(module, x, dynamic_shapes=({0: Dim("n", min=2, max=8), 1: Dim("m", min=2, max=8)},))
    result = rt.apply_rules(program, iree.rules)
    rt.assert_not_fired(result, diagonal_as_gather_for_iree)


class StridedOverDiagonal(torch.nn.Module):
    """as_strided over a diagonal view (the peer suite's case): it reads the base's storage, not the
    diagonal's values, so x[0, 0], x[1, 1], x[2, 2] here; `through_view` reaches it through an unsqueeze."""

    def __init__(self, through_view: bool = False) -> None:
        super().__init__()
        self.through_view = through_view

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        d = x.diagonal()
        if self.through_view:
            d = d.unsqueeze(0)
        return d.as_strided((3,), (6,)) * y.sum()


@pytest.mark.parametrize("through_view", [False, True], ids=["direct", "through_view"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_a_diagonal_read_by_as_strided_stays_a_view(iree, dynamic, through_view):
    """Issue 27: rewritten to a gather, the diagonal was a fresh 4-element tensor and the importer rejected the
    as_strided ("indexes outside the base tensor"); as exported IREE ran it right. The rule declines now."""
    module = StridedOverDiagonal(through_view)
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(4, 5, generator=g), torch.randn(3, generator=g))]
    inputs.append((torch.randn(4, 5, generator=g), torch.randn(6 if dynamic else 3, generator=g)))
    shapes = (None, {0: Dim("n", min=2, max=16)}) if dynamic else None
    program = rt.export(module, *inputs[0], dynamic_shapes=shapes)
    result = rt.apply_rules(program, diagonal_as_gather_for_iree, explain=True)
    rt.assert_not_fired(result, diagonal_as_gather_for_iree)
    assert any("storage" in a.reason for a in result.report.explain(diagonal_as_gather_for_iree.name))
    result = rt.apply_rules(program, iree.rules)
    rt.assert_not_fired(result, diagonal_as_gather_for_iree)
    rt.assert_matches_eager(result, module, inputs, rtol=0, atol=0)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), module(*args), rtol=1e-6, atol=1e-6)
