"""flip_of_stepped_slice_for_iree: a flip of a slice with a step along the innermost dim, which IREE 3.13
cannot compile, as a slice of the flipped tensor (the same elements)."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeCompileError
from fx_rewrites.rules.iree_steps import flip_of_stepped_slice_for_iree

aten = torch.ops.aten

CASES = {
    "last_step2": lambda x: x[..., ::2].flip(-1),
    "last_from1_step3": lambda x: x[..., 1::3].flip(-1),
    "last_bounded_negative": lambda x: x[..., -9:-1:2].flip(-1),
    "flip_other_dim": lambda x: x[..., ::2].flip(1),
    "flip_both": lambda x: x[..., 1::2].flip(-1, 1),
}


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x) * 2


def _inputs(batch: int = 3) -> list[tuple[torch.Tensor]]:
    return [(torch.randn(batch, 4, 10, generator=torch.Generator().manual_seed(s)),) for s in (0, 1)]


@pytest.fixture(scope="module")
def iree():
    return backends.get("iree")


def test_iree_cannot_compile_it_as_exported(iree):
    """Pinned: this fails once IREE compiles the flip of a stepped slice, and the rule can go."""
    module = Fn(CASES["last_step2"])
    with pytest.raises(IreeCompileError, match="LLVM Translation failed"):
        iree.compile(rt.export(module, *_inputs()[0]), _inputs()[0])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_slice_of_the_flipped_tensor_matches_eager(iree, case, dynamic):
    module = Fn(CASES[case])
    inputs = _inputs() if not dynamic else [(torch.randn(5, 4, 10),), (torch.randn(2, 4, 10),)]
    shapes = ({0: Dim("batch", min=2, max=16)},) if dynamic else None
    result = rt.apply_rules(rt.export(module, *inputs[0], dynamic_shapes=shapes), iree.rules)
    rt.assert_fired(result, flip_of_stepped_slice_for_iree, times=1)
    flips = [n for n in rt.graph_module(result).graph.nodes if n.target == aten.flip.default]
    assert [n.args[0].op for n in flips] == ["placeholder"], "the flip reads the input itself, not a slice"
    rt.assert_matches_eager(result, module, inputs, rtol=0, atol=0)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), module(*args), rtol=0, atol=0)


@pytest.mark.parametrize(
    "fn",
    [lambda x: x[:, ::2].flip(1), lambda x: x[..., 1:7].flip(-1), lambda x: x.flip(-1)[..., 1::2]],
    ids=["step_not_innermost", "no_step", "slice_after_flip"],
)
def test_forms_that_compile_are_left_alone(iree, fn):
    module = Fn(fn)
    result = rt.apply_rules(rt.export(module, *_inputs()[0]), iree.rules)
    rt.assert_not_fired(result, flip_of_stepped_slice_for_iree)
    compiled = iree.compile(result.program, _inputs()[0])
    torch.testing.assert_close(compiled(*_inputs()[1]), module(*_inputs()[1]), rtol=0, atol=0)
