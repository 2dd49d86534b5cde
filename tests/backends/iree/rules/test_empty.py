"""A statically empty tensor reshaped (backends/iree/rules/empty.py): iree-compile 3.13 crashes on it.
The "without the rule" test fails once IREE compiles the reshape itself."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules.empty import empty_reshape_as_fresh_for_iree as RULE

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
