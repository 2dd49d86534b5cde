"""Training-IR wrappers, from real torch.export graphs (R1, R2) and
pre-dispatch make_fx graphs (raw _set_grad_enabled / _enter_autocast)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch.export import Dim
from torch.fx.experimental.proxy_tensor import make_fx

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.rules import control_flow, inplace, wrappers
from fx_rewrites.rules.wrappers import (
    RULES,
    autocast_region,
    drop_assert_tensor_metadata,
    drop_set_grad_enabled,
    enter_autocast,
    exit_autocast,
    inline_autocast,
    inline_set_grad_enabled,
    set_grad_enabled,
    wrap_with_autocast,
    wrap_with_set_grad_enabled,
)

aten = torch.ops.aten
WRAPPER_OPS = [wrap_with_set_grad_enabled, wrap_with_autocast, enter_autocast, exit_autocast, set_grad_enabled]
BF16 = {"rtol": 1.6e-2, "atol": 1e-2}  # bf16 has 8 bits of mantissa


class NoGradLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)

    def forward(self, x):
        with torch.no_grad():
            y = self.lin(x)
        return y.sin()


class MutateUnderNoGrad(torch.nn.Module):
    """Seed 003: a tensor made outside a no_grad block is mutated inside it."""

    def forward(self, x):
        y = x * 2
        with torch.no_grad():
            y.add_(1)
            z = y * 3
        return y + z


class RunningAverage(torch.nn.Module):
    """A buffer updated in place under no_grad (an EMA)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("avg", torch.zeros(3))

    def forward(self, x):
        with torch.no_grad():
            self.avg.mul_(0.9).add_(x.mean(0) * 0.1)
        return x - self.avg


class AutocastLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x)
        return y.float() + 1


class AutocastMatmul(torch.nn.Module):
    def forward(self, x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ w
        return y.float() + 1


class NoGradAutocastNested(torch.nn.Module):
    """no_grad around autocast around a block that turns autocast off."""

    def forward(self, x, w):
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = x @ w
                with torch.autocast("cpu", enabled=False):
                    z = x @ w
            out = y.float() * 2 + z
        return out


class ToHalf(torch.nn.Module):
    def forward(self, x):
        return x.to(torch.float16) + 1


def _roundtrip(program):
    buf = io.BytesIO()
    torch.export.save(program, buf)
    buf.seek(0)
    return torch.export.load(buf)


def _inputs(*shapes, n=3):
    gen = torch.Generator().manual_seed(1)
    return [tuple(torch.randn(*s, generator=gen) * (i + 1) for s in shapes) for i in range(n)]


def _vals(result, op):
    return [n.meta["val"] for n in result.graph_module.graph.nodes if n.target is op]


# -- wrap_with_set_grad_enabled -----------------------------------------------------


def test_no_grad_block_is_inlined():
    torch.manual_seed(0)
    m = NoGradLinear().eval()
    ep = rt.export(m, torch.randn(2, 3))
    rt.assert_ops(ep, present=[wrap_with_set_grad_enabled])

    result = rt.apply_rules(ep, RULES)

    rt.assert_fired(result, inline_set_grad_enabled, times=1)
    rt.assert_ops(result, present=[aten.linear.default], absent=WRAPPER_OPS)
    (linear,) = [n for n in result.graph_module.graph.nodes if n.target is aten.linear.default]
    assert linear.meta["rewrites"][-1]["rule"] == "inline_set_grad_enabled"
    inputs = _inputs((2, 3))
    rt.assert_matches_eager(result, m, inputs)
    rt.assert_idempotent(result, RULES)
    loaded = _roundtrip(result.program)
    torch.testing.assert_close(loaded.module()(*inputs[0]), m(*inputs[0]))
    assert not list(result.program.graph_module.named_children()), "the body should be gone"


def test_seed003_mutation_under_no_grad_stays_on_the_outer_value():
    m = MutateUnderNoGrad()
    ep = rt.export(m, torch.randn(2, 3))
    (hop,) = [n for n in ep.graph.nodes if n.target is wrap_with_set_grad_enabled]
    body = getattr(ep.graph_module, hop.args[1].target)
    assert any(n.target is aten.add_.Tensor for n in body.graph.nodes), "the body mutates its placeholder"

    result = rt.apply_rules(ep, RULES)

    rt.assert_fired(result, inline_set_grad_enabled, times=1)
    rt.assert_ops(result, absent=WRAPPER_OPS)
    (add_,) = [n for n in result.graph_module.graph.nodes if n.target is aten.add_.Tensor]
    mul = add_.args[0]
    assert mul.op == "call_function" and mul.target is aten.mul.Tensor  # the outer y = x * 2
    assert all(add_ < u for u in mul.users if u is not add_)  # later reads see the update
    inputs = _inputs((2, 3))
    rt.assert_matches_eager(result, m, inputs)
    rt.assert_idempotent(result, RULES)
    loaded = _roundtrip(result.program)
    torch.testing.assert_close(loaded.module()(*inputs[1]), m(*inputs[1]))


def test_seed003_then_the_inplace_pack_makes_it_functional():
    m = MutateUnderNoGrad()
    ep = rt.export(m, torch.randn(2, 3))
    result = rt.apply_rules(ep, RULES, inplace.RULES)
    rt.assert_fired(result, inline_set_grad_enabled, times=1)
    rt.assert_ops(result, absent=[*WRAPPER_OPS, aten.add_.Tensor])
    rt.assert_matches_eager(result, m, _inputs((2, 3)))


def test_seed003_pre_dispatch_make_fx():
    m = MutateUnderNoGrad()
    x = torch.randn(2, 3)
    gm = make_fx(m, pre_dispatch=True)(x)
    assert rt.targets(gm).count(set_grad_enabled) == 2

    result = fx_rewrites.apply(gm, RULES, example_inputs=(x,))

    rt.assert_fired(result, drop_set_grad_enabled, times=2)
    rt.assert_ops(result, present=[aten.add_.Tensor], absent=WRAPPER_OPS)
    rt.assert_matches_eager(result, m, _inputs((2, 3)))
    rt.assert_idempotent(result, RULES)


def test_buffer_updated_under_no_grad_keeps_its_state():
    ep = rt.export(RunningAverage(), torch.randn(4, 3))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, inline_set_grad_enabled, times=1)
    rt.assert_ops(result, present=[aten.mul_.Tensor, aten.add_.Tensor], absent=WRAPPER_OPS)
    eager, rewritten = RunningAverage(), result.program.module()
    for (x,) in _inputs((4, 3)):
        torch.testing.assert_close(rewritten(x), eager(x))
    torch.testing.assert_close(rewritten.avg, eager.avg)


# -- wrap_with_autocast -------------------------------------------------------------


def test_autocast_body_is_retraced_with_its_casts():
    torch.manual_seed(0)
    m = AutocastLinear().eval()
    ep = rt.export(m, torch.randn(2, 3))
    (hop,) = [n for n in ep.graph.nodes if n.target is wrap_with_autocast]
    body = getattr(ep.graph_module, hop.args[4].target)
    assert not any(n.target is aten._to_copy.default for n in body.graph.nodes), "the body has no casts"

    result = rt.apply_rules(ep, RULES)

    rt.assert_fired(result, inline_autocast, times=1)
    rt.assert_fired(result, drop_assert_tensor_metadata, times=1)
    rt.assert_ops(result, present=[aten._to_copy.default], absent=[*WRAPPER_OPS, aten._assert_tensor_metadata.default])
    assert {v.dtype for v in _vals(result, aten._to_copy.default)} == {torch.bfloat16}
    assert [v.dtype for v in _vals(result, aten.addmm.default)] == [torch.bfloat16]  # computed in bf16, as eager
    inputs = _inputs((2, 3))
    rt.assert_matches_eager(result, m, inputs, **BF16)
    rt.assert_idempotent(result, RULES)
    loaded = _roundtrip(result.program)
    torch.testing.assert_close(loaded.module()(*inputs[0]), m(*inputs[0]), **BF16)


def test_autocast_with_dynamic_batch():
    m = AutocastMatmul()
    ep = rt.export(m, torch.randn(4, 3), torch.randn(3, 3), dynamic_shapes=({0: Dim("B", min=2, max=64)}, None))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, inline_autocast, times=1)
    rt.assert_ops(result, absent=WRAPPER_OPS)
    (mm,) = _vals(result, aten.mm.default)
    assert mm.dtype is torch.bfloat16 and isinstance(mm.shape[0], torch.SymInt)
    inputs = [(torch.randn(b, 3), torch.randn(3, 3)) for b in (2, 4, 9)]
    rt.assert_matches_eager(result, m, inputs, **BF16)
    rt.assert_idempotent(result, RULES)


def test_autocast_after_run_decompositions_leaves_only_the_assert():
    m = AutocastMatmul()
    ep = rt.export(m, torch.randn(2, 3), torch.randn(3, 3)).run_decompositions()  # R2 inlines the wrapper
    rt.assert_ops(ep, present=[aten._assert_tensor_metadata.default], absent=[wrap_with_autocast])
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, drop_assert_tensor_metadata, times=1)
    rt.assert_not_fired(result, inline_autocast)
    rt.assert_ops(result, absent=[aten._assert_tensor_metadata.default])
    rt.assert_matches_eager(result, m, _inputs((2, 3), (3, 3)), **BF16)
    rt.assert_idempotent(result, RULES)
    _roundtrip(result.program)


def test_nested_no_grad_and_autocast_regions():
    m = NoGradAutocastNested()
    ep = rt.export(m, torch.randn(2, 3), torch.randn(3, 3))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, inline_set_grad_enabled)
    rt.assert_fired(result, inline_autocast)
    rt.assert_ops(result, absent=[*WRAPPER_OPS, aten._assert_tensor_metadata.default])
    assert sorted(str(v.dtype) for v in _vals(result, aten.mm.default)) == ["torch.bfloat16", "torch.float32"]
    inputs = _inputs((2, 3), (3, 3))
    rt.assert_matches_eager(result, m, inputs, **BF16)
    rt.assert_idempotent(result, RULES)
    _roundtrip(result.program)


# -- pre-dispatch make_fx: raw calls -------------------------------------------------------


@pytest.mark.parametrize("module", [AutocastMatmul, NoGradAutocastNested])
def test_pre_dispatch_autocast_region_is_retraced(module):
    m = module()
    x, w = torch.randn(2, 3), torch.randn(3, 3)
    gm = make_fx(m, pre_dispatch=True)(x, w)
    assert enter_autocast in rt.targets(gm) and aten._to_copy.default not in rt.targets(gm)

    result = fx_rewrites.apply(gm, RULES, example_inputs=(x, w), explain=True)

    rt.assert_fired(result, autocast_region, times=1)  # the outer region, nested ones with it
    rt.assert_ops(result, present=[aten._to_copy.default], absent=WRAPPER_OPS)
    rt.assert_matches_eager(result, m, _inputs((2, 3), (3, 3)), **BF16)
    rt.assert_idempotent(result, RULES)
    if module is NoGradAutocastNested:
        inner = [a for a in result.report.explain("autocast_region") if not a.fired]
        assert inner and "nested in an outer autocast region" in inner[0].reason


# -- _assert_tensor_metadata --------------------------------------------------------


@pytest.mark.parametrize("route", ["export", "run_decompositions"])
def test_assert_tensor_metadata_is_dropped(route):
    m = ToHalf()
    ep = rt.export(m, torch.randn(2, 3))
    if route == "run_decompositions":
        ep = ep.run_decompositions()
    rt.assert_ops(ep, present=[aten._assert_tensor_metadata.default])
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, drop_assert_tensor_metadata, times=1)
    rt.assert_ops(result, absent=[aten._assert_tensor_metadata.default])
    rt.assert_matches_eager(result, m, _inputs((2, 3)))
    rt.assert_idempotent(result, RULES)


def test_rules_are_documented():
    assert wrappers.RULES.name == "wrappers"
    for r in RULES:
        assert r.doc and r.tags and "wrappers" in r.tags
    assert "'wrap_with_set_grad_enabled' not implemented in the FxImporter" in inline_set_grad_enabled.doc
    assert "'wrap_with_autocast' not implemented in the FxImporter" in inline_autocast.doc


# -- end to end on IREE ---------------------------------------------------------------


class NoGradThenAutocast(torch.nn.Module):
    def forward(self, x, w):
        y = x * 2
        with torch.no_grad():
            y.add_(1)  # seed 003
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = y @ w
        return h.float(), y.sin()  # apart: a sum could cancel down to bf16 noise


@pytest.mark.slow
def test_wrappers_compile_and_run_on_iree():
    from fx_rewrites import backends

    try:
        backend = backends.get("iree")
    except backends.UnknownBackend:
        pytest.skip("no IREE backend registered")
    m = NoGradThenAutocast()
    ep = rt.export(m, torch.randn(2, 3), torch.randn(3, 3))
    result = fx_rewrites.apply(ep, backend.rules)  # the in-place pack makes add_ functional
    rt.assert_ops(result, absent=[*WRAPPER_OPS, aten.add_.Tensor, aten._assert_tensor_metadata.default])
    compiled = backend.compile(result.program, (torch.randn(2, 3), torch.randn(3, 3)))
    for x, w in _inputs((2, 3), (3, 3)):
        torch.testing.assert_close(compiled(x.clone(), w), m(x.clone(), w), **BF16)


class CondUnderAutocast(torch.nn.Module):
    def forward(self, x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.cond(x.sum() > 0, lambda x, w: x @ w, lambda x, w: (x @ w) * 2, (x, w))
        return y.float()


def test_cond_under_autocast_exports_raw_calls_and_is_retraced():
    # torch.export keeps _enter/_exit_autocast calls (no wrapper) around a cond;
    # its branches carry no casts, so the cond alone cannot be inlined
    m = CondUnderAutocast()
    ep = rt.export(m, torch.randn(2, 3), torch.randn(3, 3))
    rt.assert_ops(ep, present=[enter_autocast, exit_autocast, control_flow.cond], absent=[wrap_with_autocast])

    result = rt.apply_rules(ep, RULES, control_flow.RULES, explain=True)

    rt.assert_fired(result, autocast_region, times=1)
    rt.assert_fired(result, control_flow.cond_to_where, times=1)  # on the re-traced cond
    declined = [a for a in result.report.explain("cond_to_where") if not a.fired]
    assert declined and "the body ran under a mode the graph does not record" in declined[0].reason
    rt.assert_ops(result, present=[aten._to_copy.default], absent=[*WRAPPER_OPS, control_flow.cond])
    inputs = [(x.abs(), w) for x, w in _inputs((2, 3), (3, 3))] + [(-x.abs(), w) for x, w in _inputs((2, 3), (3, 3))]
    rt.assert_matches_eager(result, m, inputs, **BF16)
    rt.assert_idempotent(result, RULES, control_flow.RULES)
    _roundtrip(result.program)


# -- issue 12: a no_grad block that writes into parameters (RWKV exported without no_grad) --------------


class RescaleWeights(torch.nn.Module):
    """What transformers' RWKV does in eval mode (`_rescale_layers`): parameters divided in place under
    no_grad, inside forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 4)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.div_(2)
        return self.lin(x)


def _rescale_calls(fn, inputs):
    """Outputs of successive calls (each call rescales the weights again)."""
    return [fn(*args) for args in inputs]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_no_grad_block_writing_a_parameter(dynamic):
    inputs = _inputs((2, 3)) if not dynamic else [*_inputs((2, 3), n=1), *_inputs((5, 3), n=1)]
    ep = rt.export(RescaleWeights(), *inputs[0], dynamic_shapes=({0: Dim("b")},) if dynamic else None)
    # before: inlining computed the body's values with grad enabled and raised "a leaf Variable that
    # requires grad is being used in an in-place operation"
    result = fx_rewrites.apply(ep, fx_rewrites.rules.DEFAULT)
    rt.assert_fired(result, inline_set_grad_enabled, times=1)
    rt.assert_fired(result, inplace.functionalize_inplace, times=1)
    rt.assert_ops(result, absent=[*WRAPPER_OPS, aten.div_.Tensor])
    specs = [(s.kind.name, s.target) for s in result.program.graph_signature.output_specs]
    assert specs == [("PARAMETER_MUTATION", "lin.weight"), ("USER_OUTPUT", None)]
    with torch.no_grad():  # the unlifted module copies the new weight into the parameter (torch's, as after
        got = _rescale_calls(result.program.module(), inputs)  # run_decompositions)
    torch.testing.assert_close(got, _rescale_calls(RescaleWeights(), inputs))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_no_grad_block_writing_a_parameter_on_iree(dynamic):
    from fx_rewrites import backends
    from fx_rewrites.engine import RewriteError

    iree = backends.get("iree")
    inputs = _inputs((2, 3)) if not dynamic else [*_inputs((2, 3), n=1), *_inputs((5, 3), n=1)]
    ep = rt.export(RescaleWeights(), *inputs[0], dynamic_shapes=({0: Dim("b")},) if dynamic else None)
    with pytest.raises(RewriteError):
        iree.compile(ep, inputs[0])  # the wrapper HOP has no importer
    fn = iree.compile(fx_rewrites.apply(ep, iree.rules).program, inputs[0])
    torch.testing.assert_close(_rescale_calls(fn, inputs), _rescale_calls(RescaleWeights(), inputs))


@pytest.mark.slow
def test_rwkv_exported_without_no_grad_on_iree():
    transformers = pytest.importorskip("transformers")
    from fx_rewrites import backends

    config = transformers.RwkvConfig(
        vocab_size=64,
        context_length=16,
        hidden_size=32,
        num_hidden_layers=2,
        attention_hidden_size=32,
        intermediate_size=64,
    )  # rescale_every=6: with 2 layers the in-place rescale divides by 1, so every call computes the same
    # (the exported program rescales on each call, eager once: export records the branch its flag took)
    torch.manual_seed(0)
    model = transformers.RwkvForCausalLM(config).eval()
    state = copy.deepcopy(model.state_dict())
    ids = [torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    ep = torch.export.export(model, (ids[0],), {"use_cache": False})
    assert wrap_with_set_grad_enabled in rt.targets(ep)
    iree = backends.get("iree")
    result = fx_rewrites.apply(ep, iree.rules)
    rt.assert_fired(result, inline_set_grad_enabled, times=1)
    model.load_state_dict(state)
    fn = iree.compile(result.program, (ids[0],))
    for x in ids:
        torch.testing.assert_close(
            fn(x, use_cache=False).logits, model(x, use_cache=False).logits, rtol=1e-4, atol=1e-5
        )
