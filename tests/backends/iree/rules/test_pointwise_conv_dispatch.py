"""`pointwise_conv_as_dispatch` and `pointwise_conv_as_dispatch_avx512` (backends/iree/rules/pointwise_conv_dispatch.py)
and their kernel (backends/iree/pointwise_conv_dispatch.py).

Real torch 2.13 exports of 1x1 convolutions (with and without a bias, batch 1 and 2, pixel counts off the vectors,
more input channels than a channel block, output channels off the register block); the graph after (no convolution:
one `pointwise_conv2d` of the input as it is, the weight [O, C], the bias or zeros, the ISA's lanes); numerics as near
float64 as torch's own float32 on two input sets; what the rules decline (a Dim on the sizes, a kxk kernel, groups,
stride, padding, float64, a 7x7 map); the executable's blocks; both ISAs' routes end to end on IREE
(the dispatch spliced and run: the masked last chunk, the channel blocks added to y, a strided 1x1 sliced first)
against float64. (Its speed: docs/performance.md, "A 1x1 convolution dispatch of our own".)
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeBackend, targets
from fx_rewrites.backends.iree.legality import SPLICED
from fx_rewrites.backends.iree.pointwise_conv_dispatch import (
    CHANNEL_BLOCK,
    MARK,
    POINTWISE_CONV2D,
    Shape,
    executable,
    splice,
)
from fx_rewrites.backends.iree.rules.pointwise_conv_dispatch import (
    MIN_PIXELS,
    batch_norm_into_pointwise_conv,
    pointwise_conv_as_dispatch,
    pointwise_conv_as_dispatch_avx512,
    relu_into_pointwise_conv,
)
from tests.backends.iree.rules.float32_error import assert_within_torch_error, in_float64

aten = torch.ops.aten
RULES = {8: pointwise_conv_as_dispatch, 16: pointwise_conv_as_dispatch_avx512}


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _conv(cin: int, cout: int, kernel: int = 1, bias: bool = True, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Conv2d(cin, cout, kernel, bias=bias, **kw).eval()


#: name -> (in channels, out channels, bias, input shape N, H, W)
CASES = {
    "bias_whole_chunks": (16, 24, True, (1, 12, 24)),  # 288 pixels: 3 chunks of 4 x 24 (AVX2) or of 96 (AVX-512)
    "no_bias_one_pixel_tail": (8, 16, False, (1, 17, 17)),  # 289: a last chunk of one pixel, its vector masked
    "channel_blocks_batch2": (160, 12, True, (2, 14, 15)),  # blocks of 64, 64 and 32 channels; 210 pixels
    "out_off_the_block": (12, 20, True, (1, 14, 14)),  # 20 outputs: blocks of 4 (AVX2), 5 (AVX-512)
    "prime_out": (8, 7, False, (1, 14, 15)),  # 7 outputs: blocks of 1 (AVX2), 7 (AVX-512)
    "two_part_tail": (16, 8, True, (1, 17, 19)),  # 323: AVX2's last chunk 35 pixels, parts of 3 and 2 vectors
}


def _case(name: str):
    cin, cout, bias, (n, h, w) = CASES[name]
    return _conv(cin, cout, bias=bias), [(_randn(0, n, cin, h, w),), (3.0 * _randn(1, n, cin, h, w),)]


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("name", list(CASES))
def test_pointwise_conv_as_dispatch(name, lanes):
    module, inputs = _case(name)
    rule = RULES[lanes]
    result = rt.apply_rules(rt.export(module, *inputs[0]), rule)
    rt.assert_fired(result, rule, times=1)
    rt.assert_ops(result, absent=[aten.conv2d.default, aten.convolution.default])
    (call,) = [node for node in rt.graph_module(result).graph.nodes if node.target is POINTWISE_CONV2D]
    x, w, b, call_lanes, relu = call.args
    assert x.op == "placeholder", "the input as it is"
    assert w.target is aten.reshape.default and list(w.meta["val"].shape) == list(module.weight.shape[:2])
    if module.bias is not None:
        assert b.op == "placeholder", "the bias as it is, added at the store"
    else:
        assert b.target is aten.zeros.default and b.meta["val"].shape == (module.out_channels,)
    assert call_lanes == lanes and relu == 0
    assert_within_torch_error(result.program.module(), in_float64(module), inputs)
    rt.assert_idempotent(result, rule)


class WeightIn(torch.nn.Module):
    def forward(self, x, w):
        return torch.nn.functional.conv2d(x, w)


def test_pointwise_conv_as_dispatch_declines():
    """A Dim on a spatial size or on the batch, a 3x3, two groups, stride 2 (`strided_pointwise_conv_as_slice`
    slices it first), padding, float64, fewer pixels than `MIN_PIXELS` (a 7x7 map); a weight passed in is taken
    (the kernel reads it as it is)."""
    rules = tuple(RULES.values())
    x = _randn(0, 1, 8, 16, 16)
    for dim in ({2: Dim("h", min=4, max=64)}, {0: Dim("batch", min=1, max=8)}):
        ep = rt.export(_conv(8, 8), _randn(0, 2, 8, 16, 16), dynamic_shapes=(dim,))
        result = rt.apply_rules(ep, *rules)
        for rule in rules:
            rt.assert_not_fired(result, rule)
    cases = [
        (_conv(8, 8, 3, padding=1), (x,)),
        (_conv(8, 8, groups=2), (x,)),
        (_conv(8, 8, stride=2), (x,)),
        (_conv(8, 8, padding=1), (x,)),
        (_conv(8, 8).double(), (x.double(),)),
    ]
    for m, args in cases:
        result = rt.apply_rules(rt.export(m, *args), *rules)
        for rule in rules:
            rt.assert_not_fired(result, rule)
    narrow = rt.apply_rules(rt.export(_conv(8, 8), _randn(0, 1, 8, 7, 7)), *rules)  # 49 pixels
    for rule in rules:
        rt.assert_not_fired(narrow, rule)
    assert MIN_PIXELS == 14 * 14
    rt.assert_fired(rt.apply_rules(rt.export(_conv(8, 8), _randn(0, 1, 8, 14, 14)), *rules), rules[0], times=1)
    taken = rt.apply_rules(rt.export(WeightIn(), x, _randn(1, 16, 8, 1, 1)), pointwise_conv_as_dispatch)
    rt.assert_fired(taken, pointwise_conv_as_dispatch, times=1)


def test_shape_and_executable():
    """The blocks: AVX2 4 outputs x 3 vectors of 8, AVX-512 4 x 6 of 16 (fewer where o or p is smaller); the chunks
    (AVX2's four blocks of pixels a 1x1, `PARTS`) and the last one's pixels; a masked vector only where the last
    chunk is partial; channel blocks: the first, a
    loop over the whole ones between, the last (with the ReLU); the op is named spliced; a module without a call is
    refused."""
    assert Shape(1, 256, 3136, 64, 8).block == (4, 3) and Shape(1, 256, 3136, 64, 16).block == (4, 6)
    assert Shape(1, 8, 49, 20, 16).block == (4, 4) and Shape(1, 8, 20, 6, 16).block == (3, 2)
    conv = Shape(1, 8, 113, 16, 16)
    assert (conv.chunk, conv.chunks, conv.tail) == (96, 2, 17)
    assert (Shape(1, 8, 323, 16, 8).chunk, Shape(1, 8, 323, 16, 8).tail) == (96, 35)
    assert Shape(1, 8, 20, 16, 8).chunk == 24 and Shape(1, 8, 90, 16, 8, taps=(0, 1), span=91).chunk == 24
    parts = executable(Shape(1, 8, 323, 16, 8))[1]
    assert parts.count("scf.for %fhp1k") == 1 and parts.count("scf.for %lhp1k") == 1, "parts, the last chunk's too"
    assert "vector.constant_mask [3] : vector<8xi1>" in parts and "%lhp2" not in parts
    name, text = executable(conv)
    assert name in text and "pwconv_1x8x113_o16_l16" in name
    assert "vector.constant_mask [1] : vector<16xi1>" in text and "vector.maskedstore" in text
    assert "vector.maskedload" in text and "scf.if %last" in text
    whole = executable(Shape(1, 8, 96, 16, 16))[1]
    assert "mask" not in whole and "scf.if" not in whole and "%kb" not in whole
    two, three = (executable(Shape(1, CHANNEL_BLOCK * k + 1, 96, 16, 16))[1] for k in (1, 2))
    assert "%fzacc" in two and "%fkb" not in two, "two blocks of channels: the first and the last, no loop"
    assert f"step %c{CHANNEL_BLOCK}w" in three and "%fkb" in three, "three: a loop over the whole ones between"
    relu = executable(Shape(1, CHANNEL_BLOCK * 2 + 1, 96, 16, 16, relu=True))
    assert relu[0].endswith("_relu") and relu[1].count("arith.maximumf") == 4 * 6, "in the last block's stores only"
    assert "arith.maximumf" not in three
    # a 1x1's blocks of channels but the last prefetch the next one's rows into L2 (both ISAs); one block or taps
    # prefetch none
    assert (two.count("memref.prefetch"), three.count("memref.prefetch"), whole.count("memref.prefetch")) == (1, 2, 0)
    assert "locality<2>" in two and f"%c{CHANNEL_BLOCK * 96}w" in two, "the next block's rows: 64 rows of 96 ahead"
    taps = Shape(1, CHANNEL_BLOCK * 2 + 1, 90, 16, 16, taps=(0, 1, 10), span=110)
    assert "memref.prefetch" not in executable(taps)[1]
    avx2 = executable(Shape(1, CHANNEL_BLOCK * 3, 96, 16, 8))[1]
    assert avx2.count("memref.prefetch") == 2 and f"%c{CHANNEL_BLOCK * 96}w" in avx2, "its first part's loop only"
    assert "fx_rewrites.pointwise_conv2d.default" in SPLICED
    with pytest.raises(ValueError, match=r"no pointwise_conv2d call"):
        splice("module {\n}")
    assert MARK == "torch.fx_rewrites.pointwise_conv2d"


#: through IREE: the cases above and a strided 1x1 (sliced to stride 1 by `strided_pointwise_conv_as_slice`)
IREE_CASES = [*CASES, "strided"]


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("name", IREE_CASES)
def test_pointwise_conv_as_dispatch_on_iree(name, isa):
    """The ISA's route (the code runs where the host has the ISA): the dispatch is spliced and run, and on two inputs (and 16 redraws of each for torch's error: the kernel sums its channels in
    blocks) the result is as near float64 as torch's float32, within a step."""
    if targets.host_isa() not in {"avx2": ("avx2", "avx512"), "avx512": ("avx512",)}[isa]:
        pytest.skip(f"llvm-cpu code for {isa} runs on an x86-64 host with {isa}")
    if name == "strided":
        module, inputs = _conv(24, 16, stride=2), [(_randn(0, 1, 24, 28, 30),), (3.0 * _randn(1, 1, 24, 28, 30),)]
    else:
        module, inputs = _case(name)
    rule = RULES[16 if isa == "avx512" else 8]
    iree = IreeBackend(target=targets.llvm_cpu(isa))
    assert rule.name in targets.CPU_ISAS[isa].perf_rules  # on for both (measured)
    result = fx_rewrites.apply(rt.export(module, *inputs[0]), iree.rules)
    rt.assert_fired(result, rule, times=1)
    fn = iree.compile(result.program, inputs[0])
    assert MARK in fn.mlir and "flow.dispatch @pwconv_" in splice(fn.mlir)
    assert_within_torch_error(fn, in_float64(module), inputs, redraws=16)


class ConvNormRelu(torch.nn.Module):
    """A ResNet layer's 1x1: convolution, batch norm with running statistics that are not the identity, ReLU."""

    def __init__(self, cin: int, cout: int, bias: bool = False, relu: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(cin, cout, 1, bias=bias)
        self.norm = torch.nn.BatchNorm2d(cout)
        self.relu = relu
        with torch.no_grad():
            self.norm.running_mean.uniform_(-0.5, 0.5)
            self.norm.running_var.uniform_(0.5, 2.0)
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)
        self.eval()

    def forward(self, x):
        y = self.norm(self.conv(x))
        return torch.relu(y) if self.relu else y


FOLDS = {  # name -> (in, out, conv bias, relu, input N, H, W): the last ReLU'd over one and over three channel blocks
    "norm_relu": (16, 24, False, True, (1, 17, 17)),
    "norm_no_relu_conv_bias": (12, 20, True, False, (2, 14, 15)),
    "norm_relu_three_channel_blocks": (CHANNEL_BLOCK * 2 + 8, 16, False, True, (1, 14, 14)),
}


def _fold_case(name: str):
    cin, cout, bias, relu, (n, h, w) = FOLDS[name]
    module = ConvNormRelu(cin, cout, bias, relu)
    return module, [(_randn(0, n, cin, h, w),), (3.0 * _randn(1, n, cin, h, w),)]


@pytest.mark.parametrize("name", list(FOLDS))
def test_batch_norm_and_relu_into_pointwise_conv(name):
    """The batch norm folded into the weight and bias (computed from the program's own values), the ReLU into the
    call's last store: one `pointwise_conv2d`, no batch norm or ReLU left; as near float64 as torch's float32."""
    module, inputs = _fold_case(name)
    rules = (pointwise_conv_as_dispatch, batch_norm_into_pointwise_conv, relu_into_pointwise_conv)
    result = rt.apply_rules(rt.export(module, *inputs[0]), *rules)
    rt.assert_fired(result, batch_norm_into_pointwise_conv, times=1)
    if module.relu:
        rt.assert_fired(result, relu_into_pointwise_conv, times=1)
    rt.assert_ops(result, absent=[aten.batch_norm.default, aten.relu.default, aten.conv2d.default])
    (call,) = [node for node in rt.graph_module(result).graph.nodes if node.target is POINTWISE_CONV2D]
    assert call.args[4] == int(module.relu)
    assert_within_torch_error(result.program.module(), in_float64(module), inputs, redraws=16)
    rt.assert_idempotent(result, *rules)


class NormTwice(torch.nn.Module):
    """The convolution's output used by the batch norm and by the sum after it: not folded."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = ConvNormRelu(8, 8, relu=False)

    def forward(self, x):
        y = self.inner.conv(x)
        return torch.relu(self.inner.norm(y)) + y


def test_folds_decline():
    """A convolution output with another user keeps its batch norm and ReLU; a batch norm in training mode is not
    folded."""
    rules = (pointwise_conv_as_dispatch, batch_norm_into_pointwise_conv, relu_into_pointwise_conv)
    x = _randn(0, 1, 8, 14, 14)
    result = rt.apply_rules(rt.export(NormTwice().eval(), x), *rules)
    rt.assert_fired(result, pointwise_conv_as_dispatch, times=1)
    rt.assert_not_fired(result, batch_norm_into_pointwise_conv)
    rt.assert_not_fired(result, relu_into_pointwise_conv)
    training = torch.export.export(ConvNormRelu(8, 8).train(), (x,))  # batch_norm(..., training=True, ...)
    result = rt.apply_rules(training, *rules)
    rt.assert_fired(result, pointwise_conv_as_dispatch, times=1)
    rt.assert_not_fired(result, batch_norm_into_pointwise_conv)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("name", list(FOLDS))
def test_folded_pointwise_conv_on_iree(name, isa):
    """The folded call through IREE: the ReLU in the kernel's last store, over one and three channel blocks."""
    if targets.host_isa() not in {"avx2": ("avx2", "avx512"), "avx512": ("avx512",)}[isa]:
        pytest.skip(f"llvm-cpu code for {isa} runs on an x86-64 host with {isa}")
    module, inputs = _fold_case(name)
    rules = (RULES[16 if isa == "avx512" else 8], batch_norm_into_pointwise_conv, relu_into_pointwise_conv)
    first = rt.apply_rules(rt.export(module, *inputs[0]), *rules)
    rt.assert_fired(first, batch_norm_into_pointwise_conv, times=1)
    iree = IreeBackend(target=targets.llvm_cpu(isa))
    fn = iree.compile(fx_rewrites.apply(first.program, iree.rules).program, inputs[0])
    assert ("_relu" in splice(fn.mlir)) == module.relu
    assert_within_torch_error(fn, in_float64(module), inputs, redraws=16)
