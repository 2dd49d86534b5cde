"""`conv_as_tap_dispatch` and `conv_as_tap_dispatch_avx512` (backends/iree/rules/tap_conv_dispatch.py) and their
kernel (backends/iree/tap_conv_dispatch.py over pointwise_conv_dispatch.py's).

Real torch 2.13 exports of 3x3 convolutions (stride 1 and 2, padding 1 and 0, with and without a bias, batch 1 and 2,
sizes off the vectors, more input channels than a channel block, output channels off the register block); the graph
after (the input padded, at stride 2 split into its phases, one `tap_conv2d`); numerics as near float64 as torch's own
float32 on two input sets; what the rules decline (a Dim, other kernels, groups, dilation, stride 3, float64, fewer
positions than a vector); the taps' offsets and the phases; both ISAs' routes end to end on IREE against float64; the
batch norm and ReLU folded in. (Its speed: docs/performance.md, "A kxk convolution dispatch of our own".)
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeBackend, kernels, targets
from fx_rewrites.backends.iree.legality import SPLICED
from fx_rewrites.backends.iree.pointwise_conv_dispatch import Shape
from fx_rewrites.backends.iree.rules.pointwise_conv_dispatch import (
    batch_norm_into_pointwise_conv,
    relu_into_pointwise_conv,
)
from fx_rewrites.backends.iree.rules.tap_conv_dispatch import conv_as_tap_dispatch, conv_as_tap_dispatch_avx512
from fx_rewrites.backends.iree.tap_conv_dispatch import (
    MARK,
    TAP_CONV2D,
    image,
    phase_rows,
    phases,
    shape,
    splice,
    taps,
)
from fx_rewrites.backends.iree.tap_phase_dispatch import TAP_PHASES, tap_phases
from fx_rewrites.backends.iree.tap_phase_dispatch import splice as splice_phases
from tests.backends.iree.rules.float32_error import assert_within_torch_error, in_float64

aten = torch.ops.aten
RULES = {8: conv_as_tap_dispatch, 16: conv_as_tap_dispatch_avx512}


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _conv(cin: int, cout: int, kernel: int = 3, bias: bool = True, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Conv2d(cin, cout, kernel, bias=bias, **kw).eval()


#: name -> (in channels, out channels, bias, stride, padding, input N, H, W)
CASES = {
    "same_bias": (8, 16, True, 1, 1, (1, 9, 11)),  # 9 x 13 wide positions: a masked last chunk
    "valid_no_bias": (6, 12, False, 1, 0, (1, 10, 12)),  # no padding: the phases only padded to the taps' reach
    "strided_odd": (8, 12, True, 2, 1, (1, 11, 13)),  # four phases of an odd image
    "channel_blocks_batch2": (20, 8, True, 1, 1, (2, 7, 7)),  # blocks of 7, 7 and 6 channels (63 products a sum)
    "strided_prime_out": (9, 7, False, 2, 1, (1, 12, 12)),  # 7 outputs: blocks of one output channel
    "stem_7x7_strided": (3, 8, False, 2, 3, (1, 19, 21)),  # a ResNet stem's 7x7/2: 49 taps, a channel a block
}
#: the cases whose kernel is not 3x3
KERNEL_SIZES = {"stem_7x7_strided": 7}


def _case(name: str):
    cin, cout, bias, stride, padding, (n, h, w) = CASES[name]
    module = _conv(cin, cout, KERNEL_SIZES.get(name, 3), bias=bias, stride=stride, padding=padding)
    return module, [(_randn(0, n, cin, h, w),), (3.0 * _randn(1, n, cin, h, w),)]


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("name", list(CASES))
def test_conv_as_tap_dispatch(name, lanes):
    module, inputs = _case(name)
    rule = RULES[lanes]
    result = rt.apply_rules(rt.export(module, *inputs[0]), rule)
    rt.assert_fired(result, rule, times=1)
    rt.assert_ops(result, absent=[aten.conv2d.default, aten.convolution.default])
    (call,) = [node for node in rt.graph_module(result).graph.nodes if node.target is TAP_CONV2D]
    x, w, b, stride, rows, width, call_lanes, relu = call.args
    out = module(inputs[0][0]).shape
    assert (stride, rows, width, call_lanes, relu) == (module.stride[0], out[2], out[3], lanes, 0)
    assert x.meta["val"].shape[2] == stride * stride, "the padded input's phases"
    assert x.target is TAP_PHASES and x.args[0].op == "placeholder", "padded and split in one call"
    assert x.args[1:4] == (stride, *module.padding) and x.args[6] == lanes
    rt.assert_ops(result, absent=[aten.constant_pad_nd.default, aten.permute.default])
    assert w.op == "placeholder", "the weight as it is"
    if module.bias is not None:
        assert b.op == "placeholder", "the bias as it is, added at the store"
    else:
        assert b.target is aten.zeros.default and b.meta["val"].shape == (module.out_channels,)
    assert_within_torch_error(result.program.module(), in_float64(module), inputs)
    rt.assert_idempotent(result, rule)


def test_conv_as_tap_dispatch_declines():
    """A Dim on a spatial size or on the batch, 1x1 / 5x5 / 3x1 kernels, two groups, dilation 2, stride 3 or (1, 2),
    float64, fewer positions than a vector (AVX-512's 16, AVX2 taking them)."""
    rules = tuple(RULES.values())
    x = _randn(0, 1, 8, 8, 8)
    for dim in ({2: Dim("h", min=4, max=64)}, {0: Dim("batch", min=1, max=8)}):
        ep = rt.export(_conv(8, 8, padding=1), _randn(0, 2, 8, 16, 16), dynamic_shapes=(dim,))
        result = rt.apply_rules(ep, *rules)
        for rule in rules:
            rt.assert_not_fired(result, rule)
    cases = [
        _conv(8, 8, 1),
        _conv(8, 8, 5, padding=2),
        _conv(8, 8, (3, 1), padding=1),
        _conv(8, 8, groups=2, padding=1),
        _conv(8, 8, dilation=2, padding=2),
        _conv(8, 8, stride=3),
        _conv(8, 8, stride=(1, 2), padding=1),
    ]
    for m, args in [*((m, (x,)) for m in cases), (_conv(8, 8, padding=1).double(), (x.double(),))]:
        result = rt.apply_rules(rt.export(m, *args), *rules)
        for rule in rules:
            rt.assert_not_fired(result, rule)
    narrow = rt.export(_conv(8, 8), _randn(0, 1, 8, 4, 5))  # 2 x 3 outputs, 2 x 5 wide positions
    rt.assert_not_fired(rt.apply_rules(narrow, conv_as_tap_dispatch_avx512), conv_as_tap_dispatch_avx512)
    rt.assert_fired(rt.apply_rules(narrow, conv_as_tap_dispatch), conv_as_tap_dispatch, times=1)


def test_taps_and_phases():
    """The taps' offsets in the flattened phases, phases and their inverse, the rows the taps read within, the
    executable's name and its tap loads; a shape whose taps read past a channel is refused."""
    assert taps(3, 1, 6, 5) == (0, 1, 2, 5, 6, 7, 10, 11, 12)
    plane = 4 * 5  # stride 2: tap (ky, kx) in phase (ky % 2, kx % 2) at (ky // 2, kx // 2)
    assert taps(3, 2, 4, 5) == (0, plane, 1, 2 * plane, 3 * plane, 2 * plane + 1, 5, plane + 5, 6)
    x = torch.arange(2 * 3 * 6 * 8.0).reshape(2, 3, 6, 8)
    split = phases(x, 2)
    assert split.shape == (2, 3, 4, 3, 4) and torch.equal(split[:, :, 1], x[:, :, 0::2, 1::2])
    assert torch.equal(image(split), x) and torch.equal(image(phases(x, 1)), x)
    # stride 1, 7 output rows 9 wide over 3 taps a side: the last output's last tap at 7 * 9 - 1 + 2 * 9 + 2
    assert phase_rows(3, 1, 7, 9, 9) == 10
    assert phase_rows(3, 2, 4, 5, 5) == 5
    conv = shape(1, 8, 2, 5, 5, 16, 3, 4, lanes=16)
    assert conv.taps == taps(3, 2, 5, 5) and conv.span == 100 and conv.p == 20 and conv.channel_block == 7
    with pytest.raises(ValueError, match=r"read past a channel"):
        Shape(1, 8, 63, 16, 16, taps=taps(3, 1, 9, 9), span=81)
    assert "fx_rewrites.tap_conv2d.default" in SPLICED and MARK == "torch.fx_rewrites.tap_conv2d"
    with pytest.raises(ValueError, match=r"no tap_conv2d call"):
        splice("module {\n}")
    # tap_phases (eager): x padded by (top, left) and zeros after, to [s hq, s wq], then split into its phases
    padded = torch.nn.functional.pad(x, [2, 10 - 8 - 2, 1, 8 - 6 - 1])
    assert torch.equal(tap_phases(x, 2, 1, 2, 4, 5, 8), phases(padded, 2))
    assert torch.equal(tap_phases(x, 1, 0, 1, 7, 9, 16)[:, :, 0], torch.nn.functional.pad(x, [1, 0, 0, 1]))
    assert "fx_rewrites.tap_phases.default" in SPLICED
    with pytest.raises(ValueError, match=r"no tap_phases call"):
        splice_phases("module {\n}")


class Phases(torch.nn.Module):
    def __init__(self, *args: int) -> None:
        super().__init__()
        self.args = args

    def forward(self, x):
        return TAP_PHASES(x, *self.args)


#: (N, C, H, W), (stride, top, left, hq, wq): widths off a chunk of s vectors, narrower than a vector, planes off
#: a workgroup's 4, padding from 0 to 3 (a 7x7 stem's), extra rows and columns of zeros after
PHASE_CASES = [
    ((1, 3, 19, 21), (2, 3, 3, 13, 14)),
    ((2, 5, 11, 13), (2, 1, 1, 7, 8)),
    ((1, 2, 7, 37), (2, 1, 1, 5, 20)),
    ((1, 6, 10, 12), (1, 0, 0, 11, 12)),
    ((1, 3, 9, 5), (1, 1, 1, 12, 7)),
    ((1, 1, 4, 4), (2, 0, 0, 3, 2)),
]


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_tap_phases_on_iree(isa):
    """The phases dispatch is a copy: equal to eager's padding and split, element for element, on each shape."""
    if targets.host_isa() not in {"avx2": ("avx2", "avx512"), "avx512": ("avx512",)}[isa]:
        pytest.skip(f"llvm-cpu code for {isa} runs on an x86-64 host with {isa}")
    iree = IreeBackend(target=targets.llvm_cpu(isa))
    for sizes, args in PHASE_CASES:
        module, x = Phases(*args, 16 if isa == "avx512" else 8), _randn(2, *sizes)
        fn = iree.compile(rt.export(module, x), (x,))
        assert "flow.dispatch @tapphases_" in kernels.spliced(fn.mlir)
        for value in (x, -3.0 * _randn(3, *sizes)):
            assert torch.equal(torch.as_tensor(fn(value)), module(value)), (sizes, args)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("name", list(CASES))
def test_conv_as_tap_dispatch_on_iree(name, isa):
    """The ISA's route (the code runs where the host has the ISA): the dispatch is spliced and run, its wide output sliced, and on two inputs (and 16 redraws of each for torch's error) the result
    is as near float64 as torch's float32, within a step."""
    if targets.host_isa() not in {"avx2": ("avx2", "avx512"), "avx512": ("avx512",)}[isa]:
        pytest.skip(f"llvm-cpu code for {isa} runs on an x86-64 host with {isa}")
    module, inputs = _case(name)
    rule = RULES[16 if isa == "avx512" else 8]
    iree = IreeBackend(target=targets.llvm_cpu(isa))
    assert rule.name in targets.CPU_ISAS[isa].perf_rules  # on for both (measured)
    result = fx_rewrites.apply(rt.export(module, *inputs[0]), iree.rules)
    rt.assert_fired(result, rule, times=1)
    fn = iree.compile(result.program, inputs[0])
    spliced = splice(fn.mlir)
    assert "flow.dispatch @tapconv_" in spliced and "tensor.extract_slice" in spliced
    assert "flow.dispatch @tapphases_" in kernels.spliced(fn.mlir)
    assert_within_torch_error(fn, in_float64(module), inputs, redraws=16)


class ConvNormRelu(torch.nn.Module):
    """A ResNet layer's 3x3: convolution, batch norm with running statistics that are not the identity, ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm = torch.nn.BatchNorm2d(cout)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-0.5, 0.5)
            self.norm.running_var.uniform_(0.5, 2.0)
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)
        self.eval()

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x)))


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("stride", [1, 2])
def test_batch_norm_and_relu_into_tap_conv(stride, isa):
    """The batch norm folded into the weight [O, C, 3, 3] and bias, the ReLU into the last store: one `tap_conv2d`
    with `relu` 1, no batch norm or ReLU left; as near float64 as torch's float32, in the graph and through IREE."""
    module = ConvNormRelu(10, 12, stride)
    inputs = [(_randn(0, 1, 10, 9, 10),), (3.0 * _randn(1, 1, 10, 9, 10),)]
    rules = (RULES[16 if isa == "avx512" else 8], batch_norm_into_pointwise_conv, relu_into_pointwise_conv)
    result = rt.apply_rules(rt.export(module, *inputs[0]), *rules)
    rt.assert_fired(result, batch_norm_into_pointwise_conv, times=1)
    rt.assert_fired(result, relu_into_pointwise_conv, times=1)
    rt.assert_ops(result, absent=[aten.batch_norm.default, aten.relu.default, aten.conv2d.default])
    (call,) = [node for node in rt.graph_module(result).graph.nodes if node.target is TAP_CONV2D]
    assert call.args[7] == 1 and call.args[1].meta["val"].shape == (12, 10, 3, 3)
    assert_within_torch_error(result.program.module(), in_float64(module), inputs, redraws=16)
    rt.assert_idempotent(result, *rules)
    if targets.host_isa() not in {"avx2": ("avx2", "avx512"), "avx512": ("avx512",)}[isa]:
        return  # the graph's check above runs anywhere; the module's code needs the ISA
    iree = IreeBackend(target=targets.llvm_cpu(isa))
    fn = iree.compile(fx_rewrites.apply(result.program, iree.rules).program, inputs[0])
    assert "_relu" in splice(fn.mlir)
    assert_within_torch_error(fn, in_float64(module), inputs, redraws=16)
