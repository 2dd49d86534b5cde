"""The engine benchmark runs (small sizes) and its own checks hold: every
rewriter leaves no match behind, DEFAULT converges and a second call
rewrites nothing. No timings are asserted (the machine is shared)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def engine_scaling():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import engine_scaling

        yield engine_scaling
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.slow
def test_quick_run_prints_every_section(engine_scaling, capsys, tmp_path):
    plot = tmp_path / "scaling.png"
    # one run per size (best of 1): the checks run on every run, the repeats only pick the best time
    args = ["--quick", "--repeats", "1", "--only", "rule", "--only", "pack", "--plot", str(plot)]
    assert engine_scaling.main(args) == 0
    out = capsys.readouterr().out
    rule_rows = [line for line in out.splitlines() if line.startswith("|   1,000 |") or line.startswith("|   3,000 |")]
    assert len(rule_rows) == 2, out
    assert "## DEFAULT pack" in out and "2nd call rewrites" in out
    assert plot.stat().st_size > 10_000  # a PNG with something drawn


def test_chain_graph_and_rule_agree_with_eager(engine_scaling):
    """The benchmark's graph runs, and the rule keeps its numerics."""
    import torch

    from fx_rewrites import engine

    gm = engine_scaling.graphs.chain(30)
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    gm.recompile()
    before = gm(x, w)
    report = engine.run(gm.graph, [engine_scaling.RULE])
    gm.recompile()
    assert report.total_rewrites == 10
    expected = x
    for _ in range(10):
        expected = torch.relu(expected - w) * w
    torch.testing.assert_close(gm(x, w), expected)
    assert not torch.allclose(before, expected)
