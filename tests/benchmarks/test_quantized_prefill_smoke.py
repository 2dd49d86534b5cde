"""benchmarks/quantized_prefill.py on a tiny Llama (prompts 3 and 9, one round): the int4 g32 row's compile_lm
prefill gives the eager model's first token at both lengths (no timings are asserted: the machine is shared)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quantized_prefill.py"


@pytest.mark.slow
def test_quantized_prefill_prints_each_prompt_with_the_eager_first_token():
    pytest.importorskip("torchao", reason="torchao is not installed (pip install -e '.[test]' installs it)")
    args = ["--size", "tiny", "--prompts", "3,9", "--rounds", "1", "--schemes", "float32:eager,int4_g32"]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    row = next((r for r in rows if r.startswith("| int4_g32 | compile_lm |")), None)
    assert row is not None and row.endswith("| yes |"), done.stdout[-3000:]
    assert "prefill 9 ms" in rows[0], rows[0]
