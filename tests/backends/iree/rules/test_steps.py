"""Slices with a step that IREE 3.13 cannot compile where they are read (backends/iree/rules/steps.py).

flip_of_stepped_slice_for_iree: a flip of a slice with a step along the innermost dim becomes a slice of the
flipped tensor (the same elements). stepped_slice_read_by_gather_for_iree: a gather (index, index_select, gather, a diagonal as a gather) of a
slice with a step along the innermost dim gathers the slice's elements from the sliced tensor instead
(index_select on the innermost dim). one_innermost_element_read_by_gather_for_iree: the same for one
element of the innermost dim (select, a one-element narrow). single_element_step_for_iree: a slice whose
step picks one element, written through, takes it with step 1. Each gives the same values."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeCompileError
from fx_rewrites.backends.iree.rules.steps import (
    flip_of_stepped_slice_for_iree,
    one_innermost_element_read_by_gather_for_iree,
    single_element_step_for_iree,
    stepped_slice_read_by_gather_for_iree,
    unbind_innermost_read_by_gather_for_iree,
)

aten = torch.ops.aten


def _two(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(2, device=x.device)


CASES = {
    "index_leading_dims": lambda x: x[..., ::2][_two(x), _two(x)],
    "index_select": lambda x: x[..., 1::3].index_select(1, _two(x) + 1),
    "gather": lambda x: x[..., ::2].gather(1, x.new_zeros(x.shape[0], 2, 5, dtype=torch.long) + 3),
    "index_innermost": lambda x: x[..., ::2][..., _two(x) * 2],
    "negative_bounds": lambda x: x[..., -9:-1:2][_two(x)],
    "diagonal": lambda x: x[..., ::2].diagonal(0, 1, 2),  # a gather after diagonal_as_gather_for_iree
    "diagonal_through_view": lambda x: x[..., ::2].transpose(0, 2).diagonal(0, 1, 2),  # a view with a Dim
    "flip_through_a_view": lambda x: x[..., ::2].narrow(1, 0, 2).flip(-1),  # fuzz seed 16, without its write
    "flip_through_unbind": lambda x: x[..., ::2].unbind(1)[0].flip(-1),  # seed 16 again, once the above was fixed
}


FLIP_CASES = {
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


@pytest.mark.parametrize("fn", [CASES["index_leading_dims"], FLIP_CASES["last_step2"]], ids=["gather", "flip"])
def test_iree_cannot_compile_it_as_exported(iree, fn):
    """Pinned: this fails once IREE compiles a gather or flip of a stepped slice, and the rules can go."""
    with pytest.raises(IreeCompileError, match="LLVM Translation failed"):
        iree.compile(rt.export(Fn(fn), *_inputs()[0]), _inputs()[0])


def _rewritten(iree, module: torch.nn.Module, rule, dynamic: bool) -> tuple:
    """The IREE rules' result on `module` (the rule fired once) and two input sets."""
    inputs = _inputs() if not dynamic else [(torch.randn(5, 4, 10),), (torch.randn(2, 4, 10),)]
    shapes = ({0: Dim("batch", min=2, max=16)},) if dynamic else None
    result = rt.apply_rules(rt.export(module, *inputs[0], dynamic_shapes=shapes), iree.rules)
    rt.assert_fired(result, rule, times=1)
    return result, inputs


def _left_alone_and_exact(iree, fn, rule) -> None:
    """The IREE rules leave `fn`'s program alone as far as `rule` goes, and IREE compiles it exactly."""
    module = Fn(fn)
    result = rt.apply_rules(rt.export(module, *_inputs()[0]), iree.rules)
    rt.assert_not_fired(result, rule)
    compiled = iree.compile(result.program, _inputs()[0])
    torch.testing.assert_close(compiled(*_inputs()[1]), module(*_inputs()[1]), rtol=0, atol=0)


def _exact_on_iree(iree, result, module: torch.nn.Module, inputs: list[tuple]) -> None:
    rt.assert_matches_eager(result, module, inputs, rtol=0, atol=0)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), module(*args), rtol=0, atol=0)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_gathered_slice_matches_eager(iree, case, dynamic):
    module = Fn(CASES[case])
    result, inputs = _rewritten(iree, module, stepped_slice_read_by_gather_for_iree, dynamic)
    stepped = [n for n in rt.graph_module(result).graph.nodes if n.target == aten.slice.Tensor and n.args[4:5] != ()]
    assert [n for n in stepped if n.args[4] != 1] == [], "no stepped slice is left"
    _exact_on_iree(iree, result, module, inputs)


@pytest.mark.parametrize(
    "fn",
    [lambda x: x[..., ::2] + 1, lambda x: x[:, ::2][_two(x)], lambda x: x[..., 1:7][_two(x)]],
    ids=["read_elementwise", "step_not_innermost", "no_step"],
)
def test_forms_that_compile_are_left_alone(iree, fn):
    _left_alone_and_exact(iree, fn, stepped_slice_read_by_gather_for_iree)


def test_a_slice_written_in_place_stays_a_view():
    class Write(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = x * 1
            s = y[..., ::2]
            picked = s[torch.arange(2)]
            s.mul_(2)
            return picked, y

    ep = rt.export(Write(), *_inputs()[0])
    result = rt.apply_rules(ep, stepped_slice_read_by_gather_for_iree, explain=True)
    rt.assert_not_fired(result, stepped_slice_read_by_gather_for_iree)
    reasons = [a.reason for a in result.report.explain("stepped_slice_read_by_gather_for_iree")]
    assert any("writes it in place" in r for r in reasons), reasons


# -- a step that picks one element


class WriteThroughOneElementStep(torch.nn.Module):
    """The view-write fuzzer's seed 15: a write through `y[:, ::2]` where dim 1 has size 1, narrowed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1
        y[:, ::2].narrow(0, 0, 1).mul_(-1.5)
        return y * 1


def _one_element_inputs(batch: int = 2) -> list[tuple[torch.Tensor]]:
    return [(torch.randn(batch, 1, 2, 4, generator=torch.Generator().manual_seed(s)),) for s in (0, 1)]


def test_iree_cannot_compile_a_write_through_a_one_element_step(iree):
    """Pinned: this fails once IREE compiles it, and the rule can go."""
    inputs = _one_element_inputs()
    program = fx_rewrites.apply(rt.export(WriteThroughOneElementStep(), *inputs[0]), iree.rules.without(
        "single_element_step_for_iree")).program  # fmt: skip
    with pytest.raises(IreeCompileError, match="rank-reduced"):
        iree.compile(program, inputs[0])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_a_write_through_a_one_element_step_matches_eager(iree, dynamic):
    module = WriteThroughOneElementStep()
    inputs = _one_element_inputs() if not dynamic else [_one_element_inputs(3)[0], _one_element_inputs(2)[1]]
    shapes = ({0: Dim("batch", min=2, max=16)},) if dynamic else None
    result = rt.apply_rules(rt.export(module, *inputs[0], dynamic_shapes=shapes), iree.rules)
    rt.assert_fired(result, single_element_step_for_iree)
    steps = [n.args[4] for n in rt.graph_module(result).graph.nodes if n.target in (
        aten.slice.Tensor, aten.slice_scatter.default) and len(n.args) > 4]  # fmt: skip
    assert all(step == 1 for step in steps), steps
    rt.assert_matches_eager(result, module, inputs, rtol=0, atol=0)
    fn = iree.compile(result.program, inputs[0])
    for (x,) in inputs:
        torch.testing.assert_close(fn(x.clone()), module(x.clone()), rtol=0, atol=0)


def test_a_step_that_picks_more_elements_is_left_alone():
    class Read(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, ::2] * 2  # dim 1 has size 3: two elements

    result = rt.apply_rules(rt.export(Read(), torch.randn(2, 3, 4)), single_element_step_for_iree)
    rt.assert_not_fired(result, single_element_step_for_iree)


# -- a flip of a stepped slice


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("case", sorted(FLIP_CASES))
def test_a_slice_of_the_flipped_tensor_matches_eager(iree, case, dynamic):
    module = Fn(FLIP_CASES[case])
    result, inputs = _rewritten(iree, module, flip_of_stepped_slice_for_iree, dynamic)
    flips = [n for n in rt.graph_module(result).graph.nodes if n.target == aten.flip.default]
    assert [n.args[0].op for n in flips] == ["placeholder"], "the flip reads the input itself, not a slice"
    _exact_on_iree(iree, result, module, inputs)


@pytest.mark.parametrize(
    "fn",
    [lambda x: x[:, ::2].flip(1), lambda x: x[..., 1:7].flip(-1), lambda x: x.flip(-1)[..., 1::2]],
    ids=["step_not_innermost", "no_step", "slice_after_flip"],
)
def test_flips_that_compile_are_left_alone(iree, fn):
    _left_alone_and_exact(iree, fn, flip_of_stepped_slice_for_iree)


# -- one element of the innermost dim, read by a gather or a flip (fuzz seeds 12, 16, 19, 20)

ONE_ELEMENT_CASES = {
    "select_flip": lambda x: x.select(2, -1).flip(-1),  # seed 19
    "select_index": lambda x: x.select(2, -1)[_two(x)],  # seed 19
    "select_index_select": lambda x: x.select(2, 3).index_select(0, _two(x)),
    "narrow_diagonal": lambda x: x.narrow(2, 3, 1).diagonal(0, 1, 2),  # seeds 12, 20: a gather once rewritten
    "narrow_diagonal_through_view": lambda x: x.narrow(2, 3, 1).transpose(0, 2).diagonal(0, 1, 2),  # a view (Dim)
    "slice_index_through_view": lambda x: x[..., 4:5].transpose(0, 1)[_two(x)],
    "narrow_flip_other_dim": lambda x: x[..., 2:3].flip(0),
    "unbind_diagonal": lambda x: x.unbind(2)[-1].diagonal(0, 0, 1),  # seed 21, as selects first
}


@pytest.mark.parametrize("fn", [ONE_ELEMENT_CASES["select_flip"], ONE_ELEMENT_CASES["narrow_diagonal"]])
def test_iree_cannot_compile_one_innermost_element_gathered(iree, fn):
    """Pinned, as above: rewritten by every rule but this one, the program does not compile."""
    rules = iree.rules.without(one_innermost_element_read_by_gather_for_iree.name)
    result = rt.apply_rules(rt.export(Fn(fn), *_inputs()[0]), rules)
    with pytest.raises(IreeCompileError, match="LLVM Translation failed"):
        iree.compile(result.program, _inputs()[0])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("case", sorted(ONE_ELEMENT_CASES))
def test_one_innermost_element_gathered_matches_eager(iree, case, dynamic):
    module = Fn(ONE_ELEMENT_CASES[case])
    result, inputs = _rewritten(iree, module, one_innermost_element_read_by_gather_for_iree, dynamic)
    if case.startswith("unbind"):
        rt.assert_fired(result, unbind_innermost_read_by_gather_for_iree, times=1)
    graph = rt.graph_module(result).graph
    assert not [n for n in graph.nodes if n.target == aten.select.int], "no select is left"
    assert [n.args[1] for n in graph.nodes if n.target == aten.index_select.default][:1] == [2]
    _exact_on_iree(iree, result, module, inputs)


@pytest.mark.parametrize(
    "fn",
    [lambda x: x.select(2, 1) + 1, lambda x: x.select(1, 1).flip(-1), lambda x: x[..., 2:4][_two(x)]],
    ids=["read_elementwise", "not_innermost", "two_elements"],
)
def test_other_reads_of_one_element_are_left_alone(iree, fn):
    _left_alone_and_exact(iree, fn, one_innermost_element_read_by_gather_for_iree)


class _DataLongSlice(torch.nn.Module):
    """A slice of the innermost dim as long as a value in the data says (`x[..., :n.item() + 1]`: one element when
    n is 0, which a match must not guard on), read by an index: a decode step's attention mask sized to the
    positions written so far (app/lm/export.py)."""

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        end = n.item()
        torch._check(end >= 0)
        torch._check(end < x.shape[-1])
        return x[..., : end + 1][_two(x)]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_a_slice_as_long_as_the_data_says_is_left_alone(iree, dynamic):
    module = _DataLongSlice()
    shapes = ({0: Dim("rows", min=2, max=16)}, None) if dynamic else None
    program = torch.export.export(module, (torch.randn(3, 4, 8), torch.tensor(3)), dynamic_shapes=shapes)
    result = rt.apply_rules(program, iree.rules)  # raised GuardOnDataDependentSymNode before the rule's fix
    rt.assert_not_fired(result, one_innermost_element_read_by_gather_for_iree)
    for rows, n in ((3, 0), (5 if dynamic else 3, 5)):
        x = torch.randn(rows, 4, 8)
        torch.testing.assert_close(
            result.program.module()(x, torch.tensor(n)), module(x, torch.tensor(n)), rtol=0, atol=0
        )
