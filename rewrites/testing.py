"""Helpers for rule unit tests (plain functions; use them from pytest).

from fx_rewrites import testing as rt

def test_pool_stride():
    ep = rt.export(lambda x: F.max_pool2d(x, 2), torch.randn(1, 3, 8, 8))
    result = rt.apply_rules(ep, pool_stride_defaults)
    rt.assert_fired(result, "pool_stride_defaults", times=1)
    rt.assert_ops(result, present=[aten.max_pool2d_with_indices.default])
    rt.assert_matches_eager(result, ep, [(torch.randn(2, 3, 6, 6),)])
    rt.assert_idempotent(result, pool_stride_defaults)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule

from fx_rewrites.api import Result, apply
from fx_rewrites.engine import Rule
from fx_rewrites.ruleset import Phases, RuleSet
from fx_rewrites.schema import op_name


class _Wrap(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def export(
    module: torch.nn.Module | Callable[..., Any],
    *args: Any,
    dynamic_shapes: Any = None,
    **kwargs: Any,
) -> ExportedProgram:
    """`torch.export.export` of a module (or a plain function), in eval mode."""
    mod = module if isinstance(module, torch.nn.Module) else _Wrap(module)
    if isinstance(mod, _Wrap) and isinstance(dynamic_shapes, (list, tuple)):
        dynamic_shapes = (tuple(dynamic_shapes),)  # _Wrap.forward takes *args
    mod.eval()
    return torch.export.export(mod, tuple(args), kwargs or None, dynamic_shapes=dynamic_shapes)


def apply_rules(program: ExportedProgram | GraphModule, *rules: Rule | RuleSet | Phases, **options: Any) -> Result:
    """`fx_rewrites.apply` with exactly these rules (or rule sets); one `Phases`
    (a backend's `rules`) is run as its phases, each to its own fixpoint."""
    if len(rules) == 1 and isinstance(rules[0], Phases):
        return apply(program, rules[0], **options)
    if any(isinstance(r, Phases) for r in rules):
        raise TypeError("apply_rules: give one Phases alone (combine phases with Phases.then(...) first)")
    return apply(program, RuleSet(list(rules)), **options)


def graph_module(obj: Result | ExportedProgram | GraphModule) -> GraphModule:
    """The graph module of a Result, an ExportedProgram, or the GraphModule itself."""
    return obj.graph_module if isinstance(obj, (Result, ExportedProgram)) else obj


def targets(obj: Result | ExportedProgram | GraphModule) -> list[Any]:
    """The targets of the call_function nodes, in graph order."""
    return [n.target for n in graph_module(obj).graph.nodes if n.op == "call_function"]


def assert_fired(result: Result, rule: str | Rule, times: int | None = None) -> None:
    """The rule fired at least once (exactly `times` times if given)."""
    name = rule if isinstance(rule, str) else rule.name
    count = result.report.rewrites.get(name, 0)
    if times is None:
        assert count > 0, f"rule {name!r} did not fire; fired: {dict(result.report.rewrites)}"
    else:
        assert count == times, f"rule {name!r} fired {count} times, expected {times}"


def assert_not_fired(result: Result, rule: str | Rule) -> None:
    assert_fired(result, rule, times=0)


def assert_ops(
    obj: Result | ExportedProgram | GraphModule,
    *,
    present: Iterable[Any] = (),
    absent: Iterable[Any] = (),
) -> None:
    """Each op in `present` occurs in the graph; none in `absent` does."""
    have = targets(obj)
    for op in present:
        assert op in have, f"{op_name(op)} is not in the graph; it has {sorted({op_name(t) for t in have})}"
    for op in absent:
        assert op not in have, f"{op_name(op)} is still in the graph:\n{graph_module(obj).graph}"


def _run(obj: Result | ExportedProgram | GraphModule, args: Sequence[Any]) -> Any:
    if isinstance(obj, Result):
        obj = obj.program if obj.program is not None else obj.graph_module
    if isinstance(obj, ExportedProgram):
        return obj.module()(*args)
    return obj(*args)


def assert_matches_eager(
    result: Result,
    reference: torch.nn.Module | ExportedProgram | Callable[..., Any],
    inputs: Iterable[Sequence[Any]],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """On each input tuple, the rewritten graph gives what `reference` gives
    (an eager module or function, or the program before rewriting)."""
    checked = 0
    for args in inputs:
        expected = _run(reference, args) if isinstance(reference, ExportedProgram) else reference(*args)
        got = _run(result, args)
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True)
        checked += 1
    assert checked, "assert_matches_eager was given no inputs"


def assert_idempotent(result: Result, *rules: Rule | RuleSet | Phases) -> None:
    """Applying the rules again to the result rewrites nothing."""
    source = result.program if result.program is not None else result.graph_module
    again = apply_rules(source, *rules) if rules else apply(source)
    assert again.report.total_rewrites == 0, f"second apply rewrote again: {dict(again.report.rewrites)}"
    assert again.report.converged
