"""A max pooling whose indices nothing reads, without them (backends/iree/rules/pool_indices.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.dynamo import CompiledGraph, dynamo_backend
from fx_rewrites.backends.iree.rules.pool_indices import max_pool_without_unread_indices

aten = torch.ops.aten


class ValuesOnly(torch.nn.Module):
    """F.max_pool{1,2,3}d(..., return_indices=True)[0]: export keeps `max_pool*d_with_indices` and a getitem 0."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        self.pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[dims]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x, 3, 2, 1, return_indices=True)[0] * 2


class BothRead(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.max_pool2d(x, 3, 2, 1, return_indices=True)


_WITH = {1: aten.max_pool1d_with_indices.default, 2: aten.max_pool2d_with_indices.default,
         3: aten.max_pool3d_with_indices.default}  # fmt: skip
_WITHOUT = {1: aten.max_pool1d.default, 2: aten.max_pool2d.default, 3: aten.max_pool3d.default}


def _inputs(dims: int, dynamic: bool) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    sizes = [(2, 4, *[9] * dims), (3 if dynamic else 2, 4, *[9] * dims)]
    return [(torch.randn(*s, generator=g),) for s in sizes]


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_unread_indices_are_dropped_and_the_values_match(dims, dynamic):
    module = ValuesOnly(dims).eval()
    inputs = _inputs(dims, dynamic)
    ep = rt.export(module, *inputs[0], dynamic_shapes=[{0: Dim("batch", max=8)}] if dynamic else None)
    assert ep.graph.find_nodes(op="call_function", target=_WITH[dims])  # the form export gives
    result = rt.apply_rules(ep, max_pool_without_unread_indices)
    rt.assert_fired(result, max_pool_without_unread_indices, times=1)
    graph = result.program.graph
    assert not graph.find_nodes(op="call_function", target=_WITH[dims])
    assert len(graph.find_nodes(op="call_function", target=_WITHOUT[dims])) == 1
    rt.assert_matches_eager(result, module, inputs, rtol=0, atol=0)
    rt.assert_idempotent(result, max_pool_without_unread_indices)
    iree = backends.get("iree")
    compiled = iree.compile(rt.apply_rules(ep, iree.rules).program, inputs[0])
    for args in inputs:
        assert torch.equal(compiled(*args), module(*args))


def test_read_indices_are_kept():
    x = torch.randn(2, 4, 9, 9)
    result = rt.apply_rules(rt.export(BothRead(), x), max_pool_without_unread_indices)
    rt.assert_not_fired(result, max_pool_without_unread_indices)


def test_the_torch_compile_route_pools_without_indices():
    """aot_autograd gives the torch.compile route `max_pool2d_with_indices(...)[0]` for nn.MaxPool2d; the IREE
    module then holds `max_pool2d`, as the export route's does."""
    graphs: list[CompiledGraph] = []
    model = torch.nn.Sequential(torch.nn.MaxPool2d(3, 2, 1), torch.nn.ReLU()).eval()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=dynamo_backend("iree", strict=True, on_graph=graphs.append))
        x = torch.randn(1, 8, 16, 16)
        with torch.no_grad():
            assert torch.equal(compiled(x), model(x))
    finally:
        torch._dynamo.reset()
    (graph,) = graphs
    assert graph.graph_module.graph.find_nodes(op="call_function", target=_WITH[2])  # what aot_autograd gave
    assert graph.result.report.rewrites.get("max_pool_without_unread_indices") == 1
    assert "torch.aten.max_pool2d " in graph.compiled.mlir and "max_pool2d_with_indices" not in graph.compiled.mlir
