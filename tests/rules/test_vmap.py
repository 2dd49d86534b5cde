"""torch.vmap in forward: the predispatch calls export records, retraced into ATen ops."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
from torch._functorch import predispatch

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.rules import DEFAULT
from fx_rewrites.rules.vmap import RULES, drop_lazy_load_decompositions, inline_vmap

PREDISPATCH = [
    predispatch._vmap_increment_nesting,
    predispatch._vmap_decrement_nesting,
    predispatch._add_batch_dim,
    predispatch._remove_batch_dim,
    predispatch.lazy_load_decompositions,
]


def _predispatch_targets(obj) -> set:
    return {t for t in rt.targets(obj) if t in PREDISPATCH or t is torch.ops.higher_order.flat_apply}


class CausalPaddingMask(torch.nn.Module):
    """transformers' create_causal_mask in small: vmap over batch, query and key of an index function."""

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        batch, length = padding.shape

        def allowed(b, q, k):
            return (k <= q) & padding[b, k].bool()  # indexing inside vmap: dynamo's ModIndex

        fn = torch.vmap(allowed, in_dims=(None, None, 0))
        fn = torch.vmap(fn, in_dims=(None, 0, None))
        fn = torch.vmap(fn, in_dims=(0, None, None))
        positions = torch.arange(length)
        with TransformGetItemToIndex():  # as transformers does: tensor[b, k] on 0-d batched indices
            mask = fn(torch.arange(batch), positions, positions)  # [batch, query, key]
        scores = x @ x.transpose(-1, -2)
        return scores.masked_fill(~mask, -1e4).softmax(-1) @ x


def _mask_args(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    padding = torch.ones(2, 6, dtype=torch.long)
    padding[1, 4 - seed :] = 0
    return torch.randn(2, 6, 4, generator=g), padding


def test_nested_vmap_with_indexing_becomes_aten():
    ep = rt.export(CausalPaddingMask(), *_mask_args(0))
    assert set(PREDISPATCH) <= set(rt.targets(ep))
    assert torch.ops.higher_order.flat_apply in rt.targets(ep)  # padding[b, k] inside the vmap
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, inline_vmap, times=1)  # the outermost level takes the nested ones with it
    rt.assert_fired(result, drop_lazy_load_decompositions, times=1)  # the one before the first level
    assert not _predispatch_targets(result), sorted(map(str, _predispatch_targets(result)))
    assert all(isinstance(t, torch._ops.OpOverload) for t in rt.targets(result))
    assert not any(n.op == "get_attr" for n in result.graph_module.graph.nodes)  # ModIndex's specs are gone
    rt.assert_matches_eager(result, CausalPaddingMask(), [_mask_args(0), _mask_args(1)])
    rt.assert_idempotent(result, RULES)


class OutDimAndClosure(torch.nn.Module):
    """in_dims=1, an unbatched argument (in_dims None) and a weight the body closes over.

    (torch 2.13 does not export out_dims != 0 nor a closure over a tensor computed in forward:
    "We found a fake tensor in the exported program constant's list".)
    """

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([0.5, -2.0, 1.5]))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        fn = torch.vmap(lambda col, b: torch.where(col > self.scale, col, b).cumsum(0), in_dims=(1, None))
        return fn(x, bias) + 1


def test_in_dims_and_closures():
    args = (torch.randn(3, 5), torch.randn(3))
    ep = rt.export(OutDimAndClosure(), *args)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, inline_vmap, times=1)
    assert not _predispatch_targets(result)
    rt.assert_matches_eager(result, OutDimAndClosure(), [args, (torch.randn(3, 5), -torch.rand(3))])


class TwoRegions(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.vmap(torch.outer)(x, x)
        return torch.vmap(lambda r: r.cumsum(0))(a) - a


def test_each_region_once():
    x = torch.randn(2, 3)
    result = rt.apply_rules(rt.export(TwoRegions(), x), RULES)
    rt.assert_fired(result, inline_vmap, times=2)
    assert not _predispatch_targets(result)
    rt.assert_matches_eager(result, TwoRegions(), [(x,), (torch.randn(2, 3),)])


def test_nested_level_declines_with_a_reason():
    ep = rt.export(CausalPaddingMask(), *_mask_args(0))
    inner = [n for n in ep.graph.nodes if n.target is predispatch._vmap_increment_nesting][1]
    reason = inline_vmap.match(inner)
    assert isinstance(reason, fx_rewrites.Miss) and "inside the vmap level" in str(reason)


def test_with_the_default_rules_and_dynamic_batch():
    """The whole default set on a program with a symbolic batch: the retrace keeps the symbol."""
    batch = torch.export.Dim("batch", min=2, max=8)
    ep = rt.export(OutDimAndClosure(), torch.randn(3, 5), torch.randn(3), dynamic_shapes=({1: batch}, None))
    result = fx_rewrites.apply(ep, DEFAULT | RULES)
    rt.assert_fired(result, inline_vmap, times=1)
    rt.assert_matches_eager(result, OutDimAndClosure(), [(torch.randn(3, 7), torch.randn(3))])


@pytest.mark.parametrize("rewritten", [False, True], ids=["as_is", "after_rules"])
def test_on_iree(rewritten):
    from fx_rewrites import backends
    from fx_rewrites.engine import RewriteError

    iree = backends.get("iree")
    args = _mask_args(0)
    ep = rt.export(CausalPaddingMask(), *args)
    if not rewritten:
        with pytest.raises(RewriteError, match="lazy_load_decompositions"):
            iree.compile(ep, args)
        return
    fn = iree.compile(fx_rewrites.apply(ep, iree.rules).program, args)
    for inputs in (args, _mask_args(1)):
        torch.testing.assert_close(fn(*inputs), CausalPaddingMask()(*inputs), rtol=1e-4, atol=1e-5)
