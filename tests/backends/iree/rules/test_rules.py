"""IREE's own pack (backends/iree/rules/ops.py): each rule on a tiny export, then on IREE itself.

(decompose_for_iree, the first rule of the pack, is tested in tests/backends/iree/test_backend.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules.ops import (
    RULES,
    bitwise_ops_for_iree,
    conv_single_window_for_iree,
    copy_frozen_tensor_in_list,
    decompose_meshgrid_for_iree,
    decompose_upsample_for_iree,
    select_scatter_index_for_iree,
)
from fx_rewrites.engine import RewriteError

aten = torch.ops.aten


@pytest.fixture(scope="module")
def iree():
    return backends.get("iree")


def _on_iree(iree, module, before, after, inputs, error):
    """`before` fails on IREE with an error matching `error`; `after` compiles and matches eager."""
    args = inputs[0]
    with pytest.raises(RewriteError, match=error):
        iree.compile(before, args)
    fn = iree.compile(after, args)
    for inputs_ in inputs:
        torch.testing.assert_close(fn(*inputs_), module(*inputs_), rtol=1e-4, atol=1e-5)


# -- upsampling ----------------------------------------------------------------------


class Resize(torch.nn.Module):
    """Bilinear by size (MobileViT), by scale with align_corners, and bicubic; nearest stays."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            F.interpolate(x, size=(3, 7), mode="bilinear", align_corners=False),
            F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=True),
            F.interpolate(x, size=(6, 6), mode="bicubic", align_corners=False),
            F.interpolate(x, size=(8, 8), mode="nearest"),
        )


def test_upsample_decomposed(iree):
    x = torch.randn(1, 2, 4, 5)
    ep = rt.export(Resize(), x)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, decompose_upsample_for_iree)
    rt.assert_ops(
        result,
        present=[aten.upsample_nearest2d.vec, aten.index.Tensor],
        absent=[aten.upsample_bilinear2d.vec, aten.upsample_bicubic2d.vec, aten._unsafe_index.Tensor],
    )
    rt.assert_matches_eager(result, Resize(), [(x,), (torch.randn(1, 2, 4, 5),)], rtol=1e-5, atol=1e-5)
    rt.assert_idempotent(result, RULES)
    _on_iree(
        iree, Resize(), ep, result.program, [(x,), (torch.randn(1, 2, 4, 5),)], r"upsample_bicubic2d|constant\.int"
    )


# -- meshgrid ------------------------------------------------------------------------


class RelativePositions(torch.nn.Module):
    """BEiT: a grid of coordinates built in forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = torch.stack(torch.meshgrid(torch.arange(3), torch.arange(4), indexing="ij"))
        xy = torch.stack(torch.meshgrid(x[0], x[1], indexing="xy"))
        return grid.flatten(1).sum(0) + xy.flatten(1).sum(0)[:12]


def test_meshgrid_decomposed(iree):
    x = torch.randn(2, 4)
    ep = rt.export(RelativePositions(), x)
    assert aten.meshgrid.indexing in rt.targets(ep)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, decompose_meshgrid_for_iree, times=2)
    absent = [aten.meshgrid.indexing, aten.meshgrid.default, torch.ops.prims.broadcast_in_dim.default]
    rt.assert_ops(result, present=[aten.expand.default], absent=absent)
    rt.assert_matches_eager(result, RelativePositions(), [(x,), (torch.randn(2, 4),)])
    _on_iree(
        iree,
        RelativePositions(),
        ep,
        result.program,
        [(x,), (torch.randn(2, 4),)],
        r"node 'stack'.*same type as the list",
    )


# -- bitwise dunders -----------------------------------------------------------------


class Masks(torch.nn.Module):
    """DeBERTa-v2: `mask & other`; the Tensor and Scalar overloads of &, | and ^ (bool | int promotes)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return a & b, (a ^ b) | (a & True), a | False, n & 6, n ^ 5, n | n.flip(0), a | 2, n.bitwise_or(3)


def _masks(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(6, generator=g) > 0.5, torch.rand(6, generator=g) > 0.5, torch.randint(0, 16, (6,), generator=g)


def test_bitwise_dunders(iree):
    ep = rt.export(Masks(), *_masks(0))
    roots = {aten.__and__.Tensor, aten.__and__.Scalar, aten.__or__.Scalar, aten.__xor__.Scalar, aten.bitwise_or.Scalar}
    assert roots <= set(rt.targets(ep))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, bitwise_ops_for_iree, times=10)
    assert not set(rt.targets(result)) & set(bitwise_ops_for_iree.roots)
    rt.assert_ops(result, present=[aten.bitwise_and.Tensor, aten.bitwise_xor.Tensor, aten.scalar_tensor.default])
    rt.assert_matches_eager(result, Masks(), [_masks(0), _masks(1)])
    rt.assert_idempotent(result, RULES)
    _on_iree(iree, Masks(), ep, result.program, [_masks(0), _masks(1)], r"aten\.__(and|xor|or)__")


# -- frozen tensors in lists ---------------------------------------------------------


class StateInLists(torch.nn.Module):
    """XLNet's einsum with a weight, LeViT's table[:, index_buffer], cat with a lifted constant."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3))
        self.register_buffer("index", torch.tensor([[0, 2], [1, 1], [2, 0]]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.einsum("bi,ij->bj", x, self.weight)
        picked = y[:, self.index]
        both = torch.cat([x[:, :3], self.weight[0:1].expand(x.shape[0], 3), torch.tensor([[1.0, 2.0, 3.0]])])
        return picked, both, torch.stack([self.weight, self.weight])


def test_frozen_tensor_in_list(iree):
    x = torch.randn(2, 4)
    ep = rt.export(StateInLists(), x)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, copy_frozen_tensor_in_list, times=3)  # einsum, index, stack (cat reads a slice)
    graph = result.graph_module.graph
    state = {s.arg.name for s in ep.graph_signature.input_specs if s.kind.name != "USER_INPUT"}
    for node in graph.nodes:
        for listed in [a for a in node.args if isinstance(a, (list, tuple))]:
            assert not [v.name for v in listed if getattr(v, "name", None) in state], node.format_node()
    (stack,) = [n for n in graph.nodes if n.target is aten.stack.default]
    assert stack.args[0][0] is stack.args[0][1]  # one copy per tensor and node
    user_list = [n for n in graph.nodes if n.target is aten.index.Tensor]
    assert user_list and user_list[0].args[0].target is aten.einsum.default  # user values are left alone
    rt.assert_matches_eager(result, ep, [(x,), (torch.randn(2, 4),)])
    rt.assert_idempotent(result, RULES)
    full = fx_rewrites.apply(ep, iree.rules)  # the lifted constant needs the constants pack too
    _on_iree(iree, ep.module(), ep, full.program, [(x,), (torch.randn(2, 4),)], "Heterogeneous lists are not supported")


# -- strided convolutions with one output position -----------------------------------


class SmallMaps(torch.nn.Module):
    """The last stage of a CNN on a small image: 3x3/2 convolutions whose output is 1 wide."""

    def __init__(self) -> None:
        super().__init__()
        self.down = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1)  # 2x2 -> 1x1
        self.wide = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, bias=False)  # 4x2 -> 2x1
        self.dilated = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=2)  # 4x4 -> 1x1
        self.line = torch.nn.Conv1d(4, 6, 3, stride=2)  # 4 -> 1, no padding
        self.same = torch.nn.Conv2d(4, 6, 3, padding=1)  # stride 1: left alone

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        square = torch.cat([y, y.flip(-1)], -1)  # 4x4
        return self.down(x), self.wide(y), self.dilated(square), self.line(y[:, :, :, 0]), self.same(x)


def _maps(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 4, 2, 2, generator=g), torch.randn(1, 4, 4, 2, generator=g)


def test_conv_single_window(iree):
    torch.manual_seed(0)
    model = SmallMaps().eval()
    args = _maps(0)
    ep = rt.export(model, *args)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, conv_single_window_for_iree, times=4)  # all but the stride-1 conv
    rt.assert_ops(result, present=[aten.constant_pad_nd.default, aten.slice.Tensor])
    for node in result.graph_module.graph.nodes:
        if node.target in (aten.conv1d.default, aten.conv2d.default) and node.args[1].name != "p_same_weight":
            assert list(node.args[4]) == [0] * len(node.args[4]), node.format_node()  # padding made explicit
    rt.assert_matches_eager(result, model, [args, _maps(1)], rtol=1e-5, atol=1e-6)
    rt.assert_idempotent(result, RULES)
    _on_iree(iree, model, ep, result.program, [args, _maps(1)], r"it failed as `linalg\.generic`")


def test_conv_single_window_on_aten_convolution(iree):
    """run_decompositions and aot_autograd (torch.compile) leave aten.convolution: PoolFormer through torch.compile."""
    torch.manual_seed(0)
    model = SmallMaps().eval()
    args = _maps(0)
    ep = rt.export(model, *args).run_decompositions()  # core ATen: conv1d/conv2d -> aten.convolution
    assert not [n for n in ep.graph.nodes if n.target in (aten.conv1d.default, aten.conv2d.default)]
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, conv_single_window_for_iree, times=4)
    for node in result.graph_module.graph.nodes:
        if node.target is aten.convolution.default and node.args[1].name != "p_same_weight":
            assert list(node.args[4]) == [0] * len(node.args[4]), node.format_node()
    rt.assert_matches_eager(result, model, [args, _maps(1)], rtol=1e-5, atol=1e-6)
    rt.assert_idempotent(result, RULES)
    _on_iree(iree, model, ep, result.program, [args, _maps(1)], r"it failed as `linalg\.generic`")


def test_conv_single_window_through_torch_compile():
    from fx_rewrites.backends.dynamo import dynamo_backend

    torch.manual_seed(0)
    model = SmallMaps().eval()
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=dynamo_backend("iree", on_graph=graphs.append), dynamic=False)
    try:
        with torch.no_grad():
            for args in (_maps(0), _maps(1)):
                torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-4, atol=1e-5)
    finally:
        torch._dynamo.reset()
    (graph,) = graphs
    assert graph.result.report.rewrites["conv_single_window_for_iree"] == 4


# -- select_scatter with a negative index --------------------------------------------


class LastRow(torch.nn.Module):
    """`y[:, -1] = s`: the in-place rule writes it back with select_scatter(..., 1, -1)."""

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[:, -1] = s
        return y * 2


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 4, generator=g), torch.randn(2, 4, generator=g)


def test_select_scatter_negative_index(iree):
    model = LastRow()
    args = _rows(0)
    functional = rt.apply_rules(rt.export(model, *args), backends.get("eager").rules)  # has select_scatter(.., -1)
    assert [n.args[3] for n in functional.graph_module.graph.nodes if n.target is aten.select_scatter.default] == [-1]
    result = rt.apply_rules(functional.program, RULES)
    rt.assert_fired(result, select_scatter_index_for_iree, times=1)
    (node,) = [n for n in result.graph_module.graph.nodes if n.target is aten.select_scatter.default]
    assert node.args[2:] == (1, 2), node.format_node()
    rt.assert_matches_eager(result, model, [args, _rows(1)])
    rt.assert_idempotent(result, RULES)
    inputs = [args, _rows(1)]
    wrong = iree.compile(functional.program, args)  # IREE 3.13 compiles it and writes the wrong slice
    assert not torch.allclose(wrong(*args), model(*args)), "IREE now handles a negative select_scatter index"
    fn = iree.compile(result.program, args)
    for inputs_ in inputs:
        torch.testing.assert_close(fn(*inputs_), model(*inputs_), rtol=1e-4, atol=1e-5)


def test_select_scatter_negative_index_with_a_dim_size(iree):
    """The indexed dim is a Dim: index + size goes through a sym_size node (OpInfo select_scatter, dynamic)."""
    from torch.export import Dim

    model = LastRow()
    inputs = [_rows(0), (torch.randn(3, 5, 4), torch.randn(3, 4))]
    shapes = ({0: Dim("b"), 1: Dim("rows", min=2)}, {0: Dim("b")})
    functional = rt.apply_rules(rt.export(model, *inputs[0], dynamic_shapes=shapes), backends.get("eager").rules)
    result = rt.apply_rules(functional.program, RULES)
    rt.assert_fired(result, select_scatter_index_for_iree, times=1)
    rt.assert_ops(result, present=[aten.sym_size.int])
    rt.assert_matches_eager(result, model, inputs)
    rt.assert_idempotent(result, RULES)
    wrong = iree.compile(functional.program, inputs[1])
    assert not torch.allclose(wrong(*inputs[1]), model(*inputs[1])), "IREE now handles a negative index here"
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), model(*args), rtol=1e-4, atol=1e-5)
