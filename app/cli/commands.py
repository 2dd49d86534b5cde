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
    EXIT_USAGE,
    MAX_NOTE,
    InputError,
    _backend,
    _one_line,
    _traceback,
    describe_error,
)
from fx_rewrites.app.cli.inputs import _input_signature
from fx_rewrites.app.cli.models import Model, _describe_inputs, _load_model, _user_frame, train_mode_hint

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
    """stdout at the terminal's width (or $COLUMNS); 120 columns into a pipe or file."""
    import os

    from rich.console import Console

    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(width=120)
    return console


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
    if outcome == NOT_RUN:
        return "[yellow]not run[/]"
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
    """As is and after the rules (`fx_rewrites.compile`), against eager; the same for every backend. A backend
    may say more through optional members: `rtol`/`atol` (the agreement to expect), `describe(program, label)`
    (a report printed first: ttnn's coverage), and a `BackendUnavailable` when its runtime is missing here."""
    from fx_rewrites.app.compile import compile as compile_model
    from fx_rewrites.app.demo import Row, verdict
    from fx_rewrites.backends.base import BackendUnavailable

    backend = _backend(args.backend)
    rtol = getattr(backend, "rtol", 1e-4) if args.rtol is None else args.rtol
    atol = getattr(backend, "atol", 1e-5) if args.atol is None else args.atol
    model = _load_model(args.model, args.inputs)
    start = time.perf_counter()
    with _status_console().status(f"checking {model.label} on {backend.name}"):
        expected = _reference(model)
        program = model.program()  # exports; fails here (exit 2) when torch cannot
        describe = getattr(backend, "describe", None)
        described = describe(model.program(), model.label) if callable(describe) else ""
        row = Row(model.label, "")
        failures: dict[str, BaseException] = {}
        not_run = ""
        try:
            row.as_is = verdict(_run(backend, program, model), expected, rtol, atol)[0]
        except BackendUnavailable as e:
            row.as_is, not_run = NOT_RUN, " ".join(str(e).split())
        except Exception as e:
            row.as_is, failures["as is"] = _outcome(e), e
        report = on_torch = None
        try:
            inputs, kwargs = model.inputs()
            compiled = compile_model(model.program(), inputs, kwargs, backend=backend)
            report = compiled.report
            row.fired = ", ".join(f"{k} x{v}" for k, v in sorted(report.rewrites.items())) or "-"
            inputs, kwargs = model.inputs()
            with torch.no_grad():  # the rules alone: the rewritten program run by torch
                on_torch = verdict(compiled.program.module()(*inputs, **kwargs), expected, rtol, atol)
            inputs, kwargs = model.inputs()
            row.after, row.max_diff = verdict(compiled(*inputs, **kwargs), expected, rtol, atol)
        except InputError:
            raise
        except BackendUnavailable as e:
            row.after, not_run = NOT_RUN, " ".join(str(e).split())
        except Exception as e:
            row.after, failures["after rules"] = _outcome(e), e
    row.seconds = time.perf_counter() - start

    console = _console()
    if described:
        console.print(described, markup=False, highlight=False, soft_wrap=True)
    _print_rows(console, f"fx-rewrites check: {model.label} on {backend.name}", [row], family=False)
    out = [f"inputs: {_describe_inputs(model)} ({model.inputs_from})"]
    if report is not None and not report.converged:
        out.append(f"rules stopped early: {report.stop_reason}")
    out += [f"note: {n}" for n in (report.notes if report is not None else ())]
    if on_torch is not None:
        out.append(f"the rewritten program run by torch vs eager: {on_torch[0]} (max abs diff {on_torch[1]:.2e})")
    if row.after == NOT_RUN:
        out.append(f"not run on {backend.name}: {not_run}")
    elif row.after == "ok":
        out.append(f"on {backend.name} vs eager: ok (max abs diff {row.max_diff:.2e})")
    tolerance = f"rtol {rtol:g}, atol {atol:g}"
    # the backend's runtime is missing here (ttnn not installed): the environment's fault, not the model's
    unavailable = row.after == NOT_RUN and on_torch is not None and on_torch[0] == "ok"
    if row.passed:
        out.append(
            f"PASS: after the rules, {backend.name} matches eager (max abs diff {row.max_diff:.2e}; {tolerance})"
        )
    elif unavailable:
        out.append(
            f"NOT CHECKED: after the rules, the program matches eager on torch, but {backend.name} cannot run here "
            f"({tolerance}). Fix: run the check where {backend.name} is installed (how: the 'not run' line above)."
        )
    else:
        why = row.after.split(":", 1)[0] if row.after != NOT_RUN else "the rewritten program differs from eager"
        out.append(f"FAIL: after the rules, {why} (see above; {tolerance})")
        differs = "WrongResult" in row.as_is + row.after or (on_torch is not None and on_torch[0] != "ok")
        hint = train_mode_hint(model) if differs else ""
        out += [f"note: {hint}"] if hint else []
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
    return EXIT_PASS if row.passed else EXIT_USAGE if unavailable else EXIT_FAIL


#: a cell for a run the backend could not do here (its runtime is missing): said once below the table
NOT_RUN = "not run"


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


def _closest(name: str, names: Sequence[str], backend: str) -> str:
    """The fix for an unknown rule name: the closest names (difflib, or those containing it), else where to look."""
    import difflib

    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    close += [n for n in names if name.lower() in n.lower() and n not in close][: 3 - len(close)]
    listing = f"`fx-rewrites rules --backend {backend}` lists them all"
    if close:
        return f"did you mean {' or '.join(repr(n) for n in close)}? ({listing})"
    return f"name one of the {len(names)} rules ({listing})."


def cmd_explain(args: argparse.Namespace) -> int:
    from fx_rewrites.api import apply
    from fx_rewrites.engine import RewriteError
    from fx_rewrites.explain import explanation, render_html, render_text

    backend = _backend(args.backend)
    names = [r.name for r in backend.rules]
    if args.rule is not None and args.rule not in names:
        raise InputError(
            f"{backend.name}'s rules have no rule named {args.rule!r}. Fix: {_closest(args.rule, names, backend.name)}"
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
    for other in others:  # Python callables (operator.add, torch.sym_max): as many as fit
        if len(", ".join([*shown, other])) + len(tail) + 5 > width:
            shown.append("...")
            break
        shown.append(other)
    return ", ".join(shown) + tail


def cmd_rules(args: argparse.Namespace) -> int:
    """One line per rule (name, root ops), under a line per phase; --long adds priority and what each fixes,
    --verbose every root overload too."""
    from fx_rewrites.rules import DEFAULT
    from fx_rewrites.ruleset import Phases, RuleSet
    from fx_rewrites.schema import op_name

    rules = _backend(args.backend).rules if args.backend else DEFAULT
    phases = rules.sets if isinstance(rules, Phases) else [rules if isinstance(rules, RuleSet) else RuleSet(rules)]
    if not (args.long or args.verbose):
        width = max((len(r.name) for r in rules), default=0)
        for phase in phases:
            print(f"# {phase.name}: {len(phase)} rule{'' if len(phase) == 1 else 's'}")
            for rule in phase:
                print(f"{rule.name:<{width}}  {roots_summary(rule.roots, ROOTS_WIDTH - width - 2)}")
        return EXIT_PASS
    for rule in rules:
        roots = ", ".join(op_name(r) for r in rule.roots) if args.verbose else roots_summary(rule.roots)
        print(f"{rule.name}  (priority {rule.priority})\n  roots: {roots}")
        doc = getattr(rule, "doc", "")
        if doc:
            print(textwrap.fill(" ".join(doc.split()), width=110, initial_indent="  fixes: ", subsequent_indent="    "))
    return EXIT_PASS
