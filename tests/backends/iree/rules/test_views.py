"""Guards against IREE writing a tensor into itself (backends/iree/rules/views.py).

Each "wrong on IREE" test compiles the program after every rule of the IREE
backend but these guards and asserts IREE 3.13 gets it wrong (or fails at
run time), so it fails once IREE is fixed and the guards can go. The guarded
tests check the rewrite, static and with Dim sizes, against eager on two
input sets, in torch and through IREE.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.errors import IreeUnsupportedError
from fx_rewrites.backends.iree.rules.views import RULES, index_put_of_itself_for_iree, slice_scatter_of_itself_for_iree
from fx_rewrites.engine import RewriteError

aten = torch.ops.aten


@pytest.fixture(scope="module")
def iree():
    return backends.get("iree")


class ShiftRight(torch.nn.Module):
    """MBart's shift_tokens_right: `y[:, 1:] = y[:, :-1].clone()` then the start token in column 0."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = ids.clone()
        last = (y.ne(1).sum(dim=1) - 1).unsqueeze(-1)
        start = y.gather(1, last).squeeze(-1)
        y[:, 1:] = y[:, :-1].clone()
        y[:, 0] = start
        return y


class ShiftRows(torch.nn.Module):
    """The same shift along dim 0, where the written range is contiguous."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[1:] = y[:-1].clone()
        return y


class ShiftByTwoWithStep(torch.nn.Module):
    """Every other column from the one two before (slice_scatter with step 2), and a shift by two."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.clone()
        y[:, 2::2] = y[:, :-2:2].clone()
        z = x.clone()
        z[:, 2:] = z[:, :-2] * 1  # IREE folds `* 1`: still the same buffer
        return y, z


class IndexPutShift(torch.nn.Module):
    """index_put of rows of the tensor itself, one row later, plain and accumulated."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(1, x.shape[0])
        return torch.index_put(x, (rows,), x[:-1]), torch.index_put(x, (rows,), x[:-1], accumulate=True)


class IndexCopyAdd(torch.nn.Module):
    """index_copy and index_add of the tensor's own rows: the legalize phase makes them index_put."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(1, x.shape[0])
        return torch.index_copy(x, 0, rows, x[:-1]), torch.index_add(x, 0, rows, x[:-1])


def _ids(batch: int, seq: int, seed: int) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 100, (batch, seq), generator=g)
    ids[0, -2:] = 1  # padding: the start token is the last non-pad one
    return (ids,)


def _floats(*shape: int, seed: int) -> tuple[torch.Tensor]:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)),)


#: (module, static inputs, Dim inputs (other sizes), dynamic_shapes)
CASES = {
    "mbart_shift_int64": (
        ShiftRight(),
        [_ids(2, 6, 0), _ids(2, 6, 1)],
        [_ids(2, 6, 0), _ids(3, 9, 1)],
        ({0: Dim("batch", min=2), 1: Dim("seq", min=3)},),
    ),
    "rows_float": (
        ShiftRows(),
        [_floats(5, 3, seed=0), _floats(5, 3, seed=1)],
        [_floats(5, 3, seed=0), _floats(7, 2, seed=1)],
        ({0: Dim("rows", min=3), 1: Dim("cols")},),
    ),
    "step_float": (
        ShiftByTwoWithStep(),
        [_floats(2, 8, seed=0), _floats(2, 8, seed=1)],
        [_floats(2, 8, seed=0), _floats(3, 11, seed=1)],
        ({0: Dim("batch"), 1: Dim("seq", min=5)},),
    ),
    "index_copy_add_float": (
        IndexCopyAdd(),
        [_floats(5, 3, seed=0), _floats(5, 3, seed=1)],
        [_floats(5, 3, seed=0), _floats(8, 4, seed=1)],
        ({0: Dim("rows", min=3), 1: Dim("cols")},),
    ),
    "index_put_float": (
        IndexPutShift(),
        [_floats(5, 3, seed=0), _floats(5, 3, seed=1)],
        [_floats(5, 3, seed=0), _floats(8, 4, seed=1)],
        ({0: Dim("rows", min=3), 1: Dim("cols")},),
    ),
}


def _unguarded(iree, ep):
    """The program after every rule of the IREE backend but these guards (in-place copies functionalized)."""
    return fx_rewrites.apply(ep, iree.rules.without(*(r.name for r in RULES))).program


def _results(got, expected) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(expected, torch.Tensor):
        return [(got, expected)]
    return list(zip(got, expected))


@pytest.mark.parametrize("case", sorted(CASES))
def test_wrong_on_iree_without_the_guards(iree, case):
    """IREE 3.13 returns wrong values (the first element everywhere) or fails at run time
    ("source and target ranges must not overlap within the same buffer")."""
    module, inputs, _, _ = CASES[case]
    ep = rt.export(module, *inputs[0])
    unguarded = _unguarded(iree, ep)
    rt.assert_ops(
        unguarded, present=[aten.index_put.default if case.startswith("index_") else aten.slice_scatter.default]
    )
    args = inputs[0]
    with pytest.raises(IreeUnsupportedError, match="reads the tensor it writes into"):
        iree.compile(unguarded, args)  # the backend refuses the form
    try:
        got = attrs.evolve(iree, refuse_wrong_forms=False).compile(unguarded, args)(*args)  # IREE itself
    except (RewriteError, ValueError) as error:  # the runtime's error
        assert "overlap" in str(error), error
        return
    assert not all(torch.equal(g, e) for g, e in _results(got, module(*args)))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_guarded_matches_eager(iree, case, dynamic):
    module, static_inputs, dim_inputs, shapes = CASES[case]
    inputs = dim_inputs if dynamic else static_inputs
    ep = rt.export(module, *inputs[0], dynamic_shapes=shapes if dynamic else None)
    result = rt.apply_rules(_unguarded(iree, ep), *RULES)
    guard = index_put_of_itself_for_iree if case.startswith("index_") else slice_scatter_of_itself_for_iree
    rt.assert_fired(result, guard)
    rt.assert_matches_eager(result, module, inputs, rtol=0, atol=0)
    rt.assert_idempotent(result, *RULES)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        for got, expected in _results(fn(*args), module(*args)):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_step_one_becomes_a_cat_in_the_backend_rules(iree):
    module, inputs, _, _ = CASES["rows_float"]
    result = fx_rewrites.apply(rt.export(module, *inputs[0]), iree.rules)
    rt.assert_fired(result, slice_scatter_of_itself_for_iree, times=1)
    rt.assert_ops(result, present=[aten.cat.default], absent=[aten.slice_scatter.default])


def test_sources_that_do_not_read_the_tensor_left_alone():
    def fill(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[:, 1:] = z[:, :-1]
        return torch.index_put(y, (torch.tensor([0]),), z[:1])

    ep = rt.export(fill, torch.randn(2, 6), torch.randn(2, 6))
    unguarded = _unguarded(backends.get("iree"), ep)
    rt.assert_ops(unguarded, present=[aten.slice_scatter.default, aten.index_put.default])
    result = rt.apply_rules(unguarded, *RULES)
    rt.assert_not_fired(result, slice_scatter_of_itself_for_iree)
    rt.assert_not_fired(result, index_put_of_itself_for_iree)
