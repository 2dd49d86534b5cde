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
    for side in ("n = 8 (short side): dispatched", "n = 48 (long side): dispatched"):
        assert side in out and "cond_to_where" in out, out


@pytest.mark.slow
def test_dynamo_route_prints_the_linear_row():
    out = _run("dynamo_route.py", "--cases", "linear", "--repeat", "1")
    assert "linear" in out and "CPU" in out, out
