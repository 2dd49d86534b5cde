"""float_scalar_in_comparison_for_iree: a float tensor compared with a Python int, which IREE 3.13 folds wrong
when the tensor is a constant (view-write fuzzer, seed 11: a tensor filled with 3.0, then masked_fill_ where
it is > 0, came back 3.0), compares with the int as a float: the same comparison."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules.compare_guards import COMPARISONS, float_scalar_in_comparison_for_iree

aten = torch.ops.aten
NAME = "float_scalar_in_comparison_for_iree"

#: name -> a comparison of a constant float tensor (and of the input, which IREE gets right) with an int
CASES = {
    "gt": lambda x: torch.full_like(x, 3.0) > 0,
    "ge": lambda x: torch.full_like(x, 3.0) >= 3,
    "lt": lambda x: torch.full_like(x, 3.0) < 0,
    "le": lambda x: (torch.ones_like(x) * 3) <= 2,
    "eq": lambda x: torch.full_like(x, 3.0) == 3,
    "ne": lambda x: torch.full_like(x, 3.0) != 3,
    "float64": lambda x: torch.full_like(x, 3.0, dtype=torch.float64) == 3,
    "input": lambda x: x > 0,
}


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.fn(x), 0.25, x)


class FilledThenMaskedFill(torch.nn.Module):
    """The fuzzer's program (seed 11), reduced: a copy filled in place, then masked_fill_ through a narrow."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1
        y.fill_(3.0)
        v = y.narrow(0, 0, 1)
        v.masked_fill_(v > 0, 0.25)
        return y * 1


def _inputs(batch: int = 2) -> list[tuple[torch.Tensor]]:
    return [(torch.randn(batch, 1, 2, 4, generator=torch.Generator().manual_seed(s)),) for s in (0, 1)]


@pytest.fixture(scope="module")
def iree():
    return backends.get("iree")


def test_iree_folds_the_int_comparison_wrong(iree):
    """Pinned: this fails once IREE folds it right, and the guard can go."""
    (x,) = _inputs()[0]
    program = fx_rewrites.apply(rt.export(Fn(CASES["gt"]), x), iree.rules.without(NAME)).program
    got = attrs.evolve(iree, refuse_wrong_forms=False).compile(program, (x,))(x)
    assert torch.equal(got, x), "IREE took 3.0 > 0 for False everywhere"


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_comparison_with_a_float_matches_eager(iree, case, dynamic):
    module = Fn(CASES[case])
    inputs = _inputs() if not dynamic else [_inputs(3)[0], _inputs(2)[1]]
    shapes = ({0: Dim("batch", min=2, max=16)},) if dynamic else None
    result = rt.apply_rules(rt.export(module, *inputs[0], dynamic_shapes=shapes), iree.rules)
    rt.assert_fired(result, float_scalar_in_comparison_for_iree, times=1)
    scalars = [n.args[1] for n in rt.graph_module(result).graph.nodes if n.target in COMPARISONS]
    assert scalars and all(type(s) is float for s in scalars), scalars
    rt.assert_matches_eager(result, module, inputs, rtol=0, atol=0)
    fn = iree.compile(result.program, inputs[0])
    for (x,) in inputs:
        torch.testing.assert_close(fn(x), module(x), rtol=0, atol=0)


def test_the_fuzzers_program(iree):
    module = FilledThenMaskedFill()
    (x,) = _inputs(1)[0]
    fn = iree.compile(fx_rewrites.apply(rt.export(module, x.clone()), iree.rules).program, (x,))
    torch.testing.assert_close(fn(x.clone()), module(x.clone()), rtol=0, atol=0)


@pytest.mark.parametrize(
    "fn",
    [lambda x: x > 0.5, lambda x: x.long() > 0, lambda x: x > 2**60],
    ids=["float_scalar", "int_tensor", "int_not_exact_as_a_float"],
)
def test_other_comparisons_are_left_alone(fn):
    result = rt.apply_rules(rt.export(Fn(fn), *_inputs()[0]), float_scalar_in_comparison_for_iree)
    rt.assert_not_fired(result, float_scalar_in_comparison_for_iree)
