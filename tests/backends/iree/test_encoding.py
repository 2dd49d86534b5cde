"""A module saved with `params=` reads its weights from the mapped .irpa as they are (issue 34 part 2).

`backends/iree/encoding.py`: on llvm-cpu with data tiling, `save(path, params=)` compiles the module with the
weights' packing split out and runs IREE's parameter encoder, so the archive holds the weights packed; the
loaded module maps the archive and packs nothing when it starts.
"""

from __future__ import annotations

import builtins
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fx_rewrites
from fx_rewrites.backends.base import ArtifactError
from fx_rewrites.backends.iree import archive, encoding
from fx_rewrites.backends.iree.backend import IreeBackend
from fx_rewrites.backends.iree.parameters import INLINE_ENV
from fx_rewrites.backends.iree.runtime import function_reflections

iree_runtime = pytest.importorskip("iree.runtime")


class Stack(torch.nn.Module):
    """`layers` Linear(width, width) with a ReLU between: every weight a matmul operand IREE packs."""

    def __init__(self, width: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def keys(path: Path) -> list[str]:
    index = iree_runtime.ParameterIndex()
    index.load(str(path))
    return sorted(index[i].key for i in range(len(index)))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Stack().eval(), torch.randn(8, 256)


def test_the_archive_holds_the_weights_packed_and_loads_mapped(model, tmp_path, monkeypatch):
    net, x = model
    compiled = fx_rewrites.compile(net, (x,))
    compiled.save(tmp_path / "net.vmfb", params=tmp_path / "net.irpa")
    # the encoder's output (every weight, packed or not, as the module reads it), not the state-dict tensors
    assert all(key.startswith("parameter") for key in keys(tmp_path / "net.irpa"))
    assert not set(keys(tmp_path / "net.irpa")) & set(compiled.runtime.parameters)

    real_open = builtins.open

    def no_archive_reads(file, *args, **kwargs):
        assert not str(file).endswith(".irpa"), f"the archive was read into memory by Python: {file}"
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_archive_reads)
    monkeypatch.setattr(Path, "read_bytes", lambda p: real_open(p, "rb").read() if p.suffix != ".irpa" else 1 / 0)
    loaded = fx_rewrites.load(tmp_path / "net.vmfb")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), net(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loaded(x + 1), net(x + 1), rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    maps = Path("/proc/self/maps").read_text().splitlines()
    mapped = [line for line in maps if line.endswith(str(tmp_path / "net.irpa"))]
    assert mapped and all(line.split()[1].startswith("r-") for line in mapped), "the archive is not mapped read-only"
    # the documented command line runs the packed archive as any other (scope model)
    call = json.loads(function_reflections(tmp_path / "net.vmfb")["main"]["fx_rewrites.call"])
    assert call["parameters"] == {"scope": "model"}


def test_two_functions_reading_one_weight_save_it_once(model, tmp_path):
    """Two functions (8 rows and 1 row, as prefill and decode) of one module read the same weights, each packed:
    IREE hoists a packing per function and merges them only after the encoder is split out, so without
    `encoding.SHARE_PACKED` the archive held each weight twice (docs/iree-3.13-findings.md section 33)."""
    net, x = model
    iree = fx_rewrites.backends.get("iree")
    rows = {"many": x, "one": x[:1]}
    programs = {name: fx_rewrites.apply(torch.export.export(net, (v,)), iree.rules).program for name, v in rows.items()}
    module = iree.compile_module(programs, weights_as_parameters=True)
    module.save(tmp_path / "net.vmfb", params=tmp_path / "net.irpa")
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    written = (tmp_path / "net.irpa").stat().st_size
    assert weights <= written < 1.2 * weights, f"{written} bytes written for {weights} of weights"
    loaded = iree.load_file(tmp_path / "net.vmfb", tuple(rows))
    with torch.no_grad():
        for name, v in rows.items():
            torch.testing.assert_close(loaded.functions[name](v + 1), net(v + 1), rtol=1e-5, atol=1e-5)


class Router(torch.nn.Module):
    """A Linear(256, 256) IREE packs, then a Linear(256, 4) as an MoE's router: packed for 2 rows (a decode
    step), its 4 rows pad to a tile of 16 (4x its size, past the 1.2x growth IREE's encoder accepts), so the
    module packs that weight itself when it starts, reading it by its own key."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(256, 256)
        self.router = torch.nn.Linear(256, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(torch.relu(self.hidden(x)))


@pytest.fixture
def router(tmp_path, monkeypatch):
    """A `Router` compiled (every weight a parameter) and saved packed to `tmp_path`/net.vmfb and net.irpa."""
    monkeypatch.setenv(INLINE_ENV, "0")
    torch.manual_seed(0)
    net, x = Router().eval(), torch.randn(2, 256)
    compiled = fx_rewrites.compile(net, (x,))
    compiled.save(tmp_path / "net.vmfb", params=tmp_path / "net.irpa")
    return net, x


def test_a_weight_the_encoder_leaves_out_is_archived_as_it_is(router, tmp_path):
    """IREE's encoder writes the weights it packs and those read unchanged; a weight whose packing it refuses
    is read by its own key, so the archive holds it as it is (Qwen3-MoE's routers failed to load without it)."""
    net, x = router
    saved = keys(tmp_path / "net.irpa")
    assert "router.weight" in saved and any(key.startswith("parameter") for key in saved)
    assert "hidden.weight" not in saved  # packed by the encoder: not twice
    loaded = fx_rewrites.load(tmp_path / "net.vmfb")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), net(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loaded(x - 1), net(x - 1), rtol=1e-5, atol=1e-5)


def test_an_archive_without_a_key_the_module_reads_is_a_named_error(router, tmp_path):
    index = iree_runtime.ParameterIndex()
    index.load(str(tmp_path / "net.irpa"))
    kept = {e.key: bytes(e.file_view) for e in (index[i] for i in range(len(index))) if e.key != "router.weight"}
    del index
    archive.write(kept, tmp_path / "short.irpa")
    with pytest.raises(ArtifactError, match=r"router\.weight.*short\.irpa.*Fix"):
        fx_rewrites.load(tmp_path / "net.vmfb", params=tmp_path / "short.irpa")


def test_without_data_tiling_the_weights_are_saved_as_they_are(model, tmp_path):
    net, x = model
    compiled = fx_rewrites.compile(net, (x,), backend=IreeBackend(perf_flags=()))
    assert compiled.runtime.pack is None
    compiled.save(tmp_path / "net.vmfb", params=tmp_path / "net.irpa")
    assert keys(tmp_path / "net.irpa") == sorted(compiled.runtime.parameters)
    with torch.no_grad():
        torch.testing.assert_close(fx_rewrites.load(tmp_path / "net.vmfb")(x), net(x), rtol=1e-5, atol=1e-5)


def test_a_module_iree_cannot_split_is_saved_unpacked_with_a_warning(model, tmp_path, monkeypatch):
    net, x = model
    compiled = fx_rewrites.compile(net, (x,))

    def refuse(*args, **kwargs):
        raise NotImplementedError("no encoder here")

    monkeypatch.setattr(encoding, "compile_split", refuse)
    with pytest.warns(UserWarning, match="packs them when it starts"):
        compiled.save(tmp_path / "net.vmfb", params=tmp_path / "net.irpa")
    assert keys(tmp_path / "net.irpa") == sorted(compiled.runtime.parameters)
    with torch.no_grad():
        torch.testing.assert_close(fx_rewrites.load(tmp_path / "net.vmfb")(x), net(x), rtol=1e-5, atol=1e-5)


_CHILD = """
import sys, torch, fx_rewrites
def status(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":")) * 1024
x = torch.load(sys.argv[2])
anon, file = status("RssAnon"), status("RssFile")
out = fx_rewrites.load(sys.argv[1])(x)
print(status("RssAnon") - anon, status("RssFile") - file)
"""


def test_loading_costs_the_mapped_pages_not_a_copy(tmp_path, monkeypatch):
    """In fresh processes: a module of 128 MB of weights saved packed costs their mapped pages when loaded and
    called, and no copy in the process's own memory; saved as they are (the encoder left out), the same module
    packs them when it starts, a copy of their size in anonymous memory (the runtime's own ~60 MB in both)."""
    torch.manual_seed(0)
    net, x = Stack(2048, 8).eval(), torch.randn(4, 2048)
    weights = sum(layer.weight.numel() * 4 for layer in net.layers)
    compiled = fx_rewrites.compile(net, (x,))
    compiled.save(tmp_path / "packed.vmfb", params=tmp_path / "packed.irpa")
    monkeypatch.setattr(encoding, "compile_split", lambda *a, **k: (_ for _ in ()).throw(encoding.NothingToPack()))
    compiled.save(tmp_path / "plain.vmfb", params=tmp_path / "plain.irpa")
    torch.save(x, tmp_path / "x.pt")
    growth = {}
    for name in ("packed", "plain"):
        argv = [sys.executable, "-c", _CHILD, str(tmp_path / f"{name}.vmfb"), str(tmp_path / "x.pt")]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        growth[name] = tuple(int(v) for v in proc.stdout.split()[-2:])  # (anonymous, file) bytes
    (anon, file), (plain_anon, _) = growth["packed"], growth["plain"]
    assert file > 0.9 * weights, f"only {file / 1e6:.0f} MB of the {weights / 1e6:.0f} MB archive mapped"
    assert plain_anon - anon > 0.9 * weights, (
        f"anonymous memory: {anon / 1e6:.0f} MB packed, {plain_anon / 1e6:.0f} plain"
    )
    assert anon < 0.6 * weights, f"{anon / 1e6:.0f} MB of the process's own memory for {weights / 1e6:.0f} MB"
