"""`--isa avx2|avx512|host` for the benchmarks: which CPU vector ISA is measured, on any x86 host (issue 32).

    parser = argparse.ArgumentParser(); cpu_isa.add_argument(parser); args = parser.parse_args(argv)
    if (rc := cpu_isa.run_in_child(args.isa, __file__, argv)) is not None:
        return rc                                  # AVX2 asked on an AVX-512 host: measured in a child
    backend = cpu_isa.backend(args.isa, driver="local-sync")
    print(cpu_isa.header(args.isa))                # the CPU, its vector extensions, the ISA measured

IREE compiles for the ISA's llvm-cpu target (`targets.llvm_cpu(isa)`: this
CPU where it has the ISA, else `--iree-llvmcpu-target-cpu=znver3` for AVX2,
without AMD's SSE4a, which an Intel host lacks; with that ISA's measured
flags and performance rules). torch runs at the
ISA's width: on an AVX-512 host, AVX2 is measured in a child process of the
same script whose ATen kernels (`ATEN_CPU_CAPABILITY=avx2`), oneDNN
(`ONEDNN_MAX_CPU_ISA=AVX2_VNNI`: AVX2's float kernels; on a VNNI host plain
`AVX2` would give `_int_mm` oneDNN's AVX2 int8 GEMM, whose 16-bit sums
overflow, pytorch#136746, where a real AVX2 CPU takes torch's exact
reference kernel), MKL's sgemm (`MKL_ENABLE_INSTRUCTIONS=AVX2`) and
Inductor's C++ (`ATEN_CPU_CAPABILITY` picks its vector width,
`TORCHINDUCTOR_CPP_MARCH=znver3` its `-march`) are held to AVX2; `header`
checks torch's capability in that child, and
`tests/backends/iree/test_targets.py` that the AVX2 target's code has no
zmm register.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ISAS = ("host", "avx2", "avx512")
#: `--isa both`: each of these measured in a child of its own, one table side by side (`each`)
BOTH = ("avx512", "avx2")
#: what holds torch to AVX2 on a wider CPU (read when torch, oneDNN and MKL start: set before the process)
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "TORCHINDUCTOR_CPP_MARCH": "znver3",
}
#: torch's name for each ISA (`torch.backends.cpu.get_cpu_capability()`)
TORCH_CAPABILITY = {"avx2": "AVX2", "avx512": "AVX512"}
#: the lscpu flags a table names
VECTOR_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "bmi2",
    "sse4a",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "asimd",
    "sve",
)


def add_argument(parser: argparse.ArgumentParser, both: bool = False) -> None:
    """`--isa` (and, where the script renders both ISAs side by side, `--isa both`, with `--json` for its children)."""
    parser.add_argument(
        "--isa",
        choices=(*ISAS, "both") if both else ISAS,
        default="host",
        help="the vector ISA measured: host (this CPU's), avx2 (on an AVX-512 host: IREE compiled for znver3, "
        "torch held to AVX2 in a child process), avx512" + (", both (AVX-512 and AVX2 side by side)" if both else ""),
    )
    if both:
        parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")


def add_without_argument(parser: argparse.ArgumentParser) -> None:
    """`--also-without FLAG|RULE[,...]`: also the route without the ISA's performance flags that contain each FLAG (a
    substring: `im2col`, `ukernels`), or without the performance rule named RULE, timed in the same interleaved
    rounds (`without`). `RULE/RULE2+FLAG`: without those rules and with the performance flag of any ISA's table
    containing FLAG (`pointwise_conv_as_matmul/conv_as_im2col_matmul+im2col`: AVX-512 with IREE's global im2col
    instead of the rules; `+im2col`: the route plus that flag); `+RULE`, a performance rule the ISA does not take
    (`performance.ALL`), adds that rule (`+conv_as_im2col_matmul` on AVX2). `f32_x_pad=P` (not a "without"): the
    route with the float32 kernel's x rows copied to K + P floats apart where K is a multiple of 512 and N at least
    1024, on every ISA (`f32_dispatch.X_PAD`: by default 16 on AVX-512, 0 on AVX2); `f32_prefetch=L`: the route with
    the float32 kernel's next weight block prefetched at locality L (0: none) on every ISA (`f32_dispatch.PREFETCH`:
    by default 2 on both)."""
    parser.add_argument(
        "--also-without",
        default="",
        metavar="FLAG|RULE[,...]",
        help="also time the route without each of the ISA's performance flags containing FLAG (e.g. im2col), or "
        "without the ISA's performance rule RULE (e.g. depthwise_conv_as_row_partials), in the same rounds",
    )


def without(backend: Any, spec: str) -> dict[str, Any]:
    """For each comma-separated part of `spec`: the label `-<part>` and `backend` without the ISA's performance rule
    of that name (`RULE/RULE2+FLAG`: without those rules, with the performance flag of any ISA containing FLAG, or
    with the performance rule named FLAG where the ISA lacks it, after its own), or else without its
    performance flags containing it (a substring), with a fresh compile cache.
    Raises where a part names none of its rules and none of its flags."""
    import attrs

    from fx_rewrites.backends.iree import CompileCache
    from fx_rewrites.backends.iree.rules import performance
    from fx_rewrites.ruleset import Phases, RuleSet

    perf = performance.for_target(backend.target.name, backend.target.isa)
    out: dict[str, Any] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part.startswith("f32_x_pad="):  # the float32 kernel's x rows copied to K + P floats apart (X_PAD)
            from fx_rewrites.backends.iree import f32_dispatch

            fresh = attrs.evolve(backend, cache=CompileCache())
            pad = int(part.split("=")[1])
            out[f"-{part}"] = _Patched(fresh, f32_dispatch.X_PAD, dict.fromkeys(f32_dispatch.X_PAD, pad))
            continue
        if part.startswith("f32_prefetch="):  # the float32 kernel's weight prefetch, its locality (PREFETCH)
            from fx_rewrites.backends.iree import f32_dispatch

            fresh = attrs.evolve(backend, cache=CompileCache())
            locality = int(part.split("=")[1])
            out[f"-{part}"] = _Patched(fresh, f32_dispatch.PREFETCH, dict.fromkeys(f32_dispatch.PREFETCH, locality))
            continue
        part, *added = part.split("+")
        names = [name for name in part.split("/") if name]  # none: `+FLAG`, the route plus that flag
        if (names or added) and all(name in perf.names() for name in names):  # the ISA's performance set less them
            rules = [a for a in added if a in performance.ALL.names() and a not in perf.names()]
            chosen = RuleSet([*perf.without(*names), *(performance.ALL[a] for a in rules)], name=perf.name)
            sets = [chosen if s is perf else s for s in backend.rules.sets]
            out["+".join((f"-{part}", *added))] = attrs.evolve(
                backend,
                rules=Phases(*sets, name=backend.rules.name),
                perf_flags=(*backend.perf_flags, *(_any_isa_flag(a) for a in added if a not in rules)),
                cache=CompileCache(),
            )
            continue
        if added:
            raise SystemExit(f"--also-without {part}+...: '+FLAG' follows a rule's name only")
        kept = tuple(f for f in backend.perf_flags if part not in f)
        if len(kept) == len(backend.perf_flags):
            raise SystemExit(
                f"--also-without {part}: no performance rule of the ISA has that name ({perf.names()}) and none of "
                f"its flags contains it ({backend.perf_flags})"
            )
        out[f"-{part}"] = attrs.evolve(backend, perf_flags=kept, cache=CompileCache())
    return out


class _Patched:
    """`backend` compiling with the entries `values` set in `table` (a kernel's constant against its default)."""

    def __init__(self, backend: Any, table: dict[str, Any], values: dict[str, Any]) -> None:
        self._backend, self._table, self._values = backend, table, values

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def compile(self, *args: Any, **kwargs: Any) -> Any:
        from unittest import mock

        with mock.patch.dict(self._table, self._values):
            return self._backend.compile(*args, **kwargs)


def _any_isa_flag(part: str) -> str:
    """The one performance flag of any ISA's table (`targets.CPU_ISAS`) containing `part`; `part` itself where it is
    a whole flag (`--iree-...`)."""
    from fx_rewrites.backends.iree.targets import CPU_ISAS

    if part.startswith("--iree-"):
        return part

    found = sorted({f for isa in CPU_ISAS.values() for f in isa.perf_flags if part in f})
    if len(found) != 1:
        raise SystemExit(f"--also-without RULE+{part}: {len(found)} performance flags contain {part!r}: {found}")
    return found[0]


def resolve(isa: str) -> str:
    """`isa` with "host" replaced by the ISA the library builds for by default: this host's ("avx512", "avx2"; ""
    for another CPU), or the one `FX_REWRITES_IREE_ISA` names (the suite run as an AVX2 machine would run it, on an
    AVX-512 host)."""
    if isa != "host":
        return isa
    from fx_rewrites.backends.iree.targets import TARGETS

    return TARGETS["llvm-cpu"].isa or ""  # the default target's ISA: read from the variable once, at import


def emulated(isa: str) -> bool:
    """Whether `isa` is narrower than this host's: measured with torch held to it (AVX2 on an AVX-512 host)."""
    from fx_rewrites.backends.iree.targets import host_isa

    return resolve(isa) == "avx2" and host_isa() == "avx512"


def run_in_child(isa: str, script: str, argv: Sequence[str] | None) -> int | None:
    """Where `isa` must be emulated and this process's torch runs wider, run `script` with `argv` again in a child
    with `AVX2_ENV` and return its exit status; None where this process measures `isa` itself. Raises where
    the host cannot run `isa` at all."""
    from fx_rewrites.backends.iree.targets import host_isa

    wanted = resolve(isa)
    if isa != "host" and wanted == "avx512" and host_isa() != "avx512":
        raise SystemExit(f"--isa avx512: this CPU ({cpu_model()}) has no AVX-512; measure it on an AVX-512 host")
    if not emulated(isa) or all(os.environ.get(k) == v for k, v in AVX2_ENV.items()):
        return None
    args = list(sys.argv[1:] if argv is None else argv)
    env = {**os.environ, **AVX2_ENV}
    print(f"[--isa {isa}: measured in a child process with {' '.join(f'{k}={v}' for k, v in AVX2_ENV.items())}]")
    sys.stdout.flush()
    return subprocess.run([sys.executable, script, *args], env=env, check=False).returncode


def each(script: str, argv: Sequence[str] | None, isas: Sequence[str] = BOTH) -> dict[str, Any]:
    """`--isa both`: `script` run with `argv` once per ISA in `isas`, each in a child (`--isa I --json F`); the
    rows each wrote (JSON), by ISA."""
    args = list(sys.argv[1:] if argv is None else argv)
    rest, skip = [], False
    for a in args:  # drop --isa both and --json F: each child gets its own
        if skip:
            skip = False
            continue
        if a in ("--isa", "--json"):
            skip = True
            continue
        if not a.startswith(("--isa=", "--json=")):
            rest.append(a)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for isa in isas:
            path = Path(tmp) / f"{isa}.json"
            done = subprocess.run([sys.executable, script, *rest, "--isa", isa, "--json", str(path)], check=False)
            if done.returncode or not path.is_file():
                raise SystemExit(f"--isa {isa}: {Path(script).name} exited {done.returncode}")
            out[isa] = json.loads(path.read_text())
    return out


def target(isa: str) -> Any:
    """The llvm-cpu `IreeTarget` for `isa` (`targets.llvm_cpu`)."""
    from fx_rewrites.backends.iree.targets import llvm_cpu

    return llvm_cpu(resolve(isa) or "host")


def backend(isa: str, **kwargs: Any) -> Any:
    """An `IreeBackend` (name "iree") for `isa`'s llvm-cpu target: its flags and performance rules; `kwargs`
    go to IreeBackend (driver, cache, state, ...)."""
    from fx_rewrites.backends.iree import IreeBackend

    return IreeBackend(name="iree", target=target(isa), **kwargs)


def torch_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def check(isa: str) -> None:
    """Raise where this process's torch does not run at `isa`'s width (the emulation did not take)."""
    wanted = TORCH_CAPABILITY.get(resolve(isa))
    got = torch_capability()
    if wanted is not None and got != wanted:
        raise SystemExit(
            f"--isa {isa}: torch runs {got} kernels here, expected {wanted} (run the script itself, which starts "
            f"a child with {AVX2_ENV}, or set those variables before Python starts)"
        )


def cpu_model() -> str:
    """lscpu's model name, the vector extensions its flags list, and the core count."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown").strip()
    flags = fields.get("Flags", "").split()
    vector = [f for f in VECTOR_FLAGS if f in flags]
    return f"{name} ({', '.join(vector) or 'no AVX2'}), {os.cpu_count()} cores"


def measured(isa: str) -> str:
    """The ISA measured, and how: IREE's target CPU and flags, torch's kernels."""
    t = target(isa)
    cpu = " ".join(f.split("=", 1)[1] for f in t.flags if f.startswith("--iree-llvmcpu-target-cpu"))
    how = "torch held to AVX2 (" + ", ".join(f"{k}={v}" for k, v in AVX2_ENV.items()) + ")" if emulated(isa) else ""
    flags = " ".join(t.perf_flags) or "no performance flags"
    parts = [f"ISA measured: {(t.isa or 'generic').upper()}", f"IREE llvm-cpu target-cpu={cpu}, {flags}"]
    parts.append(f"torch {torch_capability()} kernels" + (f", {how}" if how else ""))
    return "; ".join(parts)


def header(isa: str) -> str:
    """One line for a table: the CPU, its vector extensions, the ISA measured and how. Checks torch's width."""
    check(isa)
    return f"CPU: {cpu_model()}. {measured(isa)}."
