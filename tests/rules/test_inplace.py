"""In-place ops become functional; mutated inputs and buffers are returned
through the ExportedProgram signature, so ep.module() mutates like eager."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fx_rewrites import testing as rt
from fx_rewrites.rules.functionalize import variant
from fx_rewrites.rules.inplace import MUTATING_OPS, RULES, functionalize_inplace

aten = torch.ops.aten
INPLACE = list(MUTATING_OPS)


def _kinds(result):
    return [(s.kind.name, s.target) for s in result.program.graph_signature.output_specs]


def _assert_same_effects(eager: torch.nn.Module, result, make_args, calls: int = 3) -> None:
    """Outputs, mutated inputs and buffers agree with eager over several calls."""
    module = result.program.module()
    for _ in range(calls):
        args = make_args()
        eager_args = copy.deepcopy(args)
        torch.testing.assert_close(module(*args), eager(*eager_args))
        torch.testing.assert_close(args, eager_args)
    torch.testing.assert_close(dict(module.named_buffers()), dict(eager.named_buffers()))


class InputAdd(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2


def test_user_input_mutation():
    ep = rt.export(InputAdd(), torch.randn(2, 3))
    assert aten.add_.Tensor in rt.targets(ep)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, functionalize_inplace, times=1)
    rt.assert_ops(result, absent=INPLACE)
    assert _kinds(result) == [("USER_INPUT_MUTATION", "x"), ("USER_OUTPUT", None)]
    _assert_same_effects(InputAdd(), result, lambda: (torch.randn(2, 3),))
    rt.assert_idempotent(result, RULES)


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(1))
        self.register_buffer("cache", torch.zeros(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        self.cache[:2].copy_(x)
        window = self.cache[2:]
        window.add_(x)
        window.mul_(0.5)
        return self.cache.sum(0) * self.count


def test_buffer_mutations_through_slices(tmp_path):
    ep = rt.export(Counter(), torch.randn(2, 3))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, functionalize_inplace, times=4)
    rt.assert_ops(result, absent=INPLACE, present=[aten.slice_scatter.default])
    assert sorted(_kinds(result)) == [
        ("BUFFER_MUTATION", "cache"),
        ("BUFFER_MUTATION", "count"),
        ("USER_OUTPUT", None),
    ]
    rt.assert_idempotent(result, RULES)
    # save before running: the program shares its state tensors with `ep`, as torch's own passes do
    path = tmp_path / "counter.pt2"
    torch.export.save(result.program, path)
    _assert_same_effects(Counter(), result, lambda: (torch.randn(2, 3),))
    loaded, eager = torch.export.load(path).module(), Counter()
    for _ in range(2):
        x = torch.randn(2, 3)
        torch.testing.assert_close(loaded(x), eager(x))
    torch.testing.assert_close(loaded.cache, eager.cache)


def test_intermediate_mutation_needs_no_output():
    class Scaled(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(x)
            y.mul_(3)
            z = y.clone()
            z[0] = 5.0
            return y + z

    ep = rt.export(Scaled(), torch.randn(2, 3))
    result = rt.apply_rules(ep, RULES)
    rt.assert_ops(result, absent=INPLACE)
    assert _kinds(result) == [("USER_OUTPUT", None)]
    rt.assert_matches_eager(result, Scaled(), [(torch.randn(2, 3),), (torch.randn(2, 3) * 4,)])


def test_index_put_on_input():
    class Scatter(torch.nn.Module):
        def forward(self, x: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            x.index_put_((i,), v)
            return x.sum(0)

    make = lambda: (torch.randn(5, 3), torch.tensor([0, 3]), torch.randn(2, 3))
    ep = rt.export(Scatter(), *make())
    result = rt.apply_rules(ep, RULES)
    rt.assert_ops(result, absent=INPLACE, present=[aten.index_put.default])
    _assert_same_effects(Scatter(), result, make)


def test_view_made_before_a_mutation_and_read_after_it():
    class Aliased(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.zeros(3, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            row = self.b[0]
            self.b.add_(x)
            return row * 2

    ep = rt.export(Aliased(), torch.randn(3, 3))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, functionalize_inplace, times=1)  # was declined: the row read after is the new one
    rt.assert_ops(result, absent=INPLACE)
    _assert_same_effects(Aliased(), result, lambda: (torch.randn(3, 3),))


def test_graph_module_input_mutation_is_declined():
    gm = make_fx(InputAdd())(torch.randn(2, 3))
    result = rt.apply_rules(gm, RULES, explain=True)
    rt.assert_not_fired(result, functionalize_inplace)
    assert "only an ExportedProgram can record that" in result.report.explain()[0].reason


def test_no_grad_mutation_of_outside_tensor_seed_003():
    class Seed003(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            with torch.no_grad():
                y.add_(1)
            return y * y

    gm = make_fx(Seed003(), pre_dispatch=True)(torch.randn(3))
    assert aten.add_.Tensor in rt.targets(gm)
    result = rt.apply_rules(gm, RULES, example_inputs=(torch.randn(3),))
    rt.assert_fired(result, functionalize_inplace, times=1)
    rt.assert_ops(result, absent=INPLACE)
    x = torch.randn(3)
    torch.testing.assert_close(result.graph_module(x), Seed003()(x))


def test_functional_twins_come_from_the_schema_groups():
    assert variant(aten.add_.Tensor).functional is aten.add.Tensor
    assert variant(aten.pow_.Scalar).functional is aten.pow.Tensor_Scalar  # another overload name
    assert variant(aten.copy_.default).functional is aten.copy.default
    assert variant(aten.bernoulli_.float).functional is aten.bernoulli.p  # torchgen's Note [bernoulli.p schema]
    assert variant(aten._index_put_impl_.default).functional is aten._index_put_impl.default
    assert variant(aten.arange.start_out).functional is aten.arange.start_step
    for op in (aten.add_.Tensor, aten.hardswish_.default, aten.uniform_.default, aten.sum.IntList_out):
        v = variant(op)
        own = [a.name for a in op._schema.arguments if not a.is_out]
        assert [a.name for a in v.functional._schema.arguments if a.name in own] == own


# -- issue 12: every mutating op, from its schema ---------------------------------------------------------

Dim = torch.export.Dim


def _mutating_left(result) -> list[str]:
    """Ops still in the graph whose schema writes into an argument."""
    return sorted(
        str(t) for t in rt.targets(result) if getattr(t, "_schema", None) is not None and t._schema.is_mutable
    )


class MobileNetV3Block(torch.nn.Module):
    """What torchvision's MobileNetV3 / EfficientNet export to: `inplace=True` activations and dropout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.act = torch.nn.Hardswish(inplace=True)
        self.relu = torch.nn.ReLU6(inplace=True)
        self.drop = torch.nn.Dropout(0.2, inplace=True)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.act(self.conv(x))).mean((2, 3))
        return self.fc(self.drop(y))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_hardswish_and_eval_dropout_in_place(dynamic):
    m = MobileNetV3Block().eval()
    shapes = {0: Dim("batch", min=2), 2: Dim("h", min=3), 3: Dim("w", min=3)} if dynamic else None
    ep = rt.export(m, torch.randn(2, 3, 8, 8), dynamic_shapes=(shapes,) if dynamic else None)
    assert {aten.hardswish_.default, aten.dropout_.default} <= set(rt.targets(ep))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, functionalize_inplace)
    assert _mutating_left(result) == []
    rt.assert_ops(result, present=[aten.hardswish.default], absent=[aten.dropout.default])  # eval dropout_: gone
    other = torch.randn(3, 3, 9, 7) if dynamic else torch.randn(2, 3, 8, 8) * 4
    rt.assert_matches_eager(result, m, [(torch.randn(2, 3, 8, 8),), (other,)])
    rt.assert_idempotent(result, RULES)


class IndexPutImpl(torch.nn.Module):
    def forward(self, x: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        z = x.clone()
        aten._index_put_impl_(z, (i,), v, True, False)  # accumulate, with repeated indices
        return z * 2


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_index_put_impl(dynamic):
    make = lambda n: (torch.randn(n, 3), torch.tensor([0, 3, 0]), torch.randn(3, 3))
    shapes = ({0: Dim("n", min=4)}, None, None) if dynamic else None
    ep = rt.export(IndexPutImpl(), *make(5), dynamic_shapes=shapes)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, functionalize_inplace, times=1)
    rt.assert_ops(result, present=[aten._index_put_impl.default], absent=[aten._index_put_impl_.default])
    rt.assert_matches_eager(result, IndexPutImpl(), [make(5), make(7 if dynamic else 5)])


class PromotingAdd(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y += torch.arange(x.shape[-1], dtype=torch.float64) / 3  # float32 += float64 stays float32
        x += 1.0
        return y * x


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_in_place_type_promotion_keeps_the_dtype(dynamic):
    ep = rt.export(PromotingAdd(), torch.randn(2, 3), dynamic_shapes=({0: Dim("b")},) if dynamic else None)
    result = rt.apply_rules(ep, RULES)  # before: the float64 add was rejected and apply raised
    rt.assert_fired(result, functionalize_inplace, times=2)
    assert _mutating_left(result) == []
    rt.assert_ops(result, present=[aten._to_copy.default])
    assert _kinds(result) == [("USER_INPUT_MUTATION", "x"), ("USER_OUTPUT", None)]
    _assert_same_effects(PromotingAdd(), result, lambda: (torch.randn(4 if dynamic else 2, 3),))
    out = result.program.module()(torch.randn(2, 3))
    assert out.dtype == torch.float32


class RandomFill(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        u = torch.empty_like(x).uniform_(2.0, 3.0)
        ones = torch.empty_like(x).bernoulli_(1.0)  # bernoulli_.float
        zeros = torch.empty_like(x).bernoulli_(torch.zeros_like(x))  # bernoulli_.Tensor
        coin = torch.empty_like(x).bernoulli_(0.5)
        return x + u, x * ones, x + zeros, coin


def _check_random_fill(out: tuple[torch.Tensor, ...], x: torch.Tensor) -> None:
    """What can be compared of random draws: shape, dtype, range, and the exact values of p=0 and p=1."""
    shifted, kept, same, coin = out
    u = shifted - x
    assert u.shape == x.shape and u.dtype == torch.float32
    assert bool(((u >= 2.0 - 1e-6) & (u <= 3.0 + 1e-6)).all()), u
    torch.testing.assert_close(kept, x)
    torch.testing.assert_close(same, x)
    assert set(coin.unique().tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_uniform_and_bernoulli(dynamic):
    ep = rt.export(RandomFill(), torch.randn(3, 4), dynamic_shapes=({0: Dim("b")},) if dynamic else None)
    assert {aten.uniform_.default, aten.bernoulli_.float, aten.bernoulli_.Tensor} <= set(rt.targets(ep))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, functionalize_inplace, times=4)
    rt.assert_ops(result, present=[aten.uniform.default, aten.bernoulli.p, aten.bernoulli.Tensor])
    assert _mutating_left(result) == []
    for x in (torch.randn(3, 4), torch.randn(5 if dynamic else 3, 4)):
        _check_random_fill(result.program.module()(x), x)


class ArangeOut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch.arange(2, 7, out=self.steps)  # arange.start_out into a buffer of its size
        rows = torch.empty(0)
        torch.arange(1, x.shape[0] + 1, out=rows)  # resized from (0,)
        return x * self.steps, x * rows.unsqueeze(1)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_arange_out(dynamic):
    ep = rt.export(ArangeOut(), torch.randn(3, 5), dynamic_shapes=({0: Dim("b")},) if dynamic else None)
    assert rt.targets(ep).count(aten.arange.start_out) == 2
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, functionalize_inplace, times=2)
    rt.assert_ops(result, present=[aten.arange.start_step], absent=[aten.arange.start_out])
    assert _kinds(result)[0] == ("BUFFER_MUTATION", "steps")
    _assert_same_effects(ArangeOut(), result, lambda: (torch.randn(4 if dynamic else 3, 5),))


class OutVariants(torch.nn.Module):
    def __init__(self, two_outs: bool, foreach: bool = True) -> None:
        super().__init__()
        self.two_outs, self.foreach = two_outs, foreach

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs: tuple[torch.Tensor, ...] = ()
        if self.two_outs:  # torch.export specialises every dim of x at max's out= resize
            values, indices = torch.empty(0), torch.empty(0, dtype=torch.long)
            torch.max(x, 1, out=(values, indices))  # two out arguments, both resized
            outs = (values, indices)
        total = torch.empty(0, dtype=torch.float64)
        torch.sum(x, 1, out=total)  # out's dtype decides the result's
        a, b = x * 2, x + 1
        if self.foreach:
            torch._foreach_add_([a, b], 1.5)  # a list of tensors written in place
        c = x * 3
        c.unsqueeze_(0)  # the tensor's shape changes in place
        return (*outs, total, a * b, c + 1)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_other_out_and_in_place_forms(dynamic):
    m = OutVariants(two_outs=not dynamic)
    ep = rt.export(m, torch.randn(3, 4), dynamic_shapes=({0: Dim("b")},) if dynamic else None)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, functionalize_inplace, times=3 if dynamic else 4)
    assert _mutating_left(result) == []
    rt.assert_ops(result, present=[aten.sum.dim_IntList, aten._foreach_add.Scalar, aten.unsqueeze.default])
    if not dynamic:
        rt.assert_ops(result, present=[aten.max.dim], absent=[aten.max.dim_max])
    inputs = [(torch.randn(3, 4),), (torch.randn(6 if dynamic else 3, 4) * 3,)]
    rt.assert_matches_eager(result, m, inputs)
    assert result.program.module()(torch.randn(3, 4))[-3].dtype == torch.float64
    rt.assert_idempotent(result, RULES)


def test_train_mode_dropout_in_place_through_its_decomposition():
    class Drop(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y, z = x * 1, x * 2
            torch.dropout_(y, 1.0, True)  # p=1: all zeros
            torch.dropout_(z, 0.0, True)  # p=0: unchanged
            return y + x, z

    ep = rt.export(Drop(), torch.randn(3, 4))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, functionalize_inplace)
    assert _mutating_left(result) == []
    rt.assert_matches_eager(result, Drop(), [(torch.randn(3, 4),), (torch.randn(3, 4) * 5,)])


def test_op_without_a_functional_variant_is_declined_by_name():
    class Polygamma(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.clone()
            y.polygamma_(1)  # polygamma(n, self) takes n first: torchgen does not pair them either
            return y

    ep = rt.export(Polygamma(), torch.rand(3) + 1)
    result = rt.apply_rules(ep, RULES, explain=True)
    rt.assert_not_fired(result, functionalize_inplace)
    (attempt,) = result.report.explain("functionalize_inplace")
    assert "aten.polygamma_.default has no functional variant" in attempt.reason
    assert variant(aten.polygamma_.default) == attempt.reason.removeprefix("when: ")


def test_roots_are_every_mutating_aten_overload():
    from fx_rewrites.rules.functionalize import mutated_arguments

    assert len(MUTATING_OPS) > 1000  # every out= overload included
    assert set(functionalize_inplace.roots) == set(MUTATING_OPS)
    for op in (aten.hardswish_.default, aten.arange.start_out, aten._index_put_impl_.default, aten.uniform_.default):
        assert op in MUTATING_OPS
    assert all(mutated_arguments(op) for op in MUTATING_OPS)
    assert aten.add.Tensor not in MUTATING_OPS


def test_metadata_change_of_an_input_is_declined():
    class Transposed(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.t_()  # the caller's tensor is transposed: same data, other strides
            return x + 1

    ep = rt.export(Transposed(), torch.randn(3, 3))
    result = rt.apply_rules(ep, RULES, explain=True)
    rt.assert_not_fired(result, functionalize_inplace)
    (attempt,) = result.report.explain("functionalize_inplace")
    assert "changes the sizes or strides of graph input x" in attempt.reason


class RelativeShift(torch.nn.Module):
    """Funnel's `_relative_shift_gather` then `positional_attn *= cls_mask`:
    the in-place product writes through two `aten.reshape` views of a
    product that nothing else reads (`read_base` reads it after as well)."""

    def __init__(self, read_base: bool = False) -> None:
        super().__init__()
        self.read_base = read_base

    def forward(self, q: torch.Tensor, r: torch.Tensor, mask: torch.Tensor) -> Any:
        scores = torch.einsum("bnid,td->bnit", q, r)
        b, n, s, rel = scores.shape
        shifted = torch.reshape(scores, [b, n, rel, s])[:, :, 1:, :]
        shifted = torch.reshape(shifted, [b, n, s, rel - 1])[..., :s]
        shifted *= mask
        return (shifted, scores.sum()) if self.read_base else shifted


def _relative_shift_inputs(s: int) -> tuple:
    return torch.randn(2, 2, s, 8), torch.randn(2 * s + 1, 8), (torch.rand(s, s) > 0.3).float()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_in_place_through_reshape_views_of_an_unread_base(dynamic):
    seq = Dim("seq", min=2, max=32)
    shapes = ({2: seq}, {0: 2 * seq + 1}, {0: seq, 1: seq}) if dynamic else None
    ep = rt.export(RelativeShift(), *_relative_shift_inputs(5), dynamic_shapes=shapes)
    assert aten.mul_.Tensor in rt.targets(ep) and aten.reshape.default in rt.targets(ep)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, functionalize_inplace, times=1)
    rt.assert_ops(result, present=[aten.mul.Tensor], absent=[aten.mul_.Tensor])
    inputs = [_relative_shift_inputs(5), _relative_shift_inputs(7 if dynamic else 5)]
    rt.assert_matches_eager(result, RelativeShift(), inputs)
    rt.assert_idempotent(result, RULES)


def test_in_place_through_a_reshape_of_a_base_read_later():
    ep = rt.export(RelativeShift(read_base=True), *_relative_shift_inputs(5))
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, functionalize_inplace, times=1)  # was declined naming aten.reshape
    rt.assert_ops(result, absent=INPLACE)
    inputs = [_relative_shift_inputs(5), _relative_shift_inputs(5)]
    rt.assert_matches_eager(result, RelativeShift(read_base=True), inputs)


class WritesThroughAnAliasTwice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        z = aten.alias.default(y)
        z.add_(1)
        z.mul_(3)  # the second write goes through the first one's new value
        return y + 1


def test_two_writes_through_an_alias_of_a_base_read_later():
    ep = rt.export(WritesThroughAnAliasTwice(), torch.randn(3, 4))
    assert aten.alias.default in rt.targets(ep)
    result = rt.apply_rules(ep, RULES)
    rt.assert_fired(result, functionalize_inplace, times=2)
    assert _mutating_left(result) == []
    rt.assert_matches_eager(result, WritesThroughAnAliasTwice(), [(torch.randn(3, 4),), (torch.randn(3, 4) * 3,)])
