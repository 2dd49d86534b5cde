"""`fx_rewrites.apply`: the model author's entry point."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule

from fx_rewrites import bisect, engine
from fx_rewrites.engine import GraphInputError, Report, Rule
from fx_rewrites.engine import values as fake_values
from fx_rewrites.program import (
    copy_graph_module,
    drop_dead_subgraphs,
    expose_signature,
    rebuild_program,
    unwrap_tensor_subclasses,
)
from fx_rewrites.ruleset import Phases, RuleSet, as_phases


@attrs.frozen
class Result:
    """What `apply` returns.

    `graph_module` is the rewritten graph; `program` the rewritten
    ExportedProgram when one was given (None for a GraphModule); `report`
    says whether the rules converged, what fired and how long it took.
    """

    graph_module: GraphModule
    report: Report
    program: ExportedProgram | None = None


def _phases(rules: RuleSet | Phases | Rule | Iterable[Rule] | None) -> Phases:
    if rules is None:
        from fx_rewrites.rules import DEFAULT  # rule packs load on first use

        rules = DEFAULT
    return as_phases(rules)


def _run_phases(gm: GraphModule, phases: Phases, budget: int | None, **options: Any) -> Report:
    """Each phase to its fixpoint, in order; `budget` counts the rewrites of all phases together."""
    runs: list[tuple[str, Report]] = []
    remaining = budget
    for phase in phases.sets:
        if runs and remaining is not None and remaining <= 0:
            break
        report = engine.run(gm.graph, phase.rules, budget=remaining, **options)
        runs.append((phase.name, report))
        if remaining is not None:
            remaining -= report.total_rewrites
    return runs[0][1] if len(runs) == 1 and len(phases.sets) == 1 else Report.merged(runs)


def _prepare(gm: GraphModule, example_inputs: Sequence[Any] | None) -> None:
    missing = fake_values.missing_values(gm.graph)
    if not missing and example_inputs is None:
        return
    if example_inputs is None:
        raise GraphInputError(
            f"the graph's nodes carry no meta['val'] (first without: {missing[:5]}), so rules "
            "cannot see shapes and dtypes. This is what torch.fx.symbolic_trace gives. Pass "
            "example_inputs=(...) to apply() to compute them, or start from torch.export.export()."
        )
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    # a ShapeEnv gives data-dependent sizes (nonzero, x[mask]) unbacked symbols instead of an error
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    FakeTensorProp(gm, mode).propagate(*example_inputs)


def apply(
    program: ExportedProgram | GraphModule,
    rules: RuleSet | Phases | Rule | Iterable[Rule] | None = None,
    *,
    example_inputs: Sequence[Any] | None = None,
    on_error: str = "raise",
    strict: bool = False,
    explain: bool = False,
    budget: int | None = None,
    inplace: bool = False,
    check_shapes: bool = True,
    check: Any = None,
) -> Result:
    """Run `rules` (default `fx_rewrites.rules.DEFAULT`) to a fixpoint.

    `rules` is a RuleSet, a rule, rules, or `Phases` (a backend's `rules`):
    phases run one after another, each to its own fixpoint.

    `program` is a `torch.export.ExportedProgram` (a new one is returned in
    `Result.program`; the input is left untouched) or a `torch.fx.GraphModule`
    (copied first unless `inplace`). A GraphModule without `meta["val"]`
    needs `example_inputs`; given them, the values are always recomputed. `on_error="skip"` skips a failing rule on that
    node instead of raising `RuleError`; `strict=True` raises
    `NonConvergence` instead of reporting it; `explain=True` records every
    match attempt for `result.report.explain()`. `check=(x, ...)` (or a list
    of such tuples) runs the graph before and after on those inputs and raises
    `NumericMismatch` naming the first rewrite that changed the results
    (found by replaying the rewrites, see `fx_rewrites.bisect`).
    """
    phases = _phases(rules)
    if isinstance(program, ExportedProgram):
        program = unwrap_tensor_subclasses(program)  # torchao's quantized weights: plain int8 + scales
        gm = copy_graph_module(program.graph_module)
        expose_signature(program, gm)
    elif isinstance(program, GraphModule):
        gm = program if inplace else copy_graph_module(program)
        _prepare(gm, example_inputs)
    else:
        if isinstance(program, torch.nn.Module):
            hint = " Export it first: torch.export.export(model, example_args)."
        elif isinstance(program, (str, os.PathLike)):
            hint = (
                " Load a saved program first: torch.export.load(path) (from the shell, `fx-rewrites check "
                "PATH.pt2` also checks that the file holds no pickled objects before loading it)."
            )
        else:
            hint = ""
        raise GraphInputError(
            f"apply() takes a torch.export.ExportedProgram or a torch.fx.GraphModule, "
            f"got {type(program).__name__}.{hint}"
        )
    if check is not None:
        sets = bisect.input_sets(check)
        before = program if isinstance(program, ExportedProgram) else copy_graph_module(program)
        expected = bisect.references(before, sets)
    report = _run_phases(
        gm,
        phases,
        budget,
        on_error=on_error,
        strict=strict,
        explain=explain,
        check_shapes=check_shapes,
    )
    drop_dead_subgraphs(gm)
    gm.recompile()
    new_program = rebuild_program(program, gm) if isinstance(program, ExportedProgram) else None
    if check is not None:

        def rerun(k: int) -> tuple[ExportedProgram | GraphModule, Report]:
            again = apply(
                before,
                phases,
                example_inputs=example_inputs,
                on_error=on_error,
                explain=True,
                budget=k,
                check_shapes=check_shapes,
            )
            return (again.program if again.program is not None else again.graph_module), again.report

        bisect.check(before, new_program if new_program is not None else gm, report, sets, expected, rerun)
    return Result(graph_module=gm, report=report, program=new_program)
