"""Every legalize decomposition of an OpInfo op, on NaN, infinities and -0.0, through IREE against eager
(benchmarks/special_values.py, ~3 minutes; issue 27: a rule must not turn a loud failure into a wrong number).

The sweep runs in a subprocess: eager's LAPACK kernels have crashed the process on NaN input. Each op the
legalize phase decomposes must match eager or fail loudly (IREE rejects it); the ops in `KNOWN` still
compute a wrong number on these inputs and must keep doing so until fixed (then take them out: the test
fails when one passes, so the list stays true).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "special_values.py"

#: op -> what is wrong (measured 2026-11-26, IREE 3.13 llvm-cpu). Each gives what torch's own decomposition gives
#: when run on torch: the legalize phase is faithful, and torch's kernel and its decomposition disagree
#: (docs/iree-3.13-findings.md section 19). msort, the triplet losses and masked.normalize were fixed by
#: backends/iree/rules/nan_guards.py.
KNOWN = {
    "nn.functional.grid_sample": "NaN where the kernel pads with 0: the decomposition's weights of a NaN coordinate",
    "grid_sampler_2d": "as grid_sample",
    "nn.functional.instance_norm": (
        "inf where eager has NaN, with an infinite weight and bias: the kernel computes x * a + (b - mean * a), "
        "inf - inf; the decomposition (x - mean) * a + b"
    ),
}


@pytest.mark.slow
def test_legalize_decompositions_match_eager_on_special_values():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900, check=False, cwd=SCRIPT.parent
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len([r for r in records if r["status"] == "pass"]) > 80, "the sweep checked too few ops"
    wrong = {r["op"]: r["diff"] for r in records if r["status"] == "wrong"}
    new = {op: d for op, d in wrong.items() if op not in KNOWN}
    assert not new, f"a legalize decomposition gives a wrong number on special values (IREE, eager, count): {new}"
    fixed = sorted(set(KNOWN) - set(wrong))
    assert not fixed, f"now right (or no longer decomposed): take them out of KNOWN: {fixed}"
