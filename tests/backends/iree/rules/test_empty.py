"""A statically empty tensor reshaped or sorted (backends/iree/rules/empty.py): iree-compile 3.13 crashes on
it. The "without the rule" tests fail once IREE compiles the reshape or sort itself."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules.empty import empty_reshape_as_fresh_for_iree as RULE
from fx_rewrites.backends.iree.rules.empty import empty_sort_as_fresh_for_iree as SORT

aten = torch.ops.aten
IREE = backends.get("iree")


class EmptyAdapterBatch(torch.nn.Module):
    """What dynamo specialises for an adapter given no rows: views of a [0, 24, 32] batch, added to and summed."""

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.view(0, 32) + 1
        return flat, x.reshape(0, 24 * 32).sum(0) + bias


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(0, 24, 32, generator=g), torch.randn(24 * 32, generator=g)


def test_iree_crashes_without_the_rule():
    program = fx_rewrites.apply(rt.export(EmptyAdapterBatch(), *_inputs(0)), IREE.rules.without(RULE.name)).program
    with pytest.raises(Exception, match=r"without an error diagnostic|crash"):
        IREE.compile(program, _inputs(0))


def test_the_reshapes_become_fresh_and_iree_matches_eager():
    ep = rt.export(EmptyAdapterBatch(), *_inputs(0))
    result = rt.apply_rules(ep, RULE)
    rt.assert_fired(result, RULE, times=2)
    rt.assert_ops(result, present=[aten.zeros.default], absent=[aten.view.default, aten.reshape.default])
    rt.assert_idempotent(result, RULE)
    rt.assert_matches_eager(result, EmptyAdapterBatch(), [_inputs(1), _inputs(2)])
    fn = IREE.compile(fx_rewrites.apply(ep, IREE.rules).program, _inputs(0))
    for seed in (1, 2):
        got, want = fn(*_inputs(seed)), EmptyAdapterBatch()(*_inputs(seed))
        assert [g.shape for g in got] == [w.shape for w in want]
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_reshape_to_a_symbolic_size_or_of_a_full_tensor_is_left_alone():
    """With a Dim on the kept size the result's size is symbolic (not a static zeros); a full tensor is no case."""
    fn = lambda x, y: (x.reshape(0, x.shape[1] * 4), y.view(-1))
    ep = rt.export(fn, torch.randn(0, 5, 4), torch.randn(3, 4), dynamic_shapes=({1: Dim("n", min=2)}, None))
    result = rt.apply_rules(ep, RULE, explain=True)
    rt.assert_not_fired(result, RULE)
    reasons = {a.reason for a in result.report.explain(RULE.name) if not a.fired}
    assert reasons == {"when: the result has a symbolic size", "when: the input is not statically empty"}


def sort_empty_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x[:, :0].sort(1, descending=True)[0] + 1, x[:, 2:2].sort(1)[0]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_sort_of_an_empty_tensor_becomes_fresh(dynamic):
    """The values of x[:, :0].sort(1): iree-compile crashes on them; after the rule, empty results
    of torch's shapes and dtypes."""
    inputs = [(torch.randn(3, 5),), (torch.randn(6 if dynamic else 3, 5),)]
    ep = rt.export(sort_empty_rows, *inputs[0], dynamic_shapes=[{0: Dim("b")}] if dynamic else None)
    without = fx_rewrites.apply(ep, IREE.rules.without(SORT.name)).program
    with pytest.raises(Exception, match=r"without an error diagnostic|crash"):
        IREE.compile(without, inputs[0])
    result = fx_rewrites.apply(ep, IREE.rules)
    rt.assert_fired(result, SORT, times=2)
    rt.assert_ops(result, absent=[aten.sort.default])
    rt.assert_matches_eager(result, sort_empty_rows, inputs)
    fn = IREE.compile(result.program, inputs[0])
    for args in inputs:
        for got, want in zip(fn(*args), sort_empty_rows(*args)):
            assert got.shape == want.shape and got.dtype == want.dtype and got.numel() == 0


@pytest.mark.parametrize(
    "fn",
    [lambda x: x.sort(1)[0], lambda x: x[:, :0].sort(1), lambda x: torch.argsort(x[:, :0], 1)],
    ids=["non-empty", "indices-used", "argsort"],
)
def test_sorts_that_compile_are_left_alone(fn):
    x = torch.randn(3, 5)
    result = fx_rewrites.apply(rt.export(fn, x), IREE.rules)
    rt.assert_not_fired(result, SORT)
    got, want = IREE.compile(result.program, (x,))(x), fn(x)
    for g, w in zip(got if isinstance(want, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w)
