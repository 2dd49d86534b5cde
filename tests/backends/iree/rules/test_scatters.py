"""IREE's lowerings of the scatters that undo a view (backends/iree/rules/scatters.py): the in-place pack's
write-back through `diagonal` and `as_strided` emits `diagonal_scatter` / `as_strided_scatter`, which
IREE 3.13 cannot compile; after these rules it compiles and matches eager (the in-place pack's
IREE tests, test_inplace_iree.py, write through every kind of view)."""

from __future__ import annotations

import copy

import pytest
import torch

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules.scatters import RULES, as_strided_scatter_for_iree, diagonal_scatter_for_iree
from fx_rewrites.engine import RewriteError
from fx_rewrites.rules import DEFAULT

Dim = torch.export.Dim
aten = torch.ops.aten


class DiagonalWrites(torch.nn.Module):
    """Writes through diagonals (positive, negative offset; other dims, negative dims) read later."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        y.diagonal(1).add_(1)
        y.diagonal(-1, 0, 1).mul_(3)
        z = x.unsqueeze(0) + 0
        z.diagonal(0, -1, 1).sub_(5)
        return y + 1, z


class StridedWrites(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y.as_strided((2, 3), (4, 1), 3).add_(7)
        y.as_strided((2, 2), (1, 2))[0].mul_(-1)
        return y + 1


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_diagonal_scatter_becomes_where(dynamic):
    shapes = ({0: Dim("a", min=3), 1: Dim("b", min=3)},) if dynamic else None
    ep = rt.export(DiagonalWrites(), torch.randn(3, 5), dynamic_shapes=shapes)
    result = rt.apply_rules(ep, DEFAULT | RULES)
    rt.assert_fired(result, diagonal_scatter_for_iree, times=3)
    rt.assert_ops(result, present=[aten.where.self], absent=[aten.diagonal_scatter.default, aten.add_.Tensor])
    inputs = [(torch.randn(3, 5),), (torch.randn(4, 7) * 3,) if dynamic else (torch.randn(3, 5) * 3,)]
    rt.assert_matches_eager(result, DiagonalWrites(), inputs, rtol=0, atol=0)  # values selected, not computed


def test_as_strided_scatter_becomes_index_put():
    ep = rt.export(StridedWrites(), torch.randn(4, 4))
    result = rt.apply_rules(ep, DEFAULT | RULES)
    rt.assert_fired(result, as_strided_scatter_for_iree, times=2)
    rt.assert_ops(result, present=[aten.index_put.default], absent=[aten.as_strided_scatter.default])
    rt.assert_matches_eager(result, StridedWrites(), [(torch.randn(4, 4),), (torch.randn(4, 4) * 3,)])


def test_as_strided_scatter_of_a_non_contiguous_input_is_declined():
    def strided_write(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return aten.as_strided_scatter.default(x.t() * 1, src, (2,), (1,))  # storage order is not row-major

    ep = rt.export(strided_write, torch.randn(3, 4), torch.randn(2))
    result = rt.apply_rules(ep, RULES, explain=True)
    rt.assert_not_fired(result, as_strided_scatter_for_iree)
    (attempt,) = result.report.explain("as_strided_scatter_for_iree")
    assert "not (provably) contiguous" in attempt.reason


@pytest.fixture(scope="module")
def iree():
    return backends.get("iree")


@pytest.mark.parametrize(
    ("module", "inputs", "shapes"),
    [
        (DiagonalWrites(), [(torch.randn(3, 5),), (torch.randn(3, 5) * 3,)], None),
        (
            DiagonalWrites(),
            [(torch.randn(3, 5),), (torch.randn(4, 7) * 3,)],
            ({0: Dim("a", min=3), 1: Dim("b", min=3)},),
        ),
        (StridedWrites(), [(torch.randn(4, 4),), (torch.randn(4, 4) * 3,)], None),
    ],
    ids=["diagonal", "diagonal-dim", "as_strided"],
)
def test_on_iree(iree, module, inputs, shapes):
    """Without these rules IREE fails on the scatter; with them the program compiles and matches eager."""
    ep = rt.export(module, *inputs[0], dynamic_shapes=shapes)
    without = fx_rewrites.apply(ep, iree.rules.without(*RULES.names())).program
    with pytest.raises(RewriteError, match=r"constant\.int"):
        iree.compile(without, inputs[0])
    result = fx_rewrites.apply(ep, iree.rules)
    assert result.report.converged and not result.report.skips, result.report.summary()
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*copy.deepcopy(args)), module(*copy.deepcopy(args)), rtol=1e-4, atol=1e-5)
