"""The `fx-rewrites` command line (also `python -m rewrites`)."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence


def _backend(name: str):
    import backends

    try:
        return backends.get(name)
    except backends.UnknownBackend as e:
        raise SystemExit(f"fx-rewrites: {e}") from None


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    from examples import gallery
    from rewrites.demo import run_example

    backend = _backend(args.backend)
    examples = [e for e in gallery() if not args.only or e.name in args.only]
    rows = [run_example(e, backend) for e in track(examples, description=f"demo on {backend.name}")]
    table = Table(title=f"fx-rewrites demo: known-failure gallery on {backend.name}")
    for column in ("model", "family", "rules fired", "as is", "after rules", "max abs diff", "s"):
        table.add_column(column, overflow="fold")
    notes: list[str] = []
    for r in rows:
        diff = "-" if r.max_diff is None else f"{r.max_diff:.2e}"
        table.add_row(
            r.name,
            r.family,
            r.fired.replace(", ", "\n"),
            _cell(r.as_is, notes),
            _cell(r.after, notes),
            diff,
            f"{r.seconds:.1f}",
        )
    console = Console(width=max(120, Console().width))
    console.print(table)
    for i, note in enumerate(notes, 1):
        console.print(f"[{i}] {note}", highlight=False, soft_wrap=True)
    failed = [r.name for r in rows if not r.passed]
    verdict = f"{len(rows) - len(failed)}/{len(rows)} pass after rules"
    console.print(verdict + (f"; failing: {failed}" if failed else ""))
    return 1 if failed or not rows else 0


def _cell(outcome: str, notes: list[str]) -> str:
    """ "ok" in green; an error as its type in red with a numbered note below the table."""
    if outcome == "ok":
        return "[green]ok[/]"
    notes.append(outcome)
    kind = outcome.split(":", 1)[0]
    return f"[red]{kind}[/] [{len(notes)}]"


def cmd_rules(args: argparse.Namespace) -> int:
    from rewrites.rules import DEFAULT
    from rewrites.schema import op_name

    rules = _backend(args.backend).rules if args.backend else DEFAULT
    for rule in rules:
        roots = ", ".join(op_name(r) for r in rule.roots)
        print(f"{rule.name}  (priority {rule.priority})\n  roots: {roots}")
        doc = getattr(rule, "doc", "")
        if doc:
            print(f"  fixes: {doc}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fx-rewrites", description="Declarative rules that make PyTorch 2 graphs compile.")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the known-failure gallery end to end")
    demo.add_argument("--backend", default="iree", help="backend to compile with (default: iree, llvm-cpu)")
    demo.add_argument("--only", nargs="*", help="run only these gallery examples")
    demo.set_defaults(fn=cmd_demo)
    rules = sub.add_parser("rules", help="list the rules, their roots and the failures they fix")
    rules.add_argument("--backend", default=None, help="a backend's rules instead of DEFAULT")
    rules.set_defaults(fn=cmd_rules)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    # torch 2.13 warns about its own pytree internals on every export; not the user's concern.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    args = parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
