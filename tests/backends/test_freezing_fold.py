"""Eval batch norm folded into the frozen convolution before it (`backends/freezing_fold.py`), on the graphs
torch.compile's aot_autograd hands the IREE backend (BatchNorm decomposed: sub mean, mul scale, add shift)."""

from __future__ import annotations

import collections

import pytest
import torch

from fx_rewrites.backends import freezing, freezing_fold
from fx_rewrites.backends.dynamo import CompiledGraph, dynamo_backend
from fx_rewrites.backends.freezing_fold import fold_conv_affine
from fx_rewrites.backends.iree import CompileCache, IreeBackend

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    monkeypatch.setenv(freezing.FOLD_ENV, "1")  # on by default too (`test_on_by_default_off_with_0`)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class ConvBn(torch.nn.Module):
    """conv+bn+relu (no conv bias), conv+bn (conv bias), and a conv read twice (its bn cannot fold)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(8)
        # 3x3s: by the time the graph is frozen on llvm-cpu they are the kxk dispatch's calls
        # (`conv_as_tap_dispatch[_avx512]`, registered in `freezing_fold.CONVOLUTIONS`)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(8)
        self.conv3 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.bn3 = torch.nn.BatchNorm2d(8)
        for bn in (self.bn1, self.bn2, self.bn3):  # running statistics and affine parameters far from 0 and 1
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.uniform_(-1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        z = self.conv3(y)
        return self.bn3(z) + z


def _ops(gm: torch.fx.GraphModule) -> collections.Counter:
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


#: what a convolution is by the time the graph is frozen: ATen's, or the llvm-cpu route's kxk and 1x1 dispatches
CONVOLUTIONS = (aten.convolution.default, *freezing_fold.CONVOLUTIONS)


def _convs(ops: collections.Counter) -> int:
    return sum(ops[str(op)] for op in CONVOLUTIONS)


def _float64(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    import copy

    return copy.deepcopy(model).double()(x.double())


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_eval_batch_norm_folds_into_the_frozen_convolutions(monkeypatch, dynamic):
    folded: list[tuple[collections.Counter, torch.fx.GraphModule, int]] = []

    def recording(gm: torch.fx.GraphModule) -> int:
        before = _ops(gm)
        count = fold_conv_affine(gm)
        folded.append((before, gm, count))
        return count

    monkeypatch.setattr(freezing, "fold_conv_affine", recording)
    graphs: list[CompiledGraph] = []
    torch.manual_seed(0)
    model = ConvBn().eval()
    backend = dynamo_backend(IreeBackend(cache=CompileCache()), on_graph=graphs.append, strict=True)
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    with torch.no_grad():
        for shape in [(2, 3, 12, 12), (3, 3, 10, 10)] if dynamic else [(2, 3, 12, 12)]:
            x = torch.randn(shape)
            expected = model(x)
            got = compiled(x)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
            # within float32's own error of the float64 result, as eager is
            reference = _float64(model, x)
            assert (got.double() - reference).abs().max() <= 4 * (expected.double() - reference).abs().max() + 1e-6
    ((before, after, count),) = folded
    # the aot graph decomposes each batch norm: sub mean, mul scale, add shift (and rsqrt(var + eps) * gamma)
    assert _convs(before) == 3 and before[str(aten.rsqrt.default)] == 3
    assert count == 6  # bn1 and bn2: sub, mul, add each; bn3 reads a conv that its residual reads too
    ops = _ops(after)
    assert _convs(ops) == 3 and ops[str(aten.rsqrt.default)] == 1
    convs = [n for op in CONVOLUTIONS for n in after.graph.find_nodes(op="call_function", target=op)]
    # bn1's ReLU: in a dispatch's store where conv1 is one (`fold_conv_relu`; static sizes), else as it was
    in_store = [
        c for c in convs if freezing_fold.CONVOLUTIONS.get(c.target) and c.args[freezing_fold.CONVOLUTIONS[c.target]]
    ]
    assert ops[str(aten.sub.Tensor)] == 1 and ops[str(aten.relu.default)] + len(in_store) == 1
    assert len(in_store) == (0 if dynamic else 1)
    assert sum(str(c.args[1].target).startswith("_folded_") for c in convs) == 2
    assert all(c.args[2] is not None and c.args[2].op == "get_attr" for c in convs)
    (graph,) = graphs
    assert "torch.aten.rsqrt" in graph.compiled.mlir  # bn3 (not folded) only
    assert graph.compiled.mlir.count("torch.aten.rsqrt") == 1


class PointwiseBn(torch.nn.Module):
    """A 1x1 without a bias over a 14x14 map (the 1x1 dispatch's: its weight reshaped to [O, C], its bias zeros)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(16, 8, 1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)
        self.bn.running_mean.uniform_(-1, 1)
        self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize(("env", "folds"), [(None, 1), ("0", 0)], ids=["default", "0"])
def test_on_by_default_off_with_0(monkeypatch, env, folds):
    monkeypatch.delenv(freezing.FOLD_ENV)
    if env is not None:
        monkeypatch.setenv(freezing.FOLD_ENV, env)
    calls: list[int] = []
    monkeypatch.setattr(freezing, "fold_conv_affine", lambda gm: calls.append(1) or 0)
    torch.manual_seed(0)
    model = ConvBn().eval()
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=dynamo_backend("eager", strict=True))(x), model(x))
    assert calls == [1] * folds


def test_batch_norm_and_relu_fold_into_the_pointwise_dispatch(monkeypatch):
    """PointwiseBn on llvm-cpu: the 1x1 dispatch's call reads its weight through a reshape and a zeros bias, both
    computed from frozen values, so the batch norm folds (sub, mul, add); then the ReLU goes in as the dispatch's
    `relu` 1 (`fold_conv_relu`). The frozen graph keeps no ReLU and no per-channel op, and the result is as near
    float64 as eager's."""
    counts: list[int] = []
    monkeypatch.setattr(freezing, "fold_conv_affine", lambda gm: counts.append(fold_conv_affine(gm)) or counts[-1])
    frozen: list[freezing.Frozen] = []
    real = freezing.Frozen.make
    monkeypatch.setattr(freezing.Frozen, "make", lambda *a, **k: frozen.append(real(*a, **k)) or frozen[-1])
    torch.manual_seed(0)
    model = PointwiseBn().eval()
    compiled = torch.compile(model, backend=dynamo_backend(IreeBackend(cache=CompileCache()), strict=True))
    x = torch.randn(1, 16, 14, 14)
    with torch.no_grad():
        got, expected = compiled(x), model(x)
    reference = _float64(model, x)
    assert (got.double() - reference).abs().max() <= 4 * (expected.double() - reference).abs().max() + 1e-6
    assert counts == [3]
    assert bool((got == 0).any()) and bool((expected == 0).any())  # the ReLU clipped something
    (made,) = frozen
    ops = _ops(made.frozen_graph)
    assert ops[str(aten.relu.default)] == 0 and ops[str(aten.mul.Tensor)] == 0 and ops[str(aten.add.Tensor)] == 0
    (conv,) = [
        n
        for op in freezing_fold.CONVOLUTIONS
        for n in made.frozen_graph.graph.find_nodes(op="call_function", target=op)
    ]
    assert conv.args[freezing_fold.CONVOLUTIONS[conv.target]] == 1


def test_a_relu_of_a_convolution_read_elsewhere_stays():
    """`fold_conv_relu` leaves a ReLU whose convolution another node reads (the stored values would change)."""
    from fx_rewrites.backends.iree.pointwise_conv_dispatch import POINTWISE_CONV2D

    graph = torch.fx.Graph()
    x, w, b = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("b")
    conv = graph.call_function(POINTWISE_CONV2D, (x, w, b, 8, 0))
    relu = graph.call_function(aten.relu.default, (conv,))
    graph.output((relu, conv))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert freezing_fold.fold_conv_relu(gm) == 0
    graph.erase_node(graph.output_node())
    graph.output((relu,))
    gm.recompile()
    assert freezing_fold.fold_conv_relu(gm) == 1
    (fused,) = gm.graph.find_nodes(op="call_function", target=POINTWISE_CONV2D)
    assert fused.args[4] == 1 and not gm.graph.find_nodes(op="call_function", target=aten.relu.default)
    args = (torch.randn(1, 4, 14, 14), torch.randn(3, 4), torch.randn(3))
    (got,) = gm(*args)
    torch.testing.assert_close(got, torch.relu(torch.nn.functional.conv2d(args[0], args[1][:, :, None, None], args[2])))


def test_the_folded_graph_runs_as_the_unfolded_one():
    """The pass itself on the frozen aot graph as the rules leave it (eval batch norm as sub, mul and add): eager runs
    of the graph before and after agree."""
    captured: list[torch.fx.GraphModule] = []
    torch.manual_seed(0)
    model = ConvBn().eval()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(freezing, "fold_conv_affine", lambda gm: captured.append(gm) or 0)
        with torch.no_grad():
            torch.compile(model, backend=dynamo_backend("eager", strict=True))(torch.randn(2, 3, 12, 12))
    (frozen,) = captured
    assert _ops(frozen)[str(aten.rsqrt.default)] == 3  # the batch norms decomposed by the rules, not folded yet
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        (unfolded,) = frozen(x)
        assert fold_conv_affine(frozen) == 6
        (got,) = frozen(x)
        assert fold_conv_affine(frozen) == 0  # nothing left to fold
        expected = model(x)
    torch.testing.assert_close(unfolded, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


class DivideByChannels(torch.nn.Module):
    def __init__(self, divisor: torch.Tensor) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.register_buffer("divisor", divisor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) / self.divisor.view(1, -1, 1, 1)


@pytest.mark.parametrize(("divisor", "folds"), [([1.0, 2.0, -4.0, 0.5], 1), ([1.0, 0.0, 2.0, 3.0], 0)])
def test_a_division_folds_only_without_a_zero_divisor(monkeypatch, divisor, folds):
    counts: list[int] = []
    monkeypatch.setattr(freezing, "fold_conv_affine", lambda gm: counts.append(fold_conv_affine(gm)) or counts[-1])
    torch.manual_seed(0)
    model = DivideByChannels(torch.tensor(divisor)).eval()
    compiled = torch.compile(model, backend=dynamo_backend(IreeBackend(cache=CompileCache()), strict=True))
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5, equal_nan=True)
    assert counts == [folds]
