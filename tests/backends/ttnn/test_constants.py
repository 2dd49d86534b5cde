"""Values computed from the program's constants only: on the host, in float32, once per compiled function."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.ttnn import lower, runtime
from fx_rewrites.backends.ttnn.constants import ConstantCache
from fx_rewrites.backends.ttnn.coverage import coverage
from fx_rewrites.backends.ttnn.rules import RULES, ops
from fx_rewrites.rules import DEFAULT
from tests.backends.ttnn import reference_ttnn
from tests.backends.ttnn.conftest import assert_close_bf16
from tests.backends.ttnn.test_backend import _CountingDouble
from tests.backends.ttnn.test_fold import ConvBn

aten = torch.ops.aten


class WeightMath(torch.nn.Module):
    """A weight transposed and a bias scaled in forward: work on constants only, next to per-call work."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(16, 8))
        self.bias = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.relu(x @ self.weight.t().t() + torch.exp(self.bias) * 0.5)


class _Counting(TorchDispatchMode):
    """Counts the calls of one aten op made while it is active."""

    def __init__(self, op):
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is self.op
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def _double():
    previous = runtime.use(reference_ttnn)
    yield
    runtime.use(previous)


def test_nodes_computed_from_constants_only_stay_on_the_host_and_say_why():
    ep = rt.export(WeightMath(), torch.randn(4, 16))
    result = rt.apply_rules(rt.apply_rules(ep, DEFAULT).program, RULES, explain=True)
    rt.assert_ops(result, present=[aten.exp.default, ops.matmul, ops.OPS["relu"]])
    host = [n for n in result.graph_module.graph.nodes if n.op == "call_function" and not ops.is_standin(n.target)]
    # the transposes only move the weight: sink_data_movement takes them to the device (exact, and cached there)
    assert {n.target for n in host} == {aten.exp.default, aten.mul.Tensor}, host
    reasons = {a.reason for a in result.report.explain() if a.node == "exp" and not a.fired}
    assert any("computed from the program's constants only" in r for r in reasons), reasons


def test_coverage_counts_constant_work_apart():
    cov = coverage(rt.export(WeightMath(), torch.randn(4, 16)), "weight_math")
    once = {o.op: o.once for o in cov.ops if o.once}
    assert once == {"aten.t.default": 2, "aten.exp.default": 1, "aten.mul.Tensor": 1}, cov.text()
    assert cov.device_share == 1.0 and "4 computed once from constants" in cov.summary()


def test_constant_work_runs_once_and_its_result_reaches_the_device_once():
    model = WeightMath().eval()
    x = torch.randn(4, 16)
    fn = backends.get("ttnn").compile(lower(rt.export(model, x)), (x,))
    assert [r.kind for r in fn.partitioning.regions] == ["host", "device"]
    counting, exps = _CountingDouble(), _Counting(aten.exp.default)
    runtime.use(counting)
    with exps:
        results = [fn(x * scale) for scale in (1.0, 0.5, 2.0)]
    assert exps.calls == 1  # the first call only
    assert len(counting.uploads) == 3 + 2, counting.uploads  # weight, bias term, input; then the input alone
    for scale, got in zip((1.0, 0.5, 2.0), results):
        with torch.no_grad():
            assert_close_bf16(got, model(x * scale))


def test_constant_work_is_redone_when_a_constant_changes_in_place():
    """The folded batch norm follows new running statistics (same tensors, new versions): no stale weights."""
    model = ConvBn().eval()
    x = torch.randn(2, 3, 10, 12)
    program = rt.export(model, x)
    fn = backends.get("ttnn").compile(lower(program), (x,))
    rsqrts = _Counting(aten.rsqrt.default)
    with rsqrts:
        before = fn(x)
        fn(x)
    assert rsqrts.calls == 1
    var = program.state_dict["bn.running_var"]
    with torch.no_grad():
        var.mul_(4.0)
        try:
            with rsqrts:
                after = fn(x)
            expected = program.module()(x)
        finally:
            var.div_(4.0)
    assert rsqrts.calls == 2
    assert not torch.allclose(before, after, atol=0.1)
    assert_close_bf16(after, expected)


class PositionMask(torch.nn.Module):
    """A mask built from aranges in int64 (as transformers' masking utilities do): no input reaches it."""

    def forward(self, x):
        pos = torch.arange(x.shape[-1])
        allowed = (pos.unsqueeze(0) + 1) >= pos.unsqueeze(1)
        return torch.softmax(x + (~allowed).to(x.dtype) * -1e4, -1)


def test_work_on_factories_only_is_counted_once_and_runs_once():
    """The int64 mask chain stays on the host (integers), but it reads no input: the compiled function
    computes it on the first call only, and the coverage report counts it as such, not as per-call host work."""
    model = PositionMask()
    x = torch.randn(2, 6, 6)
    program = rt.export(model, x)
    cov = coverage(program, "position_mask")
    once = {o.op: o.once for o in cov.ops if o.once}
    assert once.get("aten.ge.Tensor") == 1 and once.get("aten.unsqueeze.default") == 2, cov.text()
    assert cov.device_share == 1.0, cov.text()
    fn = backends.get("ttnn").compile(lower(program), (x,))
    compares = _Counting(aten.ge.Tensor)
    with compares:
        results = [fn(x * scale) for scale in (1.0, 3.0)]
    assert compares.calls == 1
    for scale, got in zip((1.0, 3.0), results):
        assert_close_bf16(got, model(x * scale))


def test_the_constant_cache_knows_its_constants_by_identity():
    """Values stay while the same tensors come back; another tensor, even equal, empties them. The cache holds
    its constants, so no new tensor can be given a freed one's id() and read stale values."""
    cache = ConstantCache()
    weight = torch.ones(2)
    cache.region("r", [weight], "ttnn", "device")["folded"] = 1
    assert cache.region("r", [weight], "ttnn", "device") == {"folded": 1}
    held = weakref.ref(weight)
    del weight
    gc.collect()
    assert held() is not None
    assert cache.region("r", [torch.ones(2)], "ttnn", "device") == {}
    gc.collect()
    assert held() is None  # the new stamp dropped the old tensor
