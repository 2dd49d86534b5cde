"""benchmarks/int4_forms.py on a 64 x 128 weight in groups of 32 (4 groups: the rule's interleaved layout): every form compiles, is timed, and the int4
forms compute the float64 dequantized product within float32 error (no timings are asserted: the machine is
shared)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "int4_forms.py"
FORMS = ("f32", "int4_halves", "int4_packed_two", "int4_tiles4_fused", "int4_tiles4_symmetric")


@pytest.mark.slow  # four IREE compiles: about a minute on the shared machine
def test_int4_forms_prints_a_timed_row_per_form():
    args = ["--n", "64", "--k", "128", "--rows", "2", "--repetitions", "2", "--forms", ",".join(FORMS)]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:] for line in done.stdout.splitlines() if line.startswith("| ")
    }
    for form in FORMS:
        assert form in rows, (form, done.stdout)
        ms, diff = float(rows[form][0]), float(rows[form][2])
        assert ms > 0, rows[form]
        if form.startswith("int4"):
            assert diff < 1e-5, rows[form]  # the products are around 1: float32 sums of 128 terms
