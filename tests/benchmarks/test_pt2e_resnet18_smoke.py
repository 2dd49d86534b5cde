"""benchmarks/pt2e_resnet18.py: the untied ReLUs compute what torchvision's ResNet-18 computes and let torchao's X86
quantizer annotate it (it refuses torchvision's shared ReLU); the script prints a row per route (no timings are
asserted: the machine is shared)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao.quantization", reason="torchao is not installed (pip install -e '.[test]' installs it)")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pt2e_resnet18.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import pt2e_resnet18

        yield pt2e_resnet18
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_untied_relus_keep_the_numbers_and_the_x86_quantizer_takes_the_model(bench) -> None:
    import torchvision  # installed (and made importable on CPU torch) by bench.resnet18()

    model = bench.resnet18()
    torch.manual_seed(0)
    tied = torchvision.models.resnet18(weights=None).eval()  # the same seeded weights, torchvision's forward
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x), tied(x))
    assert sum(isinstance(m, torch.nn.ReLU) for m in model.modules()) == 17  # the stem's, two in each of 8 blocks
    quantized = bench.pt2e_quantize(model, x, batches=1)
    targets = {str(n.target) for n in quantized.graph.nodes if n.op == "call_function"}
    assert "quantized_decomposed.dequantize_per_channel.default" in targets, targets


@pytest.mark.slow
def test_script_prints_every_route() -> None:
    """The routes asserted, no others: `IREE, dq conv` (a third IREE compile of the model, about a quarter of this
    test's CPU; its row was never asserted) and Inductor are left out. PT2E convs on IREE against the quantized
    eager model are tests/test_pt2e.py's and tests/backends/iree/rules/test_quantized_conv.py's."""
    argv = [sys.executable, str(SCRIPT), "--rounds", "1", "--no-inductor", "--routes", "IREE float", "IREE"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = {line.split(" | ")[0][2:]: line for line in done.stdout.splitlines() if line.startswith("| ")}
    for route in ("float eager", "PT2E eager", "IREE float", "IREE"):
        assert route in rows and rows[route].split(" | ")[1].replace(".", "").isdigit(), (route, done.stdout)
