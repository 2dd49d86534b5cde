"""`x[mask] = v` with one row of v per True (backends/iree/rules/mask_put.py). Before the rule: "'iree_linalg_ext.
scatter' op mismatch in shape of indices and update value at dim#0"."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeCompileError
from fx_rewrites.backends.iree.rules.mask_put import mask_put_rows_as_gather_for_iree

aten = torch.ops.aten
IREE = backends.get("iree")


def put(x, mask, v):
    x = x.clone()
    x[mask] = v
    return x


def put_accumulate(x, mask, v):
    return torch.index_put(x, (mask,), v, accumulate=True)


def _rows(n: int, trues: list[int]) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[trues] = True
    return mask


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


CASES = {
    # name: (fn, two input sets of the same count of Trues, the Dims (None: static))
    "rows": (
        put,
        [(_randn(5, 4, seed=0), _rows(5, [0, 2, 3]), _randn(3, 4, seed=1)),
         (_randn(5, 4, seed=2), _rows(5, [1, 3, 4]), _randn(3, 4, seed=3))],
        None,
    ),
    "rows-dim-on-n": (
        put,
        [(_randn(5, 4, seed=0), _rows(5, [0, 2, 3]), _randn(3, 4, seed=1)),
         (_randn(8, 4, seed=2), _rows(8, [1, 6, 7]), _randn(3, 4, seed=3))],
        ({0: Dim("n")}, {0: Dim("n")}, None),
    ),
    "rows-dim-on-c": (
        put,
        [(_randn(5, 4, seed=0), _rows(5, [0, 2, 3]), _randn(3, 4, seed=1)),
         (_randn(5, 7, seed=2), _rows(5, [1, 3, 4]), _randn(3, 7, seed=3))],
        ({1: Dim("c")}, None, {1: Dim("c")}),
    ),
    "vector": (
        put,
        [(_randn(5, seed=0), _rows(5, [0, 4]), _randn(2, seed=1)),
         (_randn(5, seed=2), _rows(5, [2, 3]), _randn(2, seed=3))],
        None,
    ),
    "2d-mask-int": (
        put,
        [(torch.arange(24).view(2, 3, 4), torch.tensor([[True, False, True], [True, False, False]]),
          torch.arange(100, 112).view(3, 4)),
         (torch.arange(24).view(2, 3, 4) * 3, torch.tensor([[False, True, True], [False, True, False]]),
          -torch.arange(12).view(3, 4))],
        None,
    ),
    "accumulate-broadcast-row": (
        put_accumulate,
        [(_randn(5, 4, seed=0), _rows(5, [0, 2, 3]), _randn(3, 1, seed=1)),
         (_randn(6, 4, seed=2), _rows(6, [1, 3, 5]), _randn(3, 1, seed=3))],
        ({0: Dim("n")}, {0: Dim("n")}, None),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_mask_put_rows_match_torch_exactly(name):
    fn, inputs, dims = CASES[name]
    ep = rt.export(fn, *inputs[0], dynamic_shapes=dims)
    without = rt.apply_rules(ep, IREE.rules.without(mask_put_rows_as_gather_for_iree.name)).program
    with pytest.raises(IreeCompileError, match="mismatch in shape of indices and update value at dim#0"):
        IREE.compile(without, inputs[0])
    result = rt.apply_rules(ep, IREE.rules)
    rt.assert_fired(result, mask_put_rows_as_gather_for_iree, times=1)
    rt.assert_ops(
        result,
        present=[aten.where.self, aten.index_select.default],
        absent=[aten.index_put.default, aten.index_put_.default],
    )
    rt.assert_matches_eager(result, fn, inputs, rtol=0, atol=0)
    compiled = IREE.compile(result.program, inputs[0])
    for args in inputs:
        got, want = compiled(*args), fn(*args)
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize(
    ("values", "dims"),
    [(_randn(4, seed=1), None), (_randn(1, 4, seed=1), None), (_randn(3, 4, seed=1), {0: Dim("k")})],
    ids=["one-row-for-all", "leading-one", "dim-on-the-count"],
)
def test_forms_that_compile_are_left_alone(values, dims):
    """v the same for every selected element is masks.mask_index_put_to_where's; a Dim on v's count compiles
    on IREE as exported."""
    inputs = (_randn(5, 4, seed=0), _rows(5, [0, 2, 3]), values)
    shapes = ({0: Dim("n")}, {0: Dim("n")}, dims) if dims is not None else None
    ep = rt.export(put, *inputs, dynamic_shapes=shapes)
    result = rt.apply_rules(ep, IREE.rules)
    rt.assert_not_fired(result, mask_put_rows_as_gather_for_iree)
    torch.testing.assert_close(IREE.compile(result.program, inputs)(*inputs), put(*inputs), rtol=0, atol=0)
