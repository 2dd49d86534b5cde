"""Forms IREE 3.13 computes wrong: fixed by the IREE rules, or refused before compiling.

For each form: IREE itself (`refuse_wrong_forms=False`) gives other numbers
than eager (so the test fails once IREE is fixed and the entry can go); the
IREE backend as shipped refuses the exported program with an error naming
the op and the fix (backends/iree/wrong_forms.py); and, where a rewrite
exists, the program after `backend.rules` matches eager on IREE on two input
sets.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.errors import IreeUnsupportedError
from fx_rewrites.engine import RewriteError

aten = torch.ops.aten
IREE = backends.get("iree")
#: IREE itself: the forms it computes wrong compiled, not refused
RAW_IREE = attrs.evolve(IREE, refuse_wrong_forms=False)


def _wrong_on_raw_iree(program, fn, args) -> bool:
    """IREE itself compiles `program` and its result differs from eager's (NaN where eager has NaN is equal)."""
    try:
        got = RAW_IREE.compile(program, args)(*args)
    except RewriteError:
        return False  # an error is not the silent wrong result these tests are about
    expected = fn(*args)
    got, expected = (got, expected) if isinstance(expected, tuple) else ((got,), (expected,))
    return not all(
        g.shape == e.shape and torch.allclose(g, e, rtol=1e-4, atol=1e-5, equal_nan=True) for g, e in zip(got, expected)
    )


def _refused(program, args, op: str) -> None:
    with pytest.raises(IreeUnsupportedError, match=rf"computes {op} .*wrong.*fix: "):
        IREE.compile(program, args)


def _matches_on_iree(program, fn, inputs) -> None:
    compiled = IREE.compile(program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(compiled(*args), fn(*args), rtol=1e-4, atol=1e-5, equal_nan=True)


def _grid_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 5, 5, generator=g), torch.randn(
        2, 5, 5, 2, generator=g
    ) * 1.5  # some points outside [-1, 1]


def _unpool(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return F.max_unpool1d(x, indices, 3, 2, 0, output_size=[1, 2, 3])


#: (id, function, two input sets, Dim shapes or None, the op IREE computes wrong) from OpInfo's failing samples
DECOMPOSED = [
    ("softshrink", lambda x: F.softshrink(x), [(torch.randn(5, 5),), (torch.randn(5, 5) * 3,)], None,
     "aten.softshrink.default"),
    ("softshrink-dim", lambda x: F.softshrink(x, 0.25), [(torch.randn(5, 5),), (torch.randn(7, 3),)],
     ({0: Dim.AUTO, 1: Dim.AUTO},), "aten.softshrink.default"),
    ("renorm-negative-dim", lambda x: torch.renorm(x, 2, -1, 0.5), [(torch.randn(5, 5, 5),), (torch.randn(5, 5, 5) * 2,)],
     None, "aten.renorm.default"),
    ("renorm-dim", lambda x: torch.renorm(x, 2, -1, 0.5), [(torch.randn(5, 5, 5),), (torch.randn(3, 4, 6),)],
     ({0: Dim.AUTO, 1: Dim.AUTO, 2: Dim.AUTO},), "aten.renorm.default"),
    ("grid_sample-2d", lambda x, g: F.grid_sample(x, g, align_corners=False), [_grid_inputs(0), _grid_inputs(1)], None,
     "aten.grid_sampler.default"),
    ("max_unpool1d", _unpool, [(torch.randn(1, 2, 1), torch.tensor([[[2], [1]]])),
                               (torch.randn(1, 2, 1), torch.tensor([[[1], [2]]]))], None, "aten.max_unpool2d.default"),
]  # fmt: skip


@pytest.mark.parametrize(("fn", "inputs", "shapes", "op"), [c[1:] for c in DECOMPOSED], ids=[c[0] for c in DECOMPOSED])
def test_wrong_on_iree_refused_as_exported_right_after_the_rules(fn, inputs, shapes, op):
    ep = rt.export(fn, *inputs[0], dynamic_shapes=shapes)
    assert _wrong_on_raw_iree(ep, fn, inputs[0])
    _refused(ep, inputs[0], op)
    result = rt.apply_rules(ep, IREE.rules)
    rt.assert_fired(result, "legalize_for_iree")
    assert op not in {str(t) for t in rt.targets(result)}
    rt.assert_matches_eager(result, fn, inputs, rtol=1e-4, atol=1e-5)
    _matches_on_iree(result.program, fn, inputs)


class InstanceNormWithStats(torch.nn.Module):
    """F.instance_norm given running statistics it only updates (OpInfo's nn.functional.instance_norm)."""

    def forward(self, x, mean, var, weight, bias):
        return F.instance_norm(x, mean, var, weight, bias, momentum=-1.0, eps=0.5)


def _norm_inputs(n: int, c: int, h: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, c, h, 4, generator=g), torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5,
            torch.randn(c, generator=g), torch.randn(c, generator=g))  # fmt: skip


def test_instance_norm_with_running_stats_and_dims():
    inputs = [_norm_inputs(3, 2, 3, 0), _norm_inputs(2, 3, 5, 1)]
    channel = Dim("channel")
    shapes = ({0: Dim("n"), 1: channel, 2: Dim("h")}, {0: channel}, {0: channel}, {0: channel}, {0: channel})
    model = InstanceNormWithStats()
    ep = rt.export(model, *inputs[0], dynamic_shapes=shapes)
    assert _wrong_on_raw_iree(ep, model, inputs[1])
    _refused(ep, inputs[0], "aten.instance_norm.default")
    result = rt.apply_rules(ep, IREE.rules)
    rt.assert_fired(result, "instance_norm_input_stats_for_iree", times=1)
    rt.assert_fired(result, "legalize_for_iree")
    rt.assert_ops(result, absent=[aten.instance_norm.default])
    _matches_on_iree(result.program, model, [tuple(t.clone() for t in args) for args in inputs])


def test_instance_norm_normalising_by_running_stats_left_alone():
    ep = rt.export(lambda x, m, v: F.instance_norm(x, m, v, use_input_stats=False), *_norm_inputs(2, 3, 4, 0)[:3])
    rt.assert_not_fired(rt.apply_rules(ep, IREE.rules), "instance_norm_input_stats_for_iree")


class EmptyVariances(torch.nn.Module):
    """var / std / var_mean of an empty input over its empty dim: NaN in torch (OpInfo var.unbiased)."""

    def forward(self, x):
        return torch.var(x, 0), torch.std(x, 0, unbiased=False), *torch.var_mean(x, 0)


def test_variance_of_an_empty_input_is_nan():
    inputs = [(torch.randn(0, 5),), (torch.randn(0, 5),)]
    model = EmptyVariances()
    ep = rt.export(model, *inputs[0])
    assert _wrong_on_raw_iree(ep, model, inputs[0])
    _refused(ep, inputs[0], "aten.var.dim")
    result = rt.apply_rules(ep, IREE.rules)
    rt.assert_fired(result, "empty_variance_for_iree", times=3)
    rt.assert_matches_eager(result, model, inputs)
    _matches_on_iree(result.program, model, inputs)


def test_variance_of_an_empty_input_with_a_dim():
    """OpInfo's var.unbiased with Dim.AUTO: the empty dim is specialised to 0, the other stays symbolic."""
    fn = lambda x: torch.var(x, unbiased=True)
    inputs = [(torch.randn(0, 5),), (torch.randn(0, 7),)]
    ep = rt.export(fn, *inputs[0], dynamic_shapes=({0: Dim.AUTO, 1: Dim.AUTO},))
    assert _wrong_on_raw_iree(ep, fn, inputs[0])
    result = rt.apply_rules(ep, IREE.rules)
    rt.assert_fired(result, "empty_variance_for_iree", times=1)
    _matches_on_iree(result.program, fn, inputs)


def test_variance_of_one_element_left_alone_and_right():
    """The other degenerate case (fewer elements than the correction) IREE gets right: NaN too."""
    fn = lambda x: (torch.var(x, 0), torch.std(x, 1))
    inputs = [(torch.randn(1, 1),), (torch.randn(1, 1) * 3,)]
    ep = rt.export(fn, *inputs[0])
    result = rt.apply_rules(ep, IREE.rules)
    rt.assert_not_fired(result, "empty_variance_for_iree")
    _matches_on_iree(result.program, fn, inputs)


def _bag(weight, indices, offsets, per_sample_weights):
    return F.embedding_bag(indices, weight, offsets, mode="sum", per_sample_weights=per_sample_weights)


def test_embedding_bag_with_per_sample_weights_refused():
    """torch has no decomposition of embedding_bag: IREE's wrong sums are refused, before and after the rules."""
    args = (torch.randn(10, 5), torch.tensor([1, 2, 4, 5, 4]), torch.tensor([0, 2]), torch.randn(5))
    ep = rt.export(_bag, *args)
    assert _wrong_on_raw_iree(ep, _bag, args)
    _refused(ep, args, "aten.embedding_bag.padding_idx")
    with pytest.raises(IreeUnsupportedError, match="per_sample_weights"):
        IREE.compile(rt.apply_rules(ep, IREE.rules).program, args)


def test_embedding_bag_without_weights_compiles_and_matches():
    fn = lambda w, i: F.embedding_bag(i, w, mode="sum")
    inputs = [
        (torch.randn(10, 5), torch.tensor([[1, 2, 4], [5, 4, 9]])),
        (torch.randn(10, 5), torch.tensor([[0, 0, 1], [3, 2, 1]])),
    ]
    _matches_on_iree(rt.apply_rules(rt.export(fn, *inputs[0]), IREE.rules).program, fn, inputs)


def test_replicate_crop_with_dims_the_guard_cannot_take_is_refused():
    """OpInfo's pad.replicate_negative with Dim.AUTO: the crop empties the dim before the pad, which torch's
    meta kernel rejects with symbolic sizes, so the guard declines; IREE gives the wrong shape."""
    fn = lambda x: F.pad(x, (-4, 5, 0, 0), mode="replicate")
    args = (torch.randn(5, 3, 4, 4),)
    ep = rt.export(fn, *args, dynamic_shapes=({i: Dim.AUTO for i in range(4)},))
    assert _wrong_on_raw_iree(ep, fn, args)
    result = rt.apply_rules(ep, IREE.rules)
    rt.assert_not_fired(result, "negative_pad_to_slice_for_iree")
    with pytest.raises(IreeUnsupportedError, match="negative pad"):
        IREE.compile(result.program, args)


REFLECT = [
    ("reflect-3d", lambda x: F.pad(x, (1, 1, 1, 2, 2, 1), mode="reflect"), (1, 2, 4, 5, 6)),
    ("reflect-2d-asymmetric", lambda x: F.pad(x, (1, 1, 1, 2), mode="reflect"), (1, 2, 5, 6)),
]


@pytest.mark.parametrize(("fn", "shape"), [c[1:] for c in REFLECT], ids=[c[0] for c in REFLECT])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_reflect_pad_decomposed(fn, shape, dynamic):
    """IREE 3.13 fails on reflect pads (5-d: `torch.constant.int`; 4-d asymmetric: an LLVM translation error)."""
    inputs = [(torch.randn(2, *shape[1:]),), (torch.randn(3 if dynamic else 2, *shape[1:]),)]
    ep = rt.export(fn, *inputs[0], dynamic_shapes=({0: Dim("batch")},) if dynamic else None)
    with pytest.raises(RewriteError):
        IREE.compile(ep, inputs[0])
    result = rt.apply_rules(ep, IREE.rules)
    rt.assert_fired(result, "decompose_reflect_pad_for_iree")
    rt.assert_ops(result, absent=[aten.pad.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default])
    rt.assert_matches_eager(result, fn, inputs)
    _matches_on_iree(result.program, fn, inputs)


def test_eval_native_batch_norm_on_a_3d_input():
    """The aot route's eval batch norm on (N, C, L): IREE 3.13 `'tensor.cast' op ... cast incompatible`."""

    def fn(x, mean, var, weight, bias):
        return aten.native_batch_norm.default(x, weight, bias, mean, var, False, 0.1, 1e-5)[0]

    def args(seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(2, 3, 5, generator=g), torch.randn(3, generator=g), torch.rand(3, generator=g) + 0.5,
                torch.randn(3, generator=g), torch.randn(3, generator=g))  # fmt: skip

    inputs = [args(0), args(1)]
    ep = rt.export(fn, *inputs[0])
    with pytest.raises(RewriteError, match=r"tensor\.cast"):
        IREE.compile(ep, inputs[0])
    result = rt.apply_rules(ep, IREE.rules)
    rt.assert_fired(result, "decompose_eval_batch_norm_for_iree", times=1)
    rt.assert_matches_eager(result, fn, inputs, rtol=1e-5, atol=1e-5)
    _matches_on_iree(result.program, fn, inputs)
    training = rt.export(
        lambda x, m, v, w, b: aten.native_batch_norm.default(x, w, b, m, v, True, 0.1, 1e-5)[0], *inputs[0]
    )
    rt.assert_not_fired(rt.apply_rules(training, IREE.rules), "decompose_eval_batch_norm_for_iree")


def test_logcumsumexp_with_dims_refused():
    """IREE's logcumsumexp overflows: inf past exp's range (OpInfo's sample holds 10000), where torch is finite."""
    fn = lambda x: torch.logcumsumexp(x, 0)
    x = torch.randn(5, 5, 5)
    x[0, 0, 0] = 100.0
    args = (x,)
    ep = rt.export(fn, *args, dynamic_shapes=({i: Dim.AUTO for i in range(3)},))
    assert _wrong_on_raw_iree(ep, fn, args)
    with pytest.raises(IreeUnsupportedError, match=r"logcumsumexp.*export that dim static"):
        IREE.compile(rt.apply_rules(ep, IREE.rules).program, args)


class CountedMean(torch.nn.Module):
    """masked.mean without a mask as torch writes it: a sum over an element count summed from ones."""

    def forward(self, x):
        count = torch.ones(x.shape[0], x.shape[1], dtype=torch.int64).sum([0, 1])
        return x.sum([0, 1]) / count, (torch.zeros(x.shape[0]) + 1).sum(0), x.new_ones(x.shape[1]).sum(0)


def test_ones_and_zeros_of_symbolic_sizes_become_full():
    from fx_rewrites.backends.iree.rules.guards import filled_tensor_to_full_for_iree as guard

    inputs = [(torch.randn(5, 3),), (torch.randn(4, 7),)]
    model = CountedMean()
    ep = rt.export(model, *inputs[0], dynamic_shapes=({0: Dim.AUTO, 1: Dim.AUTO},))
    assert _wrong_on_raw_iree(ep, model, inputs[0])  # IREE 3.13: counts 1 per dynamic dim
    result = rt.apply_rules(ep, guard)
    rt.assert_fired(result, guard, times=3)
    rt.assert_ops(result, absent=[aten.ones.default, aten.zeros.default, aten.new_ones.default])
    rt.assert_matches_eager(result, model, inputs)
    rt.assert_idempotent(result, guard)
    _matches_on_iree(rt.apply_rules(ep, IREE.rules).program, model, inputs)
    static = rt.export(model, *inputs[0])
    rt.assert_not_fired(rt.apply_rules(static, guard), guard)
