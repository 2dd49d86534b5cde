"""Whether a size cond is dispatched is decided by what its branches cost (fx_rewrites.app.branch_cost), from
real exports: the expected counts are written out by hand from each branch's ops and sizes."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites.app.branch_cost import DISPATCH_COST, dispatch_cost
from fx_rewrites.app.dispatch import size_conds
from fx_rewrites.subgraphs import subgraph

aten = torch.ops.aten

cond = torch.ops.higher_order.cond


class LongElementwise(torch.nn.Module):
    """Issue 36's case, shorter: both branches element-wise, one of 1 op, one of 6 x 5 = 30 (the issue's: 24 x 5,
    benchmarks/size_dispatch.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def short(x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x)

        def long(x: torch.Tensor) -> torch.Tensor:
            y = x
            for _ in range(6):
                y = torch.tanh(y * 1.01 + 0.1) + torch.cos(y)
            return y

        return torch.cond(x.shape[1] <= 512, short, long, (x,))


class ShortElementwise(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.shape[1] <= 16, lambda x: x * 2, lambda x: torch.sigmoid(x) + 1, (x,))


class ViewsAndMatmul(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 48, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def short(x: torch.Tensor) -> torch.Tensor:
            return (x @ self.w).transpose(0, 1).sum(1)  # the transpose is a view; the sum reads the product

        def long(x: torch.Tensor) -> torch.Tensor:
            return torch.mm(torch.relu(x), self.w).transpose(0, 1).sum(1)  # aten.mm: torch's flop counter

        return torch.cond(x.shape[0] <= 8, short, long, (x,))


WIDE = ({1: Dim("n", min=2, max=1024)},)


def _cond(program: torch.export.ExportedProgram) -> torch.fx.Node:
    (node,) = [n for n in program.graph.nodes if n.target is cond]
    return node


def test_a_long_elementwise_branch_is_worth_dispatching():
    program = torch.export.export(LongElementwise(), (torch.randn(64, 64),), dynamic_shapes=WIDE)
    cost = dispatch_cost(_cond(program))
    assert (cost.true_branch, cost.false_branch, cost.select) == (64 * 64, 30 * 64 * 64, 64 * 64)
    assert cost.worth_dispatching and str(cost).endswith(": dispatch")
    (found,) = size_conds(program)
    assert str(found.expr).endswith("<= 512")


@pytest.mark.parametrize(
    ("module", "x", "shapes", "expected"),
    [
        (LongElementwise(), torch.randn(4, 4), WIDE, (16, 30 * 16, 16)),  # the same cond on a 4 x 4 example
        (ShortElementwise(), torch.randn(2, 8, 32), WIDE, (512, 2 * 512, 512)),
    ],
    ids=["long-chain-tiny-sizes", "short-chains"],
)
def test_a_select_cheaper_than_the_dispatch_stays_a_select(module, x, shapes, expected):
    program = torch.export.export(module, (x,), dynamic_shapes=shapes)
    cost = dispatch_cost(_cond(program))
    assert (cost.true_branch, cost.false_branch, cost.select) == expected
    assert not cost.worth_dispatching and cost.saved < DISPATCH_COST, str(cost)
    assert size_conds(program) == []


def test_matmuls_cost_their_multiply_adds_and_views_nothing():
    node = _cond(torch.export.export(ViewsAndMatmul(), (torch.randn(16, 32),), dynamic_shapes=({0: Dim("b")},)))
    product, summed = 16 * 32 * 48, 16 * 48  # multiply-adds of (16 x 32) @ (32 x 48); the sum reads 16 x 48
    cost = dispatch_cost(node)
    assert (cost.true_branch, cost.false_branch, cost.select) == (product + summed, product + summed + 16 * 32, 48)
    assert cost.worth_dispatching
    assert {n.target for n in subgraph(node.args[2]).graph.nodes} >= {aten.mm.default, aten.transpose.int}
