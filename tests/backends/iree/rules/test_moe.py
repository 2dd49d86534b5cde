"""transformers' grouped matmul of MoE experts on IREE (backends/iree/rules/moe.py)."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.errors import IreeCompileError
from fx_rewrites.backends.iree.rules.moe import grouped_mm_for_iree

moe = pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback


class Experts(torch.nn.Module):
    """The grouped matmul as transformers 5's MoE layers call it: rows sorted by expert, offs their ends."""

    def forward(self, x, weight, offs):
        return torch.ops.transformers.grouped_mm_fallback(x, weight, offs) * 2.0


def _inputs(rows: int, offs: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), torch.randn(3, 4, 5, generator=g), torch.tensor(offs)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_grouped_mm_becomes_a_gathered_bmm_on_iree(dynamic):
    # an expert with no rows, and a row past the last offset (0 in the op)
    inputs = [_inputs(7, [2, 2, 6], 0), _inputs(9 if dynamic else 7, [3, 5, 7] if dynamic else [0, 4, 7], 1)]
    shapes = ({0: Dim("rows")}, None, None) if dynamic else None
    ep = rt.export(Experts(), *inputs[0], dynamic_shapes=shapes)
    iree = backends.get("iree")
    with pytest.raises(IreeCompileError, match="grouped_mm_fallback"):
        iree.compile(ep, inputs[0])
    result = rt.apply_rules(ep, grouped_mm_for_iree)
    rt.assert_fired(result, "grouped_mm_to_gathered_bmm_for_iree", times=1)
    assert not any("grouped_mm" in str(t) for t in rt.targets(result))
    rt.assert_matches_eager(result, Experts(), inputs, rtol=1e-5, atol=1e-5)
    rt.assert_idempotent(result, grouped_mm_for_iree)
    compiled = iree.compile(rt.apply_rules(ep, iree.rules).program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(compiled(*args), Experts()(*args), rtol=1e-4, atol=1e-5)
