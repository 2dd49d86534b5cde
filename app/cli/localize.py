"""`fx-rewrites localize MODEL --backend NAME [--no-rules]`: the first node the backend gets wrong."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from fx_rewrites.app.cli.common import _INPUTS_HELP, _MODEL_HELP, EXIT_FAIL, EXIT_PASS, InputError, _backend, _traceback

_HELP = "the first node the backend gets wrong (wrong numbers or no compile), with a reproduction"
_DESCRIPTION = (
    "Run MODEL on torch recording every intermediate, then its graph on the backend piece by piece (all of it, "
    "then halves, down to one node) with the recorded values as inputs. Report the first node, in graph order, "
    "that fails to compile or whose output is off against the op run in float64 by more than 10x torch's own "
    "float32 error: its op, source line, shapes, and its error against eager and float64. Write a standalone "
    "reproduction (repro.py), a guard-rule skeleton (guard_rule.py) and its test (test_guard_rule.py) to --out. "
    "Exit status: 0 the backend matches eager on every node, 1 a node found, 2 usage or input error."
)


def add_parser(sub: Any) -> None:
    """The `localize` subcommand, on the CLI's subparsers."""
    p = sub.add_parser("localize", help=_HELP, description=_DESCRIPTION)
    p.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
    p.add_argument("--backend", default="iree", help="backend to localize on (default: iree; ttnn: emulated)")
    p.add_argument("--no-rules", action="store_true", help="the program as exported, without the backend's rules")
    p.add_argument("--out", metavar="DIR", help="where to write the reproduction (default: ./localize-<model>/)")
    p.add_argument("--inputs", metavar="FILE.pt", help=_INPUTS_HELP)
    p.add_argument("--each-node", action="store_true", help="compile every node alone instead of halving")
    p.add_argument("-v", "--verbose", action="store_true", help="add the traceback of an error in the search")
    p.set_defaults(fn=cmd_localize)


def _default_out(spec: str) -> Path:
    path = spec.rpartition(":")[0] if spec.rpartition(":")[0].endswith(".py") else spec
    return Path(f"localize-{re.sub(r'[^A-Za-z0-9_.-]', '_', Path(path).stem)}")


def cmd_localize(args: argparse.Namespace) -> int:
    from fx_rewrites.app.cli.commands import _reference, _status_console
    from fx_rewrites.app.cli.models import _load_model
    from fx_rewrites.app.localize import localize

    backend = _backend(args.backend)
    out = Path(args.out) if args.out else _default_out(args.model)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file. Fix: give a directory (it is created if missing).")
    model = _load_model(args.model, args.inputs)
    with _status_console().status(f"localizing {model.label} on {backend.name}"):
        _reference(model)  # the model must run in eager first (exit 2 if not)
        program = model.program()  # exports (exit 2 if torch cannot)
        inputs, kwargs = model.inputs()
        try:
            found = localize(
                program,
                inputs,
                kwargs,
                backend=backend,
                rules=not args.no_rules,
                bisect=not args.each_node,
                label=model.label,
            )
            if found.finding is not None:
                found.write(out)
        except Exception as e:
            print(f"fx-rewrites localize: the search itself failed: {type(e).__name__}: {' '.join(str(e).split())}")
            print(_traceback(e) if args.verbose else "(--verbose adds the traceback)")
            return EXIT_FAIL
    print(found.text())
    if found.finding is not None:
        print(f"run it: python {out / 'repro.py'}")
    return EXIT_FAIL if found.finding is not None else EXIT_PASS
