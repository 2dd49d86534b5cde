"""Running `iree-compile` on a module with a time limit (the same command line as `iree.compiler.compile_str`).

IREE's own `compile_str` waits for the compiler without a limit, and some
modules make iree-compile 3.13 spin without end (softmax of a 0-d tensor:
docs/iree-3.13-findings.md, section 11): a user's compile would hang. Here
the compiler runs in its own process group, killed with everything it
started once the limit passes; `IreeCompileTimeout` says what to do. The
limit is `IreeBackend(compile_timeout_s=...)`, by default
`$FX_REWRITES_IREE_COMPILE_TIMEOUT` seconds or `DEFAULT_TIMEOUT_S`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from fx_rewrites.backends.iree.errors import IreeCompileError
from fx_rewrites.backends.iree.memory import killed_error

log = logging.getLogger(__name__)

#: environment variable: iree-compile's time limit in seconds ("0" or "none": no limit)
TIMEOUT_ENV = "FX_REWRITES_IREE_COMPILE_TIMEOUT"
#: the limit when the variable is unset: the zoo's largest models compile in ~4 min on 2 loaded cores
DEFAULT_TIMEOUT_S = 1800.0
#: how often a running compile is logged (logger `fx_rewrites.backends.iree.invoke`, level INFO)
HEARTBEAT_S = 60.0


class IreeCompileTimeout(IreeCompileError):
    """`iree-compile` ran past its time limit and was stopped; `seconds` is the limit."""

    def __init__(self, message: str, *, mlir: str, seconds: float) -> None:
        super().__init__(message, diagnostics="", mlir=mlir, op="", node="")
        self.seconds = seconds


class IreeCompilerFailed(Exception):
    """iree-compile exited with an error; `diagnostics` is what it printed (the backend makes it readable)."""

    def __init__(self, diagnostics: str) -> None:
        super().__init__(diagnostics)
        self.diagnostics = diagnostics


def default_timeout() -> float | None:
    """`$FX_REWRITES_IREE_COMPILE_TIMEOUT` as seconds (None: no limit), else `DEFAULT_TIMEOUT_S`."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    if text.lower() in ("0", "none"):
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: expected seconds (e.g. 3600), or 0 / none for no limit") from None
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: expected seconds > 0, or 0 / none for no limit")
    return seconds


#: the phase after which `run_iree_compile(between=...)` stops the compile, runs its passes and goes on
BETWEEN_PHASE = "global-optimization"


def run_iree_compile(
    iree: Any,
    mlir: str,
    target_backend: str,
    flags: Sequence[str],
    timeout_s: float | None,
    *,
    between: str | None = None,
) -> bytes:
    """The vmfb of `mlir` (torch dialect) built for `target_backend` with `flags`, within `timeout_s` seconds.
    `between`: an `iree-opt` pass pipeline run on the module as it stands after `BETWEEN_PHASE` (the compile
    then runs as iree-compile to that phase, iree-opt, and iree-compile from it, within the same limit).

    Raises `IreeCompilerFailed` (the compiler's stderr) when it exits with an
    error, `IreeCompileTimeout` when it runs past the limit, `IreeMemoryError`
    when something else killed it (SIGKILL: the OOM killer). `IREE_SAVE_TEMPS`
    keeps the input and the command line, as `compile_str` does.
    """
    core = iree.compiler.tools.core
    options = core.CompilerOptions(input_type="torch", target_backends=[target_backend], extra_args=list(flags))
    with core.TempFileSaver.implicit() as temps:
        command = core.build_compile_command_line("-", temps, options)
        for name, text in (("core-input.mlir", mlir), ("core-command-line.txt", " ".join(command))):
            kept = temps.alloc_optional(name)
            if kept:
                with open(kept, "w") as f:
                    f.write(text)
        if between is None:
            return _run(command, mlir.encode(), timeout_s, mlir)
        start = time.monotonic()

        def left() -> float | None:
            return None if timeout_s is None else max(timeout_s - (time.monotonic() - start), 0.0)

        middle = _run([*command, f"--compile-to={BETWEEN_PHASE}"], mlir.encode(), left(), mlir)
        optimizer = core.find_tool("iree-opt")
        middle = _run([optimizer, "-", f"--pass-pipeline={between}", "--mlir-print-debuginfo"], middle, left(), mlir)
        return _run([*command, f"--compile-from={BETWEEN_PHASE}"], middle, left(), mlir)


def _run(command: list[str], data: bytes, timeout_s: float | None, mlir: str) -> bytes:
    """What `command` writes to stdout given `data`, within `timeout_s` seconds (`run_iree_compile`'s errors)."""
    stdout, stderr, returncode = _communicate(command, data, timeout_s, mlir)
    if returncode == -signal.SIGKILL:  # not our limit (that raised already): the OOM killer, most likely
        raise killed_error(returncode)
    if returncode != 0:
        raise IreeCompilerFailed(stderr.decode(errors="replace"))
    if stderr.strip():
        sys.stderr.write(stderr.decode(errors="replace"))  # warnings, as compile_str passes them on
    return stdout


def _communicate(command: list[str], data: bytes, timeout_s: float | None, mlir: str) -> tuple[bytes, bytes, int]:
    start = time.monotonic()
    proc = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        pending: bytes | None = data
        while True:
            elapsed = time.monotonic() - start
            wait = HEARTBEAT_S if timeout_s is None else min(HEARTBEAT_S, max(timeout_s - elapsed, 0.0))
            try:
                stdout, stderr = proc.communicate(pending, timeout=wait)
                return stdout, stderr, proc.returncode
            except subprocess.TimeoutExpired:
                pending = None  # sent on the first call; communicate keeps what it has read
                elapsed = time.monotonic() - start
                if timeout_s is not None and elapsed >= timeout_s:
                    raise _timeout(timeout_s, mlir) from None
                limit = "no limit" if timeout_s is None else f"limit {timeout_s:.0f} s"
                log.info("iree-compile has run %.0f s (%s, pid %d)", elapsed, limit, proc.pid)
    finally:
        if proc.poll() is None:  # stopped by the limit, or by an exception here (KeyboardInterrupt)
            _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def _timeout(seconds: float, mlir: str) -> IreeCompileTimeout:
    return IreeCompileTimeout(
        f"iree-compile ran past its limit of {seconds:.0f} s and was stopped. Some modules make IREE 3.13's "
        "compiler spin without end (softmax of a 0-d tensor, docs/iree-3.13-findings.md section 11): apply the "
        "backend's rules first (fx_rewrites.apply(program, backend.rules), as fx_rewrites.compile does), and "
        "if the module is only large, raise the limit: IreeBackend(compile_timeout_s=...) or "
        f"{TIMEOUT_ENV}=<seconds> (0 for none)",
        mlir=mlir,
        seconds=seconds,
    )
