"""PT2E int8 convs as im2col + `aten._int_mm` (backends/iree/rules/quantized_conv.py, issue 33).

Before-graphs: one `Conv2d` of ResNet-18's forms (3x3 pad 1, 3x3 stride 2, 1x1 stride 2, the 7x7 stride-2 stem
on 3 channels) through torchao's PT2E flow (`prepare_pt2e` / `convert_pt2e`, X86 quantizer: uint8 activation
per tensor with a zero point, int8 weight per channel, symmetric) and `torch.export`, static and with a Dim on
the batch and the height. After DEFAULT + the rule: one `_int_mm`, no convolution, no float copy of the weight.

How the numbers are bounded: the int32 sum the rule computes (`_int_mm` plus the zero points' terms, the value
converted to float32) must equal, exactly, the float64 convolution of (x_q - z_a) and (w_q - z_w), the integers
of the dequantized operands (exact in float64: every sum is below 2^31). The float output is that sum times
s_a s_w[c] plus the bias, rounded to float32; against the same computation in float64 it may be off by no more
than torch's own float32 conv of the dequantized operands is (the converted PT2E model run by torch), or 2 float32
ulps of the largest output where torch happens to be closer. Then through IREE (the Dim cases): the same bound.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx import Interpreter, Node

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.rules import DEFAULT

pytest.importorskip("torchao.quantization", reason="torchao is not installed (pip install -e '.[test]' installs it)")
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
    X86InductorQuantizer,
    get_default_x86_inductor_quantization_config,
)

from fx_rewrites.backends.iree.rules.quantized_conv import quantized_conv_as_int_mm_for_iree

aten = torch.ops.aten
quantized_decomposed = torch.ops.quantized_decomposed

#: (in channels, out channels, kernel, stride, padding): ResNet-18's conv forms, small
CONVS = {
    "3x3": (8, 16, 3, 1, 1),
    "3x3-stride2": (8, 16, 3, 2, 1),
    "1x1-stride2": (8, 16, 1, 2, 0),
    "7x7-stem": (3, 8, 7, 2, 3),
}


def _images(batch: int, channels: int, height: int, seed: int) -> torch.Tensor:
    """[batch, channels, height, 16] (the Dim cases vary the height)."""
    return 2 * torch.randn(batch, channels, height, 16, generator=torch.Generator().manual_seed(seed))


def _pt2e_conv(form: str, shapes) -> tuple[torch.nn.Module, torch.export.ExportedProgram]:
    """The conv, seeded, quantized by PT2E (3 calibration batches), and its export."""
    channels, out, kernel, stride, padding = CONVS[form]
    torch.manual_seed(0)
    model = torch.nn.Conv2d(channels, out, kernel, stride=stride, padding=padding).eval()
    example = _images(2, channels, 16, 0)
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(torch.export.export(model, (example,), dynamic_shapes=shapes).module(), quantizer)
    with torch.no_grad():
        for seed in range(3):
            prepared(_images(2, channels, 16, 10 + seed))
    quantized = convert_pt2e(prepared)
    return quantized, torch.export.export(quantized, (example,), dynamic_shapes=shapes)


def _pt2e_parameters(quantized: torch.nn.Module) -> dict:
    """The converted model's conv: activation scale / zero point, int8 weight, its scales and zero points, bias,
    read from torch's own graph."""
    (conv,) = [n for n in quantized.graph.nodes if n.target is aten.conv2d.default]
    activation, weight, bias = conv.args[:3]
    assert activation.target is quantized_decomposed.dequantize_per_tensor.default
    assert weight.target is quantized_decomposed.dequantize_per_channel.default
    w, scales, zeros = (getattr(quantized, n.target) for n in weight.args[:3])
    assert w.dtype == torch.int8 and not zeros.any(), "X86's default weights: int8, symmetric per channel"
    assert activation.args[5] == torch.uint8 and activation.args[2] != 0, "uint8 activations with a zero point"
    return {
        "scale": activation.args[1],
        "zero": activation.args[2],
        "weight": w,
        "weight_scale": scales,
        "weight_zero": zeros,
        "bias": getattr(quantized, bias.target),
    }


class _Record(Interpreter):
    """Runs a graph module and keeps every node's value. Its `aten._int_mm` is the exact int64 product cast to
    int32: torch's own kernel overflows where oneDNN runs without VNNI on a host torch sees with AVX-512 VNNI
    (pytorch#136746: with `ONEDNN_MAX_CPU_ISA=AVX2`; the README's simulation says `AVX2_VNNI`), and the rule is checked here,
    not torch's kernel (IREE's product is checked against the float64 reference below)."""

    def call_function(self, target, args, kwargs):
        if target is aten._int_mm.default:
            a, b = args
            return (a.long() @ b.long()).to(torch.int32)
        return super().call_function(target, args, kwargs)

    def run_node(self, n: Node):
        value = super().run_node(n)
        self.values[n] = value
        return value


def _run_recorded(gm: torch.fx.GraphModule, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    recorder = _Record(gm)
    recorder.values = {}
    with torch.no_grad():
        out = recorder.run(x)
    return out[0] if isinstance(out, (tuple, list)) else out, recorder.values


def _upstream(node: Node, dtype: torch.dtype) -> Node:
    """The nearest node above `node` (breadth first through its tensor arguments) whose value is `dtype`."""
    frontier = [node]
    while frontier:
        node = frontier.pop(0)
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.dtype == dtype:
            return node
        frontier.extend(a for a in node.all_input_nodes)
    raise AssertionError(f"no {dtype} value above the node")


@pytest.mark.parametrize("form", sorted(CONVS))
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_pt2e_conv_becomes_an_int_mm_with_exact_integer_sums(form: str, dynamic: bool) -> None:
    channels = CONVS[form][0]
    shapes = (
        {"input": {0: torch.export.Dim("batch", min=1, max=8), 2: torch.export.Dim("height", min=8, max=32)}}
        if dynamic
        else None
    )
    quantized, program = _pt2e_conv(form, shapes)
    pt2e = _pt2e_parameters(quantized)

    result = rt.apply_rules(program, DEFAULT + quantized_conv_as_int_mm_for_iree)
    rt.assert_fired(result, quantized_conv_as_int_mm_for_iree, times=1)
    rt.assert_ops(result, present=[aten._int_mm.default], absent=[aten.conv2d.default, aten.convolution.default])
    gm = result.program.module()
    weight_shape = tuple(pt2e["weight"].shape)
    matrix_shapes = (
        weight_shape,
        (weight_shape[0], pt2e["weight"][0].numel()),
        (pt2e["weight"][0].numel(), weight_shape[0]),
    )
    floats = [
        n
        for n in gm.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor)
        and n.meta["val"].dtype.is_floating_point
        and tuple(n.meta["val"].shape) in matrix_shapes
    ]
    assert not floats, floats  # the weight is read as int8 only: no float32 copy of it
    (int_mm,) = [n for n in gm.graph.nodes if n.target is aten._int_mm.default]
    (to_float,) = [
        n
        for n in gm.graph.nodes
        if n.target is aten._to_copy.default
        and n.meta["val"].dtype == torch.float32
        and n.args[0].meta["val"].dtype == torch.int32
    ]

    sizes = ((2, 16), (5, 21) if dynamic else (2, 16))
    for seed, (batch, size) in enumerate(sizes):
        x = _images(batch, channels, size, 100 + seed)
        with torch.no_grad():
            expected = quantized(x)  # torch's own run of the converted PT2E model
        got, values = _run_recorded(gm, x)
        x_q = values[_upstream(int_mm, torch.uint8)]
        assert torch.equal(
            x_q, quantized_decomposed.quantize_per_tensor(x, pt2e["scale"], pt2e["zero"], 0, 255, torch.uint8)
        )

        # the integers, exactly: the float64 conv of the dequantized operands' integers
        conv = dict(stride=CONVS[form][3], padding=CONVS[form][4])
        integers = torch.nn.functional.conv2d(
            x_q.double() - pt2e["zero"],
            (pt2e["weight"].double() - pt2e["weight_zero"].double()[:, None, None, None]),
            **conv,
        )
        acc = values[to_float.args[0]]
        assert acc.dtype == torch.int32 and acc.shape[0] == integers[:, 0].numel()
        n, o, h, w = integers.shape
        assert torch.equal(acc.double().view(n, h, w, o).permute(0, 3, 1, 2), integers)
        assert integers.abs().max() > 1000  # sums of many products, not a degenerate case

        # the float result, against the same arithmetic in float64, within torch's own float32 error
        scales = pt2e["scale"] * pt2e["weight_scale"].double()
        reference = integers * scales[:, None, None] + pt2e["bias"].double()[:, None, None]
        assert got.shape == expected.shape == reference.shape
        torch_error = (expected.double() - reference).abs().max().item()
        ulp = torch.finfo(torch.float32).eps * reference.abs().max().item()
        bound = max(torch_error, 2 * ulp)
        error = (got.double() - reference).abs().max().item()
        assert error <= bound, (error, torch_error, ulp)

        if dynamic and seed == 1:  # through IREE, the second input set only (another batch and height)
            compiled = fx_rewrites.compile(program, (_images(2, channels, 16, 0),))
            iree_error = (compiled(x).double() - reference).abs().max().item()
            assert iree_error <= bound, (iree_error, torch_error, ulp)
