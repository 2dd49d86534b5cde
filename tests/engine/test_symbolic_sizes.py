"""Rewrites keep dynamic sizes true (issue 12, item 4): a new node's value is
computed without specialising the program's symbolic sizes, carries the sizes
its users were typed against, and a rule that would fix a dynamic size to a
number fails loudly instead of making the program static."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.engine import RuleError, values
from fx_rewrites.kinds import rule

aten = torch.ops.aten


def _shape_env(result):
    return values.find_fake_mode(result.graph_module.graph).shape_env


class Shift(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 0, 1, -1)) * 2  # RWKV's time shift; aten.pad is CompositeImplicitAutograd


@rule(roots=(aten.pad.default,), name="rebuild_shift", when=lambda n: "rebuilt" not in n.meta)
def rebuild_shift(node, rw):
    """The crop as a slice, then the pad (what the IREE negative-pad guard builds)."""
    sliced = rw.call(aten.slice.Tensor, node.args[0], 1, 0, -1)
    new = rw.call(node.target, sliced, [0, 0, 1, 0], "constant", 0.0)
    new.meta["rebuilt"] = True
    rw.replace(node, new)


def test_new_composite_node_keeps_the_sizes_symbolic():
    # before: the engine ran aten.pad's C++ kernel on the fake values, which read the sizes as ints:
    # the shape environment replaced batch and time by 2 and 5, and the program rejected other sizes
    ep = rt.export(Shift(), torch.randn(2, 5, 4), dynamic_shapes=({0: Dim("batch"), 1: Dim("time", min=3)},))
    result = rt.apply_rules(ep, rebuild_shift)
    rt.assert_fired(result, rebuild_shift, times=1)
    assert _shape_env(result).replacements == {}
    (pad,) = [n for n in result.graph_module.graph.nodes if n.target is aten.pad.default]
    assert all(isinstance(s, torch.SymInt) for s in pad.meta["val"].shape[:2])
    rt.assert_matches_eager(result, Shift(), [(torch.randn(2, 5, 4),), (torch.randn(3, 9, 4),)])


class WholeMapPool(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values_, indices = F.max_pool2d(x, 6, return_indices=True)  # the kernel covers the whole map
        return values_ * 2, indices


@rule(roots=(aten.max_pool2d_with_indices.default,), name="pool_as_amax", when=lambda n: len(n.users) == 2)
def pool_as_amax(node, rw):
    """Output 0 as amax over the map: [b, c, 1, 1], where export wrote [b, c, h//6, w//6]."""
    getitem = next(u for u in node.users if u.args[1] == 0)
    rw.replace(getitem, rw.call(aten.amax.default, node.args[0], [2, 3], True))


def test_replacement_carries_the_sizes_its_users_see():
    shapes = {0: Dim("b"), 1: Dim("c"), 2: Dim("h", min=6, max=11), 3: Dim("w", min=6, max=11)}
    ep = rt.export(WholeMapPool(), torch.randn(2, 3, 6, 6), dynamic_shapes=(shapes,))
    seen = next(n for n in ep.graph.nodes if n.name == "getitem").meta["val"]
    assert not isinstance(seen.shape[2], int)  # h//6: one under the range constraints, written symbolically
    result = rt.apply_rules(ep, pool_as_amax)
    rt.assert_fired(result, pool_as_amax, times=1)
    (amax,) = [n for n in result.graph_module.graph.nodes if n.target is aten.amax.default]
    # computed alone, amax's value is [b, c, 1, 1]; it carries export's [b, c, h//6, w//6] instead
    assert values._form(amax.meta["val"]) == values._form(seen)
    inputs = [(torch.randn(2, 3, 6, 6),), (torch.randn(4, 2, 6, 6),)]  # amax is the pool only for a 6x6 map
    rt.assert_matches_eager(result, WholeMapPool(), inputs)


@rule(roots=(aten.mul.Tensor,), name="expand_to_example_size", when=lambda n: "done" not in n.meta)
def expand_to_example_size(node, rw):
    """A wrong rule: writes the example's sizes into a dynamic program."""
    new = rw.call(aten.mul.Tensor, rw.call(aten.expand.default, node.args[0], [2, 5]), node.args[1])
    new.meta["done"] = True
    rw.replace(node, new)


def test_a_rule_that_specialises_a_dynamic_size_fails_by_name():
    ep = rt.export(lambda x: x * 2, torch.randn(2, 5), dynamic_shapes=({0: Dim("b")},))
    with pytest.raises(RuleError, match=r"specialised them \(s\d+ = 2\).*would become static"):
        fx_rewrites.apply(ep, fx_rewrites.RuleSet([expand_to_example_size]))


def test_users_view_prefers_what_users_saw_only_when_equal():
    ep = rt.export(WholeMapPool(), torch.randn(2, 3, 6, 6), dynamic_shapes=({0: Dim("b")},))
    x = next(n for n in ep.graph.nodes if n.op == "placeholder").meta["val"]
    mode = x.fake_mode
    with mode:
        same, other = torch.empty_like(x), torch.empty(x.shape[0], 3, 6, 7)
    assert values.users_view(x, same) is same  # written alike: the new value stays
    assert values.users_view(x, other) is other  # not the same value: the check reports it, not this
