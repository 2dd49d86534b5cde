"""Complex fills (backends/iree/rules/complex_fills.py). Before the rule: iree-compile crashes with no diagnostic
(zeros, ones, new_ones), the importer rejects a complex fill value (full), zeros_like fails as arith.muli.

Each case reads the fill through a complex product and view_as_real, which IREE 3.13 compiles; complex add, sub,
neg, abs, div and exp it refuses by name (docs/iree-3.13-findings.md), whatever made their operands."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules.complex_fills import FILLS, complex_fill_as_real_parts_for_iree

aten = torch.ops.aten
IREE = backends.get("iree")
RULE = complex_fill_as_real_parts_for_iree


def _phase(x: torch.Tensor) -> torch.Tensor:
    return torch.complex(x, 0.5 * x)


#: name -> (fn of x, the fill op it exports)
CASES = {
    "zeros": (lambda x: torch.view_as_real(torch.zeros(x.shape, dtype=torch.complex64) * _phase(x)), aten.zeros),
    "ones": (lambda x: torch.view_as_real(torch.ones(x.shape, dtype=torch.complex64) * _phase(x)), aten.ones),
    "full": (lambda x: torch.view_as_real(torch.full(x.shape, 1.5 - 2j) * _phase(x)), aten.full),
    "zeros_like": (lambda x: torch.view_as_real(torch.zeros_like(_phase(x)) * _phase(-x)), aten.zeros_like),
    "full_like": (lambda x: torch.view_as_real(torch.full_like(_phase(x), 2j) * _phase(x)), aten.full_like),
    "new_ones": (lambda x: torch.view_as_real(_phase(x).new_ones(x.shape) * _phase(x)), aten.new_ones),
    "zeros_read_as_real": (
        lambda x: torch.view_as_real(torch.zeros(x.shape, dtype=torch.complex64)) + x.unsqueeze(-1),
        aten.zeros,
    ),
}


#: the forms IREE 3.13 compiles without the rule (measured): a fill of a symbolic size, and zeros_like; a complex
#: fill value is refused by the importer whatever the sizes
COMPILES_BEFORE = {("zeros_like", False)} | {(name, True) for name in CASES if name not in ("full", "full_like")}


def _inputs(seed: int, rows: int) -> tuple[torch.Tensor]:
    return (torch.randn(rows, 3, generator=torch.Generator().manual_seed(seed)),)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_complex_fill_becomes_two_real_fills(name, dynamic):
    fn, packet = CASES[name]
    inputs = [_inputs(1, 4), _inputs(2, 6 if dynamic else 4)]
    ep = rt.export(fn, *inputs[0], dynamic_shapes=({0: Dim("rows")},) if dynamic else None)
    assert packet.default in rt.targets(ep)
    without = fx_rewrites.apply(ep, IREE.rules.without(RULE.name)).program
    if (name, dynamic) in COMPILES_BEFORE:
        torch.testing.assert_close(IREE.compile(without, inputs[0])(*inputs[1]), fn(*inputs[1]))
    else:
        with pytest.raises(Exception, match=r"without an error diagnostic|Unsupported argument type"):
            IREE.compile(without, inputs[0])
    result = fx_rewrites.apply(ep, IREE.rules)
    rt.assert_fired(result, RULE, times=1)
    assert not [n for n in rt.graph_module(result).graph.nodes if n.target in FILLS and n.meta["val"].dtype.is_complex]
    rt.assert_matches_eager(result, fn, inputs, rtol=0, atol=0)  # the same fills and complex ops, on torch
    compiled = IREE.compile(result.program, inputs[0])
    for args in inputs:
        want = fn(*args)
        exact = fn(*(a.double() for a in args))
        got = compiled(*args)
        assert got.shape == want.shape and got.dtype == want.dtype
        # a complex product is two products and a sum: as far from float64 as torch's float32, within a step
        step = torch.finfo(torch.float32).eps * exact.abs().max().item()
        assert (got.double() - exact).abs().max().item() <= (want.double() - exact).abs().max().item() + step


def test_real_fills_are_left_alone():
    fn = lambda x: (torch.zeros(x.shape) + x, torch.full_like(x, 2.0) * x)
    result = rt.apply_rules(rt.export(fn, torch.randn(4, 3)), RULE, explain=True)
    rt.assert_not_fired(result, RULE)
    reasons = {a.reason for a in result.report.explain(RULE.name) if not a.fired}
    assert reasons == {"when: the result is not complex"}
