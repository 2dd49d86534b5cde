"""The known-failure gallery run end to end: the `fx-rewrites demo` job.

It sits at the top of the stack and so may use `backends` (imported by the
caller and passed in), which nothing else in `rewrites` does.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from fx_rewrites.api import apply
from fx_rewrites.app.cli.common import DEMO_NOTE, describe_error


@attrs.define
class Row:
    """One example's outcome."""

    name: str
    family: str
    as_is: str = ""
    fired: str = ""
    after: str = ""
    max_diff: float | None = None
    seconds: float = 0.0
    #: phase ("as is", "after rules") -> the compiler's whole output, kept with --verbose
    diagnostics: dict[str, str] = attrs.field(factory=dict)

    @property
    def passed(self) -> bool:
        return self.after == "ok"


def _note(row: Row, phase: str, e: BaseException, verbose: bool) -> str:
    """The table's note for a failure: cut at a word (`--verbose`: whole, and the compiler's output kept)."""
    if verbose and getattr(e, "diagnostics", ""):
        row.diagnostics[phase] = e.diagnostics
    return describe_error(e, None if verbose else DEMO_NOTE)


def _max_diff(got: Any, expected: Any) -> float:
    got_leaves = torch.utils._pytree.tree_leaves(got)
    exp_leaves = torch.utils._pytree.tree_leaves(expected)
    if len(got_leaves) != len(exp_leaves):
        raise ValueError(f"{len(got_leaves)} outputs, eager gives {len(exp_leaves)}")
    diffs = [(g.double() - e.double()).abs().max().item() for g, e in zip(got_leaves, exp_leaves) if g.numel()]
    return max(diffs, default=0.0)


def _export(example: Any, module: torch.nn.Module, args: Sequence[Any]) -> torch.export.ExportedProgram:
    return torch.export.export(copy.deepcopy(module), tuple(args), dynamic_shapes=example.dynamic_shapes)


def verdict(got: Any, expected: Any, rtol: float, atol: float) -> tuple[str, float]:
    """("ok" or why not, max abs diff): a run that gives wrong numbers (NaN
    from IREE's pow, say) is a failure too."""
    diff = _max_diff(got, expected)
    leaves = zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected))
    if all(torch.allclose(g, e, rtol=rtol, atol=atol) for g, e in leaves):
        return "ok", diff
    return f"WrongResult: max abs diff {diff:.3g} against eager", diff


def _run(backend: Any, program: Any, args: Sequence[Any]) -> Any:
    return backend.compile(program, args)(*args)


def run_example(example: Any, backend: Any, *, rtol: float = 1e-4, atol: float = 1e-5, verbose: bool = False) -> Row:
    """Export, try as is, apply the backend's rules, compile, run, compare (`verbose`: notes uncut)."""
    start = time.perf_counter()
    row = Row(example.name, example.family)
    module, args = example.make()
    # each phase gets its own copy: forward may update buffers, and an exported
    # program shares its state tensors with the module it came from
    with torch.no_grad():
        expected = copy.deepcopy(module)(*copy.deepcopy(args))
    try:
        as_is = _export(example, module, args)
        row.as_is = verdict(_run(backend, as_is, copy.deepcopy(args)), expected, rtol, atol)[0]
    except Exception as e:
        row.as_is = _note(row, "as is", e, verbose)
    try:
        program = _export(example, module, args)
        result = apply(program, backend.rules)
        row.fired = ", ".join(f"{k} x{v}" for k, v in sorted(result.report.rewrites.items())) or "-"
        row.after, row.max_diff = verdict(_run(backend, result.program, copy.deepcopy(args)), expected, rtol, atol)
    except Exception as e:
        row.after = _note(row, "after rules", e, verbose)
    row.seconds = time.perf_counter() - start
    return row
