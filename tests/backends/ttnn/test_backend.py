"""The ttnn backend end to end: lower, partition, run device regions on ttnn, compare with eager."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.ttnn import TtnnLoweringError, TtnnUnavailable, lower, runtime
from fx_rewrites.backends.ttnn.rules import ops
from fx_rewrites.symbolic_sizes import sym_in_tensor_slots
from tests.backends.ttnn import reference_ttnn
from tests.backends.ttnn.conftest import assert_close_bf16
from tests.backends.ttnn.models import CASES

aten = torch.ops.aten


def _compile(name):
    cls, make_inputs = CASES[name]
    model, args = cls().eval(), make_inputs()
    program = rt.export(model, *args)
    return model, args, program, backends.get("ttnn").compile(lower(program), args)


@pytest.mark.parametrize("name", sorted(CASES))
def test_runs_on_ttnn_and_matches_eager(ttnn_impl, name):
    model, args, _, fn = _compile(name)
    assert fn.partitioning.device_regions, fn.partitioning.summary()
    with torch.no_grad():
        expected = model(*args)
        again = tuple(a * 0.5 if a.is_floating_point() else a for a in args)  # other values, same shapes
        assert_close_bf16(fn(*args), expected)
        assert_close_bf16(fn(*again), model(*again))


@pytest.mark.parametrize("name", sorted(CASES))
def test_host_emulation_of_the_lowered_program_matches_eager(name):
    """program.module() runs the stand-ins' own torch bodies: the lowering's meaning, without ttnn."""
    cls, make_inputs = CASES[name]
    model, args = cls().eval(), make_inputs()
    lowered = lower(rt.export(model, *args))
    assert any(ops.is_standin(n.target) for n in lowered.graph.nodes)
    with torch.no_grad():
        assert_close_bf16(lowered.module()(*args), model(*args))


def test_regions_follow_what_ttnn_takes():
    _, _, _, fn = _compile("host_in_the_middle")
    kinds = [r.kind for r in fn.partitioning.regions]
    assert kinds == ["device", "host", "device"], fn.partitioning.summary()
    host_ops = {n.target for r in fn.partitioning.host_regions for n in r.nodes}
    assert host_ops == {aten.special_i0.default}


def test_everything_lowered_is_one_device_region():
    _, _, _, fn = _compile("mlp")
    assert [r.kind for r in fn.partitioning.regions] == ["device"]
    assert fn.partitioning.device_share == 1.0


def test_calling_without_ttnn_says_what_is_missing(monkeypatch):
    _, args, _, fn = _compile("mlp")  # compiling needs no ttnn
    previous = runtime.use(None)
    monkeypatch.setattr(runtime, "MODULE_NAME", "ttnn_is_not_installed_in_this_test")
    try:
        with pytest.raises(TtnnUnavailable, match=r"not installed.*Python 3\.10.*Tenstorrent device"):
            fn(*args)
    finally:
        runtime.use(previous)


class SizeScaled(torch.nn.Module):
    """Seed 001: x.shape[0] used as a tensor (aten.mul.Tensor(x, sym_size_int))."""

    def forward(self, x):
        return torch.relu(x * x.shape[0]) + 1.0


def test_symint_in_tensor_slot_never_reaches_ttnn(ttnn_impl):
    program = rt.export(SizeScaled(), torch.randn(4, 8), dynamic_shapes=[{0: Dim("batch", min=2, max=64)}])
    assert sym_in_tensor_slots(program.graph_module), "the export no longer has the SymInt in a tensor slot"
    with pytest.raises(TtnnLoweringError, match=r"SymInt is in a tensor slot.*apply the backend's rules first"):
        backends.get("ttnn").compile(program, (torch.randn(4, 8),))  # compile itself rewrites nothing
    fn = backends.get("ttnn").compile(lower(program), (torch.randn(4, 8),))
    assert sym_in_tensor_slots(fn.graph_module) == []
    for region in fn.partitioning.regions:
        assert sym_in_tensor_slots(fn.graph_module.get_submodule(region.name)) == [], region.name
    assert fn.partitioning.device_regions, "relu and + 1.0 take symbolic batch sizes on ttnn"
    for batch in (4, 7):
        x = torch.randn(batch, 8)
        assert_close_bf16(fn(x), SizeScaled()(x))


def test_compile_refuses_what_is_not_a_program():
    with pytest.raises(TypeError, match=r"ExportedProgram or a torch\.fx\.GraphModule"):
        backends.get("ttnn").compile(torch.nn.ReLU(), ())


def test_rules_are_default_then_the_folds_then_ttnn():
    rules = backends.get("ttnn").rules
    assert [s.name for s in rules.sets] == ["default", "ttnn_fold", "ttnn"]
    assert "sym_scalar_in_tensor_slot" in rules.sets[0] and "ttnn_fold_batch_norm" in rules.sets[1]
    assert "ttnn_linear" in rules.sets[2] and "fuse_round_trip" in rules.sets[2]


class AdditiveMask(torch.nn.Module):
    """transformers' masks hold finfo(float32).min, which bfloat16 cannot hold: it would be -inf, and 0 * -inf NaN."""

    def forward(self, scores, bias):
        return torch.softmax(scores + bias, dim=-1) + bias * 0.0 + (1.0 - scores) * 0.5


def test_float32_extremes_stay_finite_in_bfloat16(ttnn_impl):
    scores = torch.randn(2, 8)
    bias = torch.where(torch.rand(2, 8) > 0.3, 0.0, torch.finfo(torch.float32).min)
    fn = backends.get("ttnn").compile(lower(rt.export(AdditiveMask(), scores, bias)), (scores, bias))
    assert fn.partitioning.device_share == 1.0
    got = fn(scores, bias)
    assert not got.isnan().any()
    assert_close_bf16(got, AdditiveMask()(scores, bias))


def test_a_graph_module_with_fake_values_compiles_too(ttnn_impl):
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        return torch.relu(x @ w) + 1.0

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    fn = backends.get("ttnn").compile(lower(make_fx(f, tracing_mode="fake")(x, w)), (x, w))
    assert fn.partitioning.device_share == 1.0 and fn.program is None
    assert_close_bf16(fn(x, w), f(x, w))


class _CountingDouble:
    """The double, counting what from_torch sends to the device."""

    def __init__(self):
        self.uploads: list[tuple[int, ...]] = []

    def __getattr__(self, name):
        return getattr(reference_ttnn, name)

    def from_torch(self, tensor, dtype=None, **kwargs):
        if kwargs.get("device") is not None:
            self.uploads.append(tuple(tensor.shape))
        return reference_ttnn.from_torch(tensor, dtype, **kwargs)


def test_weights_reach_the_device_once_per_compiled_function():
    model, args, _, fn = _compile("mlp")  # two linears and a layer_norm: 6 weights, 1 input
    counting = _CountingDouble()
    previous = runtime.use(counting)
    try:
        first = fn(*args)
        n_first = len(counting.uploads)
        again = fn(args[0] * 0.5)
        third = fn(*args)
    finally:
        runtime.use(previous)
    assert n_first == 7, counting.uploads  # 6 parameters + the input
    assert len(counting.uploads) == n_first + 2, counting.uploads[n_first:]  # only the input afterwards
    assert counting.uploads[n_first:] == [(3, 48), (3, 48)]
    torch.testing.assert_close(first, third)
    with torch.no_grad():
        assert_close_bf16(again, model(args[0] * 0.5))


def test_changed_weights_are_uploaded_again():
    _, args, program, fn = _compile("mlp")
    previous = runtime.use(reference_ttnn)
    try:
        before = fn(*args)
        with torch.no_grad():
            for p in program.state_dict.values():
                p.mul_(-1.0)  # in place: same tensors, new versions
            after = fn(*args)
            expected = program.module()(*args)
    finally:
        runtime.use(previous)
        with torch.no_grad():
            for p in program.state_dict.values():
                p.mul_(-1.0)
    assert not torch.allclose(before, after)
    assert_close_bf16(after, expected)
