"""Saved modules run on an emulated CPU: IREE's own `iree-run-module` for that CPU, under qemu's user mode.

    emulator = aarch64_emulator(cache)                 # qemu-aarch64, the aarch64 sysroot, IREE's aarch64 tool
    fx_rewrites.load("arm.vmfb", backend=EmulatedBackend(emulator))(x)   # each call: one iree-run-module

`EmulatedBackend` reads a file as `fx_rewrites.load` does (its call convention, a size dispatch's guard) and
runs each call in a fresh `iree-run-module` under qemu, its inputs and outputs as .npy files: the bytes of the
saved file run, on code for the emulated CPU. Module state (mutable globals) lasts one call. What is missing
(qemu, the cross C library, the aarch64 `iree-base-runtime` wheel) skips the test with how to install it, and
fails it where `CI` is set (`tests.outside`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from fx_rewrites.backends.iree.artifact import CALL_KEY, plan_from_json
from fx_rewrites.backends.iree.runtime import IreeCompiled, function_reflections
from tests.outside import missing, require_program

QEMU_HINT = "apt-get install -y qemu-user (Debian's; it provides qemu-aarch64 and qemu-x86_64)"
SYSROOT_HINT = "apt-get install -y libc6-arm64-cross libstdc++6-arm64-cross (Debian's aarch64 C and C++ libraries)"
#: the aarch64 C library qemu-aarch64 loads the tool with (`qemu-aarch64 -L`), Debian's cross packages' place
SYSROOT = Path(os.environ.get("QEMU_LD_PREFIX", "/usr/aarch64-linux-gnu"))
#: where the aarch64 `iree-run-module` is kept between runs (a 15 MB wheel download the first time)
CACHE_ENV = "FX_REWRITES_TEST_TOOLS"
WHEEL_PLATFORM = "manylinux_2_28_aarch64"
TOOL = "iree/_runtime_libs/iree-run-module"


@attrs.frozen
class Emulator:
    """`iree-run-module` at `tool`, run by `qemu` (with `-L sysroot` and `-cpu cpu` where given)."""

    qemu: str
    tool: Path
    sysroot: Path | None = None
    cpu: str | None = None

    def argv(self) -> list[str]:
        argv = [self.qemu]
        if self.cpu:
            argv += ["-cpu", self.cpu]
        if self.sysroot:
            argv += ["-L", str(self.sysroot)]
        return [*argv, str(self.tool)]

    def run(
        self, vmfb: Path, function: str, inputs: list[Any], results: int, params: tuple[str, Path] | None = None
    ) -> tuple[subprocess.CompletedProcess, list[np.ndarray]]:
        """One call of `function`: `inputs` (arrays or numbers) in; the process and the `results` arrays out."""
        with tempfile.TemporaryDirectory(prefix="fxr-emulated-") as tmp:
            flags = [f"--module={vmfb}", "--device=local-sync", f"--function={function}"]
            if params is not None:
                flags.append(f"--parameters={params[0]}={params[1]}")
            for i, value in enumerate(inputs):
                if isinstance(value, np.ndarray):
                    np.save(Path(tmp) / f"in{i}.npy", value)
                    flags.append(f"--input=@{Path(tmp) / f'in{i}.npy'}")
                else:
                    flags.append(f"--input={int(value) if isinstance(value, (bool, np.bool_)) else value}")
            flags += [f"--output=@{Path(tmp) / f'out{i}.npy'}" for i in range(results)]
            proc = subprocess.run([*self.argv(), *flags], capture_output=True, text=True, timeout=600, check=False)
            outputs = [np.load(p) for i in range(results) if (p := Path(tmp) / f"out{i}.npy").exists()]
        return proc, outputs


@attrs.frozen
class EmulatedFunction:
    """One function of a saved module, called through `Emulator.run` (what `IreeCompiled` calls)."""

    emulator: Emulator
    vmfb: Path
    name: str
    results: int
    params: tuple[str, Path] | None = None

    def __call__(self, *inputs: Any) -> tuple[np.ndarray, ...]:
        proc, outputs = self.emulator.run(self.vmfb, self.name, list(inputs), self.results, self.params)
        if proc.returncode != 0 or len(outputs) != self.results:
            raise RuntimeError(
                f"{' '.join(self.emulator.argv())} on {self.vmfb} @{self.name}: exit {proc.returncode}\n"
                f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
            )
        return tuple(outputs)


@attrs.frozen
class EmulatedModule:
    functions: dict[str, IreeCompiled]


@attrs.frozen
class EmulatedBackend:
    """What `fx_rewrites.load(path, backend=...)` reads a file with (`backends.base.ModuleBackend`'s
    `read_metadata` and `load_file`), each function run by `emulator`."""

    emulator: Emulator
    name: str = "iree-emulated"

    def read_metadata(self, path: Any) -> dict[str, dict[str, str]]:
        return function_reflections(path)

    def load_file(
        self, path: Any, names: tuple[str, ...] = ("main",), *, params: Any = None, driver: Any = None
    ) -> EmulatedModule:
        path = Path(path)
        reflections = function_reflections(path)
        calls = {}
        for name in names:
            plan, doc = plan_from_json(reflections[name][CALL_KEY], str(path))
            used = [o.result for o in plan.outputs if o.result is not None]
            archive = None
            if doc["parameters"] is not None:
                archive = (doc["parameters"]["scope"], Path(params) if params else path.with_suffix(".irpa"))
            function = EmulatedFunction(self.emulator, path, name, max(used) + 1 if used else 0, archive)
            calls[name] = IreeCompiled(plan, function, "", b"")
        return EmulatedModule(calls)


def _tool_cache() -> Path:
    base = os.environ.get(CACHE_ENV) or os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / ("" if os.environ.get(CACHE_ENV) else "fx-rewrites/test-tools")


def aarch64_run_module() -> Path:
    """IREE's aarch64 `iree-run-module`, of the installed runtime's version: from the cache, else from the
    aarch64 `iree-base-runtime` wheel on PyPI (pip download, unzipped into the cache)."""
    runtime = version("iree-base-runtime")
    tool = _tool_cache() / f"iree-base-runtime-{runtime}-aarch64" / "iree-run-module"
    if tool.is_file():
        return tool
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"iree-base-runtime=={runtime}",
        "--platform",
        WHEEL_PLATFORM,
        "--only-binary=:all:",
        "--no-deps",
        "-q",
    ]
    with tempfile.TemporaryDirectory(prefix="fxr-wheel-") as tmp:
        proc = subprocess.run([*command, "-d", tmp], capture_output=True, text=True, timeout=600, check=False)
        wheels = list(Path(tmp).glob("iree_base_runtime-*.whl"))
        if proc.returncode != 0 or not wheels:
            missing(
                f"the aarch64 iree-base-runtime {runtime} wheel could not be downloaded ({proc.stderr.strip()[-300:]})",
                f"{' '.join(command)} -d DIR, then unzip its {TOOL} to {tool}",
            )
        tool.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(TOOL) as src, open(tmp + "/tool", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.chmod(tmp + "/tool", 0o755)
        shutil.move(tmp + "/tool", tool)  # whole or not at all: another run may be reading the cache
    return tool


def aarch64_emulator(cpu: str = "cortex-a53") -> Emulator:
    """qemu-aarch64 running IREE's aarch64 iree-run-module on `cpu` (default an ARMv8.0-A core with NEON and
    nothing newer: code for the generic `aarch64` target must run on it)."""
    qemu = require_program("qemu-aarch64", "qemu-aarch64-static", hint=QEMU_HINT)
    for library in ("lib/ld-linux-aarch64.so.1", "lib/libstdc++.so.6"):
        if not (SYSROOT / library).exists():
            missing(f"no aarch64 {Path(library).name} in {SYSROOT} for qemu-aarch64 -L", SYSROOT_HINT)
    return Emulator(qemu, aarch64_run_module(), SYSROOT, cpu)


def x86_emulator(cpu: str) -> Emulator:
    """qemu-x86_64 running this machine's (x86-64) iree-run-module, from the installed runtime, on `cpu`
    ("Haswell-noTSX": AVX2 and no AVX-512)."""
    import iree._runtime_libs

    qemu = require_program("qemu-x86_64", "qemu-x86_64-static", hint=QEMU_HINT)
    return Emulator(qemu, Path(iree._runtime_libs.__file__).parent / "iree-run-module", None, cpu)
