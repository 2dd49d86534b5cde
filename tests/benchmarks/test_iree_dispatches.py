"""benchmarks/iree_dispatches.py: a small module's dispatches are found, counted per call and timed. No timing
is asserted (the machine is shared), only what the profile must contain."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites.backends.iree.importing import import_mlir, iree_modules
from fx_rewrites.backends.iree.preparing import prepare_program

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


class TwoLayers(torch.nn.Module):
    """The same linear twice (one executable launched twice), then a softmax (another executable)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x):
        return torch.softmax(self.linear(torch.relu(self.linear(x))), -1)


def test_profile_counts_and_times_each_dispatch(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import iree_dispatches
    finally:
        sys.path.remove(str(BENCHMARKS))
    iree = backends.get("iree")
    x = torch.randn(32, 64)
    program = fx_rewrites.apply(torch.export.export(TwoLayers().eval(), (x,)), iree.rules).program
    mlir = str(import_mlir(iree_modules(), prepare_program(program)[0]))
    # two short runs of each dispatch (the script's default: 5 of google benchmark's 0.5 s): what is timed is the same
    found = iree_dispatches.profile(mlir, [*iree.flags, *iree.perf_flags], tmp_path, repetitions=2, min_time="0.01s")
    matmuls = [d for d in found if "matmul" in d.name or "mmt4d" in d.name]  # mmt4d: on data-tiled operands
    assert sum(d.calls for d in matmuls) == 2, found  # the two linears, not the weights' packing
    assert len(found) > len(matmuls), found  # the softmax's executables
    assert all(d.calls >= 1 and d.ms > 0 for d in found), found
    text = iree_dispatches.table(found, top=3)
    assert text.count("\n| ") == min(3, len(found)) + 1 and f"all {len(found)} executables" in text
    with pytest.raises(SystemExit, match="unknown model"):
        iree_dispatches.model_mlir("no_such_model", quick=True)
