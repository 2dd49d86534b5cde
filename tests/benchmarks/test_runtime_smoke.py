"""benchmarks/runtime.py and gpu_runtime.py run (tiny models) and their checks hold: every IREE route
matches eager. No timings are asserted (the machine is shared)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def benchmarks():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_runtime
        import runtime

        yield runtime, gpu_runtime
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.slow
def test_quick_run_prints_the_table_and_plots(benchmarks, capfd, tmp_path):
    runtime, _ = benchmarks
    plot = tmp_path / "runtime.png"
    threads = torch.get_num_threads()
    assert runtime.main(["--quick", "--models", "bert", "--plot", str(plot)]) == 0
    assert torch.get_num_threads() == threads  # the zoo's eager references ran on one thread after it once
    out = capfd.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| bert |")]
    assert len(rows) == 2, out  # the times row and the compile-stages row
    assert "| yes (" in rows[0] and "attention_as_matmul_softmax" in rows[0], rows[0]
    assert "engine share" in out and "Median IREE / eager" in out
    assert plot.stat().st_size > 10_000  # a PNG with bars drawn


def test_ablation_names_each_performance_piece(benchmarks):
    """The ablation drops one performance rule or flag at a time, keeping the rest and the rules before."""
    runtime, _ = benchmarks
    backend = runtime.default_backend("wall")
    routes = runtime.variants(backend, {"attention_as_matmul_softmax"}, ablation=True)
    assert set(routes) == {
        "iree",
        "iree_before",
        "-attention_as_matmul_softmax",
        "-iree-global-opt-data-tiling",
        "-iree-preprocessing-convert-conv-to-channels-last",
        # AVX-512: the mmt4d ukernel, and im2col per shape by its rules instead of IREE's global im2col flag
        *(["-iree-llvmcpu-enable-ukernels"] if backend.target.isa == "avx512" else []),
        *(["-iree-global-opt-use-im2col-for-convs"] if backend.target.isa != "avx512" else []),
    }
    before = routes["iree_before"]
    assert before.perf_flags == () and "attention_as_matmul_softmax" not in before.rules
    without = routes["-attention_as_matmul_softmax"]
    assert "attention_as_matmul_softmax" not in without.rules and "conv1d_as_matmul" in without.rules
    assert without.perf_flags == backend.perf_flags


@pytest.mark.slow
def test_gpu_benchmark_dry_run_on_the_cpu(benchmarks, tmp_path):
    """prepare (rules + compile) and run (rebuild from seeds, checksum, compare, time) with llvm-cpu and torch on CPU."""
    _, gpu_runtime = benchmarks
    bundle, result = tmp_path / "bundle", tmp_path / "gpu.md"
    assert gpu_runtime.main(["prepare", "--out", str(bundle), "--backend", "iree", "--models", "bert", "--quick"]) == 0
    args = ["run", "--bundle", str(bundle), "--out", str(result), "--device", "local-sync", "--torch-device", "cpu"]
    assert gpu_runtime.main([*args, "--repeat", "3", "--no-inductor"]) == 0
    rows = json.loads(result.with_suffix(".json").read_text())["rows"]
    assert [(r["model"], r["same_weights"], r["matches"]) for r in rows] == [("bert", True, True)]
    assert "| bert |" in result.read_text()
