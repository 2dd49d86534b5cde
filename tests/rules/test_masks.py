"""Boolean-mask indexing, masked_select and masked assignment, from real
torch.export (R1), run_decompositions (R2) and aot_autograd (R3) graphs."""

from __future__ import annotations

import io

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch.export import Dim

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.rules.masks import RULES, mask_index_put_to_where, mask_index_to_gather, masked_select_to_gather
from fx_rewrites.rules.symbolic import RULES as SYMBOLIC
from fx_rewrites.symbolic_sizes import sym_in_tensor_slots

aten = torch.ops.aten


def _roundtrip(program):
    buf = io.BytesIO()
    torch.export.save(program, buf)
    buf.seek(0)
    return torch.export.load(buf)


def _bool_index_nodes(obj):
    return [
        n
        for n in rt.graph_module(obj).graph.nodes
        if n.target is aten.index.Tensor
        and any(isinstance(i, torch.fx.Node) and i.meta["val"].dtype == torch.bool for i in n.args[1] if i is not None)
    ]


def _mask_variants(make, mask_of):
    """Inputs whose mask is partly, never and always True."""
    args = make()
    out = [args]
    for fill in (False, True):
        a = [t.clone() for t in args]
        if mask_of is None:  # the mask is x > 0 of the first input
            a[0] = a[0].abs() + 0.1 if fill else -a[0].abs() - 0.1
        else:
            a[mask_of] = torch.full_like(a[mask_of], fill)
        out.append(tuple(a))
    return out


def _x(*shape):
    return torch.randn(*shape)


# name: (function, make inputs, index of an explicit mask input or None for x > 0, rule)
GATHER_CASES = {
    "rank1": (lambda x: x[x > 0], lambda: (_x(7),), None, mask_index_to_gather),
    "rank2": (lambda x: x[x > 0], lambda: (_x(4, 3),), None, mask_index_to_gather),
    "rows_of_2d": (
        lambda x, m: x[m],
        lambda: (_x(4, 3), torch.tensor([True, False, True, True])),
        1,
        mask_index_to_gather,
    ),
    "rank2_over_3d": (lambda x: x[x[..., 0] > 0], lambda: (_x(3, 4, 2),), None, mask_index_to_gather),
    "columns": (lambda x, m: x[:, m], lambda: (_x(4, 3), torch.tensor([True, False, True])), 1, mask_index_to_gather),
    "non_contiguous": (lambda x: x.t()[x.t() > 0], lambda: (_x(3, 4),), None, mask_index_to_gather),
    "masked_select": (lambda x: torch.masked_select(x, x > 0), lambda: (_x(4, 3),), None, masked_select_to_gather),
    "masked_select_broadcast": (
        lambda x, m: torch.masked_select(x, m),
        lambda: (_x(4, 3), torch.tensor([True, False, True])),
        1,
        masked_select_to_gather,
    ),
}


#: R2 keeps the same op forms as R1 (run_decompositions leaves index.Tensor alone); a few cases suffice
ROUTES = [(name, "R1") for name in GATHER_CASES] + [
    (name, "R2") for name in ("rank1", "rank2_over_3d", "masked_select")
]


@pytest.mark.parametrize(("name", "route"), ROUTES)
def test_mask_gather(name, route):
    fn, make, mask_of, rule = GATHER_CASES[name]
    ep = rt.export(fn, *make())
    if route == "R2":
        ep = ep.run_decompositions()
    assert _bool_index_nodes(ep) or aten.masked_select.default in rt.targets(ep), ep.graph
    old_guards = [(n.name, n.args[1]) for n in ep.graph.nodes if n.target is aten._assert_scalar.default]

    result = rt.apply_rules(ep, RULES)

    rt.assert_fired(result, rule, times=1)
    assert not _bool_index_nodes(result)
    rt.assert_ops(
        result, present=[aten.nonzero.default, aten.index_select.default], absent=[aten.masked_select.default]
    )
    # the size checks still read the gathered value, and its size is still the program's u0
    graph = result.graph_module.graph
    guards = [n for n in graph.nodes if n.target is aten._assert_scalar.default]
    assert [(n.name, n.args[1]) for n in guards] == old_guards
    (size,) = [
        n for n in graph.nodes if n.target is aten.sym_size.int and n.args[0].target is aten.index_select.default
    ]
    (nonzero,) = [n for n in graph.nodes if n.target is aten.nonzero.default]
    assert set(nonzero.meta["unbacked_bindings"]) == {size.meta["val"].node.expr}
    assert {str(s) for s in result.program.range_constraints} == {str(s) for s in ep.range_constraints}

    inputs = _mask_variants(make, mask_of)
    rt.assert_matches_eager(result, fn, inputs)
    rt.assert_idempotent(result, RULES)
    if route == "R1":
        rt.assert_matches_eager(_roundtrip(result.program), fn, inputs)


def test_gather_with_dynamic_batch():
    fn = lambda x: x[x[..., 0] > 0] * 2
    ep = rt.export(fn, _x(4, 3, 2), dynamic_shapes=({0: Dim("B", min=2, max=64), 1: Dim("C", min=2, max=8)},))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, mask_index_to_gather, times=1)
    (view,) = [n for n in result.graph_module.graph.nodes if n.target is aten.view.default and n.args[1] == [-1, 2]]
    rt.assert_matches_eager(result, fn, [(_x(b, c, 2),) for b, c in [(2, 2), (5, 3), (9, 7)]])
    rt.assert_matches_eager(_roundtrip(result.program), fn, [(_x(6, 5, 2),)])
    assert view.args[0].op == "placeholder"


def test_masked_select_broadcast_with_dynamic_batch():
    # the [3] mask is expanded to x's [B, 3] through a sym_size node
    fn = lambda x, m: torch.masked_select(x, m)
    m = torch.tensor([True, False, True])
    ep = rt.export(fn, _x(4, 3), m, dynamic_shapes=({0: Dim("B", min=2, max=64)}, None))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, masked_select_to_gather, times=1)
    (expand,) = [n for n in result.graph_module.graph.nodes if n.target is aten.expand.default]
    assert expand.args[1][0].target is aten.sym_size.int
    rt.assert_matches_eager(result, fn, [(_x(b, 3), m) for b in (2, 5, 9)])


def test_gathered_size_feeds_symint_users():
    # y * y.shape[0] reads the unbacked size through sym_size on the replaced node
    fn = lambda x: (lambda y: y * y.shape[0])(x[x > 0])
    ep = rt.export(fn, _x(4, 3))
    result = rt.apply_rules(ep, RULES | SYMBOLIC)
    rt.assert_fired(result, mask_index_to_gather, times=1)
    rt.assert_fired(result, "sym_scalar_in_tensor_slot", times=1)
    assert sym_in_tensor_slots(result.graph_module) == []
    rt.assert_matches_eager(result, fn, _mask_variants(lambda: (_x(4, 3),), None))
    rt.assert_matches_eager(_roundtrip(result.program), fn, [(_x(4, 3),)])


def test_integer_index_is_a_near_miss():
    # (a bool mask mixed with integer indices, x[m, i], or a 0-d bool index do not export in 2.13)
    fn = lambda x, i: x[i]
    args = (_x(4, 3), torch.tensor([0, 2]))
    result = rt.apply_rules(rt.export(fn, *args), RULES, explain=True)
    rt.assert_not_fired(result, mask_index_to_gather)
    (attempt,) = result.report.explain("mask_index_to_gather")
    assert attempt.reason == "no index is a bool tensor"


# -- masked assignment --------------------------------------------------------------


def _assign(x, v):
    x = x.clone()
    x[x > 0] = v
    return x


def _assign_const(x):
    y = x.clone()
    y[y > 0] = 0.5
    return y


def _assign_rows(x, m, v):
    x = x.clone()
    x[m] = v
    return x


ASSIGN_CASES = {
    "tensor_0d": (_assign, lambda: (_x(4, 3), torch.tensor(2.0)), None),
    "constant": (_assign_const, lambda: (_x(4, 3),), None),
    "rows_broadcast_row": (_assign_rows, lambda: (_x(4, 3), torch.tensor([True, False, True, True]), _x(3)), 1),
    "int64_0d_values": (_assign, lambda: (_x(4, 3), torch.tensor(2)), None),  # cast to x's dtype
    "accumulate": (
        lambda x, m, v: torch.index_put(x, (m,), v, accumulate=True),
        lambda: (_x(4, 3), torch.tensor([True, False, True, True]), _x(3)),
        1,
    ),
}


@pytest.mark.parametrize("name", list(ASSIGN_CASES))
def test_masked_assignment_to_where(name):
    fn, make, mask_of = ASSIGN_CASES[name]
    ep = rt.export(fn, *make()).run_decompositions()  # R2: functional index_put
    assert aten.index_put.default in rt.targets(ep)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, mask_index_put_to_where, times=1)
    rt.assert_ops(result, present=[aten.where.self], absent=[aten.index_put.default])
    inputs = _mask_variants(make, mask_of)
    rt.assert_matches_eager(result, fn, inputs)
    rt.assert_idempotent(result, RULES)
    rt.assert_matches_eager(_roundtrip(result.program), fn, inputs[:1])


def test_inplace_index_put_is_left_to_the_inplace_pack():
    ep = rt.export(_assign, _x(4, 3), torch.tensor(2.0))  # R1 keeps index_put_
    assert aten.index_put_.default in rt.targets(ep)
    result = rt.apply_rules(ep, RULES)
    assert result.report.total_rewrites == 0


def test_per_element_values_are_a_near_miss():
    # x[m] = v with v of shape [nnz]: which value goes where depends on the data
    fn = lambda x, m, v: torch.index_put(x, (m,), v)
    args = (_x(4), torch.tensor([True, False, True, False]), _x(2))
    result = rt.apply_rules(rt.export(fn, *args).run_decompositions(), RULES, explain=True)
    rt.assert_not_fired(result, mask_index_put_to_where)
    assert "vary per selected element" in result.report.explain("mask_index_put_to_where")[0].reason


# -- R3: torch.compile(dynamic=True) with capture_dynamic_output_shape_ops -------------


def _apply_r3(gm, rules):
    # R3 leaves `_assert_scalar` without meta["val"]; it returns nothing, so None is its value
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and "val" not in node.meta and schema is not None and not schema.returns:
            node.meta["val"] = None
    return fx_rewrites.apply(gm, rules)


def test_r3_masks():
    seen = []

    def fw_compiler(gm, example_inputs):
        result = _apply_r3(gm, RULES)
        seen.append(result)
        return result.graph_module.forward

    def fn(x, m, v):
        y = x.clone()
        y[y > 0] = v
        return x[x > 0] * 2, torch.masked_select(x, m), y

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=fw_compiler), dynamic=True)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        for rows in (4, 5, 7):
            x = _x(rows, 3)
            args = (x, x < 0.5, torch.tensor(2.0))
            torch.testing.assert_close(compiled(*args), fn(*args))
    (result,) = seen
    rt.assert_fired(result, mask_index_to_gather, times=1)
    rt.assert_fired(result, masked_select_to_gather, times=1)
    rt.assert_fired(result, mask_index_put_to_where, times=1)
    assert not _bool_index_nodes(result)
    rt.assert_idempotent(result, RULES)


# -- end to end on IREE ----------------------------------------------------------------


@pytest.mark.slow
def test_iree_end_to_end():
    # as is: rank-1 masks fail with "'arith.cmpi' op requires all operands to have the same type",
    # masked_select has no lowering, a rank-2 mask runs iree-compile out of memory after ~2 min
    from fx_rewrites import backends

    iree = backends.get("iree")

    def fn(x, m):
        y = x.clone()
        y[y < 0] = 0.5
        return x[m], x[x > 0], x[:, 0][m], torch.masked_select(x, x > 1), y

    args = (_x(4, 3), torch.tensor([True, False, True, True]))
    result = fx_rewrites.apply(rt.export(fn, *args), iree.rules)
    assert not _bool_index_nodes(result)
    rt.assert_ops(result, absent=[aten.masked_select.default, aten.index_put.default, aten.index_put_.default])
    compiled = iree.compile(result.program, args)
    for inputs in _mask_variants(lambda: args, 1) + [(_x(4, 3) * 3, torch.tensor([False, True, False, True]))]:
        for got, expected in zip(compiled(*inputs), fn(*inputs), strict=True):
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected)
