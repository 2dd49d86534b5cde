"""Products over an empty dim (empty_contraction_for_iree, backends/iree/rules/guards.py).

iree-compile 3.13 crashes on a matrix product that sums over a size-0 dim
(OpInfo's mm of (5, 0) by (0, 10)). Each test asserts that crash without the
rule, so it fails once IREE is fixed and the rule can go, and that the
rewritten graph matches eager on two input sets, static and with a Dim batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeCompileError
from fx_rewrites.backends.iree.rules.guards import _CONTRACTIONS, empty_contraction_for_iree
from fx_rewrites.engine import Miss

aten = torch.ops.aten
RULE = "empty_contraction_for_iree"


@pytest.fixture(scope="module")
def iree():
    return backends.get("iree")


class Products(torch.nn.Module):
    """Products that sum over a size-0 dim, each with an addend so that the result carries data."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = torch.nn.Linear(0, 6)  # a weight of (6, 0) and a bias: the result is the bias

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        empty = x[..., :0]  # (b, 5, 0): sliced, so that the batch can be a Dim
        if self.kind == "matmul":
            return empty @ empty.transpose(1, 2) + y[..., :5]
        if self.kind == "einsum":
            return torch.einsum("bij,bkj->bik", empty, empty) + y[..., :5]
        if self.kind == "linear":
            return self.linear(empty) + y
        if self.kind == "addmm":  # addmm's self is added, not multiplied: it keeps its values
            return torch.addmm(y[0, :, :5], empty[0], empty[0].T, beta=0.5)
        raise AssertionError(self.kind)


KINDS = {
    "matmul": aten.matmul.default,
    "einsum": aten.einsum.default,
    "linear": aten.linear.default,
    "addmm": aten.addmm.default,
}


def _inputs(batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(batch, 5, 3), torch.randn(batch, 5, 6)) for _ in range(2)]


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # nn.Linear(0, 6)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_product_over_an_empty_dim(iree, kind, dynamic):
    module = Products(kind)
    inputs = _inputs(3)
    if dynamic:
        inputs[1] = _inputs(4)[1]
    batch = Dim("batch", min=2, max=16)
    shapes = ({0: batch}, {0: batch}) if dynamic else None
    ep = rt.export(module, *inputs[0], dynamic_shapes=shapes)
    product = KINDS[kind]
    rt.assert_ops(ep.graph_module, present=[product])
    without = rt.apply_rules(ep, iree.rules.without(RULE))
    with pytest.raises(IreeCompileError, match="crash"):  # what IREE 3.13 does with it
        iree.compile(without.program, inputs[0])

    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, RULE, times=1)
    products = [n for n in result.graph_module.graph.nodes if n.target in _CONTRACTIONS]
    assert products, "the product is gone"
    for node in products:  # the same product, of zeros: no operand of a product is empty any more
        shapes_in = [a.meta["val"].shape for a in node.all_input_nodes]
        assert all(0 not in [s for s in shape if isinstance(s, int)] for shape in shapes_in), shapes_in
    assert {aten.zeros.default, aten.full.default} & set(rt.targets(result))  # zeros (full with a Dim)
    rt.assert_matches_eager(result, module, inputs, rtol=0, atol=0)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), module(*args), rtol=0, atol=0)


class EmptyResult(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x[:0], w)  # (0, 3) by (4, 3): nothing summed over an empty dim


def test_an_empty_result_left_alone(iree):
    args = (torch.randn(5, 3), torch.randn(4, 3))
    result = rt.apply_rules(rt.export(EmptyResult(), *args), iree.rules)
    rt.assert_not_fired(result, RULE)
    rt.assert_matches_eager(result, EmptyResult(), [args])


class ThreeWay(torch.nn.Module):
    """An einsum whose third operand holds data: zeros times its inf are NaN, where an empty sum is 0."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        empty = x[:, :0]
        return torch.einsum("ij,jk,kl->il", empty, empty.T, z)


def test_a_product_with_data_declined(iree):
    # torch's result then depends on the order it contracts in (eager here: NaN in z's inf column); the
    # rule declines, and IREE's crash stays an error rather than becoming a number
    z = torch.randn(5, 2)
    z[0, 0] = float("inf")
    args = (torch.randn(5, 3), z)
    ep = rt.export(ThreeWay(), *args)
    rt.assert_ops(ep.graph_module, present=[aten.einsum.default])
    result = rt.apply_rules(ep, iree.rules)
    rt.assert_not_fired(result, RULE)
    found = empty_contraction_for_iree.match(next(n for n in ep.graph.nodes if n.target == aten.einsum.default))
    assert isinstance(found, Miss) and "'tensors'" in str(found)
    with pytest.raises(IreeCompileError, match="crash"):
        iree.compile(result.program, args)
