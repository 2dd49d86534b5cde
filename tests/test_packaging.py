"""One import root: `fx_rewrites`, mapped onto the repository's folders, and no other top-level name."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SHADOWING_NAMES = ("engine", "rewrites", "backends", "examples", "app")


def _setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed_and_nothing_else():
    config = _setuptools_config()
    package_dir: dict[str, str] = config["package-dir"]
    on_disk = set()
    for package, folder in package_dir.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join((package, *relative)))
    assert set(config["packages"]) == on_disk, (
        "pyproject.toml's [tool.setuptools] packages must list every package folder under package-dir: "
        f"missing {sorted(on_disk - set(config['packages']))}, extra {sorted(set(config['packages']) - on_disk)}"
    )
    assert all(name == "fx_rewrites" or name.startswith("fx_rewrites.") for name in on_disk)


def test_wheel_adds_one_top_level_name(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("fx_rewrites-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
        top_level = [n for n in archive.namelist() if n.endswith("top_level.txt")]
        declared = archive.read(top_level[0]).decode().split() if top_level else ["fx_rewrites"]
    assert {t for t in tops if not t.endswith(".dist-info")} == {"fx_rewrites"}
    assert declared == ["fx_rewrites"]


def test_files_named_like_the_folders_in_the_working_directory_break_nothing(tmp_path):
    """A user's own engine.py, backends.py, examples.py (and rewrites.py, app.py) next to their script."""
    for name in SHADOWING_NAMES:
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py was imported')\n")
    script = textwrap.dedent(
        """
        import pkgutil, importlib, sys
        import torch
        import fx_rewrites
        from fx_rewrites import backends
        imported = 0
        for root in ("fx_rewrites", "fx_rewrites.engine", "fx_rewrites.backends", "fx_rewrites.app"):
            package = importlib.import_module(root)
            for info in pkgutil.walk_packages(package.__path__, root + "."):
                if not info.name.endswith("__main__"):
                    importlib.import_module(info.name)
                    imported += 1
        assert imported > 60, imported
        class Net(torch.nn.Module):
            def forward(self, x):
                return torch.nn.functional.max_pool2d(x, 2) + torch.tensor(1.0)
        ep = torch.export.export(Net(), (torch.randn(1, 2, 4, 4),))
        result = fx_rewrites.apply(ep)
        assert result.report.converged, result.report.summary()
        assert {"eager", "iree", "ttnn"} <= set(backends.names())
        shadowed = sorted(m for m in sys.modules if m.split(".")[0] in {NAMES})
        assert not shadowed, shadowed
        print("ok", len(result.report.rewrites))
        """
    ).replace("{NAMES}", repr(set(SHADOWING_NAMES)))
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("ok ")
    cli = subprocess.run(
        [sys.executable, "-m", "fx_rewrites", "rules"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "pool_stride_defaults" in cli.stdout
