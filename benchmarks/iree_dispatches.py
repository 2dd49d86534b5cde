"""Where an IREE llvm-cpu module spends its time, dispatch by dispatch.

    python benchmarks/iree_dispatches.py whisper_encoder          # a benchmarks/runtime_models.py model
    python benchmarks/iree_dispatches.py vit --quick --top 10
    python benchmarks/iree_dispatches.py vit --isa avx2       # the code IREE makes for an AVX2 CPU (znver3)

The model is exported and rewritten by the default `iree` rules, then
compiled with the backend's flags and performance flags twice:
`--compile-to=stream` gives how many times `main` launches each executable,
and `--iree-hal-dump-executable-benchmarks-to` gives each executable as a
module of its own, which `iree-benchmark-module` times (median CPU time of 5, one
thread, `local-sync`); executables only the module's initializer runs (weights
packed once at load) are left out. A row is calls x median ms per call; the total is
what the dispatches cost without the runtime around them (compare it with
`iree-benchmark-module` on the whole module). Times on this shared machine
move with its load: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent))

UNITS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
#: `BM_<executable>_embedded_elf_<arch>_<function>/process_time/real_time_median  <wall> <unit>  <cpu> <unit>`:
#: the CPU time column, which other processes' load on a shared machine moves less than the wall time
#: (one thread, local-sync: the process's CPU time is the dispatch's)
MEDIAN = re.compile(r"BM_(\S+?)_embedded_elf_\w+?_64_(\S+)/process_time/real_time_median\s+[\d.]+ \w+\s+([\d.]+) (\w+)")


@attrs.frozen
class Dispatch:
    """One executable of the module: how often `main` runs it and its median time per run."""

    name: str
    calls: int
    ms: float

    @property
    def total_ms(self) -> float:
        return self.calls * self.ms


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SystemExit(f"{name} is not on PATH: install iree-base-compiler and iree-base-runtime (pip)")
    return path


def _run(args: list[Any]) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{Path(str(args[0])).name} failed:\n{done.stderr[-2000:]}")
    return done


def _calls_per_run(stream: str) -> collections.Counter:
    """Dispatches per executable in the module's functions, not its initializers (weights packed once at load)."""
    calls: collections.Counter = collections.Counter()
    depth = 0  # brace depth inside a util.initializer, 0 outside
    for line in stream.splitlines():
        if depth == 0 and "util.initializer" in line:
            depth = line.count("{") - line.count("}")
            continue
        if depth:
            depth += line.count("{") - line.count("}")
            continue
        calls.update(re.findall(r"stream\.cmd\.dispatch @([\w$]+)::", line))
    return calls


def profile(
    mlir: str, flags: list[str], workdir: Path, *, repetitions: int = 5, min_time: str | None = None
) -> list[Dispatch]:
    """Every executable of torch-dialect `mlir` compiled for llvm-cpu with `flags`, most costly first: the median
    of `repetitions` (at least 2) runs of iree-benchmark-module each, run for `min_time` (`"0.01s"`; default
    google benchmark's) each."""
    source = workdir / "module.mlir"
    source.write_text(mlir)
    compile_ = [_tool("iree-compile"), "--iree-input-type=torch", "--iree-hal-target-backends=llvm-cpu", *flags]
    _run([*compile_, source, "--compile-to=stream", "-o", workdir / "stream.mlir"])
    calls = _calls_per_run((workdir / "stream.mlir").read_text())
    dumps = workdir / "executables"
    cpu = [f for f in flags if f.startswith("--iree-llvmcpu-target-cpu")]  # the other flags shaped what was dumped
    _run([*compile_, source, "-o", workdir / "module.vmfb", f"--iree-hal-dump-executable-benchmarks-to={dumps}"])
    found = []
    for bench in sorted(dumps.glob("*.mlir")):
        vmfb = bench.with_suffix(".vmfb")
        try:
            _run([compile_[0], "--iree-hal-target-backends=llvm-cpu", *cpu, bench, "-o", vmfb])
        except RuntimeError as e:  # a dumped benchmark IREE cannot build again: say so, keep the others
            why = next((line for line in str(e).splitlines() if "error:" in line), str(e).splitlines()[-1])
            print(f"(not timed: {bench.name}: {why.split('error:', 1)[-1].strip()[:160]})", file=sys.stderr)
            continue
        timing = [f"--benchmark_repetitions={max(2, repetitions)}"]  # the median needs two
        timing += [f"--benchmark_min_time={min_time}"] if min_time else []
        out = _run([_tool("iree-benchmark-module"), f"--module={vmfb}", "--device=local-sync", *timing]).stdout
        for executable, function, time, unit in MEDIAN.findall(out):
            if calls.get(executable):  # an executable only an initializer runs costs nothing per call
                found.append(Dispatch(function, calls[executable], float(time) * UNITS[unit]))
    return sorted(found, key=lambda d: -d.total_ms)


def table(dispatches: list[Dispatch], top: int) -> str:
    """A markdown table of the `top` costliest dispatches and the total of all."""
    lines = ["| ms in all | calls | ms a call | dispatch |", "|---:|---:|---:|---|"]
    for d in dispatches[:top]:
        lines.append(f"| {d.total_ms:.2f} | {d.calls} | {d.ms:.3f} | `{d.name}` |")
    total = sum(d.total_ms for d in dispatches)
    lines.append(f"| **{total:.2f}** | | | all {len(dispatches)} executables |")
    return "\n".join(lines)


def model_mlir(name: str, quick: bool, isa: str = "host") -> tuple[str, list[str]]:
    """A benchmark model exported, rewritten by the rules of IREE's llvm-cpu target for `isa` (benchmarks/cpu_isa.py),
    imported; and that target's compile flags. Only IREE's code depends on the ISA: no torch kernel is timed here,
    so any host profiles either ISA's code (AVX-512 code needs an AVX-512 host to run)."""
    import cpu_isa
    import torch
    from runtime_models import MODELS

    import fx_rewrites
    from fx_rewrites.backends.iree import kernels
    from fx_rewrites.backends.iree.importing import import_mlir, iree_modules
    from fx_rewrites.backends.iree.preparing import prepare_program

    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}: one of {', '.join(MODELS)}")
    spec = MODELS[name]
    pos, kw = spec.inputs(quick, 0)
    program = torch.export.export(spec.model(quick), pos, kw)
    iree = cpu_isa.backend(isa)
    rewritten = fx_rewrites.apply(program, iree.rules).program
    mlir = import_mlir(iree_modules(), prepare_program(rewritten)[0])
    # the hand-written dispatches spliced, as IreeBackend does (the AVX2 route's float32 linears are one)
    return kernels.spliced(str(mlir)), [*iree.flags, *iree.perf_flags]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a benchmarks/runtime_models.py model (bert, vit, whisper_encoder, ...)")
    parser.add_argument("--quick", action="store_true", help="the model at its tiny --quick size")
    parser.add_argument("--top", type=int, default=25, help="rows to print (default 25)")
    parser.add_argument(
        "--isa",
        choices=("host", "avx2", "avx512"),
        default="host",
        help="whose code: this CPU's, or IREE's for an AVX2 CPU (znver3) or an AVX-512 one (x86-64-v4)",
    )
    args = parser.parse_args(argv)
    mlir, flags = model_mlir(args.model, args.quick, args.isa)
    with tempfile.TemporaryDirectory() as tmp:
        print(table(profile(mlir, flags, Path(tmp)), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
