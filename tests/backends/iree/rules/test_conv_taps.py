"""`conv_as_tap_matmuls` (backends/iree/rules/conv_taps.py): a 3x3 convolution as nine tap products summed.

Real exports (static and with a Dim batch) of a convolution + batch norm + ReLU; the graph after (no convolution,
nine matmuls of an [O, C] weight tap by an [N, C, OH OW] window, no stack or im2col matrix); numerics as near a
float64 run as torch's own float32 on two input sets; what it declines; and IREE end to end through the AVX2 route.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeBackend, targets
from fx_rewrites.backends.iree.rules.conv_taps import MIN_TAP_CHANNELS as C
from fx_rewrites.backends.iree.rules.conv_taps import constant_weight, conv_as_tap_matmuls
from fx_rewrites.backends.iree.rules.tap_conv_dispatch import conv_as_tap_dispatch
from fx_rewrites.ruleset import Phases
from tests.backends.iree.rules.float32_error import assert_within_torch_error, in_float64

aten = torch.ops.aten
CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default)


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class ConvNorm(torch.nn.Module):
    """A convolution, a batch norm with running statistics that are not the identity, and a ReLU."""

    def __init__(self, conv: torch.nn.Conv2d):
        super().__init__()
        self.conv = conv
        self.norm = torch.nn.BatchNorm2d(conv.out_channels)
        with torch.no_grad():
            self.norm.running_mean.copy_(_randn(7, conv.out_channels))
            self.norm.running_var.copy_(_randn(8, conv.out_channels).abs() + 0.5)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x)))


#: name -> (the convolution, the input's shape without the batch)
CASES = {
    "3x3_pad1": (lambda: torch.nn.Conv2d(C, C + 8, 3, padding=1), (C, 7, 6)),
    "3x3_unpadded_no_bias": (lambda: torch.nn.Conv2d(C + 4, C, 3, bias=False), (C + 4, 9, 5)),
    "3x3_pad_hw": (lambda: torch.nn.Conv2d(C, C, 3, padding=(2, 0)), (C, 5, 8)),
}


def _module(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return ConvNorm(CASES[name][0]()).eval()


def _inputs(name: str) -> list[tuple[torch.Tensor]]:
    return [(_randn(s, 2, *CASES[name][1]),) for s in (0, 1)]


def _native(module: torch.nn.Module):
    """`module` through torch's native CPU convolution, not oneDNN's: the other of torch's float32 convolutions."""

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.backends.mkldnn.flags(enabled=False):
            return module(x)

    return run


def _export(name: str, dynamic: bool):
    module, inputs = _module(name), _inputs(name)
    ep = rt.export(module, *inputs[0], dynamic_shapes=({0: Dim("batch", min=2, max=16)},) if dynamic else None)
    return module, inputs, ep


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_conv_as_tap_matmuls(name, dynamic):
    module, inputs, ep = _export(name, dynamic)
    result = rt.apply_rules(ep, conv_as_tap_matmuls)
    rt.assert_fired(result, conv_as_tap_matmuls, times=1)
    rt.assert_ops(result, absent=[*CONVS, aten.stack.default, aten.cat.default, aten.unfold.default])
    conv = module.conv
    (height, width), (pad_h, pad_w) = CASES[name][1][1:], conv.padding
    rows, cols = height + 2 * pad_h - 2, width + 2 * pad_w - 2
    matmuls = [n for n in rt.graph_module(result).graph.nodes if n.target == aten.matmul.default]
    assert len(matmuls) == 9, "one product per kernel tap"
    for n in matmuls:
        tap, window = (a.meta["val"] for a in n.args)
        assert tuple(tap.shape) == (conv.out_channels, conv.in_channels), "the weight's tap as [O, C]"
        assert tuple(window.shape[1:]) == (conv.in_channels, rows * cols), "the window as [N, C, OH OW]"
    adds = [n for n in rt.graph_module(result).graph.nodes if n.target == aten.add.Tensor]
    assert len(adds) == 8 + (conv.bias is not None), "the taps summed, then the bias"
    rt.assert_matches_eager(result, module, inputs, rtol=1e-5, atol=1e-5)
    assert_within_torch_error(result.program.module(), in_float64(module), inputs, torch_forms=[_native(module)])
    wide = copy.deepcopy(result.program.module()).double()  # the same sum: float64 runs agree to float64's rounding
    for (x,) in inputs:
        torch.testing.assert_close(wide(x.double()), in_float64(module)(x.double()), rtol=1e-12, atol=1e-12)
    rt.assert_idempotent(result, conv_as_tap_matmuls)


def test_conv_as_tap_matmuls_declines():
    cases = [
        (torch.nn.Conv2d(C, C, 3, stride=2, padding=1), (1, C, 8, 8)),  # strided
        (torch.nn.Conv2d(C, C, 3, padding=2, dilation=2), (1, C, 8, 8)),  # dilated
        (torch.nn.Conv2d(C, C, 5, padding=2), (1, C, 8, 8)),  # 5x5: not measured
        (torch.nn.Conv2d(C, C, 1), (1, C, 8, 8)),  # 1x1: pointwise_conv_as_matmul
        (torch.nn.Conv2d(C, C, 3, padding=1, groups=2), (1, C, 8, 8)),  # grouped: grouped_conv_as_convs
        (torch.nn.Conv2d(C - 1, C, 3, padding=1), (1, C - 1, 8, 8)),  # too few input channels
        (torch.nn.Conv2d(C, 8, 3, padding=1), (1, C, 8, 8)),  # too few output channels
        (torch.nn.Conv1d(C, C, 3), (1, C, 8)),
        (torch.nn.Conv3d(C, C, 3), (1, C, 4, 4, 4)),
        (torch.nn.ConvTranspose2d(C, C, 3), (1, C, 4, 4)),
    ]
    for conv, shape in cases:
        ep = rt.export(conv.eval(), _randn(0, *shape))
        rt.assert_not_fired(rt.apply_rules(ep, conv_as_tap_matmuls), conv_as_tap_matmuls)
    # a Dim height: the windows need static bounds
    ep = rt.export(torch.nn.Conv2d(C, C, 3).eval(), _randn(0, 1, C, 6, 6), dynamic_shapes=({2: Dim("h", min=4)},))
    rt.assert_not_fired(rt.apply_rules(ep, conv_as_tap_matmuls), conv_as_tap_matmuls)


class WeightIn(torch.nn.Module):
    """A 3x3 convolution whose weight is passed in (torch.compile's route without freezing)."""

    def forward(self, x, w):
        return torch.nn.functional.conv2d(x, w, padding=1)


class WeightAttr(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(_randn(3, C, C, 3, 3))

    def forward(self, x):
        return torch.nn.functional.conv2d(x, self.w, padding=1)


def test_conv_as_tap_matmuls_takes_the_programs_own_weight_only():
    """A weight passed in at every call declines (its nine taps would be sliced and packed per call: torch.compile's
    route with the weights as inputs read 1.03, 1.14 and 0.90 of itself with them); a parameter or a get_attr is
    taken."""
    ep = rt.export(WeightIn(), _randn(0, 1, C, 6, 6), _randn(1, C, C, 3, 3))
    rt.assert_not_fired(rt.apply_rules(ep, conv_as_tap_matmuls), conv_as_tap_matmuls)
    ep = rt.export(WeightAttr().eval(), _randn(0, 1, C, 6, 6))
    rt.assert_fired(rt.apply_rules(ep, conv_as_tap_matmuls), conv_as_tap_matmuls, times=1)
    traced = torch.fx.symbolic_trace(WeightAttr())  # the weight a get_attr
    (weight,) = [n for n in traced.graph.nodes if n.op == "get_attr"]
    assert constant_weight(weight)
    (x,) = [n for n in traced.graph.nodes if n.op == "placeholder"]
    assert not constant_weight(x), "a placeholder of no program's signature is an input"


def test_conv_as_tap_matmuls_on_avx2():
    """The AVX2 route takes it (targets.CPU_ISAS) and AVX-512's does not."""
    assert conv_as_tap_matmuls.name in targets.CPU_ISAS["avx2"].perf_rules
    assert conv_as_tap_matmuls.name not in targets.CPU_ISAS["avx512"].perf_rules


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_conv_as_tap_matmuls_on_iree(dynamic):
    """Through the AVX2 route (any AVX2 or AVX-512 host runs its code): the rule fires, and on two inputs the result
    is as near float64 as torch's float32 or as the route without the rule (IREE's im2col), within a step."""
    if targets.host_isa() == "":
        pytest.skip("llvm-cpu code for AVX2 runs on an x86-64 host with AVX2 only")
    module, inputs, ep = _export("3x3_pad1", dynamic)
    iree = IreeBackend(target=targets.llvm_cpu("avx2"))

    def without(name, rules=iree.rules):
        return Phases(*(s.without(name) if name in s.names() else s for s in rules.sets))

    # a static 3x3 goes to the kxk dispatch first (test_tap_conv_dispatch.py); a Dim to this rule
    route = without(conv_as_tap_dispatch.name) if not dynamic else iree.rules
    result = fx_rewrites.apply(ep, route)
    rt.assert_fired(result, conv_as_tap_matmuls, times=1)
    rt.assert_ops(result, absent=list(CONVS))
    before = fx_rewrites.apply(ep, without(conv_as_tap_matmuls.name, route))
    assert set(rt.targets(before)) & set(CONVS), "the route without the rule keeps its convolution"
    fn, fn_before = iree.compile(result.program, inputs[0]), iree.compile(before.program, inputs[0])
    exact = in_float64(module)
    for (x,) in inputs:
        want = exact(x.double())

        def error(f, x=x, want=want):
            return (f(x).double() - want).abs().max().item()

        torch_error = max(error(module), error(_native(module)))
        step = torch.finfo(torch.float32).eps * want.abs().max().item()
        assert error(fn) <= max(torch_error, error(fn_before)) + step
