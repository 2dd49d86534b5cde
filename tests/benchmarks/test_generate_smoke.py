"""benchmarks/generate.py runs its routes on a tiny Llama (prompt 8, 4 new tokens, one round, one thread) and prints
its table; every route that runs generates eager's tokens (no timings are asserted: the machine is shared).

The `iree compile_lm` route is left out (`--routes`): its two compiles (float32, int8) were a third of this test's
CPU and its row was never asserted; compile_lm's tokens against `generate` are tests/test_lm_architectures.py's and
tests/test_lm.py's, its int8 weight-only model tests/test_quantized_artifact.py's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "generate.py"
#: the routes run and asserted
ROUTES = ("eager dynamic", "eager static", "inductor static", "iree export+loop")


@pytest.mark.slow
def test_generate_prints_every_route_with_eager_tokens():
    pytest.importorskip("torchao", reason="torchao is not installed (pip install -e '.[test]' installs it)")
    args = ["--sizes", "tiny", "--prompt", "8", "--new", "4", "--rounds", "1", "--threads", "1", "--routes", *ROUTES]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    assert "CPU: " in out
    rows = [line for line in out.splitlines() if line.startswith("| tiny")]
    for kind in ("float32", "int8 wo"):
        for route in ROUTES:
            row = next((r for r in rows if f"{kind} | {route} |" in r), None)
            assert row is not None and row.endswith("| yes |"), (kind, route, out[-3000:])
