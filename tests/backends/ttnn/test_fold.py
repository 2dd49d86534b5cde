"""The ttnn fold phase: eval batch norm and per-channel affines folded into the convolution before them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.ttnn import lower, runtime
from fx_rewrites.backends.ttnn.rules import FOLD, RULES
from fx_rewrites.rules import DEFAULT
from fx_rewrites.ruleset import Phases
from tests.backends.ttnn import reference_ttnn
from tests.backends.ttnn.conftest import BF16_ATOL, BF16_RTOL, assert_close_bf16

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _double():
    previous = runtime.use(reference_ttnn)
    yield
    runtime.use(previous)


class ConvBn(torch.nn.Module):
    """conv -> eval batch norm -> relu6 (MobileNetV2's layer), with statistics that are not the identity."""

    def __init__(self, bias: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1, bias=bias)
        self.bn = torch.nn.BatchNorm2d(8, eps=1e-3)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.2, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return F.relu6(self.bn(self.conv(x)))


class OffsetConvBn(ConvBn):
    """A conv whose outputs sit at 64 +- 1 and the batch norm that centres them (mean 64, std 0.5): bfloat16
    rounds 64 +- 1 to steps of 0.5, which the batch norm turns into steps of 1."""

    def __init__(self):
        super().__init__()
        with torch.no_grad():
            self.conv.weight.mul_(0.5)
            self.conv.bias.fill_(64.0)
            self.bn.running_mean.fill_(64.0)
            self.bn.running_var.fill_(0.25)
            self.bn.weight.fill_(1.0)
            self.bn.bias.zero_()

    def forward(self, x):
        return self.bn(self.conv(x))


class ScaleShift(torch.nn.Module):
    """A per-channel scale (constant first) and shift after a conv: a layer scale, a folded norm's affine."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.gamma = torch.nn.Parameter(torch.rand(8) + 0.5)
        self.register_buffer("beta", torch.randn(8))

    def forward(self, x):
        return torch.relu(self.gamma.view(1, -1, 1, 1) * self.conv(x) + self.beta[:, None, None] - 0.25)


def _fold(program):
    first = rt.apply_rules(program, DEFAULT)
    return rt.apply_rules(first.program, FOLD, explain=True)


def _inputs(batch: int = 2):
    return [(torch.randn(batch, 3, 10, 12),), (torch.randn(batch, 3, 10, 12) * 2.0,)]


def _conv_readers(result):
    convs = (aten.conv2d.default, aten.convolution.default)
    (conv,) = [n for n in result.graph_module.graph.nodes if n.target in convs]
    return conv, [u.target for u in conv.users]


@pytest.mark.parametrize("bias", [True, False], ids=["conv_bias", "no_conv_bias"])
def test_batch_norm_folds_into_the_conv_before_it(bias):
    model = ConvBn(bias).eval()
    result = _fold(rt.export(model, torch.randn(2, 3, 10, 12)))
    rt.assert_fired(result, "ttnn_fold_batch_norm", times=1)
    rt.assert_ops(result, present=[aten.conv2d.default, aten.rsqrt.default], absent=[aten.batch_norm.default])
    conv, readers = _conv_readers(result)
    assert readers == [aten.relu6.default]
    assert conv.args[1].target is aten.mul.Tensor and conv.args[2] is not None  # W * s, and a bias
    rt.assert_matches_eager(result, model, _inputs(), rtol=1e-5, atol=1e-5)  # float32: only rounding moves
    rt.assert_idempotent(result, FOLD)


def test_batch_norm_after_a_conv_on_the_host_is_left_alone():
    """Dim batch: the ttnn lowering keeps the conv on the host (its sizes are constants in ttnn.conv2d), where
    folding would only change a float32 result."""
    model = ConvBn().eval()
    program = rt.export(model, torch.randn(2, 3, 10, 12), dynamic_shapes=[{0: Dim("b", min=2)}])
    result = _fold(program)
    rt.assert_not_fired(result, "ttnn_fold_batch_norm")
    reasons = [a.reason for a in result.report.explain() if a.rule == "ttnn_fold_batch_norm"]
    assert any("the convolution stays on the host (symbolic sizes" in r for r in reasons), reasons
    backend = backends.get("ttnn")
    fn = backend.compile(lower(program), (torch.randn(2, 3, 10, 12),))
    for batch in (2, 3):
        for (x,) in _inputs(batch):
            assert_close_bf16(fn(x), model(x))


def test_the_fold_keeps_a_batch_norm_that_centres_large_conv_outputs_within_tolerance():
    """Fails without the fold: the double rounds the conv's 64 +- 1 to bfloat16 steps of 0.5 before the batch
    norm subtracts 64 and divides by 0.5, so errors reach 0.5. Folded, the conv computes the centred value."""
    model = OffsetConvBn().eval()
    x0 = torch.randn(2, 3, 10, 12)
    program = rt.export(model, x0)
    backend = backends.get("ttnn")
    unfolded = backend.compile(rt.apply_rules(rt.apply_rules(program, DEFAULT).program, RULES).program, (x0,))
    folded = backend.compile(lower(program), (x0,))
    for (x,) in _inputs():
        expected = model(x)
        assert not torch.allclose(unfolded(x), expected, rtol=BF16_RTOL, atol=BF16_ATOL)
        assert_close_bf16(folded(x), expected)


def test_the_sub_mul_add_form_of_batch_norm_folds_step_by_step():
    """run_decompositions turns eval batch norm into _native_batch_norm_legit_no_training, which DEFAULT
    writes as (x - mean) * scale + bias: each step folds into the conv."""
    model = ConvBn().eval()
    program = rt.export(model, torch.randn(2, 3, 10, 12)).run_decompositions()
    result = _fold(program)
    rt.assert_fired(result, "ttnn_fold_affine", times=3)
    _, readers = _conv_readers(result)
    assert readers == [aten.hardtanh.default]  # run_decompositions writes relu6 so
    rt.assert_matches_eager(result, model, _inputs(), rtol=1e-5, atol=1e-5)
    rt.assert_idempotent(result, FOLD)


def test_a_per_channel_scale_and_shift_fold_either_side():
    model = ScaleShift().eval()
    result = _fold(rt.export(model, torch.randn(2, 3, 10, 12)))
    rt.assert_fired(result, "ttnn_fold_affine", times=3)  # gamma * conv, + beta, - 0.25
    _, readers = _conv_readers(result)
    assert readers == [aten.relu.default]
    rt.assert_matches_eager(result, model, _inputs(), rtol=1e-5, atol=1e-5)
    x0 = torch.randn(2, 3, 10, 12)
    fn = backends.get("ttnn").compile(lower(rt.export(model, x0)), (x0,))
    for (x,) in _inputs():
        assert_close_bf16(fn(x), model(x))


def test_a_per_channel_scale_after_a_conv_on_the_host_is_left_alone():
    model = ScaleShift().eval()
    program = rt.export(model, torch.randn(2, 3, 10, 12), dynamic_shapes=[{0: Dim("b", min=2)}])
    result = _fold(program)
    rt.assert_not_fired(result, "ttnn_fold_affine")
    rt.assert_matches_eager(result, model, [(torch.randn(3, 3, 10, 12),), (torch.randn(5, 3, 10, 12),)])


class _TwoReaders(ConvBn):
    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


class _RuntimeScale(ConvBn):
    def forward(self, x, s):
        return self.conv(x) * s


class _SpatialShift(ConvBn):
    def __init__(self):
        super().__init__()
        self.register_buffer("position", torch.randn(1, 1, 10, 12))

    def forward(self, x):
        return self.conv(x) + self.position


class _DivideByTensor(ConvBn):
    def forward(self, x):
        return self.conv(x) / self.bn.running_var[:, None, None]


class _TrainingBatchNorm(ConvBn):
    def forward(self, x):
        bn = self.bn
        return F.batch_norm(self.conv(x), bn.running_mean.clone(), bn.running_var.clone(), training=True)


@pytest.mark.parametrize(
    ("module", "extra", "reason"),
    [
        (_TwoReaders, (), "has 2 readers; they need its unfolded result"),
        (_RuntimeScale, (torch.rand(1, 8, 1, 1),), "the other operand is not computed from the program's constants"),
        (_DivideByTensor, (), "a division by a tensor"),
        (_TrainingBatchNorm, (), "training-mode batch norm"),
    ],
    ids=["two_readers", "runtime_scale", "divide_by_tensor", "training"],
)
def test_declines_say_why(module, extra, reason):
    model = module().eval()
    x = torch.randn(2, 3, 10, 12)
    result = _fold(rt.export(model, x, *extra))
    assert result.report.total_rewrites == 0, dict(result.report.rewrites)
    reasons = [a.reason for a in result.report.explain() if not a.fired]
    assert any(reason in r for r in reasons), reasons
    rt.assert_matches_eager(result, model, [(x, *extra), (x * 2.0, *extra)])


def test_a_constant_that_is_not_per_channel_is_not_folded():
    model = _SpatialShift().eval()
    x = torch.randn(2, 3, 10, 12)
    result = _fold(rt.export(model, x))
    rt.assert_not_fired(result, "ttnn_fold_affine")
    reasons = [a.reason for a in result.report.explain() if a.rule == "ttnn_fold_affine"]
    assert any("is not per output channel (8)" in r for r in reasons), reasons


def test_the_fold_phase_sits_between_default_and_the_lowering():
    phases = backends.get("ttnn").rules
    assert isinstance(phases, Phases) and phases.sets[1] is FOLD
