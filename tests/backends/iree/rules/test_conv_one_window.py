"""One convolution window over a longer Dim-sized map on IREE 3.13 (backends/iree/rules/conv.py).

`F.conv2d(x, w, stride=6)` with a 6x6 kernel on maps of 6 to 11 has one
window per map (output h//6 == 1, the rest unread). With Dim sizes and a
user typed 1 (export types `conv * 2` as [b, o, 1, 1]) IREE 3.13 rejects
every map but 6x6 at run time; with padding (`stride=4, padding=1`, a 5x5
kernel on 3..6) it returns wrong values on 6x6. The "without the guard"
tests show IREE wrong (they fail once IREE is fixed and the guard can go);
the guarded tests compare with eager on two input sets in torch and on IREE
at map sizes across the Dim range. Static sizes: tests/backends/iree/rules/test_rules.py.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.errors import IreeUnsupportedError
from fx_rewrites.backends.iree.rules.conv import CONVS, conv_single_window_for_iree

aten = torch.ops.aten
IREE = backends.get("iree")
#: IREE itself: the wrong-forms check off
RAW_IREE = attrs.evolve(IREE, refuse_wrong_forms=False)
GUARD = conv_single_window_for_iree.name
FUNCTIONAL = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class Conv(torch.nn.Module):
    """A convolution times 2 (the user export types with static 1s)."""

    def __init__(self, nsp: int, kernel: int | tuple[int, ...], groups: int = 1, **kwargs) -> None:
        super().__init__()
        kernel = kernel if isinstance(kernel, tuple) else (kernel,) * nsp
        self.weight = torch.nn.Parameter(
            torch.randn(4, 4 // groups, *kernel, generator=torch.Generator().manual_seed(0))
        )
        self.bias = torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(1)))
        self.fn, self.kwargs = FUNCTIONAL[nsp], {"groups": groups, **kwargs}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight, self.bias, **self.kwargs) * 2


#: name: (module, spatial dims, Dim range of each, map sizes to run on IREE)
CASES = {
    # a patch convolution (patch_conv_as_matmul takes it once the guard made its sizes static)
    "conv2d_patch": (Conv(2, 6, stride=6), 2, (6, 11), [6, 7, 9, 11]),
    # conv1d_as_matmul takes it after the guard
    "conv1d_patch": (Conv(1, 6, stride=6), 1, (6, 11), [6, 7, 11]),
    "conv3d_patch": (Conv(3, 6, stride=6), 3, (6, 8), [6, 7, 8]),
    # padding="valid" exports as conv2d.padding (the guard's convolution is conv2d.default)
    "conv2d_valid": (Conv(2, 6, stride=6, padding="valid"), 2, (6, 11), [6, 7, 11]),
    # (h + 2 - 5)//4 + 1 == 1 on [3, 6]: IREE gives wrong values on 6x6 without the guard
    "conv2d_padded": (Conv(2, 5, stride=4, padding=1), 2, (3, 6), [3, 4, 5, 6]),
    "conv3d_padded": (Conv(3, 5, stride=4, padding=1), 3, (3, 6), [3, 4, 6]),
    # a dilated window: span 5 of kernel 3
    "conv2d_dilated": (Conv(2, 3, stride=5, dilation=2), 2, (5, 9), [5, 6, 9]),
    "conv2d_groups": (Conv(2, 6, groups=2, stride=6), 2, (6, 11), [6, 8, 11]),
    # one window along h only: w convolved as usual (its size stays symbolic)
    "conv2d_h_only": (Conv(2, (6, 2), stride=(6, 2)), 2, (6, 11), [6, 7, 11]),
}


def _x(nsp: int, size: int, *, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 4, *[size] * nsp, generator=g),)


def _dims(nsp: int, lo: int, hi: int) -> tuple[dict[int, Dim]]:
    return ({0: Dim("b"), **{2 + i: Dim(f"s{i}", min=lo, max=hi) for i in range(nsp)}},)


def _assert_iree_matches(fn, module, inputs) -> None:
    for args in inputs:
        torch.testing.assert_close(fn(*args), module(*args), rtol=1e-4, atol=1e-4)


def _wrong(fn, module, args) -> bool:
    return not torch.allclose(fn(*args), module(*args), rtol=1e-4, atol=1e-4)


def _unguarded(case: str):
    module, nsp, (lo, hi), sizes = CASES[case]
    ep = rt.export(module, *_x(nsp, lo), dynamic_shapes=_dims(nsp, lo, hi))
    return module, nsp, lo, sizes, fx_rewrites.apply(ep, IREE.rules.without(GUARD)).program


@pytest.mark.parametrize("case", ["conv2d_patch", "conv1d_patch", "conv3d_patch", "conv2d_valid"])
def test_dim_sizes_fail_on_iree_without_the_guard(case):
    module, nsp, lo, sizes, unguarded = _unguarded(case)
    fn = RAW_IREE.compile(unguarded, _x(nsp, lo))
    _assert_iree_matches(fn, module, [_x(nsp, lo, seed=1)])  # the Dim's minimum is right
    for size in sizes[1:]:
        with pytest.raises(Exception, match=f"expected {lo} but have {size}"):
            fn(*_x(nsp, size, seed=1))
    # IREE as shipped refuses it, naming the fix
    with pytest.raises(IreeUnsupportedError, match=r"one window over a longer map.*fix: apply the backend's rules"):
        IREE.compile(unguarded, _x(nsp, lo))


@pytest.mark.parametrize("case", ["conv2d_padded", "conv3d_padded"])
def test_dim_sizes_wrong_on_iree_without_the_guard(case):
    """A silent wrong result: IREE's convolution of the padded 6-map with a static 1-wide output."""
    module, nsp, lo, _, unguarded = _unguarded(case)
    fn = RAW_IREE.compile(unguarded, _x(nsp, lo))
    _assert_iree_matches(fn, module, [_x(nsp, lo, seed=1), _x(nsp, 4, seed=1)])
    assert _wrong(fn, module, _x(nsp, 6, seed=1))
    with pytest.raises(IreeUnsupportedError, match=r"conv\dd.default \(node .*one window over a longer map"):
        IREE.compile(unguarded, _x(nsp, lo))


@pytest.mark.parametrize("case", sorted(CASES))
def test_guarded_with_dim_sizes_matches_eager(case):
    module, nsp, (lo, hi), sizes = CASES[case]
    ep = rt.export(module, *_x(nsp, lo), dynamic_shapes=_dims(nsp, lo, hi))
    guarded = rt.apply_rules(ep, IREE.rules.sets[0])  # the guard's phase, before the performance rules
    rt.assert_fired(guarded, GUARD, times=1)
    rt.assert_idempotent(guarded, conv_single_window_for_iree)
    (conv,) = [n for n in guarded.graph_module.graph.nodes if n.target in CONVS]
    # every spatial size was a Dim: the ones now static are the guard's cuts, each the window's span
    spans = [(k - 1) * module.kwargs.get("dilation", 1) + 1 for k in module.weight.shape[2:]]
    cut = {d: size for d, size in enumerate(conv.args[0].meta["val"].shape[2:]) if isinstance(size, int)}
    assert cut and all(size == spans[d] for d, size in cut.items()), conv.format_node()
    assert list(conv.args[4]) == [0] * nsp  # the padding made explicit
    rt.assert_matches_eager(guarded, module, [_x(nsp, hi, seed=1), _x(nsp, lo + 1, batch=3, seed=2)])
    result = fx_rewrites.apply(ep, IREE.rules)
    rt.assert_fired(result, GUARD, times=1)
    rt.assert_matches_eager(result, module, [_x(nsp, hi, seed=1), _x(nsp, lo + 1, batch=3, seed=2)])
    fn = IREE.compile(result.program, _x(nsp, lo))
    _assert_iree_matches(fn, module, [_x(nsp, s, batch=3, seed=s) for s in sizes])


def test_on_aten_convolution():
    """run_decompositions (and aot_autograd) leave aten.convolution."""
    module, nsp, (lo, hi), sizes = CASES["conv2d_padded"]
    ep = rt.export(module, *_x(nsp, lo), dynamic_shapes=_dims(nsp, lo, hi)).run_decompositions()
    assert [n for n in ep.graph.nodes if n.target is aten.convolution.default]
    result = fx_rewrites.apply(ep, IREE.rules)
    rt.assert_fired(result, GUARD, times=1)
    rt.assert_matches_eager(result, module, [_x(nsp, hi, seed=1), _x(nsp, lo + 1, seed=2)])
    _assert_iree_matches(IREE.compile(result.program, _x(nsp, lo)), module, [_x(nsp, s, seed=s) for s in sizes])


@pytest.mark.parametrize(
    ("module", "size", "dims"),
    [
        (Conv(2, 6, stride=6), 6, None),  # the window is the map
        (Conv(2, 3, stride=3), 6, _dims(2, 6, 8)),  # two windows (h//3 on [6, 8])
        (Conv(2, 3, padding=1), 6, _dims(2, 4, 11)),  # stride 1: as many as the map
    ],
    ids=["exact", "two-windows", "same"],
)
def test_convs_left_alone(module, size, dims):
    ep = rt.export(module, *_x(2, size), dynamic_shapes=dims)
    rt.assert_not_fired(fx_rewrites.apply(ep, IREE.rules), GUARD)
