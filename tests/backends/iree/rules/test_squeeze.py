"""Squeezing a Dim-sized dim its range makes 1, on IREE 3.13 (backends/iree/rules/ops.py).

`F.max_pool2d(x, 6).squeeze(-1).squeeze(-1)` with h, w in [6, 11]: the pool
is [b, c, h//6, w//6], the squeezes [b, c, h//6] and [b, c]. IREE 3.13 fails
to compile the second squeeze ("'tensor.collapse_shape' op expected dimension
1 of collapsed type to be dynamic"), with or without the one-window guard;
`squeeze_dim_sized_one_for_iree` writes it as a reshape to the kept sizes.
The "without the rule" test fails once IREE compiles the squeeze.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules.ops import squeeze_dim_sized_one_for_iree

aten = torch.ops.aten
IREE = backends.get("iree")
RULE = squeeze_dim_sized_one_for_iree.name
SQUEEZES = (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)


class Squeezed(torch.nn.Module):
    def __init__(self, squeeze, conv: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(4, 3, 6, 6, generator=g)) if conv else None
        self.squeeze = squeeze

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.conv2d(x, self.weight, stride=6) if self.weight is not None else F.max_pool2d(x, 6)
        return self.squeeze(y)


CASES = {
    "pool_dim_dim": Squeezed(lambda y: y.squeeze(-1).squeeze(-1)),
    "conv_dim_dim": Squeezed(lambda y: y.squeeze(-1).squeeze(-1), conv=True),
    "pool_dims": Squeezed(lambda y: y.squeeze((2, 3))),
    "pool_all": Squeezed(lambda y: y.squeeze()),
    # a non-contiguous input (the reshape reads a contiguous copy)
    "pool_transposed": Squeezed(lambda y: y.transpose(0, 1).squeeze(-1) + 1),
}
DIMS = ({0: Dim("b", min=2), 2: Dim("h", min=6, max=11), 3: Dim("w", min=6, max=11)},)


def _x(size: int, *, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed)),)


def test_fails_to_compile_without_the_rule():
    ep = rt.export(CASES["pool_dim_dim"], *_x(6), dynamic_shapes=DIMS)
    without = fx_rewrites.apply(ep, IREE.rules.without(RULE)).program
    with pytest.raises(Exception, match=r"collapse_shape' op expected dimension 1 of collapsed type to be dynamic"):
        IREE.compile(without, _x(6))


@pytest.mark.parametrize("case", sorted(CASES))
def test_reshape_matches_eager(case):
    module = CASES[case]
    result = fx_rewrites.apply(rt.export(module, *_x(6), dynamic_shapes=DIMS), IREE.rules)
    rt.assert_fired(result, RULE)
    rt.assert_ops(result, present=[aten.reshape.default], absent=list(SQUEEZES))
    if case.startswith("pool"):  # (the conv guard makes a contiguous copy of its own)
        clones = [n for n in result.graph_module.graph.nodes if n.target is aten.clone.default]
        assert bool(clones) == (case == "pool_transposed")
    rt.assert_idempotent(result, IREE.rules)
    rt.assert_matches_eager(result, module, [_x(11, seed=1), _x(7, batch=3, seed=2)])
    fn = IREE.compile(result.program, _x(6))
    for size in (6, 7, 9, 11):
        args = _x(size, batch=3, seed=size)
        torch.testing.assert_close(fn(*args), module(*args), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("module", "dims"),
    [
        (CASES["pool_dim_dim"], None),  # static sizes
        (Squeezed(lambda y: y.squeeze(-1)), ({0: Dim("b", min=2)},)),  # a Dim elsewhere; the squeezed 1 static
    ],
    ids=["static", "static-one"],
)
def test_left_alone(module, dims):
    result = fx_rewrites.apply(rt.export(module, *_x(6), dynamic_shapes=dims), IREE.rules)
    rt.assert_not_fired(result, RULE)
