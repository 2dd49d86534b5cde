"""`fx-rewrites compile MODEL -o model.vmfb [--params model.irpa]`: a file iree-run-module runs."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from fx_rewrites.app.cli.commands import _outcome, _reference, _status_console
from fx_rewrites.app.cli.common import EXIT_FAIL, EXIT_PASS, InputError, _backend, _traceback
from fx_rewrites.app.cli.models import _load_model


def _writable(path: Path, flag: str) -> Path:
    if not path.parent.is_dir():
        raise InputError(f"cannot write {path} ({flag}): no directory {path.parent}. Fix: create it or pick another.")
    if path.is_dir():
        raise InputError(f"{path} ({flag}) is a directory. Fix: give a file name, e.g. {path / 'model.vmfb'}.")
    return path


def _size(path: Path) -> str:
    size = path.stat().st_size
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"


def run_command(compiled: object, vmfb: Path, params: Path | None, driver: str = "local-task") -> str:
    """The iree-run-module command line for the saved module (zero-filled inputs of the compiled shapes)."""
    from fx_rewrites.app.compile import example_inputs

    argv = ["iree-run-module", f"--device={driver}", f"--module={vmfb}", "--function=main"]
    if params is not None:
        argv.append(f"--parameters=model={params}")
    argv += [f"--input={value}" for value in example_inputs(compiled)]
    return " ".join(shlex.quote(a) for a in argv)


def cmd_compile(args: argparse.Namespace) -> int:
    """Export MODEL, apply the backend's rules, compile, compare with eager on the example inputs, save."""
    from fx_rewrites.app.compile import compile as compile_model
    from fx_rewrites.app.demo import verdict

    backend = _backend(args.backend)
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
        try:
            compiled = compile_model(program, inputs, kwargs, backend=backend)
            outcome, diff = verdict(compiled(*inputs, **kwargs), expected, args.rtol, args.atol)
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
    print(f"on the example inputs vs eager: {outcome} (max abs diff {diff:.2e})")
    print(f"wrote {out} ({_size(out)})" + (f" and {params} ({_size(params)}, the weights)" if params else ""))
    command = run_command(compiled, out, params, getattr(backend, "driver", "local-task"))
    print(f"in {time.perf_counter() - start:.1f} s. Run it:\n  {command}")
    print(f'or from Python: fx_rewrites.load("{out}"' + (f', params="{params}")' if params else ")"))
    return EXIT_PASS if outcome == "ok" else EXIT_FAIL
