"""A torch.cond on the input sizes runs only the taken branch (fx_rewrites.app.dispatch), through fx_rewrites.compile."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites.app.dispatch import SizeDispatch, size_conds
from fx_rewrites.backends.iree.artifact import ArtifactError

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
        (ElementwiseBranches(), SEQ, "element-wise branches: cond_to_where stays"),
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


def test_saving_a_dispatched_program_names_why_not():
    compiled = fx_rewrites.compile(SizeDispatched(), (_x(8),), dynamic_shapes=SEQ, backend="eager")
    with pytest.raises(ArtifactError, match=r"dispatches on the sizes of a call .* Fix: export each side"):
        compiled.save("never.vmfb")
