"""A compiled program's per-call path (`backends/iree/calling.py`): positional tensors that fit take the checks
built once and the direct invoke, and give what the general path (`convention.bind`, iree.runtime's invoker)
gives; a call that does not fit still gets `bind`'s named error; and a result is the caller's own: unchanged by
the next call and by writes through an earlier result, whether the module computed it, keeps it as its state,
folded it to a constant or serves it from the model's weight. Small compiles (a few ms each)."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import apply, backends
from fx_rewrites.backends.convention import InputMismatch
from fx_rewrites.backends.iree.calling import MISS, Invoker, fast_call
from fx_rewrites.backends.iree.parameters import INLINE_ENV


def _compile(model: torch.nn.Module, args: tuple, dynamic_shapes=None):
    iree = backends.get("iree")
    program = apply(torch.export.export(model, args, dynamic_shapes=dynamic_shapes), iree.rules).program
    return iree.compile(program, args)


class Pair(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.sin(x) + y, x * 2


def _xy(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, n, generator=g), torch.randn(3, n, generator=g)


@pytest.fixture(scope="module")
def pair():
    n = Dim("n", min=2, max=64)
    return _compile(Pair(), _xy(8, 0), dynamic_shapes=({1: n}, {1: n}))


def test_the_direct_path_is_taken_and_agrees_with_the_general_one(pair):
    # on the pinned iree-base-runtime the invoker's parts are where `Invoker.of` reads them
    assert Invoker.of(pair.function) is not None
    fast = fast_call(pair.plan, pair.function)
    assert fast is not None
    for n in (2, 8, 64):
        x, y = _xy(n, n)
        direct = fast((x, y))
        assert direct is not MISS
        general = pair.call_bound(x, y)
        want = Pair()(x, y)
        for got in (direct, general):
            assert isinstance(got, tuple) and len(got) == 2
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(pair(x, y), want, rtol=1e-6, atol=1e-6)


def test_a_result_that_is_not_host_mappable_takes_the_runtimes_own_copy(pair):
    invoker = Invoker.of(pair.function)
    invoker._visible = 1 << 30  # a memory type no buffer here has: as a GPU's device-local result, not mapped
    x, y = _xy(8, 1)
    got = invoker(x.numpy(), y.numpy())
    assert len(got) == 2
    for a, b in zip(got, Pair()(x, y), strict=True):
        torch.testing.assert_close(torch.from_numpy(a), b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8)), "float64 tensor; the compiled program takes"),
        ((torch.randn(4, 8), torch.randn(4, 8)), "dim 0 is 4, compiled for 3"),
        ((torch.randn(3, 65), torch.randn(3, 65)), "outside the range"),
        ((torch.randn(3, 8), torch.randn(3, 9)), "exported with the two equal"),
        ((torch.randn(3, 8),), "positional argument"),
        ((torch.randn(3, 8), 1.0), "is not a tensor"),
    ],
)
def test_a_call_that_does_not_fit_still_gets_the_named_error(pair, args, message):
    assert fast_call(pair.plan, pair.function)(args) is MISS
    with pytest.raises((InputMismatch, TypeError), match=message):
        pair(*args)


def _unchanged_by_later_calls(compiled, make_input, eager) -> None:
    """Each result keeps its value after the next calls and after writes through the earlier results, and
    every call gives eager's result for its own input."""
    results, kept = [], []
    for seed in range(3):
        x = make_input(seed)
        got = compiled(x)
        torch.testing.assert_close(got, eager(x), rtol=1e-6, atol=1e-6)
        results.append(got)
        kept.append(got.clone())
        got.add_(1000.0)  # a write through the result must not reach the module or the next call
        kept[-1].add_(1000.0)
    for got, want in zip(results, kept, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class Computed(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 3


class Folded(torch.nn.Module):
    """Its result reads no input: IREE folds it to a constant of the module."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, 12).reshape(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * 2 + 1


class Weight(torch.nn.Module):
    """Returns its weight as it is: a parameter served from the model's own memory."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, 64 * 64).reshape(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w


class Running(torch.nn.Module):
    """Adds each input to a buffer and returns the buffer: the result is the module's state (a global)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x)
        return self.total


def _x(seed: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_class", [Computed, Folded, Running])
def test_a_result_is_unchanged_by_the_next_call_and_by_writes_through_it(model_class):
    model = model_class()
    compiled = _compile(model_class(), (_x(0),))
    assert fast_call(compiled.plan, compiled.function) is not None  # the direct path is what is checked here
    with torch.no_grad():
        _unchanged_by_later_calls(compiled, _x, lambda x: model(x).clone())


def test_a_weight_returned_as_it_is_is_a_copy(monkeypatch):
    monkeypatch.setenv(INLINE_ENV, "0")  # every weight a parameter, read from the tensor's own memory
    model = Weight()
    before = model.w.detach().clone()
    compiled = _compile(model, (_x(0),))
    assert compiled.parameters  # the weight is served from model.w's memory
    with torch.no_grad():
        _unchanged_by_later_calls(compiled, _x, lambda x: before)
    torch.testing.assert_close(model.w.detach(), before, rtol=0, atol=0)


class Accumulated(torch.nn.Module):
    """index_put with accumulate into its first input: IREE 3.13 scatters into the storage of `x` in place when it
    is handed `x`'s own memory (docs/iree-3.13-findings.md section 71)."""

    def forward(self, x: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return torch.index_put(x, (rows,), values, accumulate=True)


def test_a_call_leaves_its_inputs_as_they_were():
    g = torch.Generator().manual_seed(5)
    args = (torch.randn(4, 5, generator=g), torch.tensor([0, 2, 2, 3]), torch.randn(4, 5, generator=g))
    compiled = _compile(Accumulated(), args)
    kept = [a.clone() for a in args]
    for _ in range(2):  # the second call sees the first's inputs unchanged, so it gives the same result
        torch.testing.assert_close(compiled(*args), Accumulated()(*kept), rtol=1e-6, atol=1e-6)
        for a, b in zip(args, kept, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
