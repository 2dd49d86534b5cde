"""The commands: demo, check, explain, rules."""

from __future__ import annotations

import argparse
import copy
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fx_rewrites.app.cli.common import (
    EXIT_FAIL,
    EXIT_PASS,
    MAX_NOTE,
    InputError,
    _backend,
    _one_line,
    _traceback,
    describe_error,
)
from fx_rewrites.app.cli.inputs import _input_signature
from fx_rewrites.app.cli.models import Model, _describe_inputs, _load_model, _user_frame

# ----------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.progress import track

    from fx_rewrites.app.demo import run_example
    from fx_rewrites.app.gallery import gallery

    backend = _backend(args.backend)
    backend = backend.for_demo() if hasattr(backend, "for_demo") else backend  # ttnn without ttnn: emulated
    examples = [e for e in gallery() if not args.only or e.name in args.only]
    tolerance = {k: getattr(backend, k) for k in ("rtol", "atol") if hasattr(backend, k)}  # ttnn: bfloat16
    verbose = getattr(args, "verbose", False)
    progress = track(examples, description=f"demo on {backend.name}")
    rows = [run_example(e, backend, verbose=verbose, **tolerance) for e in progress]
    console = _console()
    _print_rows(console, f"fx-rewrites demo: known-failure gallery on {backend.name}", rows, family=True)
    for r in rows:
        for phase, text in r.diagnostics.items():
            console.print(f"\n--- {r.name}, {phase}: iree-compile's output\n{text}", markup=False, highlight=False)
    failed = [r.name for r in rows if not r.passed]
    verdict = f"{len(rows) - len(failed)}/{len(rows)} pass after rules"
    console.print(verdict + (f"; failing: {failed}" if failed else ""), markup=False)
    return EXIT_FAIL if failed or not rows else EXIT_PASS


def _console():
    from rich.console import Console

    return Console(width=max(120, Console().width))


def _print_rows(console: Any, title: str, rows: Sequence[Any], *, family: bool) -> None:
    """The demo table (one row per model), each failure a numbered note below it."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title))
    columns = ("model", "family", "rules fired", "as is", "after rules", "max abs diff", "s")
    for column in columns if family else [c for c in columns if c != "family"]:
        table.add_column(column, overflow="fold")
    notes: list[str] = []
    for r in rows:
        diff = "-" if r.max_diff is None else f"{r.max_diff:.2e}"
        cells = [escape(r.name), escape(r.family)] if family else [escape(r.name)]
        cells += [escape(r.fired).replace(", ", "\n"), _cell(r.as_is, notes), _cell(r.after, notes), diff]
        table.add_row(*cells, f"{r.seconds:.1f}")
    console.print(table)
    for i, note in enumerate(notes, 1):
        console.print(f"[{i}] {note}", markup=False, highlight=False, soft_wrap=True)


def _cell(outcome: str, notes: list[str]) -> str:
    """ "ok" in green; an error as its type in red with a numbered note below the table."""
    from rich.markup import escape

    if outcome == "ok":
        return "[green]ok[/]"
    notes.append(outcome)
    kind = outcome.split(":", 1)[0]
    return f"[red]{escape(kind)}[/] \\[{len(notes)}]"


# ----------------------------------------------------------------------------- check


def _outcome(e: BaseException) -> str:
    """An error as one paragraph: its type and message, whitespace collapsed (see `describe_error`)."""
    return describe_error(e, MAX_NOTE)


def _run(backend: Any, program: Any, model: Model) -> Any:
    args, kwargs = model.inputs()
    fn = backend.compile(program, args)
    return fn(*args, **kwargs)


def cmd_check(args: argparse.Namespace) -> int:
    from fx_rewrites.api import apply
    from fx_rewrites.app.demo import Row, verdict

    backend = _backend(args.backend)
    if backend.name == "ttnn":
        return _check_ttnn(args, backend)
    args.rtol = 1e-4 if args.rtol is None else args.rtol
    args.atol = 1e-5 if args.atol is None else args.atol
    model = _load_model(args.model, args.inputs)
    start = time.perf_counter()
    status = _status_console()
    with status.status(f"checking {model.label} on {backend.name}"):
        expected = _reference(model)
        program = model.program()  # exports; fails here (exit 2) when torch cannot
        row = Row(model.label, "")
        failures: dict[str, BaseException] = {}
        try:
            row.as_is = verdict(_run(backend, program, model), expected, args.rtol, args.atol)[0]
        except Exception as e:
            row.as_is, failures["as is"] = _outcome(e), e
        report = None
        try:
            result = apply(model.program(), backend.rules)
            report = result.report
            row.fired = ", ".join(f"{k} x{v}" for k, v in sorted(report.rewrites.items())) or "-"
            row.after, row.max_diff = verdict(_run(backend, result.program, model), expected, args.rtol, args.atol)
        except InputError:
            raise
        except Exception as e:
            row.after, failures["after rules"] = _outcome(e), e
    row.seconds = time.perf_counter() - start

    console = _console()
    _print_rows(console, f"fx-rewrites check: {model.label} on {backend.name}", [row], family=False)
    out = [f"inputs: {_describe_inputs(model)} ({model.inputs_from})"]
    if report is not None and not report.converged:
        out.append(f"rules stopped early: {report.stop_reason}")
    out += [f"note: {n}" for n in (report.notes if report is not None else ())]
    if row.passed:
        out.append(f"PASS: after the rules, {backend.name} matches eager (max abs diff {row.max_diff:.2e})")
    else:
        out.append(f"FAIL: after the rules, {row.after.split(':', 1)[0]} (see the note above)")
    for line in out:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if args.verbose:
        for phase, e in failures.items():
            console.print(f"\n--- {phase}: traceback", markup=False, highlight=False)
            console.print(_traceback(e), markup=False, highlight=False, soft_wrap=True)
            if getattr(e, "diagnostics", ""):  # IreeCompileError: iree-compile's whole output
                console.print(
                    f"--- {phase}: diagnostics\n{e.diagnostics}", markup=False, highlight=False, soft_wrap=True
                )
    return EXIT_PASS if row.passed else EXIT_FAIL


def _check_ttnn(args: argparse.Namespace, backend: Any) -> int:
    """The ttnn coverage report, the lowered graph run on the host (the stand-ins' torch bodies)
    against eager, and, when ttnn and a device are there, the run on ttnn against eager."""
    from fx_rewrites.app.demo import verdict
    from fx_rewrites.backends.ttnn import TtnnUnavailable, lower
    from fx_rewrites.backends.ttnn.coverage import coverage

    rtol = 3e-2 if args.rtol is None else args.rtol
    atol = 3e-2 if args.atol is None else args.atol
    model = _load_model(args.model, args.inputs)
    with _status_console().status(f"lowering {model.label} for ttnn"):
        expected = _reference(model)
        report = coverage(model.program(), model.label)
        inputs, kwargs = model.inputs()
        lowered = lower(model.program())
        with torch.no_grad():
            emulated = verdict(lowered.module()(*inputs, **kwargs), expected, rtol, atol)
        try:
            fn = backend.compile(lowered, inputs)
            on_ttnn = verdict(fn(*inputs, **kwargs), expected, rtol, atol)
        except TtnnUnavailable as e:
            on_ttnn = None
            not_run = " ".join(str(e).split())
        except Exception as e:
            on_ttnn = (_outcome(e), float("nan"))
    console = _console()
    console.print(report.text(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"inputs: {_describe_inputs(model)} ({model.inputs_from})", markup=False, highlight=False)
    lines = [f"lowered graph on the host (bfloat16 emulation) vs eager: {emulated[0]} (max abs diff {emulated[1]:.2e})"]
    if on_ttnn is None:
        lines.append(f"not run on ttnn: {not_run}")
    else:
        lines.append(f"on ttnn vs eager: {on_ttnn[0]} (max abs diff {on_ttnn[1]:.2e})")
    passed = emulated[0] == "ok" and (on_ttnn is None or on_ttnn[0] == "ok")
    lines.append(f"{'PASS' if passed else 'FAIL'}: rtol {rtol:g}, atol {atol:g}")
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    return EXIT_PASS if passed else EXIT_FAIL


def _status_console():
    """Progress on stderr, shown only on a terminal (rich's status is transient)."""
    from rich.console import Console

    return Console(stderr=True)


def _reference(model: Model) -> Any:
    """The eager outputs: the factory's module, or the saved program's own module()."""
    args, kwargs = model.inputs()
    try:
        with torch.no_grad():
            if model.module is not None:
                return copy.deepcopy(model.module)(*args, **kwargs)
            return model.program().module()(*args, **kwargs)
    except InputError:
        raise
    except Exception as e:
        if model.pt2 is not None:
            fix = (
                f"check that the inputs ({model.inputs_from}) fit what the program takes: "
                f"{_input_signature(model.program())}"
            )
        else:
            fix = "make module(*example_args) run in eager first"
        raise InputError(
            f"the model raised in eager on its inputs ({model.inputs_from}): {type(e).__name__}: {_one_line(e)}"
            f"{_user_frame(e, model.path) if model.path else ''}. Fix: {fix}.",
            detail=f"{type(e).__name__}: {str(e).strip()}",
            cause=e,
        ) from e


# ----------------------------------------------------------------------------- explain


def cmd_explain(args: argparse.Namespace) -> int:
    from fx_rewrites.api import apply
    from fx_rewrites.engine import RewriteError
    from fx_rewrites.explain import explanation, render_html, render_text

    backend = _backend(args.backend)
    names = [r.name for r in backend.rules]
    if args.rule is not None and args.rule not in names:
        raise InputError(
            f"{backend.name}'s rules have no rule named {args.rule!r}. Fix: name one of: {', '.join(names)} "
            f"(`fx-rewrites rules --backend {backend.name}` says what each fixes)."
        )
    html_path = Path(args.html) if args.html else None
    if html_path is not None and not html_path.parent.is_dir():
        raise InputError(
            f"cannot write {html_path}: no directory {html_path.parent}. Fix: create it or pick another path."
        )
    model = _load_model(args.model, args.inputs, need_inputs=False)
    program = model.program()
    try:
        # on_error="skip": a failing rule is reported with the rest, not the end of the story
        result = apply(program, backend.rules, explain=True, on_error="skip")
    except RewriteError as e:
        print(f"fx-rewrites explain: {_outcome(e)}", file=sys.stderr)
        if args.verbose:
            print(_traceback(e), file=sys.stderr)
        return EXIT_FAIL
    e = explanation(program, result, backend.rules, title=model.label, backend=backend.name, rule=args.rule)
    sys.stdout.write(render_text(e))
    if html_path is not None:
        html_path.write_text(render_html(e), encoding="utf-8")
        print(f"wrote {html_path}")
    return EXIT_PASS


# ----------------------------------------------------------------------------- rules

#: a roots line longer than this is summarised by op packet (`--verbose` lists every overload)
ROOTS_WIDTH = 100


def roots_summary(roots: Sequence[Any], width: int = ROOTS_WIDTH) -> str:
    """Root ops, listed when short; else by packet: "aten.add/sub/rsub/mul/... (78 overloads of 41 ops)"."""
    from fx_rewrites.schema import op_name

    names = [op_name(r) for r in roots]
    text = ", ".join(names)
    if len(text) <= width:
        return text
    packets: dict[str, list[str]] = {}
    others: list[str] = []
    for name in names:
        parts = name.split(".")
        if len(parts) == 3:
            packets.setdefault(parts[0], [])
            if parts[1] not in packets[parts[0]]:
                packets[parts[0]].append(parts[1])
        else:
            others.append(name)
    count = sum(len(p) for p in packets.values()) + len(others)
    tail = f" ({len(names)} overloads of {count} ops)"
    shown: list[str] = []
    for namespace, ops in packets.items():
        listed = f"{namespace}."
        for i, op in enumerate(ops):
            more = f"{listed}{'/' if i else ''}{op}"
            if len(", ".join([*shown, more])) + len(tail) + 4 > width:
                listed += "/..."
                break
            listed = more
        shown.append(listed)
    shown += others
    return ", ".join(shown) + tail


def cmd_rules(args: argparse.Namespace) -> int:
    from fx_rewrites.rules import DEFAULT
    from fx_rewrites.schema import op_name

    rules = _backend(args.backend).rules if args.backend else DEFAULT
    for rule in rules:
        roots = ", ".join(op_name(r) for r in rule.roots) if args.verbose else roots_summary(rule.roots)
        print(f"{rule.name}  (priority {rule.priority})\n  roots: {roots}")
        doc = getattr(rule, "doc", "")
        if doc:
            print(textwrap.fill(" ".join(doc.split()), width=110, initial_indent="  fixes: ", subsequent_indent="    "))
    return EXIT_PASS
