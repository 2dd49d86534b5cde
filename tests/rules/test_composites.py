"""Composites that lie about their schema: batch norm, rrelu, dropout in eval."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fx_rewrites import testing as rt
from fx_rewrites.rules.composites import RULES, batch_norm_eval_to_affine, dropout_eval, rrelu_eval_to_leaky_relu

aten = torch.ops.aten


class ConvBN(torch.nn.Module):
    def __init__(self, affine: bool = True, dims: int = 2) -> None:
        super().__init__()
        conv, bn = (torch.nn.Conv1d, torch.nn.BatchNorm1d) if dims == 1 else (torch.nn.Conv2d, torch.nn.BatchNorm2d)
        self.conv = conv(3, 4, 3)
        self.bn = bn(4, affine=affine)
        with torch.no_grad():  # non-trivial running statistics
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize(
    ("affine", "dims", "shape"), [(True, 2, (2, 3, 8, 8)), (False, 2, (1, 3, 6, 6)), (True, 1, (2, 3, 9))]
)
def test_batch_norm_eval_becomes_affine(affine, dims, shape):
    torch.manual_seed(0)
    model = ConvBN(affine, dims).eval()
    ep = rt.export(model, torch.randn(*shape)).run_decompositions()
    assert aten._native_batch_norm_legit_no_training.default in rt.targets(ep)
    result = rt.apply_rules(ep, batch_norm_eval_to_affine)
    rt.assert_fired(result, batch_norm_eval_to_affine, times=1)
    rt.assert_ops(result, absent=[aten._native_batch_norm_legit_no_training.default], present=[aten.rsqrt.default])
    rt.assert_matches_eager(result, model, [(torch.randn(*shape),), (torch.randn(*shape) * 3,)], atol=1e-5)
    rt.assert_idempotent(result, RULES)


def test_batch_norm_through_torch_compile_graph():
    torch.manual_seed(0)
    model = ConvBN().eval()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    from torch._dynamo.backends.common import aot_autograd

    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.compile(model, backend=aot_autograd(fw_compiler=capture))(x)
    (gm,) = graphs
    assert aten._native_batch_norm_legit_no_training.default in rt.targets(gm)
    result = rt.apply_rules(gm, batch_norm_eval_to_affine)
    rt.assert_fired(result, batch_norm_eval_to_affine, times=1)
    # same graph before and after, on random inputs (variances kept positive)
    args = [torch.rand(n.meta["val"].shape) + 0.5 for n in gm.graph.nodes if n.op == "placeholder"]
    torch.testing.assert_close(result.graph_module(*args), gm(*args), atol=1e-5, rtol=1e-5)


def test_rrelu_eval_both_routes():
    fn = lambda x: F.rrelu(x, training=False) * 2
    x = torch.randn(4, 5)
    ep = rt.export(fn, x)
    assert aten.rrelu.default in rt.targets(ep)
    for program, absent in [
        (ep, aten.rrelu.default),
        (ep.run_decompositions(), aten.rrelu_with_noise_functional.default),
    ]:
        assert absent in rt.targets(program)
        result = rt.apply_rules(program, rrelu_eval_to_leaky_relu)
        rt.assert_fired(result, rrelu_eval_to_leaky_relu, times=1)
        rt.assert_ops(result, absent=[absent], present=[aten.leaky_relu.default])
        rt.assert_matches_eager(result, fn, [(x,), (torch.randn(4, 5) * 4,)])
        rt.assert_idempotent(result, RULES)


def test_rrelu_training_is_left_alone():
    fn = lambda x: F.rrelu(x, training=True)
    ep = rt.export(fn, torch.randn(4, 5))
    result = rt.apply_rules(ep, rrelu_eval_to_leaky_relu, explain=True)
    rt.assert_not_fired(result, rrelu_eval_to_leaky_relu)
    assert "training=True" in result.report.explain()[0].reason


def test_dropout_eval_is_dropped():
    fn = lambda x: F.dropout(x, 0.5, training=False) + 1
    ep = rt.export(fn, torch.randn(3, 4))
    assert aten.dropout.default in rt.targets(ep)
    result = rt.apply_rules(ep, dropout_eval)
    rt.assert_fired(result, dropout_eval, times=1)
    rt.assert_ops(result, absent=[aten.dropout.default])
    rt.assert_matches_eager(result, fn, [(torch.randn(3, 4),)])
    train = rt.apply_rules(rt.export(lambda x: F.dropout(x, 0.5, training=True), torch.randn(3, 4)), dropout_eval)
    rt.assert_not_fired(train, dropout_eval)
