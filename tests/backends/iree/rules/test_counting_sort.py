from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.errors import IreeUnsupportedError
from fx_rewrites.backends.iree.rules.counting_sort import MAX_BINS, counting_sort_for_iree, value_bound
from fx_rewrites.backends.iree.rules.topk import sort_as_ranks_for_iree, topk_as_ranks_for_iree
from fx_rewrites.backends.iree.wrong_forms import wrong_forms

aten = torch.ops.aten


class Routed(torch.nn.Module):
    """Two MoE layers' routing as transformers' grouped-mm experts do it: the top k of E router probabilities
    per token, the flattened expert ids sorted (`sort`: torch.sort, or torch.sort(stable=True), the reference)."""

    def __init__(self, top: int, stable: bool = False, descending: bool = False) -> None:
        super().__init__()
        self.top, self.stable, self.descending = top, stable, descending

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out: list[torch.Tensor] = []
        for logits in (x, y):
            ids = torch.topk(torch.softmax(logits, dim=-1), self.top, dim=-1).indices.reshape(-1)
            if self.stable:
                out.extend(torch.sort(ids, stable=True, descending=self.descending))
            else:
                out.extend(torch.sort(ids, descending=self.descending))
        return tuple(out)


def _logits(tokens: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=g), torch.randn(tokens, experts, generator=g)


def _exact(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("descending", [False, True], ids=["ascending", "descending"])
def test_expert_ids_sort_as_a_counting_sort_and_iree_matches_eager(dynamic, descending):
    """Many ties (24 tokens x top 2 over 8 experts): the stable order is the only right one, indices exact."""
    tokens = [24, 40 if dynamic else 24, 3 if dynamic else 24]
    inputs = [_logits(t, 8, seed) for seed, t in enumerate(tokens)]
    shapes = ({0: Dim("tokens", min=2, max=64)},) * 2 if dynamic else None
    ep = rt.export(Routed(2, descending=descending), *inputs[0], dynamic_shapes=shapes)
    iree = backends.get("iree")
    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, counting_sort_for_iree, times=2)  # both layers', after the topks became ranks
    rt.assert_fired(result, topk_as_ranks_for_iree, times=2)
    rt.assert_not_fired(result, sort_as_ranks_for_iree)
    rt.assert_ops(result, present=[aten.cumsum.default], absent=[aten.sort.default, aten.topk.default])
    reference = Routed(2, stable=True, descending=descending)
    rt.assert_matches_eager(result, reference, inputs, rtol=0, atol=0)
    rt.assert_idempotent(result, iree.rules)
    compiled = iree.compile(result.program, inputs[0])
    for args in inputs:
        _exact(compiled(*args), reference(*args))


def test_a_lone_sort_of_argmax_and_a_stable_sort_of_topk_indices():
    """The range from an argmax (over 5) and from topk indices seen before any rule (over 300, too wide for the
    ranks, and copied to int16); torch.sort(stable=True) (aten.sort.stable) too."""

    def f(x, y):
        a = torch.sort(torch.argmax(x, dim=-1))
        b = torch.sort(torch.topk(y, 3).indices.flatten(), stable=True)
        c = torch.sort(torch.topk(y, 3).indices.to(torch.int16).flatten(), descending=True)  # int16 holds 0..299
        return *a, *b, *c

    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(2, 40, 5, generator=g), torch.randn(7, 300, generator=g)) for _ in range(2)]
    ep = rt.export(f, *inputs[0])
    result = rt.apply_rules(ep, backends.get("iree").rules)
    rt.assert_fired(result, counting_sort_for_iree, times=3)

    def reference(x, y):
        a = torch.sort(torch.argmax(x, dim=-1), stable=True)
        b = torch.sort(torch.topk(y, 3).indices.flatten(), stable=True)
        c = torch.sort(torch.topk(y, 3).indices.to(torch.int16).flatten(), stable=True, descending=True)
        return *a, *b, *c

    rt.assert_matches_eager(result, reference, inputs, rtol=0, atol=0)


def test_unbounded_or_wide_values_are_left():
    """Values not proved in [0, E) (an input; a float sort; a clamp of floats; indices copied to a type that
    wraps them) or E > MAX_BINS: no counting sort."""

    def f(ids, v, w, u):
        return (
            torch.sort(ids).indices,
            torch.sort(v).indices,
            torch.sort(torch.clamp(v, 0, 3)).indices,
            torch.sort(torch.argmax(w, dim=-1)).indices,
            torch.sort(torch.topk(u, 2).indices.to(torch.int8).flatten()).indices,  # 0..299 wraps in int8
        )

    inputs = torch.randint(0, 4, (2, 6)), torch.randn(2, 6), torch.randn(6, MAX_BINS + 1), torch.randn(3, 300)
    ep = rt.export(f, *inputs)
    result = rt.apply_rules(ep, backends.get("iree").rules)
    rt.assert_not_fired(result, counting_sort_for_iree)
    nodes = {n.name: n for n in ep.graph.nodes}
    assert value_bound(nodes["argmax"]) == MAX_BINS + 1


def test_shared_iota_refusal_names_the_counting_sort():
    """Two sorts of expert ids too long for the ranks (16400 > 16384): as exported, refused with the fix of
    applying the rules (the counting sort takes them); after the rules, nothing is refused."""
    inputs = _logits(4100, 8, 0)
    ep = rt.export(Routed(4), *inputs)
    iree = backends.get("iree")
    with pytest.raises(IreeUnsupportedError, match=r"shares that iota.*3 more such node"):
        iree.compile(ep, inputs)
    why = {node.target: reason for node, reason in wrong_forms(ep.graph_module)}
    assert "write it as a counting sort" in why[aten.sort.default]
    assert "write it as ranks" in why[aten.topk.default]
    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, counting_sort_for_iree, times=2)
    rt.assert_not_fired(result, sort_as_ranks_for_iree)
