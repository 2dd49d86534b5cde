"""benchmarks/roofline.py runs (tiny models) and counts the matmul work by hand's count. No timings asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def roofline():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import roofline

        yield roofline
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_matmul_work_of_the_quick_bert_counts_attention(roofline):
    # quick BERT: batch 2 x 16 tokens = 32 rows, hidden 32, 2 heads of 16, FFN 64, one layer, a pooler on 2 rows:
    # q, k, v, out 4 * 2*32*32*32 + FFN 2 * 2*32*32*64 + scores and values 2 * (2*2 heads * 2*16*16*16) + pooler
    # 2*2*32*32 + the softmax's row sums as a matrix-vector product (softmax_matmul_normalized_after) 2*2 heads *
    # 2*16*16*1 = 262144 + 262144 + 65536 + 4096 + 2048 (attention is 67584 of it: eager's own call counts none)
    assert roofline.model_row("bert", repeat=1, quick=True)["flops"] == 595968


@pytest.mark.slow
def test_quick_run_prints_the_table(roofline, capsys):
    assert roofline.main(["--quick", "--repeat", "3"]) == 0
    out = capsys.readouterr().out
    assert "Matmul rate of this core" in out
    rows = [line for line in out.splitlines() if line.startswith(("| bert |", "| vit |"))]
    assert len(rows) == 2 and all(row.count("|") == 7 for row in rows), out
