"""IREE convolution performance rules (backends/iree/rules/conv_performance.py): same numbers, another form.

Each rule on real exports (static, with a Dim batch, with a Dim height),
its graph after, numerics against eager on two input sets, idempotence, and
the default llvm-cpu route end to end on IREE. Speed: benchmarks/scale_cnn.py
and benchmarks/runtime.py, not here.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeBackend, targets
from fx_rewrites.backends.iree.rules import performance
from fx_rewrites.backends.iree.rules.conv_performance import (
    TAPS_PER_SUM,
    conv3d_as_conv2d_over_frames,
    depthwise_conv_as_row_partials,
    depthwise_conv_as_taps,
    grouped_conv_as_convs,
    strided_pointwise_conv_as_slice,
)
from fx_rewrites.ruleset import Phases

aten = torch.ops.aten
CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default)


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Shortcut(torch.nn.Module):
    """ResNet's downsampling shortcut: a strided 1x1 convolution and a batch norm, added to a strided 3x3 path."""

    def __init__(self, spatial: int = 2, stride: int | tuple[int, ...] = 2, groups: int = 1, bias: bool = False):
        super().__init__()
        conv = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)[spatial - 1]
        norm = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)[spatial - 1]
        self.conv = conv(8, 16, 1, stride=stride, groups=groups, bias=bias)
        self.norm = norm(16)
        with torch.no_grad():  # running statistics that are not the identity
            self.norm.running_mean.copy_(_randn(7, 16))
            self.norm.running_var.copy_(_randn(8, 16).abs() + 0.5)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x)))


CASES = {
    "2d_stride2": (dict(spatial=2, stride=2), (8, 15, 14)),
    "2d_stride_2x1_grouped_bias": (dict(spatial=2, stride=(2, 1), groups=2, bias=True), (8, 9, 7)),
    "2d_stride3_odd": (dict(spatial=2, stride=3), (8, 10, 11)),
    "1d_stride2": (dict(spatial=1, stride=2), (8, 13)),
    "3d_stride_1x2x2": (dict(spatial=3, stride=(1, 2, 2)), (8, 3, 9, 10)),
}


def _check(name: str, dynamic: str | None) -> None:
    kwargs, shape = CASES[name]
    torch.manual_seed(0)
    module = Shortcut(**kwargs).eval()
    inputs = [(_randn(s, 2, *shape),) for s in (0, 1)]
    if dynamic == "width":
        inputs.append((_randn(2, 2, *shape[:2], shape[2] + 3),))
    dims = {"batch": {0: Dim("batch", min=2, max=16)}, "width": {3: Dim("w", min=4, max=64)}}
    ep = rt.export(module, *inputs[0], dynamic_shapes=(dims[dynamic],) if dynamic else None)
    result = rt.apply_rules(ep, strided_pointwise_conv_as_slice)
    rt.assert_fired(result, strided_pointwise_conv_as_slice, times=1)
    convs = [n for n in rt.graph_module(result).graph.nodes if n.target == aten.convolution.default]
    assert len(convs) == 1 and all(s == 1 for s in convs[0].args[3]), "the convolution is left unstrided"
    stride = kwargs["stride"]
    steps = [stride] * kwargs["spatial"] if isinstance(stride, int) else list(stride)
    slices = [n for n in rt.graph_module(result).graph.nodes if n.target == aten.slice.Tensor]
    assert sorted((n.args[1], n.args[4]) for n in slices) == [(d + 2, s) for d, s in enumerate(steps) if s != 1]
    rt.assert_ops(result, absent=[aten.conv1d.default, aten.conv2d.default, aten.conv3d.default])
    rt.assert_matches_eager(result, module, inputs, rtol=1e-5, atol=1e-5)
    rt.assert_idempotent(result, strided_pointwise_conv_as_slice)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dynamic", [None, "batch"], ids=["static", "dim"])
def test_strided_pointwise_conv_as_slice(name, dynamic):
    _check(name, dynamic)


def test_strided_pointwise_declines_a_dim_along_a_strided_dim():
    """The slice's length and the convolution's are equal expressions the engine cannot prove equal: declined."""
    module = Shortcut(spatial=2, stride=3).eval()
    ep = rt.export(module, _randn(0, 2, 8, 10, 11), dynamic_shapes=({2: Dim("h", min=4, max=64)},))
    rt.assert_not_fired(rt.apply_rules(ep, strided_pointwise_conv_as_slice), strided_pointwise_conv_as_slice)


def test_strided_pointwise_conv_with_a_dim_along_an_unstrided_dim():
    _check("2d_stride_2x1_grouped_bias", "width")


def test_strided_pointwise_declines_other_convolutions():
    convs = (
        torch.nn.Conv2d(8, 16, 1),  # no stride
        torch.nn.Conv2d(8, 16, 3, stride=2),  # not pointwise
        torch.nn.Conv2d(8, 16, 1, stride=2, padding=1),  # the padded border would be read
        torch.nn.ConvTranspose2d(8, 16, 1, stride=2),
    )
    for conv in convs:
        ep = rt.export(conv.eval(), _randn(0, 1, 8, 12, 12))
        rt.assert_not_fired(rt.apply_rules(ep, strided_pointwise_conv_as_slice), strided_pointwise_conv_as_slice)


@pytest.mark.parametrize("name", ["2d_stride2", "2d_stride_2x1_grouped_bias", "3d_stride_1x2x2"])
def test_strided_pointwise_on_iree(name):
    """The default `iree` backend (llvm-cpu, its performance phase on): the rule fires, IREE matches eager."""
    kwargs, shape = CASES[name]
    torch.manual_seed(0)
    module = Shortcut(**kwargs).eval()
    inputs = [(_randn(s, 2, *shape),) for s in (0, 1)]
    iree = backends.get("iree")
    result = fx_rewrites.apply(rt.export(module, *inputs[0]), iree.rules)
    rt.assert_fired(result, strided_pointwise_conv_as_slice)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), module(*args), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- 3-D, depthwise, grouped


class ConvNorm(torch.nn.Module):
    """A convolution, a batch norm with running statistics that are not the identity, and a relu."""

    def __init__(self, conv: torch.nn.Module, channels: int, spatial: int):
        super().__init__()
        self.conv = conv
        self.norm = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)[spatial - 1](channels)
        with torch.no_grad():
            self.norm.running_mean.copy_(_randn(7, channels))
            self.norm.running_var.copy_(_randn(8, channels).abs() + 0.5)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x)))


#: name -> (rule, convolution, output channels, spatial dims, input shape without the batch)
MORE = {
    "conv3d_3x3x3_pad1": (
        conv3d_as_conv2d_over_frames,
        lambda: torch.nn.Conv3d(4, 6, 3, padding=1),
        6,
        3,
        (4, 5, 7, 6),
    ),
    "conv3d_strided_dilated_no_bias": (
        conv3d_as_conv2d_over_frames,
        lambda: torch.nn.Conv3d(4, 6, (3, 2, 3), stride=(2, 1, 2), padding=(2, 0, 1), dilation=(2, 1, 1), bias=False),
        6,
        3,
        (4, 7, 6, 9),
    ),
    "conv3d_one_frame_pad1": (  # r3d's last stage: two of the three taps read only the time padding
        conv3d_as_conv2d_over_frames,
        lambda: torch.nn.Conv3d(4, 6, 3, padding=1),
        6,
        3,
        (4, 1, 5, 5),
    ),
    "conv3d_grouped": (
        conv3d_as_conv2d_over_frames,
        lambda: torch.nn.Conv3d(4, 6, (2, 3, 3), padding=(0, 1, 1), groups=2),
        6,
        3,
        (4, 4, 6, 6),
    ),
    "depthwise_3x3_pad1": (
        depthwise_conv_as_taps,
        lambda: torch.nn.Conv2d(6, 6, 3, padding=1, groups=6),
        6,
        2,
        (6, 9, 8),
    ),
    "depthwise_3x2_pad1": (
        depthwise_conv_as_taps,
        lambda: torch.nn.Conv2d(6, 6, (3, 2), padding=1, groups=6),
        6,
        2,
        (6, 11, 10),
    ),
    "depthwise_strided_dilated_no_bias": (
        depthwise_conv_as_taps,
        lambda: torch.nn.Conv2d(6, 6, (3, 3), stride=(2, 3), padding=(1, 2), dilation=(2, 1), groups=6, bias=False),
        6,
        2,
        (6, 13, 14),
    ),
    "depthwise_7x7_pad3": (  # ConvNeXt's
        depthwise_conv_as_row_partials,
        lambda: torch.nn.Conv2d(6, 6, 7, padding=3, groups=6),
        6,
        2,
        (6, 10, 9),
    ),
    "depthwise_5x3_dilated_no_bias": (
        depthwise_conv_as_row_partials,
        lambda: torch.nn.Conv2d(6, 6, (5, 3), padding=(3, 1), dilation=(2, 1), groups=6, bias=False),
        6,
        2,
        (6, 12, 7),
    ),
    "grouped_2d_g4": (
        grouped_conv_as_convs,
        lambda: torch.nn.Conv2d(8, 12, 3, padding=1, groups=4),
        12,
        2,
        (8, 9, 7),
    ),
    "grouped_2d_strided_no_bias": (
        grouped_conv_as_convs,
        lambda: torch.nn.Conv2d(8, 8, 3, stride=2, groups=2, bias=False),
        8,
        2,
        (8, 11, 10),
    ),
    "grouped_1d_g2": (grouped_conv_as_convs, lambda: torch.nn.Conv1d(4, 6, 3, padding=1, groups=2), 6, 1, (4, 12)),
}


def _more(name: str, dynamic: bool):
    rule, conv, channels, spatial, shape = MORE[name]
    torch.manual_seed(0)
    module = ConvNorm(conv(), channels, spatial).eval()
    inputs = [(_randn(s, 2, *shape),) for s in (0, 1)]
    ep = rt.export(module, *inputs[0], dynamic_shapes=({0: Dim("batch", min=2, max=16)},) if dynamic else None)
    return rule, module, inputs, rt.apply_rules(ep, rule)


@pytest.mark.parametrize("name", list(MORE))
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_conv_class_rules(name, dynamic):
    rule, module, inputs, result = _more(name, dynamic)
    rt.assert_fired(result, rule, times=1)
    convs = [n for n in rt.graph_module(result).graph.nodes if n.target in CONVS]
    weights = [n.args[1].meta["val"] for n in convs]
    if rule is conv3d_as_conv2d_over_frames:  # a 2-D convolution per kernel frame that reads the input
        assert len(convs) == (1 if name == "conv3d_one_frame_pad1" else module.conv.kernel_size[0])
        assert all(w.dim() == 4 for w in weights)
    elif rule is depthwise_conv_as_taps:  # no convolution left: multiply-adds, summed in chains of TAPS_PER_SUM
        assert not convs
        nodes = rt.graph_module(result).graph.nodes
        taps = module.conv.kernel_size[0] * module.conv.kernel_size[1]
        assert sum(n.target == aten.mul.Tensor for n in nodes) == taps
        joins = [n for n in nodes if n.target == aten.add.Tensor and n.args[1].target == aten.add.Tensor]
        assert len(joins) == -(-taps // TAPS_PER_SUM) - 1, "chains of TAPS_PER_SUM taps, then added"
    elif rule is depthwise_conv_as_row_partials:  # a width partial per kernel row, its rows shifted, summed
        assert not convs
        nodes = list(rt.graph_module(result).graph.nodes)
        (kh, kw), (dh, _) = module.conv.kernel_size, module.conv.dilation
        assert sum(n.target == aten.mul.Tensor for n in nodes) == kh * kw
        shifts = [n.args[2] for n in nodes if n.target == aten.slice.Tensor and n.args[1] == 2]
        assert shifts == [i * dh for i in range(kh)], "each kernel row's partial shifted by its row"
        partials = [n for n in nodes if n.target == aten.slice.Tensor and n.args[1] == 2]
        assert all(p.args[0].target in (aten.add.Tensor, aten.mul.Tensor) for p in partials)
    else:  # one ungrouped convolution per group
        assert len(convs) == module.conv.groups and all(n.args[8] == 1 for n in convs)
    rt.assert_matches_eager(result, module, inputs, rtol=1e-5, atol=1e-5)
    rt.assert_idempotent(result, rule)


def test_conv_class_rules_decline():
    cases = [
        (conv3d_as_conv2d_over_frames, torch.nn.Conv2d(4, 4, 3), (1, 4, 8, 8)),
        (conv3d_as_conv2d_over_frames, torch.nn.Conv3d(4, 4, 1, stride=2, padding=(1, 0, 0)), (1, 4, 1, 4, 4)),
        (depthwise_conv_as_taps, torch.nn.Conv2d(4, 8, 3, groups=4), (1, 4, 8, 8)),  # a channel multiplier
        (depthwise_conv_as_taps, torch.nn.Conv1d(4, 4, 3, groups=4), (1, 4, 8)),
        (depthwise_conv_as_taps, torch.nn.Conv2d(4, 4, 7, groups=4), (1, 4, 12, 12)),  # 49 taps: row partials
        (depthwise_conv_as_taps, torch.nn.Conv2d(4, 4, (1, 11), groups=4), (1, 4, 12, 12)),  # 11 taps
        (depthwise_conv_as_row_partials, torch.nn.Conv2d(4, 4, 3, groups=4), (1, 4, 8, 8)),  # 9 taps: taps
        (depthwise_conv_as_row_partials, torch.nn.Conv2d(4, 4, 7, stride=2, groups=4), (1, 4, 12, 12)),  # strided
        (depthwise_conv_as_row_partials, torch.nn.Conv2d(4, 4, 9, groups=4), (1, 4, 12, 12)),  # 81 taps
        (depthwise_conv_as_row_partials, torch.nn.Conv2d(4, 8, 7, groups=4), (1, 4, 12, 12)),  # a multiplier
        (grouped_conv_as_convs, torch.nn.Conv2d(4, 4, 3), (1, 4, 8, 8)),
        (grouped_conv_as_convs, torch.nn.Conv2d(4, 4, 3, groups=4), (1, 4, 8, 8)),  # depthwise: taps
        (grouped_conv_as_convs, torch.nn.Conv2d(66, 66, 1, groups=33), (1, 66, 4, 4)),  # too many groups
    ]
    for rule, conv, shape in cases:
        ep = rt.export(conv.eval(), _randn(0, *shape))
        rt.assert_not_fired(rt.apply_rules(ep, rule), rule)


@pytest.mark.parametrize("isa", ["host", "avx2"])
@pytest.mark.parametrize("name", ["conv3d_grouped", "depthwise_strided_dilated_no_bias", "grouped_2d_g4"])
def test_conv_class_rules_on_iree(name, isa):
    """The `iree` rules and flags for this host's ISA and for AVX2 (runs on any AVX2 host): the rule fires and
    IREE matches eager (torch's float32 error: 1e-5 here)."""
    if isa != "host" and targets.host_isa() == "":
        pytest.skip("AVX2 code runs on an x86-64 host with AVX2 only")
    rule, conv, channels, spatial, shape = MORE[name]
    torch.manual_seed(0)
    module = ConvNorm(conv(), channels, spatial).eval()
    inputs = [(_randn(s, 2, *shape),) for s in (0, 1)]
    iree = backends.get("iree") if isa == "host" else IreeBackend(target=targets.llvm_cpu(isa))
    result = fx_rewrites.apply(rt.export(module, *inputs[0]), iree.rules)
    rt.assert_fired(result, rule)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), module(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ["host", "avx2"])
def test_depthwise_row_partials_on_iree(isa):
    """`depthwise_conv_as_row_partials` is among the `iree` rules of this host's ISA and of AVX2 (on for both by
    measurement: targets.CPU_ISAS), after `depthwise_conv_as_dispatch`, which takes a 7x7 at stride 1 first: the
    route less the dispatch rewrites a 7x7 depthwise convolution by the partials alone, and IREE matches eager on two
    inputs."""
    if isa != "host" and targets.host_isa() == "":
        pytest.skip("AVX2 code runs on an x86-64 host with AVX2 only")
    rule, module, inputs, _ = _more("depthwise_7x7_pad3", dynamic=False)
    iree = backends.get("iree") if isa == "host" else IreeBackend(target=targets.llvm_cpu(isa))
    perf = performance.for_target(iree.target.name, iree.target.isa)
    assert perf.names().index("depthwise_conv_as_dispatch") < perf.names().index(rule.name)
    less = perf.without("depthwise_conv_as_dispatch")
    rules = Phases(*(less if s is perf else s for s in iree.rules.sets), name=iree.rules.name)
    result = fx_rewrites.apply(rt.export(module, *inputs[0]), rules)
    rt.assert_fired(result, rule, times=1)
    rt.assert_ops(result, absent=list(CONVS))
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), module(*args), rtol=1e-5, atol=1e-5)
