"""benchmarks/conv_classes.py runs one op and its table names the rule that fired; benchmarks/scale_cnn.py's
table renders a row. No timings are asserted (the machine is shared); ResNet-50 itself is not compiled here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def modules():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import conv_classes
        import scale_cnn

        yield conv_classes, scale_cnn
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_conv_classes_one_op(modules, capsys):
    conv_classes, _ = modules
    assert conv_classes.main(["--cases", "g8", "--rounds", "1", "--no-inductor"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| grouped"))
    assert "grouped_conv_as_convs" in row and "not close" not in out, out


def test_scale_cnn_table(modules):
    _, scale_cnn = modules
    ms = {"median": 10.0, "min": 9.0, "max": 11.0}
    row = {
        "parameters": 23.5e6,
        "steps_s": {"export": 1.0},
        "peak_gb": 0.7,
        "rounds": 3,
        "ms": {"eager": ms, "Inductor": ms, "export route": {"median": 5.0, "min": 4.0, "max": 6.0}},
        "max_abs_diff": {"eager": 0.0, "Inductor": 1e-4, "export route": 2e-4},
        "float32_error": {"eager": 1e-4, "Inductor": 1e-4, "export route": 2e-4},
        "output_scale": 255.0,
    }
    text = scale_cnn.cnn_table(row, "a CPU")
    assert "| export route | 5.0 | 4.0-6.0 | 0.50 | 0.50 | 2.0e-04 | 2.0e-04 |" in text, text
