"""The CPU an llvm-cpu module is built for, what it needs to run, and what this host has.

    backend = IreeBackend().for_cpu("x86-64-v3")      # code any AVX2 machine runs
    requirement(backend.flags)                        # {"target": "x86-64-v3", "arch": "x86_64", "features": [...]}
    check(requirement(backend.flags), "model.vmfb")   # IreeCpuError where this host lacks one of them

`CPUS` are the CPUs `fx_rewrites.compile(..., cpu=...)` and `fx-rewrites compile --target` take: `host`
(this machine, the default), `x86-64-v3` (AVX2, FMA, BMI: Haswell, Zen 1 and later), `x86-64-v4`
(AVX-512 F/BW/CD/DQ/VL: Skylake-SP, Zen 4 and later), `aarch64` (cross-compiled: a generic ARMv8-A CPU
with NEON). A saved module records its requirement in its call convention (`artifact.plan_json`) and
`fx_rewrites.load` checks it here before IREE maps the code: IREE 3.13 checks no CPU feature itself, and
x86-64-v4 code on an AVX2 CPU dies of SIGILL on its first AVX-512 instruction (seen under
`qemu-x86_64 -cpu Haswell`). Features are named as /proc/cpuinfo names them (`flags` on x86, `Features` on
ARM), the names `lscpu` prints: `host()` reads them, once, and is the one function that reads them.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from fx_rewrites.backends.iree.errors import IreeDeviceError

_CPU = "--iree-llvmcpu-target-cpu="
_FEATURES = "--iree-llvmcpu-target-cpu-features="
_TRIPLE = "--iree-llvmcpu-target-triple="

# The x86-64 psABI's micro-architecture levels (what `x86-64-v3` and `x86-64-v4` mean to LLVM), in /proc/cpuinfo
# names: SSE3 is `pni`, LZCNT `abm`, LAHF/SAHF `lahf_lm`.
X86_64_V2 = ("cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3")
X86_64_V3 = (*X86_64_V2, "abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave")
X86_64_V4 = (*X86_64_V3, "avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl")
#: ARMv8-A's floating point and Advanced SIMD (NEON): what LLVM's generic AArch64 CPU assumes
AARCH64_BASE = ("asimd", "fp")

#: the /proc/cpuinfo flags of instructions compiled code can use without intrinsics, which a `host` build records
#: (the rest, `hypervisor`, `tsc`, `rdrand`, ..., say nothing about what the code needs): x86's levels, every
#: AVX, AVX-512 and AMX extension (by prefix), AMD's SSE4a, FMA4, XOP and TBM (LLVM emitted SSE4a's insertq for
#: znver3), GFNI (LLVM's byte shifts); ARM's SIMD, dot-product, matrix and SVE/SME extensions (by prefix).
_X86_CODEGEN = (*X86_64_V4, "sse", "sse2", "sse4a", "fma4", "xop", "tbm", "adx", "gfni", "vaes", "vpclmulqdq")
_X86_PREFIXES = ("avx", "amx")
_ARM_CODEGEN = (
    *AARCH64_BASE,
    "fphp",
    "asimdhp",
    "asimdrdm",
    "asimddp",
    "asimdfhm",
    "atomics",
    "crc32",
    "fcma",
    "jscvt",
    "frint",
    "lrcpc",
    "i8mm",
    "bf16",
)
_ARM_PREFIXES = ("sve", "sme")


@attrs.frozen
class TargetCpu:
    """A CPU to build for: its name (`CPUS`), the iree-compile flags that say it, and what runs its code."""

    name: str
    flags: tuple[str, ...]
    description: str


CPUS: dict[str, TargetCpu] = {
    cpu.name: cpu
    for cpu in (
        TargetCpu("host", (f"{_CPU}host",), "this machine's CPU"),
        TargetCpu(
            "x86-64-v3",
            (f"{_TRIPLE}x86_64-linux-gnu", f"{_CPU}x86-64-v3"),
            "any x86-64 CPU with AVX2, FMA and BMI: Intel Haswell, AMD Zen 1 and later",
        ),
        TargetCpu(
            "x86-64-v4",
            (f"{_TRIPLE}x86_64-linux-gnu", f"{_CPU}x86-64-v4"),
            "any x86-64 CPU with AVX-512 F/BW/CD/DQ/VL: Intel Skylake-SP, AMD Zen 4 and later",
        ),
        TargetCpu(
            "aarch64",
            (f"{_TRIPLE}aarch64-linux-gnu", f"{_CPU}generic"),
            "any 64-bit ARM CPU, ARMv8-A with NEON: AWS Graviton, Ampere Altra, a Raspberry Pi 4",
        ),
    )
}


# ----------------------------------------------------------------------------- this host


@attrs.frozen
class HostCpu:
    """This machine's CPU: `arch` ("x86_64", "aarch64"), `model` (/proc/cpuinfo's `model name`, else
    `CPU part`) and `features` (its `flags`, or `Features` on ARM)."""

    arch: str
    model: str
    features: frozenset[str]


def host() -> HostCpu:
    """This machine's CPU, read from /proc/cpuinfo once. Every reader of the host's CPU features goes through
    this function (tests replace it to play another machine)."""
    return _read_host()


@functools.cache
def _read_host() -> HostCpu:
    arch = normalized_arch(platform.machine())
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return HostCpu(arch, platform.processor(), frozenset())
    return parse_cpuinfo(text, arch)


def parse_cpuinfo(text: str, arch: str) -> HostCpu:
    """The CPU /proc/cpuinfo's `text` describes (its first processor's lines) on an `arch` machine."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or fields.get("CPU part", "") or platform.processor()
    return HostCpu(arch, model, frozenset((fields.get("flags") or fields.get("Features", "")).split()))


def normalized_arch(arch: str) -> str:
    """`platform.machine()` or a triple's first part as /proc and Linux name it: x86_64, aarch64, ..."""
    arch = arch.lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(arch, arch)


def codegen_features(arch: str, features: Iterable[str]) -> list[str]:
    """Of `features` (/proc/cpuinfo names), those of instructions compiled code may use, sorted (all of them
    for an architecture other than x86_64 and aarch64)."""
    if arch == "x86_64":
        names, prefixes = _X86_CODEGEN, _X86_PREFIXES
    elif arch == "aarch64":
        names, prefixes = _ARM_CODEGEN, _ARM_PREFIXES
    else:
        return sorted(set(features))
    return sorted(f for f in set(features) if f in names or f.startswith(prefixes))


def level(arch: str, features: frozenset[str]) -> str:
    """The highest of the CPUs in `CPUS` a CPU of `arch` with `features` runs, for messages ("x86-64-v3")."""
    if arch == "aarch64":
        return "aarch64" if features.issuperset(AARCH64_BASE) else "aarch64 without NEON"
    if arch != "x86_64":
        return arch
    for name, needs in (("x86-64-v4", X86_64_V4), ("x86-64-v3", X86_64_V3), ("x86-64-v2", X86_64_V2)):
        if features.issuperset(needs):
            return name
    return "x86-64"


# ----------------------------------------------------------------------------- what a module needs


def flags_for(cpu: str, flags: Sequence[str]) -> tuple[str, ...]:
    """`flags` (an llvm-cpu backend's) with their CPU, features and triple replaced by `cpu`'s (`CPUS`)."""
    if cpu not in CPUS:
        raise ValueError(f"cpu={cpu!r}: expected one of {', '.join(CPUS)}")
    kept = tuple(f for f in flags if not f.startswith((_CPU, _FEATURES, _TRIPLE)))
    return (*CPUS[cpu].flags, *kept)


def _value(flags: Sequence[str], prefix: str) -> str | None:
    found = [f[len(prefix) :] for f in flags if f.startswith(prefix)]
    return found[-1] if found else None


def requirement(flags: Sequence[str], *, on: HostCpu | None = None) -> dict[str, Any]:
    """What code iree-compile builds with `flags` (llvm-cpu) needs to run, as the call convention records it:
    `target` (the CPU name, "host" or an LLVM one), `arch`, `features` (/proc/cpuinfo names; None where not
    known: an LLVM CPU name outside `CPUS`, such as znver3) and, for `host`, `built_on` (the CPU's model).
    `on`: the machine compiling (default `host()`)."""
    on = on or host()
    triple = _value(flags, _TRIPLE)
    arch = normalized_arch(triple.split("-", 1)[0]) if triple else on.arch
    cpu = _value(flags, _CPU) or ("generic" if triple else "host")
    doc: dict[str, Any] = {"target": cpu, "arch": arch, "features": None}
    if any(f.startswith("+") for f in (_value(flags, _FEATURES) or "").split(",")):
        return doc  # features added to the CPU's own: not known in /proc/cpuinfo names, not checked
    if cpu == "host" and arch == on.arch:
        doc["features"] = codegen_features(arch, on.features)
        doc["built_on"] = on.model
    elif arch == "x86_64" and cpu in ("x86-64-v2", "x86-64-v3", "x86-64-v4"):
        doc["features"] = sorted({"x86-64-v2": X86_64_V2, "x86-64-v3": X86_64_V3, "x86-64-v4": X86_64_V4}[cpu])
    elif arch == "x86_64" and cpu in ("generic", "x86-64"):
        doc["features"] = []
    elif arch == "aarch64" and cpu == "generic":
        doc["target"] = "aarch64"
        doc["features"] = sorted(AARCH64_BASE)
    return doc


class IreeCpuError(IreeDeviceError):
    """A module built for another CPU: this host's architecture differs, or it lacks CPU features the code
    uses (running it would end in an illegal instruction). `target`, `arch` and `missing` say what the module
    needs and lacks here; `host` is this machine's CPU (`HostCpu`)."""

    def __init__(self, message: str, *, target: str, arch: str, missing: tuple[str, ...], host: HostCpu) -> None:
        super().__init__(message, driver="local-task", device="this host's CPU")
        self.target = target
        self.arch = arch
        self.missing = missing
        self.host = host


def describe(record: Mapping[str, Any]) -> str:
    """`record` (a `requirement`) in words: "x86-64-v4 (any x86-64 CPU with AVX-512 ...)"."""
    target = record.get("target", "?")
    if target == "host":
        return f"the CPU it was compiled on ({record.get('built_on') or record.get('arch')})"
    known = CPUS.get(target)
    return f"{target} ({known.description})" if known else f"{target} ({record.get('arch')})"


def why_not_here(record: Mapping[str, Any] | None, source: str = "this module") -> IreeCpuError | None:
    """The error loading code that needs `record` on this host would be, or None where it runs here (or
    the record is absent: a file saved before modules recorded their CPU)."""
    if not record:
        return None
    here = host()
    arch, needs = record.get("arch"), record.get("features")
    fixes = (
        "Fix: compile it for a CPU this machine runs (fx_rewrites.compile(..., cpu='host'), or "
        "cpu='x86-64-v3' for a file any AVX2 machine runs; `fx-rewrites compile --target ...`)"
    )
    if arch and arch != here.arch:
        return IreeCpuError(
            f"{source} was compiled for {describe(record)}; this machine is {here.arch} "
            f"({here.model or 'CPU model unknown'}), which cannot run {arch} code. Fix: run it on an {arch} machine "
            "(docs/deploy.md, 'Other CPUs'), or compile it for this one (cpu='host')",
            target=str(record.get("target")),
            arch=arch,
            missing=(),
            host=here,
        )
    if needs is None or not here.features:  # not known what it needs, or what this host has: IREE decides
        return None
    missing = tuple(sorted(set(needs) - here.features))
    if not missing:
        return None
    has = codegen_features(here.arch, here.features)
    return IreeCpuError(
        f"{source} was compiled for {describe(record)} and uses CPU features this machine lacks: "
        f"{', '.join(missing)}. This machine ({here.model or here.arch}) is {level(here.arch, here.features)}, "
        f"with {' '.join(has) or 'none of the vector extensions'}; the code would stop at its first such "
        f"instruction (SIGILL, illegal instruction). {fixes}, on this machine or the one that wrote the file",
        target=str(record.get("target")),
        arch=str(arch),
        missing=missing,
        host=here,
    )


def check(record: Mapping[str, Any] | None, source: str = "this module") -> None:
    """Raise `IreeCpuError` where code that needs `record` (a `requirement`) cannot run on this host."""
    error = why_not_here(record, source)
    if error is not None:
        raise error


__all__ = [
    "CPUS",
    "HostCpu",
    "IreeCpuError",
    "TargetCpu",
    "check",
    "codegen_features",
    "describe",
    "flags_for",
    "host",
    "level",
    "parse_cpuinfo",
    "requirement",
    "why_not_here",
]
