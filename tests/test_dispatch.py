"""A torch.cond on the input sizes runs only the taken branch (fx_rewrites.app.dispatch), through fx_rewrites.compile."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites.app.dispatch import (
    DISPATCH_KEY,
    GuardError,
    SizeDispatch,
    check_guard,
    evaluate,
    guard,
    guard_function,
    size_conds,
)
from fx_rewrites.backends.iree.artifact import ArtifactError
from fx_rewrites.backends.iree.backend import IreeBackend
from fx_rewrites.backends.iree.runtime import function_reflections
from tests.test_branch_cost import LongElementwise

aten = torch.ops.aten


class SizeDispatched(torch.nn.Module):
    """The seed's dispatch case: a short path up to a threshold on the sequence length, a long one past it."""

    def __init__(self, threshold: int = 16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(32, 32, generator=g) / 6)
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def short(x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x @ self.w)

        def long(x: torch.Tensor) -> torch.Tensor:
            y = x
            for _ in range(6):
                y = torch.tanh(y @ self.w) + y
            return y

        return torch.cond(x.shape[1] <= self.threshold, short, long, (x,))


class ElementwiseBranches(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.shape[1] <= 16, lambda x: x * 2, lambda x: torch.sigmoid(x) + 1, (x,))


SEQ = ({1: Dim("n", min=2, max=64)},)


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, n, 32, generator=torch.Generator().manual_seed(seed))


def test_a_size_cond_is_found_with_the_input_dim_it_reads():
    (found,) = size_conds(torch.export.export(SizeDispatched(), (_x(8),), dynamic_shapes=SEQ))
    assert found.sizes and list(found.sizes.values()) == [(0, 1)]
    assert str(found.expr).endswith("<= 16")


@pytest.mark.parametrize(
    ("module", "shapes", "why"),
    [
        (ElementwiseBranches(), SEQ, "short element-wise branches: a select costs less than a dispatch"),
        (SizeDispatched(), None, "static sizes: the predicate is decided when exported"),
        (SizeDispatched(), ({1: Dim("n", min=2, max=16)},), "the Dim range decides it"),
    ],
)
def test_conds_left_to_the_rules(module, shapes, why):
    assert size_conds(torch.export.export(module, (_x(8),), dynamic_shapes=shapes)) == [], why


@pytest.mark.parametrize("backend", ["eager", "iree"])
def test_only_the_taken_side_runs_and_both_sides_match_eager(backend):
    model = SizeDispatched()
    compiled = fx_rewrites.compile(model, (_x(8),), dynamic_shapes=SEQ, backend=backend)
    runtime = compiled.runtime
    assert isinstance(runtime, SizeDispatch)
    short, long = runtime.results
    matmuls = [sum(n.target is aten.matmul.default for n in r.graph_module.graph.nodes) for r in (short, long)]
    assert matmuls == [1, 6]  # each side holds its own branch only
    calls = []

    def counted(fn, side):
        def call(*args, **kwargs):
            calls.append(side)
            return fn(*args, **kwargs)

        return call

    runtime.when_true, runtime.when_false = counted(runtime.when_true, "short"), counted(runtime.when_false, "long")
    for n, side in ((2, "short"), (16, "short"), (17, "long"), (64, "long")):
        x = _x(n, seed=n)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        assert calls[-1] == side, n
    # the rewritten program itself computes both and selects, for program.module() and check
    torch.testing.assert_close(compiled.program.module()(_x(40, 1)), model(_x(40, 1)), rtol=1e-5, atol=1e-5)


def test_elementwise_branches_whose_select_costs_more_are_dispatched_and_match_eager():
    """Issue 36: both branches element-wise, one long: the estimate (tests/test_branch_cost.py) picks the dispatch,
    and only the side the sizes pick runs, on IREE, with eager's numbers on both sides."""
    model = LongElementwise()
    shapes = ({1: Dim("n", min=2, max=1024)},)
    gen = torch.Generator().manual_seed(3)
    compiled = fx_rewrites.compile(model, (torch.randn(64, 64, generator=gen),), dynamic_shapes=shapes)
    runtime = compiled.runtime
    assert isinstance(runtime, SizeDispatch) and runtime.tree == ["le", ["size", 0, 1], ["int", 512]]
    short, long = runtime.results
    # each side holds its own branch only (the long one's 6 tanh; its cos are float64 forms after the IREE rules)
    tanh = [sum(n.target is aten.tanh.default for n in r.graph_module.graph.nodes) for r in (short, long)]
    assert tanh == [0, 6]
    calls = []
    true, false = runtime.when_true, runtime.when_false
    runtime.when_true = lambda *a: calls.append("short") or true(*a)
    runtime.when_false = lambda *a: calls.append("long") or false(*a)
    for n, side in ((64, "short"), (512, "short"), (513, "long"), (640, "long")):
        x = torch.randn(64, n, generator=gen) * 3
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        assert calls[-1] == side, n


def test_saving_a_dispatched_program_names_why_not():
    compiled = fx_rewrites.compile(SizeDispatched(), (_x(8),), dynamic_shapes=SEQ, backend="eager")
    with pytest.raises(ArtifactError, match=r"dispatches on the sizes of a call .* Fix: export each side"):
        compiled.save("never.vmfb")


class RunningDispatched(torch.nn.Module):
    """A buffer both sides read, updated on every call: the sides must share it across calls."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w = torch.nn.Parameter(torch.randn(32, 32, generator=g) / 6)
        self.register_buffer("total", torch.zeros(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.mean((0, 1)))

        def short(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return torch.relu(x @ self.w + t)

        def long(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            y = x
            for _ in range(3):
                y = torch.tanh(y @ self.w) + y + t
            return y

        return torch.cond(x.shape[1] <= 16, short, long, (x, self.total))


ALTERNATING = ((4, True), (30, False), (16, True), (17, False), (2, True), (64, False))


def _same_sequence_as_eager(run, eager: torch.nn.Module) -> None:
    for n, side in ALTERNATING:
        x = _x(n, seed=100 + n) + 1  # a mean far from 0: the state moves the result
        assert run.taken(x) is side, n
        torch.testing.assert_close(run(x), eager(x), rtol=1e-5, atol=1e-5)


def test_both_sides_are_two_functions_of_one_module_sharing_the_state():
    model = RunningDispatched()
    eager = copy.deepcopy(model)
    runtime = fx_rewrites.compile(model, (_x(8),), dynamic_shapes=SEQ).runtime
    assert isinstance(runtime, SizeDispatch) and runtime.module is not None
    assert runtime.when_true.vmfb is runtime.when_false.vmfb  # one module
    mlir = runtime.when_true.mlir
    assert "func.func @when_true(" in mlir and "func.func @when_false(" in mlir
    assert len(re.findall(r"util\.global private mutable @__state_total\b", mlir)) == 1  # one global, both read it
    assert mlir.count('#stream.parameter.named<"model"::"total">') == 1  # its initial value: one parameter
    assert runtime.tree == ["le", ["size", 0, 1], ["int", 16]]
    _same_sequence_as_eager(runtime, eager)
    torch.testing.assert_close(model.total, torch.zeros(32))  # the compiled module keeps its own state


@pytest.mark.parametrize("params", [True, False], ids=["irpa", "self-contained"])
def test_a_dispatch_saves_and_loads_with_its_guard(tmp_path, params):
    model = RunningDispatched()
    eager = copy.deepcopy(model)
    compiled = fx_rewrites.compile(model, (_x(8),), dynamic_shapes=SEQ)
    compiled(_x(20))  # a run moves the module's state; the file holds the initial one
    path = tmp_path / "dispatch.vmfb"
    compiled.save(path, params=tmp_path / "w.irpa" if params else None)
    reflections = function_reflections(path)
    assert {"when_true", "when_false"} <= reflections.keys() and "main" not in reflections
    assert json.loads(reflections["when_true"][DISPATCH_KEY])["guard"] == ["le", ["size", 0, 1], ["int", 16]]
    loaded = fx_rewrites.load(path, params=tmp_path / "w.irpa" if params else None)
    assert isinstance(loaded, SizeDispatch) and loaded.found is None
    _same_sequence_as_eager(loaded, eager)


def test_guard_data_is_checked_and_evaluated_without_code():
    both = ["and", ["le", ["size", 0, 1], ["int", 16]], ["eq", ["mod", ["size", 1, 0], ["int", 2]], ["int", 0]]]
    one_more = ["le", ["add", ["size", 0, 1], ["int", 1]], ["int", 16]]
    assert evaluate(both, [(2, 16), (4,)]) and not evaluate(one_more, [(2, 16)])
    # the closures a dispatched call evaluates agree, on the call's tensors
    assert guard_function(both)([torch.empty(2, 16), torch.empty(4)])
    assert not guard_function(both)([torch.empty(2, 16), torch.empty(5)])
    assert not guard_function(one_more)([torch.empty(2, 16)]) and guard_function(one_more)([torch.empty(2, 15)])
    for bad in (["call", "os.system"], ["size", 0], ["int", "1"], "x <= 16", ["le", ["size", 0, 1]], ["size", -1, 0]):
        with pytest.raises(GuardError, match="is not a size guard"):
            check_guard(bad)


class MaxDispatched(SizeDispatched):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(
            max(x.shape[0], x.shape[1]) <= 16, lambda x: torch.relu(x @ self.w), lambda x: torch.tanh(x @ self.w), (x,)
        )


def test_a_guard_the_data_cannot_hold_still_runs_and_names_why_it_cannot_be_saved(tmp_path):
    model = MaxDispatched()
    shapes = ({0: Dim("b", min=2, max=64), 1: Dim("n", min=2, max=64)},)
    compiled = fx_rewrites.compile(model, (_x(8),), dynamic_shapes=shapes)
    assert compiled.runtime.tree is None
    for n in (4, 40):
        torch.testing.assert_close(compiled(_x(n)), model(_x(n)), rtol=1e-5, atol=1e-5)
    with pytest.raises(
        ArtifactError, match=r"Max, which a saved size dispatch cannot carry\. Fix: write the predicate"
    ):
        compiled.save(tmp_path / "never.vmfb")
    host = fx_rewrites.compile(SizeDispatched(), (_x(8),), dynamic_shapes=SEQ, backend=IreeBackend(state="host"))
    with pytest.raises(ArtifactError, match=r"compiled as two modules .*IreeBackend\(state='host'\)"):
        host.save(tmp_path / "never.vmfb")


class FloorModDispatched(SizeDispatched):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        short, long = (lambda x: torch.relu(x @ self.w)), (lambda x: torch.tanh(x @ self.w))
        return torch.cond((x.shape[1] // 3) % 2 == 0, short, long, (x,))


def test_a_guard_of_torchs_floordiv_and_mod_is_data_that_agrees_with_python():
    (found,) = size_conds(torch.export.export(FloorModDispatched(), (_x(8),), dynamic_shapes=SEQ))
    tree = guard(found.expr, found.sizes)
    assert tree == ["eq", ["mod", ["floordiv", ["size", 0, 1], ["int", 3]], ["int", 2]], ["int", 0]]
    for n in range(2, 65):
        assert bool(evaluate(tree, [(2, n, 32)])) is ((n // 3) % 2 == 0), n
