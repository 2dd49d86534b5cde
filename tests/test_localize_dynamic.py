"""The localizer's dynamic pass: a fault the backend shows only with dynamic dims (docs/localize.md).

The planted fault is main's own, with its fix turned off: under a derived Dim (`L = 16 * chunks`) torch gives
`x.reshape(2, -1, 16, 4, 8)` the value shape `(2, chunks, 16, 4, 8)` with its 16 a SymInt, IREE's importer types
the view `[2,?,?,4,8]` and IREE 3.13 lowers it with a negative size (findings section 23;
`backends/iree/constant_sizes.py` gives such sizes their ints, `importing.concrete_sizes`). Every piece with the
recorded, static sizes is right, so only the dynamic pass can name the reshape. These tests fail once IREE
lowers that view right: then plant another dynamic-only fault.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import fx_rewrites
from fx_rewrites.app.localize.dynamic import dims_source
from fx_rewrites.app.localize.pieces import build_piece, flat_inputs, record
from fx_rewrites.backends.iree import preparing
from tests.lm_models import Mamba2Scan

CHUNK = 16


class Chunked(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.reshape(2, -1, CHUNK, 4, 8) * 2).cumsum(2)


def _chunked() -> tuple[torch.export.ExportedProgram, tuple[torch.Tensor]]:
    x = torch.randn(2, 32, 4, 8, generator=torch.Generator().manual_seed(0))
    chunks = Dim("chunks", min=1, max=4)
    return torch.export.export(Chunked(), (x,), dynamic_shapes=({1: CHUNK * chunks},)), (x,)


@pytest.fixture
def unfixed(monkeypatch):
    """IREE's import without main's fix for constant SymInt sizes: the dynamic-only fault is back."""
    monkeypatch.setattr(preparing, "concrete_sizes", lambda graph: 0)


def test_a_dynamic_only_fault_is_named_with_its_symbolic_shapes(unfixed, tmp_path):
    program, args = _chunked()
    found = fx_rewrites.localize(program, args, backend="iree", rules=False, label="chunked")
    assert found.whole.startswith("fails:"), found.whole
    f = found.finding
    assert f is not None, found.text()
    assert (f.op, f.node.name, f.kind) == ("aten.reshape.default", "reshape", "run failure"), found.text()
    assert found.dynamic and f.symbolic
    symbols = f.symbolic.replace(" ", "")
    assert "x:f32[2,16*s" in symbols and ",16,4,8]" in symbols, f.symbolic
    text = found.text()
    assert "wrong only with dynamic shapes" in text and "symbolic shapes the backend compiled" in text

    written = found.write(tmp_path)
    assert found.reproduced, found.text()  # here, with the fix off
    repro = (tmp_path / "repro.py").read_text()
    assert "16 * s" in repro and "Dim(" in repro and "dynamic_shapes=shapes" in repro
    assert {p.name for p in written} == {"repro.py", "guard_rule.py", "test_guard_rule.py"}
    # on its own: reproduced with the fix off; with main's fix the same dynamic piece is right
    unpatched = _run(tmp_path / "repro.py")
    assert unpatched.returncode == 0, unpatched.stdout + unpatched.stderr
    wrapper = tmp_path / "unfixed.py"
    wrapper.write_text(
        "import runpy\nfrom fx_rewrites.backends.iree import preparing\n"
        "preparing.concrete_sizes = lambda graph: 0\n"
        f"runpy.run_path({str(tmp_path / 'repro.py')!r}, run_name='__main__')\n"
    )
    patched = _run(wrapper)
    assert patched.returncode == 1, patched.stdout + patched.stderr
    assert "REPRODUCED: iree fails on aten.reshape.default" in patched.stdout


def _run(script: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)


def test_with_the_fix_the_same_program_passes_in_both_passes():
    program, args = _chunked()
    found = fx_rewrites.localize(program, args, backend="iree", rules=False)
    assert found.finding is None, found.text()
    assert found.dynamic and found.compiles == 3  # the whole, the static search's whole piece, the dynamic one
    assert "PASS: iree matches eager on every node, with the recorded sizes and with the program's symbolic" in (
        found.text()
    )


def test_a_static_fault_is_found_by_the_static_search_first():
    """IREE 3.13's gelu(approximate="tanh") is off by ~5e-5 at any size: the static pass names it."""

    class Gelu(torch.nn.Module):
        def forward(self, x):
            return F.gelu(x * 2.0, approximate="tanh") + 1.0

    x = torch.linspace(-3, 3, 100001).reshape(1, -1)
    program = torch.export.export(Gelu(), (x,), dynamic_shapes=({1: Dim("n", min=2)},))
    found = fx_rewrites.localize(program, (x,), backend="iree", rules=False)
    f = found.finding
    assert (f.op, f.kind) == ("aten.gelu.default", "wrong numbers"), found.text()
    assert not found.dynamic and f.symbolic == ""
    assert "only with dynamic shapes" not in found.text()


def test_a_dynamic_piece_recomputes_the_sizes_it_reads_from_its_inputs():
    class Flatten(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            return y.reshape(x.shape[0] * x.shape[1], -1) + 1

    x = torch.randn(3, 5, 4)
    program = torch.export.export(Flatten(), (x,), dynamic_shapes=({0: Dim("a"), 1: Dim("b")},))
    values = record(program.graph_module, flat_inputs(program, (x,), {}))
    view = next(
        n for n in program.graph.nodes if n.target in (torch.ops.aten.reshape.default, torch.ops.aten.view.default)
    )
    gm, inputs, _ = build_piece([view], values, symbolic=True)
    assert [type(i) for i in inputs] == [torch.Tensor]  # the sizes it reads are not inputs
    sizes = [n for n in gm.graph.nodes if n.target is torch.ops.aten.sym_size.int]
    assert sizes and all(n.args[0].op == "placeholder" for n in sizes)
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert str(placeholder.meta["val"].shape[0]) != "3", placeholder.meta["val"]  # symbolic, not the recorded 3
    got = fx_rewrites.backends.get("iree").compile(gm, inputs)(*[i.clone() for i in inputs])
    torch.testing.assert_close(got[0], values[view.name], rtol=0, atol=0)
    # the piece's dims as Dims: a * b is one input's dim0 * dim1, no dim of its own here
    source, static = dims_source(gm)
    assert static == "" and 'Dim("' in source, source


@pytest.mark.slow
def test_mamba2_chunk_scan_wrong_numbers_named_at_the_reshape(unfixed):
    """transformers' Mamba2 chunked scan: with the fix off IREE's whole program is silently wrong (logits-sized
    errors, no exception); every static piece is right; the dynamic pass names the chunking reshape."""
    generator = torch.Generator().manual_seed(0)
    scan = Mamba2Scan(CHUNK, generator)
    args = Mamba2Scan.inputs(32, generator)
    chunks = Dim("chunks", min=1, max=4)
    with torch.no_grad():
        program = torch.export.export(scan, args, dynamic_shapes=tuple({1: CHUNK * chunks} for _ in args))
    found = fx_rewrites.localize(program, args, backend="iree")  # after the rules: the padding is the int 0
    diff = float(found.whole.rsplit(" ", 1)[-1])
    assert found.whole.startswith("compiles and runs") and diff > 1.0, found.whole  # 5.4 measured
    f = found.finding
    assert f is not None and found.dynamic and f.symbolic, found.text()
    assert f.op == "aten.reshape.default" and ", 16, 4, 8]" in f.symbolic, found.text()


def test_dims_export_cannot_say_leave_the_reproduction_static_and_say_why():
    class Flat(torch.nn.Module):
        def forward(self, x):
            return x.reshape(-1) * 2

    x = torch.randn(3, 5)
    program = torch.export.export(Flat(), (x,), dynamic_shapes=({0: Dim("a"), 1: Dim("b")},))
    values = record(program.graph_module, flat_inputs(program, (x,), {}))
    mul = next(n for n in program.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    gm, _, _ = build_piece([mul], values, symbolic=True)
    source, static = dims_source(gm)
    assert "not linear in one symbol" in static and "return None" in source, (source, static)
