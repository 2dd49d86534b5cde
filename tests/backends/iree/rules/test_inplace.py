"""The in-place forms of issue 12 end to end on IREE (llvm-cpu): each fails on
IREE as exported and, after the IREE backend's rules, compiles and matches
eager on two input sets, with static shapes and with `torch.export.Dim`
sizes. The modules are the ones `test_inplace.py` checks on torch."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import CompileCache, IreeBackend
from fx_rewrites.engine import RewriteError
from tests.rules.test_inplace import (
    ArangeOut,
    IndexPutImpl,
    MobileNetV3Block,
    OutVariants,
    PromotingAdd,
    RandomFill,
    RelativeShift,
    _check_random_fill,
    _relative_shift_inputs,
)
from tests.rules.test_inplace_views import (
    ChainedWritesThroughACopy,
    InputWrites,
    KVCache,
    NarrowCopy,
    NarrowOfNarrow,
    PermutedWriteThenReshape,
    ReshapedWrites,
    StaleAliases,
    WritesThroughViews,
    _narrow_inputs,
)

Dim = torch.export.Dim
aten = torch.ops.aten


@pytest.fixture(scope="module")
def iree() -> IreeBackend:
    return IreeBackend(cache=CompileCache())


def _compiled(
    iree: IreeBackend, module: torch.nn.Module, inputs: list[tuple], dynamic_shapes: Any = None
) -> Callable[..., Any]:
    """Export on the first input set; IREE fails on the program as exported and compiles it after the rules."""
    ep = rt.export(module, *inputs[0], dynamic_shapes=dynamic_shapes)
    with pytest.raises(RewriteError):
        iree.compile(ep, inputs[0])
    result = fx_rewrites.apply(ep, backends.get("iree").rules)
    assert result.report.converged and not result.report.skips, result.report.summary()
    return iree.compile(result.program, inputs[0])


def _matches(fn: Callable[..., Any], module: torch.nn.Module, inputs: list[tuple]) -> None:
    for args in inputs:
        expected = copy.deepcopy(module)(*copy.deepcopy(args))
        torch.testing.assert_close(fn(*copy.deepcopy(args)), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_mobilenet_v3_block(iree, dynamic):
    m = MobileNetV3Block().eval()
    inputs = [(torch.randn(2, 3, 8, 8),), (torch.randn(3, 3, 9, 7) if dynamic else torch.randn(2, 3, 8, 8) * 4,)]
    shapes = ({0: Dim("batch", min=2), 2: Dim("h", min=3), 3: Dim("w", min=3)},) if dynamic else None
    _matches(_compiled(iree, m, inputs, shapes), m, inputs)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_index_put_impl(iree, dynamic):
    make = lambda n: (torch.randn(n, 3), torch.tensor([0, 3, 0]), torch.randn(3, 3))
    inputs = [make(5), make(7 if dynamic else 5)]
    shapes = ({0: Dim("n", min=4)}, None, None) if dynamic else None
    _matches(_compiled(iree, IndexPutImpl(), inputs, shapes), IndexPutImpl(), inputs)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_float32_plus_float64_in_place(iree, dynamic):
    inputs = [(torch.randn(2, 3),), (torch.randn(4 if dynamic else 2, 3) * 3,)]
    fn = _compiled(iree, PromotingAdd(), inputs, ({0: Dim("b")},) if dynamic else None)
    for (x,) in inputs:
        got_x, want_x = x.clone(), x.clone()
        got, want = fn(got_x), PromotingAdd()(want_x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_x, want_x)  # the input is written as in eager


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_uniform_and_bernoulli(iree, dynamic):
    inputs = [(torch.randn(3, 4),), (torch.randn(5 if dynamic else 3, 4),)]
    fn = _compiled(iree, RandomFill(), inputs, ({0: Dim("b")},) if dynamic else None)
    for (x,) in inputs:
        _check_random_fill(fn(x), x)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_arange_out(iree, dynamic):
    inputs = [(torch.randn(3, 5),), (torch.randn(4 if dynamic else 3, 5) * 2,)]
    fn = _compiled(iree, ArangeOut(), inputs, ({0: Dim("b")},) if dynamic else None)
    _matches(fn, ArangeOut(), inputs)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_other_out_and_in_place_forms(iree, dynamic):
    m = OutVariants(two_outs=not dynamic, foreach=False)  # IREE 3.13 has no lowering for _foreach_add
    inputs = [(torch.randn(3, 4),), (torch.randn(6 if dynamic else 3, 4) * 3,)]
    _matches(_compiled(iree, m, inputs, ({0: Dim("b")},) if dynamic else None), m, inputs)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_in_place_through_reshape_views(iree, dynamic):
    """Funnel's `positional_attn *= cls_mask` through `aten.reshape` views."""
    seq = Dim("seq", min=2, max=32)
    shapes = ({2: seq}, {0: 2 * seq + 1}, {0: seq, 1: seq}) if dynamic else None
    inputs = [_relative_shift_inputs(5), _relative_shift_inputs(7 if dynamic else 5)]
    _matches(_compiled(iree, RelativeShift(), inputs, shapes), RelativeShift(), inputs)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_narrow_copy(iree, dynamic):
    """`y.narrow(1, 1, n).copy_(src)` into a tensor read later: IREE rejects the `copy_` as exported."""
    n = Dim("n", min=2, max=64)
    shapes = ({0: Dim("b"), 1: n + 2}, {0: Dim("b"), 1: n}) if dynamic else None
    second = _narrow_inputs(3, 5) if dynamic else (torch.randn(2, 5) * 3, torch.randn(2, 3))
    inputs = [_narrow_inputs(2, 3), second]
    _matches(_compiled(iree, NarrowCopy(), inputs, shapes), NarrowCopy(), inputs)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_narrow_copy_into_a_buffer(iree, dynamic):
    inputs = [(torch.randn(2, 3, 4),), (torch.randn(2, 5 if dynamic else 3, 4) * 3,)]
    shapes = ({1: Dim("t", min=1, max=6)},) if dynamic else None
    _matches(_compiled(iree, KVCache(), inputs, shapes), KVCache(), inputs)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_writes_through_views(iree, dynamic):
    """Writes through diagonal, transpose, permute, view, unsqueeze/squeeze, split and unbind pieces, select,
    as_strided, a copying reshape and a view made before them, of a tensor read later."""
    m = WritesThroughViews(static_only=not dynamic)
    inputs = [(torch.randn(4, 4),), (torch.randn(6 if dynamic else 4, 4) * 3,)]
    shapes = ({0: Dim("b", min=4)},) if dynamic else None
    _matches(_compiled(iree, m, inputs, shapes), m, inputs)
    inputs = [(torch.randn(4, 6),), (torch.randn(5 if dynamic else 4, 6) * 3,)]
    _matches(_compiled(iree, ReshapedWrites(), inputs, ({0: Dim("b")},) if dynamic else None), ReshapedWrites(), inputs)


def test_write_through_views_of_size_batch_minus_one(iree):
    """Dim batch exported at 2, the written view `batch - 1` long: the traced write-back kept batch
    symbolic (it fixed it to 2 before: IREE failed to compile, 'flow.tensor.reshape' ... dynamic dims)."""
    inputs = [(torch.randn(b, 2, 2, 4),) for b in (2, 3, 5)]
    _matches(_compiled(iree, NarrowOfNarrow(), inputs, ({0: Dim.AUTO},)), NarrowOfNarrow(), inputs)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_write_through_permute_then_reshape(iree, dynamic):
    """The base keeps its strides after a write through permute: the later reshape's write reaches it."""
    m = PermutedWriteThenReshape(flat=True)
    inputs = [(torch.randn(2, 3, 2, 4),), (torch.randn(3 if dynamic else 2, 3, 2, 4) * 3,)]
    _matches(_compiled(iree, m, inputs, ({0: Dim("b", min=2)},) if dynamic else None), m, inputs)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_chained_writes_through_a_copying_reshape(iree, dynamic):
    """The second write through a narrow of a reshape that copies reaches the copy, not its source."""
    m = ChainedWritesThroughACopy()
    inputs = [(torch.randn(2, 2, 2, 4),), (torch.randn(3 if dynamic else 2, 2, 2, 4) * 3,)]
    _matches(_compiled(iree, m, inputs, ({0: Dim("b", min=2)},) if dynamic else None), m, inputs)


def test_writes_through_split_and_unbind_pieces(iree):
    inputs = [(torch.randn(2, 4),), (torch.randn(2, 4) * 3,)]
    _matches(_compiled(iree, StaleAliases(), inputs), StaleAliases(), inputs)


def test_writes_through_views_of_an_input(iree):
    """x.diagonal().zero_() and x.narrow(0, 1, 2).mul_(2) on the caller's tensor: written as in eager."""
    inputs = [(torch.randn(4, 4),), (torch.randn(4, 4) * 3,)]
    fn = _compiled(iree, InputWrites(), inputs)
    for (x,) in inputs:
        got_x, want_x = x.clone(), x.clone()
        torch.testing.assert_close(fn(got_x), InputWrites()(want_x))
        torch.testing.assert_close(got_x, want_x)
