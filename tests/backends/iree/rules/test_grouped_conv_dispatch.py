"""`depthwise_conv_as_dispatch` and `grouped_conv_as_dispatch` (backends/iree/rules/grouped_conv_dispatch.py) and
their kernel (backends/iree/grouped_conv_dispatch.py).

Real torch 2.13 exports of depthwise convolutions (3x3, 5x5, 7x7; stride 1 and 2; padded or not, with and without a
bias, batch 1 and 2; widths off 8) and grouped ones (2 to 8 input channels a group, more outputs than inputs); the
graph after (no convolution: one `grouped_conv2d` of the input and weight as they are, the bias added after);
numerics as near float64 as torch's own float32 on two input sets; what each declines (a Dim on the sizes, stride 3,
dilation, too narrow a width, the other rule's convolutions, too wide a group, float64); the executable's register
blocks; both ISAs' routes end to end on IREE (the dispatch spliced and run: the padding read inside the kernel, edge
blocks, a row of two column blocks, the loop over a group's channels) against float64. (Its speed:
docs/performance.md, "A depthwise convolution dispatch of our own".)
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeBackend, targets
from fx_rewrites.backends.iree.grouped_conv_dispatch import GROUPED_CONV2D, MARK, Shape, block, executable, splice
from fx_rewrites.backends.iree.legality import SPLICED
from fx_rewrites.backends.iree.rules.grouped_conv_dispatch import (
    conv_as_direct_dispatch,
    depthwise_conv_as_dispatch,
    grouped_conv_as_dispatch,
)
from tests.backends.iree.rules.float32_error import assert_within_torch_error, in_float64

aten = torch.ops.aten
RULES = (depthwise_conv_as_dispatch, grouped_conv_as_dispatch, conv_as_direct_dispatch)


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _conv(
    cin: int,
    cout: int,
    groups: int,
    kernel: int,
    padding: int | tuple[int, int],
    bias: bool = True,
    stride: int = 1,
    **kw,
) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Conv2d(cin, cout, kernel, stride, padding=padding, groups=groups, bias=bias, **kw).eval()


#: name -> (in channels, out channels, groups, kernel, padding, bias, input shape N, H, W, stride)
CASES = {
    "dw_3x3_same": (16, 16, 16, 3, 1, True, (1, 24, 16), 1),
    "dw_7x7_same_batch2": (8, 8, 8, 7, 3, False, (2, 20, 24), 1),
    "dw_5x5_valid": (8, 8, 8, 5, 0, True, (1, 12, 20), 1),
    "dw_3x3_rows_only": (8, 8, 8, 3, (1, 0), True, (1, 9, 10), 1),
    "dw_7x7_width_14": (8, 8, 8, 7, 3, True, (1, 14, 14), 1),
    "dw_3x3_width_28": (8, 8, 8, 3, 1, False, (1, 6, 28), 1),
    "dw_3x3_stride2": (8, 8, 8, 3, 1, True, (1, 15, 34), 2),
    "dw_5x5_stride2_batch2": (4, 4, 4, 5, 2, False, (2, 16, 32), 2),
    "g4_3x3_same": (16, 16, 4, 3, 1, True, (1, 10, 16), 1),
    "g2_3x3_stride2_wider_out": (8, 16, 2, 3, 1, False, (2, 12, 20), 2),
    "g8_5x5_channels_2": (16, 24, 8, 5, 2, True, (1, 5, 9), 1),
    "dense_3x3": (6, 16, 1, 3, 1, True, (1, 10, 12), 1),
}


def _case(name: str):
    cin, cout, groups, kernel, padding, bias, shape, stride = CASES[name]
    module = _conv(cin, cout, groups, kernel, padding, bias, stride)
    n, h, w = shape
    inputs = [(_randn(0, n, cin, h, w),), (3.0 * _randn(1, n, cin, h, w),)]
    if groups == 1:
        return module, inputs, conv_as_direct_dispatch
    return module, inputs, depthwise_conv_as_dispatch if groups == cin == cout else grouped_conv_as_dispatch


@pytest.mark.parametrize("name", list(CASES))
def test_conv_as_dispatch(name):
    module, inputs, rule = _case(name)
    result = rt.apply_rules(rt.export(module, *inputs[0]), *RULES)
    rt.assert_fired(result, rule, times=1)
    rt.assert_ops(result, absent=[aten.conv2d.default, aten.convolution.default, aten.constant_pad_nd.default])
    (call,) = [node for node in rt.graph_module(result).graph.nodes if node.target is GROUPED_CONV2D]
    x, w, ph, pw, sh, sw = call.args
    assert x.op == "placeholder", "the input as it is: the padding is read inside the kernel"
    assert w.op == "placeholder", "the weight as it is, [O, C / groups, kh, kw]"
    padding, stride = CASES[name][4], CASES[name][7]
    assert (ph, pw) == (padding if isinstance(padding, tuple) else (padding, padding)) and (sh, sw) == (stride, stride)
    adds = [node for node in rt.graph_module(result).graph.nodes if node.target is aten.add.Tensor]
    bias = CASES[name][5]
    assert len(adds) == int(bias) and (not bias or adds[0].args[0] is call), "the bias added after"
    assert_within_torch_error(result.program.module(), in_float64(module), inputs)
    rt.assert_idempotent(result, rule)


class WeightIn(torch.nn.Module):
    def forward(self, x, w):
        return torch.nn.functional.conv2d(x, w, padding=1, groups=w.shape[0])


def test_conv_as_dispatch_declines():
    """A Dim on the sizes (a spatial one, the batch), stride 3, dilation 2, an output under 8 wide, an input under 16 wide at stride 2, a 1x1,
    a strided dense 3x3, 64 input channels a group, a grouped 1x1, float64, by the three rules; each declines the
    others'; a weight passed in is taken (the kernel reads it as it is)."""
    both = RULES
    x = _randn(0, 1, 8, 16, 16)
    for dim in ({2: Dim("h", min=4, max=64)}, {0: Dim("batch", min=1, max=8)}):
        ep = rt.export(_conv(8, 8, 8, 3, 1), _randn(0, 2, 8, 16, 16), dynamic_shapes=(dim,))
        result = rt.apply_rules(ep, *both)
        for rule in both:
            rt.assert_not_fired(result, rule)
    cases = [
        (_conv(8, 8, 8, 3, 1, stride=3), (_randn(0, 1, 8, 32, 32),)),
        (_conv(8, 8, 4, 3, 2, dilation=2), (x,)),
        (_conv(8, 8, 8, 3, 1), (_randn(0, 1, 8, 16, 7),)),
        (_conv(8, 8, 2, 3, 1, stride=2), (_randn(0, 1, 8, 32, 15),)),
        (_conv(8, 8, 1, 1, 0), (x,)),
        (_conv(8, 8, 1, 3, 1, stride=2), (_randn(0, 1, 8, 32, 32),)),
        (_conv(128, 128, 2, 3, 1), (_randn(0, 1, 128, 8, 8),)),
        (_conv(16, 16, 8, 1, 0), (_randn(0, 1, 16, 8, 8),)),
        (_conv(8, 8, 8, 3, 1).double(), (x.double(),)),
    ]
    for m, args in cases:
        result = rt.apply_rules(rt.export(m, *args), *both)
        for rule in both:
            rt.assert_not_fired(result, rule)
    for module, rule in (
        (_conv(8, 8, 8, 3, 1), depthwise_conv_as_dispatch),
        (_conv(8, 8, 4, 3, 1), grouped_conv_as_dispatch),
        (_conv(8, 8, 1, 3, 1), conv_as_direct_dispatch),
    ):
        result = rt.apply_rules(rt.export(module, x), *RULES)
        rt.assert_fired(result, rule, times=1)
        for other in RULES:
            if other is not rule:
                rt.assert_not_fired(result, other)
    taken = rt.apply_rules(rt.export(WeightIn(), x, _randn(1, 8, 1, 3, 3)), depthwise_conv_as_dispatch)
    rt.assert_fired(taken, depthwise_conv_as_dispatch, times=1)


def test_block_and_executable():
    """The register blocks: a row of 56 as 7 vectors by 2 rows; 112 as two blocks of 7; 28 as 4 vectors, the last
    overlapping the third; 14 as 2 overlapping by 2, 7 rows. The executable is named by its shape, strided loads are
    16 wide, a group of channels is a loop; the op is named spliced; a module without a call is refused."""
    assert block(56, 56) == (2, [list(range(0, 56, 8))])
    assert block(112, 112) == (2, [list(range(0, 56, 8)), list(range(56, 112, 8))])
    assert block(28, 28) == (2, [[0, 8, 16, 20]]) and block(14, 14) == (7, [[0, 6]])
    name, text = executable(Shape(1, 8, 20, 24, 8, 1, 7, 7, 3, 3, 1, 1))
    assert name in text and "vector.fma" in text and "vector.shuffle" in text and "scf.for %" in text
    assert "1x8x20x24_o8x1_k7x7_p3x3_s1x1" in name and "iter_args" not in text
    assert "vector<16xf32>" in executable(Shape(1, 8, 20, 32, 8, 1, 3, 3, 1, 1, 2, 2))[1], "stride 2: 16 columns"
    assert "iter_args" in executable(Shape(1, 8, 20, 32, 8, 4, 3, 3, 1, 1, 1, 1))[1], "a group's channels: a loop"
    assert "fx_rewrites.grouped_conv2d.default" in SPLICED
    with pytest.raises(ValueError, match=r"no grouped_conv2d call"):
        splice("module {\n}")
    assert MARK == "torch.fx_rewrites.grouped_conv2d"


#: through IREE: the cases above and a width of two column blocks (112: 14 vectors, 7 a block)
CASES["dw_3x3_two_column_blocks"] = (4, 4, 4, 3, 1, True, (1, 6, 112), 1)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("name", list(CASES))
def test_conv_as_dispatch_on_iree(name, isa):
    """Through each ISA's route (the code runs where the host has the ISA): the rule fires, the dispatch is spliced
    and run, and on two inputs the result is as near float64 as torch's float32, within a step."""
    if targets.host_isa() not in {"avx2": ("avx2", "avx512"), "avx512": ("avx512",)}[isa]:
        pytest.skip(f"llvm-cpu code for {isa} runs on an x86-64 host with {isa}")
    module, inputs, rule = _case(name)
    iree = IreeBackend(target=targets.llvm_cpu(isa))
    ep = rt.export(module, *inputs[0])
    if rule.name not in targets.CPU_ISAS[isa].perf_rules:  # a rule on for no ISA (conv_as_direct_dispatch): first
        assert rule is conv_as_direct_dispatch
        first = rt.apply_rules(ep, rule)
        rt.assert_fired(first, rule, times=1)
        result = fx_rewrites.apply(first.program, iree.rules)
    else:
        result = fx_rewrites.apply(ep, iree.rules)
        rt.assert_fired(result, rule, times=1)
    fn = iree.compile(result.program, inputs[0])
    assert_within_torch_error(fn, in_float64(module), inputs)


def test_splice_takes_an_operand_of_a_multi_result_op():
    """An input that is one result of an op with several (`%35#1`: a batch norm's output in FocalNet) is spliced."""
    call = (
        '    %37 = torch.operator "torch.fx_rewrites.grouped_conv2d"(%35#1, %36, %int1, %int1, %int1, %int1) : '
        "(!torch.vtensor<[2,16,8,8],f32>, !torch.vtensor<[16,1,3,3],f32>, !torch.int, !torch.int, !torch.int, "
        "!torch.int) -> !torch.vtensor<[2,16,8,8],f32>"
    )
    mlir = splice("\n".join(["module {", "    %int1 = torch.constant.int 1", call, "}"]))
    assert "torch_c.to_builtin_tensor %35#1" in mlir and "flow.dispatch @gconv_2x16x8x8_o16x1_k3x3_p1x1_s1x1" in mlir


def test_a_dim_batch_keeps_the_route_working_on_iree():
    """With a Dim on the batch the dispatch is not written (static workgroups) and the host's route compiles the
    depthwise convolution by its other forms, matching eager on two batch sizes."""
    if targets.host_isa() == "":
        pytest.skip("llvm-cpu code for AVX2 or AVX-512 needs an x86-64 host with one")
    module = _conv(8, 8, 8, 3, 1)
    inputs = [(_randn(0, 2, 8, 16, 16),), (3.0 * _randn(1, 5, 8, 16, 16),)]
    iree = IreeBackend(target=targets.llvm_cpu(targets.host_isa()))
    ep = rt.export(module, *inputs[0], dynamic_shapes=({0: Dim("batch", min=1, max=8)},))
    result = fx_rewrites.apply(ep, iree.rules)
    rt.assert_not_fired(result, depthwise_conv_as_dispatch)
    fn = iree.compile(result.program, inputs[0])
    assert_within_torch_error(fn, in_float64(module), inputs)
