"""PT2E static int8 CNNs (issue 33): torchao's `prepare_pt2e` / `convert_pt2e` with the X86 quantizer, exported,
through `fx_rewrites.compile` on IREE, against the quantized model run by torch.

The converted graph holds `quantized_decomposed` ops (uint8 activations per tensor, int8 weights per channel)
around float convs, a residual add, ReLUs and max pools, as a PT2E ResNet does (benchmarks/pt2e_resnet18.py
measures the whole ResNet-18). The net ends in a max pool, whose output the quantizer quantizes, so the output
lies on a grid of known step (the last dequantize's scale): the compiled model must give the quantized eager
model's numbers to within one step of it, a quantize rounding the other way at a tie where IREE's float
convolution sums in another order than oneDNN's. On torch 2.13 / IREE 3.13 (AVX-512) these inputs come out
equal bit for bit; the test also bounds how many elements may differ at all.

PT2E's quantize ops run as torch's own kernels (rewrites/rules/quantized.py: `lower_quantized_decomposed_ops`);
IREE's own lowering of them rounds `x / scale`, 3 values in a million off torch's `x * (1 / scale)`, and fails on a
scale that is not a float32 value (`test_quantize_per_tensor_is_torchs_bit_for_bit`).

Three small IREE compiles (static, a Dim on the batch, one quantize).
"""

from __future__ import annotations

import pytest
import torch

import fx_rewrites

pytest.importorskip("torchao.quantization", reason="torchao is not installed (pip install -e '.[test]' installs it)")
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
    X86InductorQuantizer,
    get_default_x86_inductor_quantization_config,
)

quantized_decomposed = torch.ops.quantized_decomposed


class ResidualNet(torch.nn.Module):
    """A ResNet stem and basic block in small: conv-bn-relu-maxpool, two convs and a residual add, a 1x1 conv,
    ReLU and max pool (each ReLU its own module: the X86 quantizer refuses a module called twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn, self.relu = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()
        self.pool = torch.nn.MaxPool2d(2)
        self.conv1, self.relu1 = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU()
        self.conv2, self.relu2 = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU()
        self.head, self.relu3, self.pool_out = torch.nn.Conv2d(8, 4, 1), torch.nn.ReLU(), torch.nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.bn(self.stem(x))))
        x = self.relu2(self.conv2(self.relu1(self.conv1(x))) + x)
        return self.pool_out(self.relu3(self.head(x)))


def images(batch: int, seed: int) -> torch.Tensor:
    return 2 * torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def pt2e_residual_net(dynamic_shapes=None) -> torch.nn.Module:
    """`ResidualNet`, seeded, through torchao's PT2E flow (X86 quantizer, 3 calibration batches)."""
    torch.manual_seed(0)
    model = ResidualNet().eval()
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(
        torch.export.export(model, (images(2, 0),), dynamic_shapes=dynamic_shapes).module(), quantizer
    )
    with torch.no_grad():
        for seed in range(3):  # calibration
            prepared(images(2, 10 + seed))
    return convert_pt2e(prepared)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_pt2e_conv_net_compiles_and_matches_the_quantized_eager_model(dynamic: bool) -> None:
    shapes = {"x": {0: torch.export.Dim("batch", min=1, max=8)}} if dynamic else None
    quantized = pt2e_residual_net(shapes)
    program = torch.export.export(quantized, (images(2, 0),), dynamic_shapes=shapes)
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    targets = {n.target for n in calls}
    assert {  # what PT2E's convert leaves: the form this test is about
        quantized_decomposed.quantize_per_tensor.default,
        quantized_decomposed.dequantize_per_tensor.default,
        quantized_decomposed.dequantize_per_channel.default,
    } <= targets, targets
    last = calls[-1]
    assert last.target is quantized_decomposed.dequantize_per_tensor.default  # the output lies on a grid
    step = last.args[1]

    compiled = fx_rewrites.compile(program, (images(2, 0),))
    for batch, seed in ((2, 1), (5, 2) if dynamic else (2, 3)):
        x = images(batch, seed)
        with torch.no_grad():
            expected, got = quantized(x), compiled(x)
        assert got.shape == expected.shape
        assert expected.abs().max() > 10 * step  # a varied output, not all zeros after the ReLUs
        diff = (got - expected).abs()
        # one quantization step where a quantize rounds the other way at a tie; no more, and rarely
        assert diff.max().item() <= step * (1 + 1e-5), (diff.max().item(), step)
        assert (diff > 0).float().mean().item() <= 0.02, (diff > 0).sum().item()


@pytest.mark.parametrize("scale", [float(torch.tensor(0.02)), 0.02], ids=["float32-scale", "float64-scale"])
def test_quantize_per_tensor_is_torchs_bit_for_bit(scale: float) -> None:
    class Quantize(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return quantized_decomposed.quantize_per_tensor(x, scale, 3, 0, 255, torch.uint8)

    x = 5 * torch.rand(1 << 20, generator=torch.Generator().manual_seed(0))
    # values whose x * (1 / scale) is a tie in float32 where x / scale is not: 4.09 / 0.02 -> torch's 204 + 3
    x[:2] = torch.tensor([4.09, 2.35])
    compiled = fx_rewrites.compile(torch.export.export(Quantize(), (x,)), (x,))
    got, expected = compiled(x), Quantize()(x)
    assert got.dtype == torch.uint8 and expected[0].item() == 207
    assert torch.equal(got, expected), (got != expected).sum().item()
