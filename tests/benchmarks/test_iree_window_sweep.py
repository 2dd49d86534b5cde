"""benchmarks/iree_window_sweep.py: one case of the sweep, as exported and after the rules (a few seconds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def sweep():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import iree_window_sweep

        yield iree_window_sweep
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_padded_conv_is_wrong_as_exported_and_right_after_the_rules(sweep):
    (case,) = [c for c in sweep.cases() if c[0] == "conv2d k5s4p1"]
    assert sweep.run(case, dynamic=True, rules=False) == "[] 3:ok 4:ok 6:WRONG"
    assert sweep.run(case, dynamic=True, rules=True) == "[conv_single_window_for_iree] 3:ok 4:ok 6:ok"
