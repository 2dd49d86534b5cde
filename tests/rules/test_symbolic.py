"""SymInt/SymFloat/SymBool in Tensor slots, and pow with a SymInt exponent,
from real torch.export (R1), run_decompositions (R2) and aot_autograd (R3) graphs."""

from __future__ import annotations

import io
import operator

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch.export import Dim

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.rules.symbolic import (
    RULES,
    pow_sym_exponent_sign_safe,
    sym_arithmetic_constant,
    sym_scalar_in_tensor_slot,
)
from fx_rewrites.rules.symbolic import _scalar_overload as scalar_overload
from fx_rewrites.symbolic_sizes import sym_in_tensor_slots, sym_placeholder_sources

aten = torch.ops.aten
B = Dim("B", min=2, max=64)


def _export(fn, *args, route="R1", dynamic=True):
    ds = tuple({0: B} if isinstance(a, torch.Tensor) and a.dim() and i == 0 else None for i, a in enumerate(args))
    ep = rt.export(fn, *args, dynamic_shapes=ds if dynamic else None)
    return ep.run_decompositions() if route == "R2" else ep


def _roundtrip(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buf = io.BytesIO()
    torch.export.save(program, buf)
    buf.seek(0)
    return torch.export.load(buf)


def _rows(*sizes, scale=3.0):
    return [(torch.randn(s, 3) * scale,) for s in sizes]


# name: (function, route, op expected after the rewrite)
SLOT_CASES = {
    "mul_R1": (lambda x: x * x.shape[0], "R1", aten.mul.Scalar),
    "mul_R2": (lambda x: x * x.shape[0], "R2", aten.mul.Scalar),
    "add_R1": (lambda x: x + x.shape[0], "R1", aten.add.Scalar),
    "div_R2": (lambda x: x / x.shape[0], "R2", aten.div.Scalar),
    "floor_divide_R1": (lambda x: x // x.shape[0], "R1", aten.floor_divide.Scalar),
    "div_Tensor_mode_R2": (lambda x: x // x.shape[0], "R2", aten.div.Scalar_mode),
    "sub_slot0_R2": (lambda x: x.shape[0] - x, "R2", aten.scalar_tensor.default),
    "symfloat_R1": (lambda x: x * (x.shape[0] / 2), "R1", aten.mul.Scalar),
    "symbool_R2": (lambda x: x * (x.shape[0] > 3), "R2", aten.mul.Scalar),
}


@pytest.mark.parametrize("name", list(SLOT_CASES))
def test_sym_in_tensor_slot(name):
    fn, route, expected = SLOT_CASES[name]
    ep = _export(fn, torch.randn(4, 3), route=route)
    before = sym_in_tensor_slots(ep.graph)
    assert len(before) == 1, f"export of {name} should put one Sym value in a Tensor slot:\n{ep.graph}"

    result = rt.apply_rules(ep, RULES)

    rt.assert_fired(result, sym_scalar_in_tensor_slot, times=1)
    assert sym_in_tensor_slots(result.graph_module) == []
    rt.assert_ops(result, present=[expected])
    inputs = _rows(2, 4, 5, 9)
    rt.assert_matches_eager(result, fn, inputs)
    rt.assert_idempotent(result, RULES)
    rt.assert_matches_eager(_roundtrip(result.program), fn, inputs[:2])


def test_sub_slot0_wraps_with_int64_scalar_tensor():
    # R2 alone puts the SymInt in `self`; sub has no Scalar-self overload
    fn = lambda x: (x.shape[0] - x, x.shape[0] - (x * 10).int())
    ep = _export(fn, torch.randn(4, 3), route="R2")
    subs = [n for n in ep.graph.nodes if n.target is aten.sub.Tensor]
    assert len(subs) == 2 and all(isinstance(n.args[0].meta["val"], torch.SymInt) for n in subs)
    found = sym_in_tensor_slots(ep.graph)
    assert len(found) == 2 and all("aten.sub.Tensor argument 'self' (Tensor) gets SymInt" in f for f in found)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, sym_scalar_in_tensor_slot, times=2)
    for sub, dtype in zip(
        [n for n in result.graph_module.graph.nodes if n.target is aten.sub.Tensor], (torch.float32, torch.int32)
    ):
        wrap = sub.args[0]
        assert wrap.target is aten.scalar_tensor.default and wrap.kwargs["dtype"] == torch.int64
        assert wrap.args[0].target is aten.sym_size.int
        assert sub.meta["val"].dtype == dtype  # int32 - int64 0-d stays int32
    rt.assert_matches_eager(result, fn, _rows(2, 7))


def test_wrap_keeps_result_dtype_with_0d_operand():
    # float16 0-d minus a SymFloat: a float32 scalar_tensor would promote to float32
    fn = lambda x: (x.shape[0] / 2) - x.half().sum()
    ep = _export(fn, torch.randn(4, 3), route="R2")
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, sym_scalar_in_tensor_slot, times=1)
    (wrap,) = [n for n in result.graph_module.graph.nodes if n.target is aten.scalar_tensor.default]
    assert wrap.kwargs["dtype"] == torch.float16
    rt.assert_matches_eager(result, fn, _rows(3, 6), rtol=1e-3, atol=1e-2)


def test_item_value_and_guards_untouched():
    def fn(x, n):
        k = n.item()
        torch._check(k >= 0)
        torch._check(k < 10)
        return x * k

    for route in ("R1", "R2"):
        ep = _export(fn, torch.randn(4, 3), torch.tensor(3), route=route)
        guards = [n for n in ep.graph.nodes if n.target is aten._assert_scalar.default]
        assert guards
        result = rt.apply_rules(ep, RULES)
        rt.assert_fired(result, sym_scalar_in_tensor_slot, times=1)
        after = [n for n in result.graph_module.graph.nodes if n.target is aten._assert_scalar.default]
        assert [(n.name, n.args[1]) for n in after] == [(n.name, n.args[1]) for n in guards]
        assert sym_in_tensor_slots(result.graph_module) == []
        rt.assert_matches_eager(result, fn, [(torch.randn(5, 3), torch.tensor(k)) for k in (0, 3, 9)])


def test_scalar_overload_lookup_is_schema_driven():
    assert scalar_overload(aten.mul.Tensor, ["other"], {}) is aten.mul.Scalar
    assert scalar_overload(aten.add.Tensor, ["other"], {}) is aten.add.Scalar  # alpha kwarg-only vs positional
    assert scalar_overload(aten.pow.Tensor_Tensor, ["exponent"], {}) is aten.pow.Tensor_Scalar
    assert scalar_overload(aten.where.self, ["other"], {}) is aten.where.ScalarOther
    assert scalar_overload(aten.where.self, ["self", "other"], {}) is aten.where.Scalar
    assert scalar_overload(aten.clamp.Tensor, ["max"], {"min": None}) is aten.clamp.default
    assert scalar_overload(aten.remainder.Tensor, ["self"], {}) is aten.remainder.Scalar_Tensor
    assert scalar_overload(aten.sub.Tensor, ["self"], {}) is None
    assert scalar_overload(aten.maximum.default, ["other"], {}) is None


def test_legal_scalar_slots_are_near_misses():
    # rsub.Scalar, where.ScalarOther, clamp(Scalar) take a SymInt by schema; static x * 3 has none
    fns = [
        lambda x: x.shape[0] - x,
        lambda x: torch.where(x > 0, x, x.shape[0]),
        lambda x: torch.clamp(x, max=x.shape[0]),
    ]
    for fn in fns:
        ep = _export(fn, torch.randn(4, 3))
        assert sym_in_tensor_slots(ep.graph) == []
        result = rt.apply_rules(ep, RULES)
        rt.assert_not_fired(result, sym_scalar_in_tensor_slot)
    static = rt.apply_rules(_export(lambda x: x * 3, torch.randn(4, 3), dynamic=False), RULES)
    assert static.report.total_rewrites == 0


# -- pow -----------------------------------------------------------------------------


def _negative_rows(*sizes):
    rows = []
    for s in sizes:
        x = torch.randn(s, 3) * 2
        x[0, 0], x[0, 1], x[-1, 2] = -1.5, 0.0, -0.25
        rows.append((x,))
    return rows


@pytest.mark.parametrize("route", ["R1", "R2"])
def test_pow_sym_exponent_sign_safe(route):
    fn = lambda x: torch.pow(x, x.shape[0])
    ep = _export(fn, torch.randn(4, 3), route=route)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, pow_sym_exponent_sign_safe, times=1)
    (pow_node,) = [n for n in result.graph_module.graph.nodes if n.target is aten.pow.Tensor_Scalar]
    assert pow_node.args[0].target is aten.abs.default
    rt.assert_matches_eager(result, fn, _negative_rows(2, 3, 4, 5))  # even and odd exponents
    rt.assert_idempotent(result, RULES)
    rt.assert_matches_eager(_roundtrip(result.program), fn, _negative_rows(3))


def test_pow_item_exponent_zero_negative_and_odd():
    fn = lambda x, n: x ** n.item()
    ep = _export(fn, torch.randn(4, 3), torch.tensor(3), route="R2")
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, pow_sym_exponent_sign_safe, times=1)
    x = _negative_rows(4)[0][0]
    rt.assert_matches_eager(result, fn, [(x, torch.tensor(k)) for k in (0, 1, 2, 3, 4)])
    x[0, 1] = 0.5  # 0 ** -1 is inf
    rt.assert_matches_eager(result, fn, [(x, torch.tensor(k)) for k in (-1, -2)])


def test_pow_near_misses():
    for fn, why in [
        (lambda x: torch.pow(x, 3), "not a SymInt"),
        (lambda x: torch.pow((x * 4).int(), x.shape[0]), "not a floating-point"),
    ]:
        ep = _export(fn, torch.randn(4, 3))
        again = rt.apply_rules(ep, pow_sym_exponent_sign_safe, explain=True)
        rt.assert_not_fired(again, pow_sym_exponent_sign_safe)
        (attempt,) = again.report.explain("pow_sym_exponent_sign_safe")
        assert why in attempt.reason


# -- R3: the aot_autograd graph of torch.compile(dynamic=True) -----------------------


def _compile_with_rules(fn, rules, **config):
    """torch.compile(fn, dynamic=True) whose forward graphs are rewritten by
    `rules`; returns the compiled function and, per graph, (what
    sym_in_tensor_slots found before, Result)."""
    seen = []

    def fw_compiler(gm, example_inputs):
        result = fx_rewrites.apply(gm, rules)
        seen.append((sym_in_tensor_slots(gm), result))
        return result.graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=fw_compiler), dynamic=True)
    return compiled, seen


def test_r3_symint_placeholders():
    fn = lambda x: (x * x.shape[0], torch.pow(x, x.shape[0]), x // x.shape[1])
    compiled, seen = _compile_with_rules(fn, RULES)
    for (x,) in _negative_rows(4, 5, 7):
        torch.testing.assert_close(compiled(x), fn(x))
    (slots, result), *more = seen
    assert not more, "dynamic=True should compile once"
    # mul.Tensor(x, arg0_1) and floor_divide(x, arg1_1): the SymInt placeholders themselves
    assert len(slots) == 2 and all("gets SymInt" in s for s in slots), slots
    rt.assert_fired(result, sym_scalar_in_tensor_slot, times=2)
    rt.assert_fired(result, pow_sym_exponent_sign_safe, times=1)
    assert sym_in_tensor_slots(result.graph_module) == []
    rt.assert_idempotent(result, RULES)


def test_seed001_symint_inputs_come_from_shapes():
    # seed 001: a backend cloned every example input, SymInts included:
    # "aten::clone() Expected a value of type 'Tensor' for argument 'self' but instead found type 'SymInt'".
    # After the rules no Sym value sits in a Tensor slot, and each SymInt
    # placeholder names the input dim it can be computed from.
    graphs = []

    def cloning_backend(gm, example_inputs):
        result = fx_rewrites.apply(gm, RULES)
        assert sym_in_tensor_slots(result.graph_module) == []
        sources = sym_placeholder_sources(result.graph_module)
        placeholders = [n.name for n in result.graph_module.graph.nodes if n.op == "placeholder"]
        for name, inp in zip(placeholders, example_inputs):
            if name in sources:
                assert sources[name] is not None, f"{name} has no source dim"
                tensor_name, dim = sources[name]
                tensor = example_inputs[placeholders.index(tensor_name)]
                assert inp == tensor.shape[dim]
            else:
                torch.ops.aten.clone(inp)  # what the seed's backend did to every input
        graphs.append(sources)
        return result.graph_module.forward

    torch._dynamo.reset()
    fn = lambda x: x * x.shape[0] + x.shape[1]
    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=cloning_backend), dynamic=True)
    x = torch.randn(4, 3)
    torch.testing.assert_close(compiled(x), fn(x))
    (sources,) = graphs
    assert sorted(v for v in sources.values()) == [("arg2_1", 0), ("arg2_1", 1)]


# -- end to end on IREE ----------------------------------------------------------------


@pytest.mark.slow
def test_iree_end_to_end():
    from fx_rewrites import backends

    iree = backends.get("iree")

    def fn(x, k):
        n = x.shape[0]
        return x * n + x // n, n - x, torch.pow(x, n), torch.pow(x, k.item())

    ep = rt.export(fn, torch.randn(4, 3), torch.tensor(3), dynamic_shapes=({0: B}, None))
    result = fx_rewrites.apply(ep, iree.rules)
    assert sym_in_tensor_slots(result.graph_module) == []
    compiled = iree.compile(result.program, (torch.randn(4, 3), torch.tensor(3)))
    for (x,), k in zip(_negative_rows(2, 3, 4, 5), (0, 1, 2, 3)):  # IREE gave NaN for x < 0 before
        for got, expected in zip(compiled(x, torch.tensor(k)), fn(x, torch.tensor(k)), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


class _ChunkPad(torch.nn.Module):
    """Mamba2's chunked scan (transformers `mamba2_chunk_scan`): pad the sequence to a multiple of the chunk
    with `(chunk - L % chunk) % chunk` zeros, sum each chunk, cut the padding off again."""

    def forward(self, x):
        pad = (4 - x.shape[1] % 4) % 4
        chunks = torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(x.shape[0], -1, 4, x.shape[2])
        out = chunks.cumsum(2).reshape(x.shape[0], -1, x.shape[2])
        return out[:, : x.shape[1]] if pad > 0 else out


def _chunk_program():
    chunks = Dim("chunks", min=1, max=8)
    return rt.export(_ChunkPad(), torch.randn(2, 8, 3), dynamic_shapes=({1: 4 * chunks},))


def test_sym_arithmetic_constant_folds_the_chunk_padding():
    ep = _chunk_program()
    mods = [n for n in ep.graph.nodes if n.target is operator.mod]
    assert mods and all(n.meta["val"] == 0 for n in mods), f"the export should hold constant mods:\n{ep.graph}"

    result = rt.apply_rules(ep, RULES)

    rt.assert_fired(result, sym_arithmetic_constant)
    assert not [n for n in result.graph_module.graph.nodes if n.target in (operator.mod, operator.sub)]
    inputs = [(torch.randn(2, 8, 3),), (torch.randn(2, 12, 3),), (torch.randn(2, 32, 3),)]
    rt.assert_matches_eager(result, _ChunkPad(), inputs)
    rt.assert_idempotent(result, RULES)


def test_sym_arithmetic_constant_leaves_symbolic_values():
    """`L % 4` with L any size stays: its value depends on the input."""

    def fn(x):
        return torch.nn.functional.pad(x, (0, (4 - x.shape[0] % 4) % 4))

    ep = rt.export(fn, torch.randn(6), dynamic_shapes=({0: Dim("L", min=2, max=64)},))
    result = rt.apply_rules(ep, RULES)
    rt.assert_not_fired(result, sym_arithmetic_constant)
    assert [n for n in result.graph_module.graph.nodes if n.target is operator.mod]
    rt.assert_matches_eager(result, fn, [(torch.randn(6),), (torch.randn(9),)])


def test_chunk_padding_through_iree():
    """IREE failed on the constant mods ("failed to legalize ... aten.fmod.int") before the rule."""
    from fx_rewrites import backends

    iree = backends.get("iree")
    result = fx_rewrites.apply(_chunk_program(), iree.rules)
    compiled = iree.compile(result.program, (torch.randn(2, 8, 3),))
    for length in (4, 8, 20):
        x = torch.randn(2, length, 3, dtype=torch.float64).float()
        torch.testing.assert_close(compiled(x), _ChunkPad()(x), rtol=1e-6, atol=1e-6)
