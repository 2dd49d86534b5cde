"""`fx-rewrites compile MODEL -o model.vmfb [--params model.irpa]`: a file iree-run-module runs."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from fx_rewrites.app.cli.commands import _outcome, _reference, _status_console
from fx_rewrites.app.cli.common import EXIT_FAIL, EXIT_PASS, InputError, _backend, _traceback
from fx_rewrites.app.cli.models import _load_model, train_mode_hint


def _writable(path: Path, flag: str) -> Path:
    if not path.parent.is_dir():
        raise InputError(f"cannot write {path} ({flag}): no directory {path.parent}. Fix: create it or pick another.")
    if path.is_dir():
        raise InputError(f"{path} ({flag}) is a directory. Fix: give a file name, e.g. {path / 'model.vmfb'}.")
    return path


def _size(path: Path) -> str:
    size = path.stat().st_size
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"


def run_command(compiled: Any, vmfb: Path, params: Path | None, driver: str = "local-task") -> str:
    """The command line that runs the saved module, where the backend gives one (IREE: iree-run-module with
    zero-filled inputs of the compiled shapes), else ""."""
    command = getattr(compiled.runtime, "run_command", None)
    return command(vmfb, params, driver) if callable(command) else ""


def _cross_compiled(backend: Any, program: Any) -> Any:
    """`program` after the backend's rules, compiled for a device absent here (IREE's `artifact`: no device
    needed) and not loaded: it saves as a loaded one does, but cannot run."""
    from fx_rewrites.api import apply
    from fx_rewrites.app.compile import Compiled

    result = apply(program, backend.rules)
    return Compiled(backend.name, result.program, result.report, backend.unloaded(result.program))


def cmd_compile(args: argparse.Namespace) -> int:
    """Export MODEL, apply the backend's rules, compile, compare with eager on the example inputs, save. For a
    backend whose device is absent here (iree-cuda on a machine without a GPU), compile for it and save, and
    say that the comparison was not run."""
    from fx_rewrites.app.compile import compile as compile_model
    from fx_rewrites.app.demo import verdict
    from fx_rewrites.backends.base import BackendUnavailable, for_cpu

    try:
        backend = for_cpu(_backend(args.backend), args.target)
    except ValueError as e:
        raise InputError(f"--target {args.target}: {str(e).split(': ', 1)[-1]}") from None
    out = _writable(Path(args.output), "-o")
    params = _writable(Path(args.params), "--params") if args.params else None
    if params is not None and params.resolve() == out.resolve():
        raise InputError("-o and --params name the same file. Fix: give the weights their own .irpa file.")
    model = _load_model(args.model, args.inputs)
    start = time.perf_counter()
    with _status_console().status(f"compiling {model.label} for {backend.name}"):
        expected = _reference(model)
        program = model.program()  # exports; fails here (exit 2) when torch cannot
        inputs, kwargs = model.inputs()
        absent = ""  # why the module cannot run here (its device is absent, or it is for another CPU), when so
        compiled = None
        try:
            try:
                compiled = compile_model(program, inputs, kwargs, backend=backend)
                outcome, diff = verdict(compiled(*inputs, **kwargs), expected, args.rtol, args.atol)
            except BackendUnavailable as e:
                if compiled is None and not callable(getattr(backend, "artifact", None)):
                    raise
                absent = " ".join(str(e).split(". Compiling needs no device")[0].split(". Fix:")[0].split())
                if compiled is None:  # a device absent here: compiled without loading
                    compiled = _cross_compiled(backend, program)
                    absent = f"compiled for {backend.name} without running it ({absent})"
            compiled.save(out, params=params)
        except Exception as e:
            print(f"fx-rewrites compile: {_outcome(e)}")
            if args.verbose:
                print(_traceback(e))
                if getattr(e, "diagnostics", ""):
                    print(f"--- iree-compile's output\n{e.diagnostics}")
            else:
                print("(--verbose adds the traceback and the compiler's whole output)")
            return EXIT_FAIL
    fired = ", ".join(f"{k} x{v}" for k, v in sorted(compiled.report.rewrites.items())) or "none"
    print(f"rules fired: {fired}")
    if absent:
        print(f"not compared with eager: {absent}")
    else:
        print(f"on the example inputs vs eager: {outcome} (max abs diff {diff:.2e})")
        hint = train_mode_hint(model) if outcome != "ok" else ""
        if hint:
            print(f"note: {hint}")
    print(f"wrote {out} ({_size(out)})" + (f" and {params} ({_size(params)}, the weights)" if params else ""))
    command = run_command(compiled, out, params, getattr(backend, "driver", "local-task"))
    where = f" (on a machine that runs {compiled.cpu} code)" if absent and getattr(compiled, "cpu", None) else ""
    print(f"in {time.perf_counter() - start:.1f} s." + (f" Run it{where}:\n  {command}" if command else ""))
    print(f'or from Python: fx_rewrites.load("{out}"' + (f', params="{params}")' if params else ")"))
    return EXIT_PASS if absent or outcome == "ok" else EXIT_FAIL
