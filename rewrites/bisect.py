"""Numeric checking of a rewrite run, and bisection to the rewrite that broke it.

`fx_rewrites.apply(program, rules, check=inputs)` runs the graph before and after
the rules on `inputs` and, when a result differs beyond tolerance, finds the
first rewrite that changed it and raises `NumericMismatch` naming the rule,
the node, the op and the difference.

How the rewrite is found: the engine is deterministic and stops after exactly
`k` rewrites when given `budget=k`, so re-running it with `budget=k` on a fresh
copy replays the first `k` rewrites of the full run. The search is binary over
`k` in `[0, n]`: `k = 0` (the graph as given) matches, `k = n` does not; each
step halves the interval, so it costs about log2(n) engine runs, graph runs
and copies, and no per-rewrite snapshot of the graph is kept (those would cost
n copies of the graph). The `k` found is one where the first `k - 1` rewrites
match and the first `k` do not: the k-th rewrite changed the results, whatever
the later ones did. Its rule and node are the last fired attempt of that run
(re-run with `explain=True`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule

from fx_rewrites.engine import GraphInputError, Report
from fx_rewrites.engine.errors import NumericMismatch
from fx_rewrites.program import quiet_torch_pytree

__all__ = ["NumericMismatch", "check", "difference", "input_sets", "references", "run"]

#: (rtol, atol) by dtype; float32 allows for reassociated sums (e.g. batch norm folded to one affine)
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
}

Program = ExportedProgram | GraphModule


@attrs.frozen
class Difference:
    """Where two results differ most: the output's path and the largest |difference|."""

    where: str
    max_difference: float
    detail: str = ""

    def describe(self) -> str:
        return f"{self.where}: {self.detail or f'max |difference| {self.max_difference:.3g}'}"


def input_sets(check: Any) -> list[tuple[Any, ...]]:
    """`check=(x, y)` is one set of positional inputs; `check=[(x,), (x2,)]` several."""
    if isinstance(check, list) and check and all(isinstance(c, (tuple, list)) for c in check):
        return [tuple(c) for c in check]
    if isinstance(check, (tuple, list)):
        return [tuple(check)]
    raise GraphInputError(
        f"check= takes the program's positional inputs, got a {type(check).__name__}. Fix: pass check=(x,) for "
        "one input set, or check=[(x1,), (x2,)] for several."
    )


def run(program: Program, args: tuple[Any, ...]) -> Any:
    """Outputs of `program` on copies of `args` and of its state (running it may update both), seed 0."""
    args = copy.deepcopy(args)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if isinstance(program, ExportedProgram):
            with quiet_torch_pytree():  # copying its TreeSpecs makes torch 2.13 warn about its own pytree code
                copied = copy.deepcopy(program).module()
            return copied(*args)
        return program(*args)


def difference(got: Any, expected: Any) -> Difference | None:
    """None when every output is close (per-dtype TOLERANCE), else where they differ most."""
    got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
    want_leaves, want_spec = torch.utils._pytree.tree_flatten(expected)
    if got_spec != want_spec:
        return Difference("the outputs", float("inf"), f"structure {got_spec} instead of {want_spec}")
    worst: Difference | None = None
    for i, (g, e) in enumerate(zip(got_leaves, want_leaves)):
        found = _leaf_difference(f"output {i}", g, e)
        if found is not None and (worst is None or found.max_difference > worst.max_difference):
            worst = found
    return worst


def _leaf_difference(where: str, got: Any, expected: Any) -> Difference | None:
    if not isinstance(expected, torch.Tensor) or not isinstance(got, torch.Tensor):
        same = type(got) is type(expected) and got == expected
        return None if same else Difference(where, float("inf"), f"{got!r} instead of {expected!r}")
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return Difference(
            where, float("inf"), f"{got.dtype} {list(got.shape)} instead of {expected.dtype} {list(expected.shape)}"
        )
    if not (got.dtype.is_floating_point or got.dtype.is_complex):
        wrong = got != expected
        if not wrong.any():
            return None
        return Difference(where, float((got.double() - expected.double()).abs()[wrong].max()))
    rtol, atol = TOLERANCE.get(got.dtype, TOLERANCE[torch.float32])
    close = torch.isclose(got, expected, rtol=rtol, atol=atol, equal_nan=True)
    if bool(close.all()):
        return None
    gap = (got.double() - expected.double()).abs()[~close]
    worst = float(torch.nan_to_num(gap, nan=float("inf")).max())
    return Difference(where, worst, f"max |difference| {worst:.3g} (rtol {rtol:g}, atol {atol:g})")


def _outcome(program: Program, args: tuple[Any, ...], expected: Any) -> Difference | None:
    try:
        got = run(program, args)
    except Exception as e:
        return Difference("the run", float("inf"), f"raised {type(e).__name__}: {str(e).strip().splitlines()[0]}")
    return difference(got, expected)


def references(before: Program, sets: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Outputs of the graph before rewriting; its failure is the caller's input problem, named as such."""
    out = []
    for n, args in enumerate(sets):
        try:
            out.append(run(before, args))
        except Exception as e:
            raise GraphInputError(
                f"check= input set {n} does not run on the graph before rewriting: {type(e).__name__}: {e}. "
                "Fix: pass inputs the program takes (check=(x,) for one set, check=[(x1,), (x2,)] for several)."
            ) from e
    return out


def check(
    before: Program,
    after: Program,
    report: Report,
    sets: Sequence[tuple[Any, ...]],
    expected: Sequence[Any],
    rerun: Callable[[int], tuple[Program, Report]],
) -> None:
    """Raise NumericMismatch when `after` differs from `before` on an input set.

    `rerun(k)` rewrites a fresh copy of `before` with the first `k` rewrites
    only (budget=k, explain=True) and returns the program and its report.
    """
    for n, (args, want) in enumerate(zip(sets, expected)):
        found = _outcome(after, args, want)
        if found is not None:
            _blame(report.total_rewrites, args, want, rerun, n, found)


def _blame(
    total: int,
    args: tuple[Any, ...],
    want: Any,
    rerun: Callable[[int], tuple[Program, Report]],
    set_index: int,
    final: Difference,
) -> None:
    runs: dict[int, tuple[Program, Report, Difference | None]] = {}

    def outcome(k: int) -> Difference | None:
        program, report = rerun(k)
        runs[k] = (program, report, _outcome(program, args, want))
        return runs[k][2]

    lo, hi = 0, total  # the first lo rewrites match; the first hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if outcome(mid) is None:
            lo = mid
        else:
            hi = mid
    if hi == 0 or (hi not in runs and outcome(hi) is None):
        raise NumericMismatch(
            f"apply(check=...): the rewritten graph differs from the graph before rewriting on input set "
            f"{set_index} ({final.describe()}), but no single rewrite could be blamed ({total} rewrites; replaying "
            "them one by one did not reproduce it, so a rule or op is not deterministic). Fix: check the rules for "
            "randomness or state kept between calls.",
            max_difference=final.max_difference,
        )
    _, report, found = runs[hi]
    fired = [a for a in (report.attempts or []) if a.fired]
    last = fired[-1] if fired else None
    rule, node, op = (last.rule, last.node, last.op) if last else ("?", "?", "?")
    assert found is not None
    raise NumericMismatch(
        f"apply(check=...): rule {rule!r} changed the results: its rewrite of node {node!r} ({op}), rewrite {hi} of "
        f"{total}, makes {found.describe()} on input set {set_index} (the finished graph: {final.describe()}). "
        f"Fix the rule so its replacement computes what {op} computed (or decline this case with when=), or leave "
        f"{rule!r} out of the rules passed to apply().",
        rule=rule,
        node=node,
        op=op,
        max_difference=found.max_difference,
        step=hi,
    )
