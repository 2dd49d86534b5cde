"""Legality-driven decomposition for IREE (rewrites/kinds/legalize.py, backends/iree/legality.py).

Each form the issue names, from a real export: IREE 3.13 rejects it as exported; after the IREE
backend's rules (DEFAULT + the IREE pack, then the legalize phase) it compiles and matches eager on two
input sets, static and with Dim dims where the form exports with them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules import legalize as iree_legalize
from fx_rewrites.engine import RewriteError
from fx_rewrites.kinds.legalize import decomposition, legalize
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten
LEGALIZE = iree_legalize.LEGALIZE_FOR_IREE.name


@pytest.fixture(scope="module")
def iree():
    return backends.get("iree")


class Aliases(torch.nn.Module):
    """ConvBERT's torch.multiply, and torch.subtract / true_divide."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.subtract(torch.multiply(x, y), y, alpha=2) + torch.true_divide(x, y.abs() + 1)


class Unfold(torch.nn.Module):
    """ConvBERT's span-based convolution: nn.Unfold((k, 1), padding=((k - 1) // 2, 0)) -> aten.im2col."""

    def __init__(self) -> None:
        super().__init__()
        self.unfold = torch.nn.Unfold(kernel_size=(3, 1), padding=(1, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unfold(x)


class Losses(torch.nn.Module):
    """nll_loss (aten.nll_loss_nd -> nll_loss_forward) and xlogy."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = F.log_softmax(logits, dim=-1)
        return F.nll_loss(logp, target), torch.xlogy(logits.abs(), logits.abs() + 0.5).sum()


class Products(torch.nn.Module):
    """addmv and addr (imported as torch.operator) and block_diag."""

    def forward(self, x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = v[: x.shape[1]]
        return torch.addmv(v, x, w), torch.addr(x, v, w)


def _aliases(n: int = 4):
    return (torch.randn(n, 5), torch.randn(n, 5))


def _unfold(n: int = 2):
    return (torch.randn(n, 3, 6, 4),)


def _losses(n: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 7, generator=g), torch.randint(0, 7, (n,), generator=g))


def _products(n: int = 6):
    return (torch.randn(n, 5), torch.randn(n))


FORMS = {
    # name: (module, two input sets, Dim spec, ops gone after the rules)
    "aliases": (Aliases, [_aliases(), _aliases(6)], ({0: Dim("n")}, {0: Dim("n")}), [aten.multiply.Tensor]),
    "unfold": (Unfold, [_unfold(), _unfold(3)], ({0: Dim("n")},), [aten.im2col.default]),
    "losses": (Losses, [_losses(), _losses(5, 1)], ({0: Dim("n")}, {0: Dim("n")}), [aten.nll_loss_nd.default]),
    "products": (
        Products,
        [_products(), _products(8)],
        ({0: Dim("n", min=6)}, {0: Dim("n", min=6)}),
        [aten.addmv.default, aten.addr.default],
    ),
}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_form_is_decomposed_until_iree_lowers_it(iree, form, dynamic):
    module, inputs, shapes, gone = FORMS[form]
    if not dynamic:
        inputs = [inputs[0], tuple(t.clone() * 2 if t.is_floating_point() else t for t in inputs[0])]
    ep = rt.export(module(), *inputs[0], dynamic_shapes=shapes if dynamic else None)
    rt.assert_ops(ep, present=gone)
    result = fx_rewrites.apply(ep, iree.rules)
    rt.assert_fired(result, LEGALIZE)
    rt.assert_ops(result, absent=gone)
    rt.assert_matches_eager(result, module(), inputs, rtol=1e-4, atol=1e-4)
    with pytest.raises(RewriteError):  # as exported: IREE rejects it
        _compile_and_compare(iree, ep, module(), inputs)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), module()(*args), rtol=1e-4, atol=1e-4)


def _compile_and_compare(iree, program, module, inputs) -> None:
    """Compile and run; a result other than eager's raises too (a wrong number counts as a failure)."""
    fn = iree.compile(program, inputs[0])
    for args in inputs:
        got, expected = fn(*args), module(*args)
        for g, e in zip(got, expected):
            if not torch.allclose(g, e, rtol=1e-4, atol=1e-4, equal_nan=True):
                raise RewriteError(f"IREE computes {type(module).__name__} wrong")


def test_legal_ops_are_not_roots_and_every_root_has_a_decomposition():
    roots = set(iree_legalize.LEGALIZE_FOR_IREE.roots)
    assert aten.mul.Tensor not in roots and aten.convolution.default not in roots and aten.addmm.default not in roots
    assert {aten.multiply.Tensor, aten.im2col.default, aten.xlogy.Tensor, aten.nll_loss_nd.default} <= roots
    assert all(decomposition(op) is not None for op in roots)
    assert aten.histc.default not in roots  # illegal, but torch cannot decompose it: a hand-written rule does


def test_a_decomposition_that_raises_is_a_named_decline(monkeypatch):
    """A decomposition torch rejects for these arguments leaves the node with the reason: never a crash."""

    def refuse(*args, **kwargs):
        raise ValueError("not for these arguments")

    rule = legalize(["aten.xlogy.Tensor"], name="legalize_test", backend="test")
    monkeypatch.setitem(torch._decomp.decomposition_table, aten.xlogy.Tensor, refuse)
    ep = rt.export(lambda x: torch.xlogy(x, x), torch.rand(3))
    result = fx_rewrites.apply(ep, RuleSet([rule]), explain=True)
    rt.assert_not_fired(result, rule)
    rt.assert_ops(result, present=[aten.xlogy.Tensor])
    reasons = [attempt.reason for attempt in result.report.explain()]
    assert reasons == ["the decomposition of aten.xlogy.Tensor raised ValueError: not for these arguments"]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_inputs_of_equal_metadata_stay_distinct(dynamic):
    """instance_norm's decomposition makes repeat(weight) and repeat(bias), whose fake values the engine memoised
    into one object; decomposing _native_batch_norm_legit on them must still read the weight and the bias
    (it once used the bias twice: wrong numbers; the engine's memo now gives each node its own fake value)."""

    def fn(x, weight, bias):
        return F.instance_norm(x, weight=weight, bias=bias, eps=0.5)

    inputs = [
        (torch.randn(3, 2, 3, 4), torch.randn(2), torch.randn(2)),
        (torch.randn(3, 2, 3, 4), torch.randn(2), torch.randn(2)),
    ]
    shapes = ({0: Dim("n"), 2: Dim("h")}, None, None) if dynamic else None
    if dynamic:
        inputs[1] = (torch.randn(2, 2, 5, 4), torch.randn(2), torch.randn(2))
    ep = rt.export(fn, *inputs[0], dynamic_shapes=shapes)
    result = rt.apply_rules(ep, iree_legalize.LEGALIZE_FOR_IREE)
    rt.assert_fired(result, "legalize_for_iree", times=2)
    rt.assert_ops(result, absent=[aten.instance_norm.default, aten._native_batch_norm_legit.no_stats])
    rt.assert_matches_eager(result, fn, inputs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "fn",
    [torch.kron, lambda a, b: torch.linalg.multi_dot([a, b.T]), lambda a, b: torch.gradient(a * b.sum())[0]],
    ids=["kron", "multi_dot", "gradient"],
)
def test_decomposition_that_specialises_dims_is_a_named_decline(fn):
    """With Dim.AUTO sizes (which torch.export itself fixes for these ops: their C++ kernels read sizes as ints)
    torch's decompositions of kron / multi_dot / gradient read sizes through aten.size, an op the dispatcher does
    not know: declined with that reason (the op stays, IREE's error names it), never a RuleError (the corpus
    met 9). Static, they are decomposed and match."""
    inputs = [(torch.randn(3, 4), torch.randn(2, 4)), (torch.randn(5, 4), torch.randn(3, 4))]
    dims = ({0: Dim.AUTO, 1: Dim.AUTO}, {0: Dim.AUTO, 1: Dim.AUTO})
    dynamic = rt.export(fn, *inputs[0], dynamic_shapes=dims)
    result = fx_rewrites.apply(dynamic, iree_legalize.LEGALIZE_FOR_IREE, explain=True)
    before = {t for t in rt.targets(dynamic) if isinstance(t, torch._ops.OpOverload) and t.namespace == "aten"}
    assert before <= set(rt.targets(result)), "the op was rewritten"
    assert any("reads sizes through aten.size" in attempt.reason for attempt in result.report.explain())
    rt.assert_matches_eager(result, fn, inputs[:1], rtol=1e-4, atol=1e-5)
    static = rt.apply_rules(rt.export(fn, *inputs[0]), iree_legalize.LEGALIZE_FOR_IREE)
    rt.assert_fired(static, "legalize_for_iree")
    rt.assert_matches_eager(static, fn, inputs[:1], rtol=1e-4, atol=1e-5)


class Fold(torch.nn.Module):
    """nn.Fold (aten.col2im), the inverse of ConvBERT's unfold: patches summed back onto an 8x8 map."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.fold(x, (8, 8), kernel_size=2, stride=2), F.fold(x, (6, 6), kernel_size=2, stride=2, padding=1)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_fold_is_decomposed_and_matches_eager_on_iree(iree, dynamic):
    """col2im has no sample in the OpInfo corpus (measured by hand: legality.MEASURED_OUTSIDE_CORPUS)."""
    inputs = [(torch.randn(2, 12, 16),), (torch.randn(3, 12, 16) * 4,) if dynamic else (torch.randn(2, 12, 16) * 4,)]
    ep = rt.export(Fold(), *inputs[0], dynamic_shapes=({0: Dim("batch", min=2)},) if dynamic else None)
    with pytest.raises(Exception, match=r"torch\.constant\.int"):
        iree.compile(fx_rewrites.apply(ep, iree.rules.without(LEGALIZE)).program, inputs[0])
    result = rt.apply_rules(ep, iree_legalize.LEGALIZE_FOR_IREE)
    rt.assert_fired(result, LEGALIZE)
    rt.assert_ops(result, absent=[aten.col2im.default])
    rt.assert_matches_eager(result, Fold(), inputs)
    fn = iree.compile(fx_rewrites.apply(ep, iree.rules).program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), Fold()(*args), rtol=1e-5, atol=1e-5)


class EmbeddingBackward(torch.nn.Module):
    """What a joint forward-backward graph of an nn.Embedding holds: the weight's gradient, rows summed per token
    id (padding_idx 1 left out)."""

    def forward(self, grad: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return aten.embedding_dense_backward(grad, ids, 10, 1, False)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_embedding_backward_is_decomposed_and_matches_eager_on_iree(iree, dynamic):
    """Its decomposition makes `_unsafe_masked_index_put_accumulate`, decomposed in turn (its decomposition appends
    to its index list, which the node's own immutable list refused)."""
    g = torch.Generator().manual_seed(0)
    inputs = [
        (torch.randn(4, n, 8, generator=g), torch.randint(0, 10, (4, n), generator=g)) for n in (6, 9 if dynamic else 6)
    ]
    shapes = ({1: Dim("n", min=2)}, {1: Dim("n", min=2)}) if dynamic else None
    ep = rt.export(EmbeddingBackward(), *inputs[0], dynamic_shapes=shapes)
    with pytest.raises(Exception, match=r"torch\.constant\.bool"):
        iree.compile(fx_rewrites.apply(ep, iree.rules.without(LEGALIZE)).program, inputs[0])
    result = rt.apply_rules(ep, iree_legalize.LEGALIZE_FOR_IREE)
    rt.assert_fired(result, LEGALIZE)
    rt.assert_ops(
        result, absent=[aten.embedding_dense_backward.default, aten._unsafe_masked_index_put_accumulate.default]
    )
    rt.assert_matches_eager(result, EmbeddingBackward(), inputs)
    fn = iree.compile(fx_rewrites.apply(ep, iree.rules).program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), EmbeddingBackward()(*args), rtol=1e-5, atol=1e-5)
