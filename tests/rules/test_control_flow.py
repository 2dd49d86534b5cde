"""torch.cond, from real torch.export / make_fx graphs: constant predicates
are specialised, the others become aten.where over both branches."""

from __future__ import annotations

import io

import pytest
import torch
from torch.export import Dim
from torch.fx.experimental.proxy_tensor import make_fx

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.rules import control_flow
from fx_rewrites.rules.control_flow import RULES, cond, cond_constant_predicate, cond_to_where

aten = torch.ops.aten
DYN = {"x": {0: Dim("B", min=2, max=64)}}


class CondTensor(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))


class CondShape(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.shape[0] > 4, lambda x: x.sin(), lambda x: x.cos(), (x,))


class CondShapeAlwaysTrue(torch.nn.Module):
    def forward(self, x):  # with Dim(min=2), s > 1 holds for every allowed size
        return torch.cond(x.shape[0] > 1, lambda x: x.sin(), lambda x: x.cos(), (x,))


class CondConstantTensor(torch.nn.Module):
    def forward(self, x):
        return torch.cond(torch.tensor(False), lambda x: x.sin(), lambda x: x.cos(), (x,))


class CondNested(torch.nn.Module):
    def forward(self, x, y):
        def inner(x, y):
            return torch.cond(y.sum() > 0, lambda x, y: x + y, lambda x, y: x - y, (x, y))

        return torch.cond(x.sum() > 0, inner, lambda x, y: x * y, (x, y))


class CondNestedShape(torch.nn.Module):
    def forward(self, x, y):
        def inner(x, y):
            return torch.cond(y.sum() > 0, lambda x, y: x + y, lambda x, y: x - y, (x, y))

        return torch.cond(x.shape[0] > 4, inner, lambda x, y: x * y, (x, y))


class CondClosure(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))
        self.register_buffer("b", torch.randn(3))

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x * self.w, lambda x: x + self.b, (x,))


class CondTwoOutputs(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: (x.sin(), x.sum(0)), lambda x: (x.cos(), x.amax(0)), (x,))


class CondRandom(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x + torch.rand_like(x), lambda x: x.cos(), (x,))


def _x(sign: float = 1.0, rows: int = 6) -> torch.Tensor:
    return sign * (torch.rand(rows, 3) + 0.1)  # sum > 0 for sign 1, < 0 for sign -1


def _roundtrip(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buf = io.BytesIO()
    torch.export.save(program, buf)
    buf.seek(0)
    return torch.export.load(buf)


def _check_saved(result, module, inputs):
    loaded = _roundtrip(result.program)
    for args in inputs:
        torch.testing.assert_close(loaded.module()(*args), module(*args))


@pytest.mark.parametrize("route", ["export", "run_decompositions"])
def test_tensor_predicate_becomes_where(route):
    m = CondTensor()
    ep = rt.export(m, _x())
    if route == "run_decompositions":
        ep = ep.run_decompositions()  # cond survives R2
    rt.assert_ops(ep, present=[cond])

    result = rt.apply_rules(ep, RULES)

    rt.assert_fired(result, cond_to_where, times=1)
    rt.assert_ops(result, present=[aten.where.self, aten.sin.default, aten.cos.default], absent=[cond])
    (where,) = [n for n in result.graph_module.graph.nodes if n.target is aten.where.self]
    assert where.meta["rewrites"][-1]["rule"] == "cond_to_where"
    inputs = [(_x(),), (_x(-1),), (torch.randn(6, 3),)]  # true branch, false branch, either
    rt.assert_matches_eager(result, m, inputs)
    rt.assert_idempotent(result, RULES)
    _check_saved(result, m, inputs)
    assert not list(result.program.graph_module.named_children()), "the branch bodies should be gone"


@pytest.mark.parametrize("route", ["export", "run_decompositions"])
def test_symbolic_predicate_becomes_where_on_a_bool_tensor(route):
    m = CondShape()
    ep = rt.export(m, torch.randn(6, 3), dynamic_shapes=DYN)
    if route == "run_decompositions":
        ep = ep.run_decompositions()
    (c,) = [n for n in ep.graph.nodes if n.target is cond]
    assert isinstance(c.args[0].meta["val"], torch.SymBool)

    result = rt.apply_rules(ep, RULES)

    rt.assert_fired(result, cond_to_where, times=1)
    rt.assert_ops(result, present=[aten.scalar_tensor.default, aten.where.self], absent=[cond])
    (pred,) = [n for n in result.graph_module.graph.nodes if n.target is aten.scalar_tensor.default]
    assert pred.kwargs["dtype"] is torch.bool and pred.meta["val"].dim() == 0
    inputs = [(torch.randn(6, 3),), (torch.randn(3, 3),), (torch.randn(5, 3),), (torch.randn(4, 3),)]
    rt.assert_matches_eager(result, m, inputs)
    rt.assert_idempotent(result, RULES)
    _check_saved(result, m, inputs)


def test_predicate_the_shape_ranges_decide_is_specialised_with_a_note():
    m = CondShapeAlwaysTrue()
    ep = rt.export(m, torch.randn(6, 3), dynamic_shapes=DYN)
    rt.assert_ops(ep, present=[cond])  # export keeps it: s77 > 1 is not folded

    result = rt.apply_rules(ep, RULES)

    rt.assert_fired(result, cond_constant_predicate, times=1)
    rt.assert_not_fired(result, cond_to_where)
    rt.assert_ops(result, present=[aten.sin.default], absent=[cond, aten.cos.default, aten.where.self])
    (note,) = result.report.notes
    assert "specialised to its true branch" in note and "holds for every allowed shape" in note
    assert "specialised" in result.report.summary()
    inputs = [(torch.randn(6, 3),), (torch.randn(2, 3),), (torch.randn(40, 3),)]
    rt.assert_matches_eager(result, m, inputs)
    rt.assert_idempotent(result, RULES)
    _check_saved(result, m, inputs)


def test_constant_tensor_predicate_is_specialised():
    m = CondConstantTensor()
    ep = rt.export(m, _x())  # torch.tensor(False) is a lifted constant placeholder
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, cond_constant_predicate, times=1)
    rt.assert_ops(result, present=[aten.cos.default], absent=[cond, aten.sin.default])
    assert "false branch" in result.report.notes[0] and "constant tensor" in result.report.notes[0]
    inputs = [(_x(),), (_x(-1),)]
    rt.assert_matches_eager(result, m, inputs)
    rt.assert_idempotent(result, RULES)
    _check_saved(result, m, inputs)


def test_constant_tensor_predicate_in_make_fx_graph():
    m = CondConstantTensor()
    gm = make_fx(m, tracing_mode="symbolic")(_x())  # the constant is a get_attr here
    result = fx_rewrites.apply(gm, RULES)
    rt.assert_fired(result, cond_constant_predicate, times=1)
    rt.assert_ops(result, absent=[cond, aten.sin.default])
    rt.assert_matches_eager(result, m, [(_x(),), (_x(-1, rows=4),)])


@pytest.mark.parametrize("value", [True, False])
def test_python_bool_predicate_is_specialised(value):
    # every route folds torch.cond(True, ...) itself; build the form by hand
    m = CondTensor()
    ep = rt.export(m, _x())
    (c,) = [n for n in ep.graph.nodes if n.target is cond]
    c.args = (value, *c.args[1:])
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, cond_constant_predicate, times=1)
    kept, gone = (aten.sin.default, aten.cos.default) if value else (aten.cos.default, aten.sin.default)
    rt.assert_ops(result, present=[kept], absent=[cond, gone])
    x = torch.randn(6, 3)
    torch.testing.assert_close(result.program.module()(x), x.sin() if value else x.cos())


NESTED_INPUTS = [(_x(s), _x(t)) for s in (1, -1) for t in (1, -1)]  # every branch pair


@pytest.mark.parametrize("route", ["export", "run_decompositions"])
def test_nested_cond_is_inlined_inside_out(route):
    m = CondNested()
    ep = rt.export(m, _x(), _x())
    if route == "run_decompositions":
        ep = ep.run_decompositions()
    inner = ep.graph_module.true_graph_0
    assert any(n.target is cond for n in inner.graph.nodes), "the inner cond should sit in the true branch"

    result = rt.apply_rules(ep, RULES)

    rt.assert_fired(result, cond_to_where, times=2)  # the outer, then the inner it brought out
    rt.assert_ops(result, present=[aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor], absent=[cond])
    assert rt.targets(result).count(aten.where.self) == 2
    rt.assert_matches_eager(result, m, NESTED_INPUTS)
    rt.assert_idempotent(result, RULES)
    _check_saved(result, m, NESTED_INPUTS)
    assert not list(result.graph_module.named_children())


def test_nested_cond_in_symbolic_make_fx_graph():
    # make_fx threads SymInts into the cond operands and branch placeholders
    m = CondNestedShape()
    gm = make_fx(m, tracing_mode="symbolic")(_x(), _x())
    (c,) = [n for n in gm.graph.nodes if n.target is cond]
    assert any(isinstance(a.meta["val"], torch.SymInt) for a in c.args[3])

    result = fx_rewrites.apply(gm, RULES)

    rt.assert_fired(result, cond_to_where, times=2)
    rt.assert_ops(result, present=[aten.scalar_tensor.default], absent=[cond])
    # nothing dead left for importers that walk every child module
    assert not list(result.graph_module.named_children())
    inputs = [*NESTED_INPUTS, (_x(rows=3), _x(-1, rows=3)), (_x(rows=3), _x(rows=3))]
    rt.assert_matches_eager(result, m, inputs)
    rt.assert_idempotent(result, RULES)


def test_branches_closing_over_parameter_and_buffer():
    torch.manual_seed(0)
    m = CondClosure().eval()
    ep = rt.export(m, _x())
    (c,) = [n for n in ep.graph.nodes if n.target is cond]
    assert len(c.args[3]) == 3  # x, p_w, b_b are lifted into the operands
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, cond_to_where, times=1)
    inputs = [(_x(),), (_x(-1),)]
    rt.assert_matches_eager(result, m, inputs)
    _check_saved(result, m, inputs)


def test_several_outputs_each_get_a_where():
    m = CondTwoOutputs()
    ep = rt.export(m, _x())
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, cond_to_where, times=1)
    assert rt.targets(result).count(aten.where.self) == 2
    rt.assert_matches_eager(result, m, [(_x(),), (_x(-1),)])


def test_branch_with_side_effects_is_left_alone():
    ep = rt.export(CondRandom(), _x())
    result = rt.apply_rules(ep, RULES, explain=True)
    rt.assert_not_fired(result, cond_to_where)
    rt.assert_ops(result, present=[cond])
    (attempt,) = result.report.explain("cond_to_where")
    assert "side effects" in attempt.reason and "rand_like" in attempt.reason


def test_rules_are_documented():
    for r in RULES:
        assert r.doc and "Higher-order operation 'cond' not implemented" in r.doc
        assert "cond" in r.tags
    assert control_flow.RULES.name == "control_flow"


# -- end to end on IREE ---------------------------------------------------------------


def _iree():
    from fx_rewrites import backends

    try:
        return backends.get("iree")
    except backends.UnknownBackend:
        pytest.skip("no IREE backend registered")


@pytest.mark.slow
def test_nested_symbolic_cond_compiles_and_runs_on_iree():
    backend = _iree()
    m = CondNestedShape()
    batch = Dim("B", min=2, max=64)
    ep = rt.export(m, _x(), _x(), dynamic_shapes={"x": {0: batch}, "y": {0: batch}})
    result = fx_rewrites.apply(ep, backend.rules)
    rt.assert_ops(result, absent=[cond])
    compiled = backend.compile(result.program, (_x(), _x()))
    for args in [*NESTED_INPUTS, (_x(rows=3), _x(rows=3)), (_x(-1, rows=3), _x(rows=3))]:
        torch.testing.assert_close(compiled(*args), m(*args), rtol=1e-4, atol=1e-5)
