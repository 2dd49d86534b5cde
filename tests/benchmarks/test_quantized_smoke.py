"""benchmarks/quantized.py on a tiny Llama (prompt 8, 4 new tokens, one round): the float32 and int4 g32 rows
generate their eager tokens through compile_lm, and without a llama.cpp build the llama.cpp column says why (no
timings are asserted: the machine is shared). Two of the four schemes: the script's code is the same for each,
and every scheme's compile_lm is proven by the unit tests (int8_wo: tests/test_quantized_artifact.py; w8a8 and
int4_g32: tests/test_quantized_schemes.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quantized.py"


@pytest.mark.slow
def test_quantized_prints_every_scheme_with_eager_tokens(tmp_path):
    pytest.importorskip("torchao", reason="torchao is not installed (pip install -e '.[test]' installs it)")
    schemes = ("float32", "int4_g32")
    args = ["--size", "tiny", "--prompt", "8", "--new", "4", "--rounds", "1", "--schemes", ",".join(schemes)]
    args += ["--routes", "eager,compile_lm,compile_lm_torch_steps"]  # the greedy loop before app/lm/greedy.py too
    args += ["--llama-cpp", "--plot", str(tmp_path / "decode.png")]
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_CPP_DIR", "LLAMA_CPP_SRC")}
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    for scheme in schemes:
        for route in ("eager", "compile_lm", "compile_lm_torch_steps"):
            row = next((r for r in rows if r.startswith(f"| {scheme} | {route} |")), None)
            assert row is not None and "| yes |" in row, (scheme, route, done.stdout[-3000:])
    assert any("no llama.cpp build (set LLAMA_CPP_DIR" in r for r in rows), rows
    assert (tmp_path / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # --plot drew the bars
