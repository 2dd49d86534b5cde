"""benchmarks/size_dispatch.py and dynamo_route.py run one round on their small cases and print their tables
(no timings are asserted: the machine is shared)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_size_dispatch_prints_both_sides():
    out = _run("size_dispatch.py", "--rounds", "1")
    assert "CPU: " in out
    for line in (
        "matmul: compiled as a size dispatch",
        "matmul, n = 8 (short side): dispatched",
        "matmul, n = 48 (long side): dispatched",
        "elementwise: compiled as a size dispatch",  # issue 36: both branches element-wise, one long
        "elementwise, n = 64 (short side): dispatched",
        "elementwise, n = 640 (long side): dispatched",
        "elementwise: one element op",
    ):
        assert line in out, out
    assert out.count("cond_to_where") == 4, out


@pytest.mark.slow
def test_dynamo_route_prints_the_linear_row():
    out = _run("dynamo_route.py", "--cases", "linear", "--repeat", "1")
    assert "linear" in out and "CPU" in out, out
