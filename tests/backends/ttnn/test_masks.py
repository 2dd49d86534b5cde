"""Attention-mask plumbing on the device: bool `&` and `where` with a number (transformers 5's masks)."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.ttnn import lower, runtime
from fx_rewrites.backends.ttnn.rules import RULES, ops
from fx_rewrites.rules import DEFAULT
from tests.backends.ttnn import reference_ttnn
from tests.backends.ttnn.conftest import assert_close_bf16

aten = torch.ops.aten
LOWEST = torch.finfo(torch.float32).min


@pytest.fixture(autouse=True)
def _double():
    previous = runtime.use(reference_ttnn)
    yield
    runtime.use(previous)


class MaskedScores(torch.nn.Module):
    """Two bool masks joined with `&`, made additive with where(mask, scores, lowest), then softmax."""

    def forward(self, scores, keep, rows):
        mask = (keep > 0.0) & (rows > 0.0)  # signs: exact on bfloat16 values too
        return torch.softmax(torch.where(mask, scores, LOWEST), -1), torch.where(mask, 0.5, scores * 2.0)


def _inputs(batch: int):
    scores = torch.randn(batch, 2, 6, 6)
    keep = torch.randn(batch, 1, 1, 6)
    keep[:, :, :, 0] = 1.0  # every row keeps a key (torch gives NaN for a row that masks all)
    rows = torch.randn(batch, 1, 6, 1).abs() + 0.1
    rows[:, :, 1] = -1.0
    return [(scores, keep, rows), (scores * 3.0, keep.neg().clamp(max=0.5) + 0.25, rows.flip(2))]


def _lower_rules(program):
    return rt.apply_rules(rt.apply_rules(program, DEFAULT).program, RULES, explain=True)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim_batch"])
def test_bool_and_and_where_with_a_number_lower(dynamic):
    model = MaskedScores()
    args = _inputs(2)[0]
    shapes = [{0: Dim("b")}] * 3 if dynamic else None
    program = rt.export(model, *args, dynamic_shapes=shapes)
    result = _lower_rules(program)
    rt.assert_fired(result, "ttnn_bool_and", times=1)
    rt.assert_fired(result, "ttnn_where_number", times=2)
    rt.assert_ops(
        result,
        present=[ops.where_scalar, ops.OPS["logical_not"]],
        absent=[aten.__and__.Tensor, aten.where.ScalarOther, aten.where.ScalarSelf],
    )
    fn = backends.get("ttnn").compile(lower(program), args)
    for batch in (2, 3) if dynamic else (2,):
        for inputs in _inputs(batch):
            got, expected = fn(*inputs), model(*inputs)
            for g, e in zip(got, expected):
                assert_close_bf16(g, e)


def test_integer_and_and_infinite_numbers_stay_on_the_host():
    def fn(x, n):
        return (n & (n + 1)) + 1, torch.where(x > 0.0, x * 2.0, float("-inf"))

    x, n = torch.randn(4, 8), torch.randint(0, 16, (4, 8))
    result = _lower_rules(rt.export(fn, x, n))
    rt.assert_ops(result, present=[aten.where.ScalarOther])
    reasons = [a.reason for a in result.report.explain() if not a.fired]
    assert any("is int64, not bool" in r and "integer & is bitwise" in r for r in reasons), reasons
    assert any("the lowering takes a finite number" in r for r in reasons), reasons
    for inputs in ((x, n), (x * -2.0, n + 3)):
        got, expected = result.program.module()(*inputs), fn(*inputs)
        torch.testing.assert_close(got[0], expected[0])
        assert_close_bf16(got[1], expected[1])
