"""adaptive_max_pool2d of a Dim-sized map on IREE 3.13 (backends/iree/rules/legalize.py, PARTIAL_FORMS).

IREE 3.13 fails to compile `F.adaptive_max_pool2d` when the map's height or
width is a Dim ("failed to legalize operation 'torch.aten.max_pool2d'"), with
or without indices; static maps compile and match. To (1, 1), torch's own
decomposition (amax, argmax of the flattened map) compiles and matches at
every size. Other output sizes, the indices unused, are max over torch's
adaptive row windows then column windows (backends/iree/rules/pooling.py); with the indices
used, each window flattened, amax and argmax (backends/iree/rules/adaptive_max_indices.py).
The "without the rule" tests fail once IREE compiles it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt

aten = torch.ops.aten
IREE = backends.get("iree")
RULE = "decompose_adaptive_max_pool2d_for_iree"
VALUES = "adaptive_max_pool2d_values_for_iree"
INDICES = "adaptive_max_pool2d_indices_for_iree"


class Pool(torch.nn.Module):
    def __init__(self, output_size: int, return_indices: bool) -> None:
        super().__init__()
        self.output_size, self.return_indices = output_size, return_indices

    def forward(self, x: torch.Tensor):
        out = F.adaptive_max_pool2d(x, self.output_size, return_indices=self.return_indices)
        return (out[0] * 2, out[1]) if self.return_indices else out * 2


def _x(size: int, *, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 3, size, size + 1, generator=torch.Generator().manual_seed(seed)),)


DIMS = ({0: Dim("b"), 2: Dim("h", min=6, max=11), 3: Dim("w", min=7, max=12)},)


def _export(module: Pool, dims=DIMS):
    return rt.export(module, *_x(6), dynamic_shapes=dims)


def _pairs(got, expected):
    return list(zip(got, expected)) if isinstance(expected, tuple) else [(got, expected)]


@pytest.mark.parametrize("indices", [False, True], ids=["values", "indices"])
def test_dim_sizes_fail_to_compile_without_the_rule(indices):
    without = fx_rewrites.apply(_export(Pool(1, indices)), IREE.rules.without(RULE)).program
    with pytest.raises(Exception, match=r"failed to legalize operation 'torch\.aten\.max_pool2d"):
        IREE.compile(without, _x(6))


@pytest.mark.parametrize("indices", [False, True], ids=["values", "indices"])
def test_global_pool_with_dim_sizes_matches_eager(indices):
    module = Pool(1, indices)
    result = fx_rewrites.apply(_export(module), IREE.rules)
    rt.assert_fired(result, RULE, times=1)
    rt.assert_ops(result, present=[aten.amax.default], absent=[aten.adaptive_max_pool2d.default])
    rt.assert_idempotent(result, IREE.rules)
    rt.assert_matches_eager(result, module, [_x(11, seed=1), _x(7, batch=3, seed=2)])
    fn = IREE.compile(result.program, _x(6))
    for size in (6, 7, 9, 11):
        args = _x(size, batch=3, seed=size)
        for got, expected in _pairs(fn(*args), module(*args)):
            torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("output_size", [(3, 2), 2])
def test_values_with_dim_sizes_match_eager(output_size):
    """Any output size, the indices unused: row windows then column windows (adaptive_max_pool2d_values_for_iree)."""
    module = Pool(output_size, False)
    ep = _export(module)
    without = fx_rewrites.apply(ep, IREE.rules.without(VALUES)).program
    with pytest.raises(Exception, match=r"failed to legalize operation 'torch\.aten\.max_pool2d"):
        IREE.compile(without, _x(6))
    result = fx_rewrites.apply(ep, IREE.rules)
    rt.assert_fired(result, VALUES, times=1)
    rt.assert_ops(result, present=[aten.amax.default], absent=[aten.adaptive_max_pool2d.default])
    rt.assert_idempotent(result, IREE.rules)
    rt.assert_matches_eager(result, module, [_x(11, seed=1), _x(7, batch=3, seed=2)])
    fn = IREE.compile(result.program, _x(6))
    for size in (6, 7, 9, 11):
        args = _x(size, batch=3, seed=size)
        torch.testing.assert_close(fn(*args), module(*args))


@pytest.mark.parametrize("output_size", [(3, 2), 2])
def test_indices_with_dim_sizes_match_eager(output_size):
    """Any output size, the indices used: each adaptive window flattened, amax and argmax
    (adaptive_max_pool2d_indices_for_iree); ties (small integers) pick torch's first maximum."""
    module = Pool(output_size, True)
    ep = _export(module)
    without = fx_rewrites.apply(ep, IREE.rules.without(INDICES)).program
    with pytest.raises(Exception, match=r"failed to legalize operation 'torch\.aten\.max_pool2d_with_indices"):
        IREE.compile(without, _x(6))
    result = fx_rewrites.apply(ep, IREE.rules)
    rt.assert_fired(result, INDICES, times=1)
    rt.assert_not_fired(result, VALUES)
    rt.assert_ops(result, present=[aten.argmax.default], absent=[aten.adaptive_max_pool2d.default])
    rt.assert_idempotent(result, IREE.rules)
    ties = (torch.randint(0, 3, (3, 3, 9, 7), generator=torch.Generator().manual_seed(5)).float(),)
    rt.assert_matches_eager(result, module, [_x(11, seed=1), _x(7, batch=3, seed=2), ties], rtol=0, atol=0)
    fn = IREE.compile(result.program, _x(6))
    for args in [_x(size, batch=3, seed=size) for size in (6, 7, 9, 11)] + [ties]:
        for got, expected in _pairs(fn(*args), module(*args)):
            assert torch.equal(got, expected)


@pytest.mark.parametrize(
    ("module", "dims"),
    [(Pool(1, True), None), (Pool(2, True), None), (Pool(2, False), DIMS)],
    ids=["static", "static-output-2", "values-only-with-dims"],
)
def test_left_alone(module, dims):
    """Static maps compile as they are (and match); the values alone with Dim sizes are VALUES's."""
    result = fx_rewrites.apply(_export(module, dims), IREE.rules)
    rt.assert_not_fired(result, RULE)
    rt.assert_not_fired(result, INDICES)
    if dims is None:
        rt.assert_not_fired(result, VALUES)
        fn = IREE.compile(result.program, _x(6))
        for got, expected in _pairs(fn(*_x(6, seed=3)), module(*_x(6, seed=3))):
            assert torch.equal(got, expected)
