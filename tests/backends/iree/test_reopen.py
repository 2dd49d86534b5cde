"""After `save(params=)` the compiled module reads its weights from the archive it wrote (issue 34 part 2).

`runtime.reopen`: a module compiled in this process packs a copy of its weights when it starts (data tiling,
`encoding.py`); once the save has written them packed, the module is re-opened on that archive, mapped, and
its own copy freed, so compile + save + load in one process holds the weights' pages once more, not twice.
A module that keeps state between calls stays as it is (a new context would start its state over), unless it
was compiled with `state_restarts=True` (`compile_lm`'s: each generate fills the KV cache it reads).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.export import export

import fx_rewrites
from fx_rewrites.backends.iree.backend import IreeBackend
from tests.backends.iree.test_encoding import Stack

iree_runtime = pytest.importorskip("iree.runtime")


def mapped(path: Path) -> list[str]:
    """The lines of /proc/self/maps that map `path`."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(str(path))]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Stack().eval(), torch.randn(8, 256)


def test_after_a_save_with_params_the_module_reads_the_saved_archive(model, tmp_path):
    net, x = model
    compiled = fx_rewrites.compile(net, (x,))
    with torch.no_grad():
        before = compiled(x)
        assert compiled.runtime.reads is None and not mapped(tmp_path / "net.irpa")
        compiled.save(tmp_path / "net.vmfb", params=tmp_path / "net.irpa")
        assert compiled.runtime.reads == (tmp_path / "net.irpa").resolve()
        lines = mapped(tmp_path / "net.irpa")
        assert lines and all(line.split()[1].startswith("r-") for line in lines), "the archive is not mapped read-only"
        assert torch.equal(compiled(x), before)  # the same kernels over the same weights, packed offline
        torch.testing.assert_close(compiled(x - 1), net(x - 1), rtol=1e-5, atol=1e-5)
        # it saves as before: self-contained, and with params= elsewhere (both load and give eager's numbers)
        compiled.save(tmp_path / "whole.vmfb")
        compiled.save(tmp_path / "again.vmfb", params=tmp_path / "again.irpa")
        for name in ("whole", "again"):
            torch.testing.assert_close(fx_rewrites.load(tmp_path / f"{name}.vmfb")(x), net(x), rtol=1e-5, atol=1e-5)
        assert compiled.runtime.reads == (tmp_path / "again.irpa").resolve()
        assert torch.equal(compiled(x), before)


def test_a_later_save_to_the_same_archive_leaves_a_module_reading_it_as_it_was(model, tmp_path):
    """Archives are written to a new file renamed over the old one (`archive.replacing`): a module that maps the
    old one, compiled and saved or loaded, keeps its numbers when another model is saved to the same path."""
    net, x = model
    torch.manual_seed(1)
    other = Stack().eval()
    first = fx_rewrites.compile(net, (x,))
    first.save(tmp_path / "a.vmfb", params=tmp_path / "net.irpa")
    loaded = fx_rewrites.load(tmp_path / "a.vmfb", params=tmp_path / "net.irpa")
    fx_rewrites.compile(other, (x,)).save(tmp_path / "b.vmfb", params=tmp_path / "net.irpa")
    with torch.no_grad():
        torch.testing.assert_close(first(x), net(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loaded(x), net(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            fx_rewrites.load(tmp_path / "b.vmfb", params=tmp_path / "net.irpa")(x), other(x), rtol=1e-5, atol=1e-5
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.vmfb", "b.vmfb", "net.irpa"]  # no temporary left


class Counter(torch.nn.Module):
    """A packed weight and a buffer each call adds one to: state the module keeps between calls."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(256, 256)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.linear(x) * self.calls


def test_a_module_that_keeps_state_is_not_reopened(tmp_path):
    torch.manual_seed(0)
    net, x = Counter().eval(), torch.randn(8, 256)
    compiled = fx_rewrites.compile(net, (x,))
    with torch.no_grad():
        compiled(x)
        compiled.save(tmp_path / "net.vmfb", params=tmp_path / "net.irpa")
        assert compiled.runtime.reads is None
        torch.testing.assert_close(compiled(x), net.linear(x) * 2, rtol=1e-5, atol=1e-5)  # its state went on


def test_a_module_whose_state_may_start_over_is_reopened(tmp_path):
    """`compile_module(..., state_restarts=True)` (`compile_lm`'s): the save moves even a module that keeps state
    onto its archive, and the state starts over from its initial value; without it the state goes on."""
    torch.manual_seed(0)
    net, x = Counter().eval(), torch.randn(8, 256)
    backend = IreeBackend()
    program = fx_rewrites.apply(export(net, (x,)), backend.rules).program  # rules applied, as compile_module takes
    kept = backend.compile_module({"main": program})
    moved = backend.compile_module({"main": program}, state_restarts=True)
    with torch.no_grad():
        for name, module in (("kept", kept), ("moved", moved)):
            module.functions["main"](x)
            module.save(tmp_path / f"{name}.vmfb", params=tmp_path / f"{name}.irpa")
        assert kept.functions["main"].reads is None
        assert moved.functions["main"].reads == (tmp_path / "moved.irpa").resolve()
        assert mapped((tmp_path / "moved.irpa").resolve())
        torch.testing.assert_close(kept.functions["main"](x), net.linear(x) * 2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(moved.functions["main"](x), net.linear(x), rtol=1e-5, atol=1e-5)


def test_a_module_of_several_functions_is_reopened_as_one(model, tmp_path):
    net, x = model
    backend = IreeBackend()
    programs = {"small": export(net, (x[:2],)), "large": export(net, (x,))}
    module = backend.compile_module(programs)
    module.save(tmp_path / "two.vmfb", params=tmp_path / "two.irpa")
    assert {c.reads for c in module.functions.values()} == {(tmp_path / "two.irpa").resolve()}
    with torch.no_grad():
        torch.testing.assert_close(module.functions["small"](x[:2]), net(x[:2]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(module.functions["large"](x), net(x), rtol=1e-5, atol=1e-5)


_CHILD = """
import sys, torch, fx_rewrites
from tests.backends.iree.test_encoding import Stack
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:")) * 1024
torch.manual_seed(0)
net, x = Stack(2048, 8).eval(), torch.randn(4, 2048)
compiled = fx_rewrites.compile(net, (x,))
with torch.no_grad():
    compiled(x)
    started = anon()
    compiled.save(sys.argv[1] + ".vmfb", params=sys.argv[1] + ".irpa")
    compiled(x)
print(started - anon())
"""


def test_the_save_frees_the_module_s_own_packed_copy(tmp_path):
    """In a fresh process: 128 MB of weights; after the save and a call the process's own (anonymous) memory is
    smaller by most of their size (the encoder's transient buffers may stay with the allocator)."""
    weights = 8 * 2048 * 2048 * 4
    root = Path(__file__).resolve().parents[3]
    argv = [sys.executable, "-c", _CHILD, str(tmp_path / "net")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    freed = int(proc.stdout.split()[-1])
    assert freed > 0.5 * weights, f"{freed / 1e6:.0f} MB freed of the module's {weights / 1e6:.0f} MB packed copy"
