"""contiguous is a copy or its input, decided from the fake value; the in-place rule then goes through."""

from __future__ import annotations

import torch

from fx_rewrites import testing as rt
from fx_rewrites.rules import DEFAULT
from fx_rewrites.rules.inplace import functionalize_inplace
from fx_rewrites.rules.view_or_copy import RULES, contiguous_view_or_copy

aten = torch.ops.aten


class RelativeIndex(torch.nn.Module):
    """BEiT's relative position index: a permuted (copying) contiguous written into in place."""

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        relative[:, :, 0] += 3
        relative[:, :, 1] += 3
        relative[:, :, 0] *= 7
        return relative.sum(-1)


def _coords(seed: int) -> torch.Tensor:
    return torch.randint(0, 4, (2, 5), generator=torch.Generator().manual_seed(seed))


def test_copying_contiguous_becomes_clone():
    ep = rt.export(RelativeIndex(), _coords(0))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, contiguous_view_or_copy, times=1)
    rt.assert_ops(result, present=[aten.clone.default], absent=[aten.contiguous.default])
    rt.assert_matches_eager(result, RelativeIndex(), [(_coords(0),), (_coords(1),)])
    rt.assert_idempotent(result, RULES)


class RelativeIndexBaseRead(RelativeIndex):
    """The same, and the un-permuted difference is read after the writes."""

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        diff = coords[:, :, None] - coords[:, None, :]
        relative = diff.permute(1, 2, 0).contiguous()
        relative[:, :, 0] += 3
        relative[:, :, 1] *= 7
        return relative.sum(-1) + diff.sum(0)


def test_then_the_inplace_rule_goes_through():
    """Writes through the contiguous view reach its base only when contiguous
    aliases it; the in-place rule alone decides that from the base's strides
    (torch's functionalization replays the contiguous), with or without this
    pack's clone."""
    inputs = [(_coords(0),), (_coords(1),)]
    alone = rt.apply_rules(rt.export(RelativeIndex(), _coords(0)), DEFAULT.without(*RULES.names()))
    rt.assert_fired(alone, functionalize_inplace)
    rt.assert_matches_eager(alone, RelativeIndex(), inputs)
    ep = rt.export(RelativeIndexBaseRead(), _coords(0))
    for rules in (DEFAULT.without(*RULES.names()), DEFAULT | RULES):
        result = rt.apply_rules(ep, rules)
        rt.assert_fired(result, functionalize_inplace)
        assert not [t for t in rt.targets(result) if t._schema.is_mutable], rt.targets(result)
        rt.assert_matches_eager(result, RelativeIndexBaseRead(), inputs)


class AliasingContiguous(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        aten.add_.Tensor(aten.select.int(aten.contiguous.default(y), 0, 0), 1)
        return y


def test_aliasing_contiguous_is_its_input():
    """export drops a contiguous that aliases (its input is contiguous already); graphs traced
    otherwise keep it, and there it is the input itself."""
    x = torch.randn(3, 4)
    gm = torch.fx.symbolic_trace(AliasingContiguous())
    assert aten.contiguous.default in rt.targets(gm)
    result = rt.apply_rules(gm, RULES, example_inputs=(x,))
    rt.assert_fired(result, contiguous_view_or_copy, times=1)
    rt.assert_ops(result, absent=[aten.contiguous.default, aten.clone.default])
    rt.assert_matches_eager(result, AliasingContiguous(), [(x,), (torch.randn(3, 4),)])


class ChannelsLast(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.contiguous(memory_format=torch.channels_last)
        y.mul_(2)
        return y + x


def test_memory_format_is_kept():
    x = torch.randn(2, 3, 4, 5)
    result = rt.apply_rules(rt.export(ChannelsLast(), x), RULES)
    (clone,) = [n for n in result.graph_module.graph.nodes if n.target is aten.clone.default]
    assert clone.kwargs["memory_format"] == torch.channels_last
    assert clone.meta["val"].is_contiguous(memory_format=torch.channels_last)
    rt.assert_matches_eager(result, ChannelsLast(), [(x,)])


def test_read_only_contiguous_is_left_alone():
    class Attention(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.transpose(1, 2).contiguous().view(2, -1).relu()

    x = torch.randn(2, 3, 4)
    result = rt.apply_rules(rt.export(Attention(), x), RULES, explain=True)
    rt.assert_not_fired(result, contiguous_view_or_copy)
    assert all("nothing writes into it" in a.reason for a in result.report.explain("contiguous_view_or_copy"))


def test_symbolic_sizes_decide_too():
    class Transposed(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.t().contiguous()
            y[0] = 0
            return y

    n = torch.export.Dim("n", min=2, max=16)
    ep = rt.export(Transposed(), torch.randn(3, 4), dynamic_shapes=({0: n},))
    result = rt.apply_rules(ep, DEFAULT | RULES)
    rt.assert_fired(result, contiguous_view_or_copy, times=1)
    rt.assert_matches_eager(result, Transposed(), [(torch.randn(5, 4),)])
