"""Will a step fit in memory? An estimate before the import, iree-compile and the load, and a named error.

The estimates are upper bounds measured on llvm-cpu (benchmarks/scale.py): a
weight frozen inline costs its bytes about 2x as MLIR hex text, again as the
bytes sent to iree-compile, and iree-compile holds it several times while it
folds and packs constants (docs/deploy.md, "Memory"); a weight bound as a
parameter costs the runtime one copy at load and nothing before. When the
estimate passes what the machine has (`/proc/meminfo` MemAvailable, and the
cgroup's limit less its usage), `IreeMemoryError` says what was being built,
how big it is and what to do, instead of the process being OOM-killed.
`$FX_REWRITES_IREE_MEMORY_CHECK=0` turns the check off.
"""

from __future__ import annotations

import os
from pathlib import Path

from fx_rewrites.backends.iree.errors import IreeMemoryError

#: environment variable: "0" or "off" skips the check (the estimate may be wrong for a model)
CHECK_ENV = "FX_REWRITES_IREE_MEMORY_CHECK"
#: bytes of process memory per byte of inline weight, import through iree-compile (text, its bytes, the
#: compiler's copies): measured 22.9 GB peak for 3.8 GB inline (issue 25), rounded up
INLINE_FACTOR = 6
#: what iree-compile needs besides the weights: 0.20 GB measured for a 1B decoder's module (weights as
#: parameters, benchmarks/scale.py), rounded up; low, so that a small machine is not refused a small compile
COMPILER_BASE = 256 << 20


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_available() -> int | None:
    """The cgroup (v2, else v1) limit less its usage, when a limit is set."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit_text = Path(limit_file).read_text().strip()
            if limit_text == "max":
                return None
            limit, usage = int(limit_text), int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 1 << 60:  # v1's "no limit"
            return None
        return max(limit - usage, 0)
    return None


def available() -> int | None:
    """Bytes this process can still allocate (None when the system does not say)."""
    values = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
    return min(values) if values else None


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def check(step: str, what: str, needed: int, fix: str) -> None:
    """Raise `IreeMemoryError` when `needed` bytes for `step` (building `what`) exceed what is available."""
    if os.environ.get(CHECK_ENV, "").strip().lower() in ("0", "off", "no", "false"):
        return
    free = available()
    if free is None or needed <= free:
        return
    raise IreeMemoryError(
        f"{step} of {what} would need about {_gb(needed)} of memory and this machine has {_gb(free)} available "
        f"(MemAvailable / the cgroup's limit); stopped before the kernel's OOM killer would. Fix: {fix} "
        f"(or {CHECK_ENV}=0 to try anyway)",
        step=step,
        needed=needed,
        available=free,
    )


def compile_estimate(inline_bytes: int) -> int:
    """Bytes the import and iree-compile of a module with `inline_bytes` of inline weights need at most."""
    return INLINE_FACTOR * inline_bytes + COMPILER_BASE


def killed_error(returncode: int, inline_bytes: int | None = None) -> IreeMemoryError:
    """iree-compile died of SIGKILL that was not ours: the OOM killer, most likely."""
    size = f" (with {_gb(inline_bytes)} of weights inline)" if inline_bytes else ""
    free = available()
    return IreeMemoryError(
        f"iree-compile was killed by signal {-returncode} (SIGKILL) while compiling{size}: most likely the "
        f"kernel's OOM killer, the machine running out of memory ({_gb(free) if free else 'unknown'} available "
        "now). Fix: close what else uses memory, compile a smaller batch or sequence length, or raise the "
        "machine's memory; weights over the inline limit are already parameters (parameters.INLINE_LIMIT)",
        step="iree-compile",
        available=free or 0,
    )
