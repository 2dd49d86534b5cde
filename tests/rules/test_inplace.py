"""In-place ops become functional; mutated inputs and buffers are returned
through the ExportedProgram signature, so ep.module() mutates like eager."""

from __future__ import annotations

import copy

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fx_rewrites import testing as rt
from fx_rewrites.rules.inplace import FUNCTIONAL, RULES, functionalize_inplace

aten = torch.ops.aten
INPLACE = list(FUNCTIONAL)


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


def test_view_read_after_mutation_is_declined():
    class Aliased(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.zeros(3, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            row = self.b[0]
            self.b.add_(x)
            return row * 2

    ep = rt.export(Aliased(), torch.randn(3, 3))
    result = rt.apply_rules(ep, RULES, explain=True)
    rt.assert_not_fired(result, functionalize_inplace)
    (attempt,) = result.report.explain()
    assert "is read after it" in attempt.reason
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


def test_functional_twins_have_the_same_arguments():
    assert FUNCTIONAL[aten.add_.Tensor] is aten.add.Tensor
    assert FUNCTIONAL[aten.pow_.Scalar] is aten.pow.Tensor_Scalar
    assert FUNCTIONAL[aten.copy_.default] is aten.copy.default
    for inplace, functional in FUNCTIONAL.items():
        assert [a.name for a in inplace._schema.arguments] == [a.name for a in functional._schema.arguments]
