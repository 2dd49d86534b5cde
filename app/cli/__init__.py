"""The `fx-rewrites` command line (also `python -m fx_rewrites`).

    fx-rewrites demo [--backend iree]            the known-failure gallery, end to end
    fx-rewrites check MODEL [--backend iree]     one model: as is, after the rules, against eager
    fx-rewrites explain MODEL [--html out.html]  what the rules did to its graph, and why not
    fx-rewrites compile MODEL -o model.vmfb      a module iree-run-module runs [--params model.irpa: weights apart]
    fx-rewrites rules [--backend NAME] [--long]  the rules and their root ops, one line each (--long: what each fixes)
    fx-rewrites localize MODEL [--no-rules]      the first node the backend gets wrong, and a reproduction

MODEL is `PATH.py:FACTORY` (FACTORY() returns `(module, example_args[, example_kwargs])`) or
a `PATH.pt2` saved with `torch.export.save`. Exit status: 0 pass, 1 fail,
2 usage or input error (or, for check, a backend that cannot run here).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import textwrap
import warnings
from collections.abc import Callable, Sequence

from fx_rewrites.app.cli import localize
from fx_rewrites.app.cli.common import _INPUTS_HELP, _MODEL_HELP, EXIT_FAIL, EXIT_USAGE, InputError, _traceback

#: each command's function, imported when that command runs (torch and the rule packs load only then, so
#: `--version` and `--help` answer at once)
COMMANDS = {
    "demo": "fx_rewrites.app.cli.commands:cmd_demo",
    "check": "fx_rewrites.app.cli.commands:cmd_check",
    "explain": "fx_rewrites.app.cli.commands:cmd_explain",
    "compile": "fx_rewrites.app.cli.artifacts:cmd_compile",
    "rules": "fx_rewrites.app.cli.commands:cmd_rules",
    "localize": "fx_rewrites.app.cli.localize:cmd_localize",
}


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    module, _, function = COMMANDS[name].partition(":")
    return getattr(importlib.import_module(module), function)


# ----------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fx-rewrites",
        description="Declarative rules that make PyTorch 2 graphs compile.",
        epilog="Exit status: 0 pass, 1 fail, 2 usage or input error (check: or the backend cannot run here).",
    )
    p.add_argument("--version", action="version", version=f"fx-rewrites {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the known-failure gallery end to end")
    demo.add_argument("--backend", default="iree", help="backend to compile with (default: iree, llvm-cpu)")
    demo.add_argument("--only", nargs="*", help="run only these gallery examples")
    demo.add_argument("-v", "--verbose", action="store_true", help="notes uncut, and iree-compile's whole output")

    check = sub.add_parser(
        "check",
        help="one model as a demo row: as is, after the rules, compared with eager",
        description="Export MODEL, compile and run it on the backend as is, then after the backend's rules, and "
        "compare both with eager. Prints the rules fired, both outcomes and the max abs diff. "
        "Exit status: 0 pass (after the rules the backend matches eager), 1 fail, 2 usage or input error, or the "
        "backend cannot run here (ttnn not installed; the rewritten program is still compared on torch).",
    )
    check.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
    check.add_argument(
        "--backend",
        default="iree",
        help="backend to compile with (default: iree); ttnn prints its coverage report: per op, device or host and why",
    )
    check.add_argument("--inputs", metavar="FILE.pt", help=_INPUTS_HELP)
    check.add_argument(
        "--rtol", type=float, default=None, help="relative tolerance against eager (default 1e-4; ttnn, bfloat16: 3e-2)"
    )
    check.add_argument(
        "--atol", type=float, default=None, help="absolute tolerance against eager (default 1e-5; ttnn, bfloat16: 3e-2)"
    )
    check.add_argument("-v", "--verbose", action="store_true", help="add tracebacks and torch's side output")

    explain = sub.add_parser(
        "explain",
        help="what the rules did to a model's graph, and why the others did not fire",
        description="Apply the backend's rules to MODEL's exported graph and show the graph before and after, "
        "which rule rewrote which node (from node provenance) and, for each rule that did not fire (or the one "
        "named by --rule), each candidate node and why not. Exit status: 0, or 2 on usage or input errors.",
    )
    explain.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
    explain.add_argument("--backend", default="iree", help="whose rules (default: iree)")
    explain.add_argument("--rule", metavar="NAME", help="explain this rule only (its near-misses even where it fired)")
    explain.add_argument("--html", metavar="OUT.html", help="also write one self-contained page: graphs side by side")
    explain.add_argument("--inputs", metavar="FILE.pt", help="export a factory's module with these inputs instead")
    explain.add_argument("-v", "--verbose", action="store_true", help="add tracebacks and torch's side output")

    comp = sub.add_parser(
        "compile",
        help="compile a model to a .vmfb that iree-run-module runs (weights optionally in an .irpa)",
        description="Export MODEL, apply the backend's rules, compile, check the result against eager on the "
        "example inputs and write the module to -o: a .vmfb that iree-run-module runs and fx_rewrites.load() reads "
        "back with its call convention. --params puts the weights in an IREE parameter archive (.irpa) instead of "
        "the module (iree-run-module --parameters=model=FILE.irpa). A backend whose device is absent here "
        "(--backend iree-cuda without a GPU) is compiled for and written all the same, without the comparison; so "
        "is code for a CPU this machine cannot run (--target aarch64 on x86). "
        "Exit status: 0 written (and matching eager where it ran), 1 fail, 2 usage or input error.",
    )
    comp.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
    comp.add_argument("-o", "--output", metavar="OUT.vmfb", required=True, help="the compiled module to write")
    comp.add_argument("--params", metavar="OUT.irpa", help="write the weights to this IREE parameter archive")
    comp.add_argument("--backend", default="iree", help="backend to compile with (default: iree, llvm-cpu)")
    comp.add_argument(
        "--target",
        metavar="CPU",
        default=None,
        help="the CPU to build for (iree): host (default: this machine's), x86-64-v3 (any AVX2 machine), "
        "x86-64-v4 (AVX-512), aarch64 (64-bit ARM, cross-compiled); the file records it and what it needs",
    )
    comp.add_argument("--inputs", metavar="FILE.pt", help=_INPUTS_HELP)
    comp.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance against eager (default 1e-4)")
    comp.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance against eager (default 1e-5)")
    comp.add_argument("-v", "--verbose", action="store_true", help="add tracebacks and the compiler's output")

    rules = sub.add_parser(
        "rules",
        help="list the rules: one line each (name, root ops), under a line per phase; --long: what each fixes",
    )
    rules.add_argument("--backend", default=None, help="a backend's rules instead of DEFAULT")
    rules.add_argument(
        "-l", "--long", action="store_true", help="each rule's priority and the failure it fixes, not one line each"
    )
    rules.add_argument("-v", "--verbose", action="store_true", help="--long, listing every root overload")
    localize.add_parser(sub)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fx-rewrites")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _print_error(command: str, e: InputError, verbose: bool) -> None:
    err = sys.stderr
    print(f"fx-rewrites {command}: error: {e.message}", file=err)
    if e.detail:
        print(textwrap.indent(e.detail.rstrip(), "    "), file=err)
    if verbose:
        if e.side:
            print("--- torch's output meanwhile:\n" + e.side, file=err)
        if e.cause is not None:
            print("--- traceback:\n" + _traceback(e.cause), file=err)
    elif e.cause is not None or e.side:
        print("(--verbose adds the traceback)", file=err)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse's own exits included)."""
    # torch 2.13 warns about its own pytree internals on every export; not the user's concern.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse has printed
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return _command(args.command)(args)
    except InputError as e:
        _print_error(args.command, e, getattr(args, "verbose", False))
        return EXIT_USAGE
    except BrokenPipeError:  # `fx-rewrites rules | head`: the reader left; say nothing more
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
