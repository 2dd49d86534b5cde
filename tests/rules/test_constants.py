"""Fresh constants: lift_fresh_copy, lift_fresh and detach_ from real graphs."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fx_rewrites import testing as rt
from fx_rewrites.rules.constants import RULES, drop_detach_, lift_fresh_copy_to_clone

aten = torch.ops.aten
BAD = [aten.lift_fresh_copy.default, aten.lift_fresh.default, aten.detach_.default]


class Constants(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = torch.tensor([1.0, 2.0, 3.0])
        keep = torch.tensor(True)
        return torch.where(keep, x + c, -x) * torch.tensor(2.0)


def test_export_route():
    ep = rt.export(Constants(), torch.randn(2, 3))
    assert set(BAD[::2]) <= set(rt.targets(ep))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, lift_fresh_copy_to_clone, times=3)
    rt.assert_fired(result, drop_detach_, times=3)
    rt.assert_ops(result, absent=BAD, present=[aten.clone.default])
    rt.assert_matches_eager(result, Constants(), [(torch.randn(2, 3),), (torch.randn(2, 3) * 7,)])
    rt.assert_idempotent(result, RULES)
    kinds = {s.kind.name for s in result.program.graph_signature.input_specs}
    assert "CONSTANT_TENSOR" in kinds  # the constants stay lifted


def test_torch_compile_route_tensor_constant_get_attr():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    from torch._dynamo.backends.common import aot_autograd

    x = torch.randn(2, 3)
    torch.compile(Constants(), backend=aot_autograd(fw_compiler=capture))(x)
    (gm,) = graphs
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    assert aten.lift_fresh_copy.default in rt.targets(gm)
    result = rt.apply_rules(gm, RULES)
    rt.assert_fired(result, lift_fresh_copy_to_clone)
    rt.assert_ops(result, absent=BAD)
    torch.testing.assert_close(result.graph_module(x)[0], Constants()(x))


def test_pre_dispatch_make_fx_route():
    gm = make_fx(Constants(), pre_dispatch=True)(torch.randn(2, 3))
    assert aten.detach_.default in rt.targets(gm)
    result = rt.apply_rules(gm, RULES, example_inputs=(torch.randn(2, 3),))
    rt.assert_ops(result, absent=BAD)
    x = torch.randn(2, 3)
    torch.testing.assert_close(result.graph_module(x), Constants()(x))


def test_seed_000_mask_assignment_constant():
    class Seed000(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x = x.clone()
            x[y == 1] = 2
            return x

    args = (torch.randn(4, 5), torch.randint(0, 3, (4, 5)))
    ep = rt.export(Seed000(), *args)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, lift_fresh_copy_to_clone, times=1)
    rt.assert_ops(result, absent=[aten.lift_fresh_copy.default])
    rt.assert_matches_eager(result, Seed000(), [args, (torch.randn(4, 5), torch.ones(4, 5, dtype=torch.int64))])
