"""An input the compiled program never writes is handed to a CPU call in place, the others copied.

`unwritten.unwritten_arguments` decides per argument from the prepared graph (`Plan.unwritten`); `calling.Invoker`
imports those arrays (`import_host_allocation`) and copies the rest. IREE 3.13 writes in place into an imported
argument that a scatter updates (docs/iree-3.13-findings.md, 71): the first tests show the graphs where that can
happen are refused, the last that the suite's check (`FX_REWRITES_CHECK_INPUTS`, tests/conftest.py) catches such a
write where the proof is forced. Small compiles.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from torch.export import Dim

from fx_rewrites import apply, backends
from fx_rewrites.backends.iree import IreeBackend
from fx_rewrites.backends.iree.calling import CHECK_ENV, InputWrittenError, Invoker, fast_call
from fx_rewrites.backends.iree.preparing import prepare_program
from fx_rewrites.backends.iree.runtime import is_host_device
from fx_rewrites.backends.iree.sharing import unwritten_arguments

DRIVERS = ("local-task", "local-sync")


def _program(model: torch.nn.Module, args: tuple, dynamic_shapes: Any = None) -> Any:
    exported = torch.export.export(model, args, dynamic_shapes=dynamic_shapes)
    return apply(exported, backends.get("iree").rules).program


def _unwritten(model: torch.nn.Module, args: tuple) -> tuple[bool, ...]:
    return prepare_program(_program(model, args))[1].unwritten


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Pointwise(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(16, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class Pooled(torch.nn.Module):
    """A pool with indices (a tuple's item), a flatten (a view) and a linear: all read x."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled, _ = torch.nn.functional.max_pool2d(x, 2, return_indices=True)
        return self.fc(pooled.flatten(1))


class Accumulated(torch.nn.Module):
    def forward(self, x: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return torch.index_put(x, (rows,), values, accumulate=True)


class SortedAfterFold(torch.nn.Module):
    """x passes a clone and a `* 1` (ops IREE may fold to x itself) into a sort; y only into an add."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.sort(x.clone() * 1.0).values + y


class SliceWritten(torch.nn.Module):
    def forward(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[:, :2] = v
        return y


class Branched(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,))


def test_reading_ops_leave_their_arguments_unwritten():
    assert _unwritten(Pointwise(), (torch.randn(1, 16, 6, 6, generator=_g(0)),)) == (True,)
    assert _unwritten(Pooled(), (torch.randn(2, 8, 8, 8, generator=_g(0)),)) == (True,)


def test_scatters_sorts_slice_writes_and_branches_keep_their_arguments_copied():
    rows = torch.tensor([0, 2, 2])
    assert _unwritten(Accumulated(), (torch.zeros(4, 5), rows, torch.ones(3, 5))) == (False, False, False)
    assert _unwritten(SortedAfterFold(), (torch.randn(3, 7, generator=_g(1)), torch.randn(3, 7))) == (False, True)
    assert _unwritten(SliceWritten(), (torch.randn(3, 4, generator=_g(2)), torch.randn(3, 2))) == (False, False)
    # the IREE rules turn this cond into a select of both branches; as exported, it is a higher-order op
    exported = torch.export.export(Branched(), (torch.randn(3, 4, generator=_g(3)),))
    (x,) = [n for n in exported.graph.nodes if n.op == "placeholder"]
    assert any(isinstance(n.target, torch._ops.HigherOrderOperator) for n in x.users)
    assert unwritten_arguments([x]) == (False,)


class _CountingPacker:
    """iree.runtime's argument packer, counting the calls that copy all their arguments."""

    def __init__(self, packer: Any) -> None:
        self.packer, self.calls = packer, 0

    def pack(self, *args: Any) -> Any:
        self.calls += 1
        return self.packer.pack(*args)


def _invoker(compiled: Any) -> tuple[Invoker, _CountingPacker]:
    assert is_host_device(compiled.function._device)
    invoker = Invoker.of(compiled.function, compiled.plan.unwritten)
    assert invoker is not None
    invoker._packer = counting = _CountingPacker(invoker._packer)
    return invoker, counting


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("driver", DRIVERS)
def test_an_unwritten_input_is_read_in_place_and_the_result_is_eagers(driver, dynamic):
    model = Pointwise().eval()
    example = (torch.randn(2, 16, 6, 6, generator=_g(4)),)
    shapes = ({0: Dim("n", min=1, max=8)},) if dynamic else None
    compiled = IreeBackend(driver=driver).compile(_program(model, example, shapes), example)
    assert compiled.plan.unwritten == (True,)
    invoker, packer = _invoker(compiled)
    for seed, n in ((5, 2), (6, 3 if dynamic else 2)):
        x = torch.randn(n, 16, 6, 6, generator=_g(seed))
        kept = x.clone()
        (got,) = invoker(x.numpy())
        assert packer.calls == 0  # imported: the packer, which copies, was not asked
        with torch.no_grad():
            want = model(kept)
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-6)  # the call's own path
        torch.testing.assert_close(x, kept, rtol=0, atol=0)


def test_misaligned_and_read_only_arrays_are_copied():
    model = Pointwise().eval()
    example = (torch.randn(1, 16, 6, 6, generator=_g(7)),)
    compiled = IreeBackend(driver="local-sync").compile(_program(model, example), example)
    invoker, packer = _invoker(compiled)
    flat = torch.randn(16 * 36 + 1, generator=_g(8))
    read_only = torch.randn(1, 16, 6, 6, generator=_g(9)).numpy()
    read_only.flags.writeable = False
    for array in (flat[1:].view(1, 16, 6, 6).numpy(), read_only):
        before = packer.calls
        (got,) = invoker(array)
        assert packer.calls == before + 1
        with torch.no_grad():
            want = model(torch.from_numpy(array.copy()))
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-5, atol=1e-6)


class Mixed(torch.nn.Module):
    """x is only read; y is scattered into: x imported, y copied, in one call."""

    def forward(self, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) + torch.index_put(y, (rows,), torch.ones(3, 5), accumulate=True)


def test_one_input_imported_and_another_copied_in_the_same_call():
    args = (torch.randn(4, 5, generator=_g(10)), torch.randn(4, 5, generator=_g(11)), torch.tensor([0, 3, 3]))
    compiled = IreeBackend(driver="local-sync").compile(_program(Mixed(), args), args)
    assert compiled.plan.unwritten == (True, False, False)
    kept = [a.clone() for a in args]
    for _ in range(2):  # the second call reads the first's inputs as they were
        torch.testing.assert_close(compiled(*args), Mixed()(*kept), rtol=1e-6, atol=1e-6)
        for a, b in zip(args, kept, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_check_catches_a_write_into_an_input_handed_over(monkeypatch):
    """What the proof prevents: the index_put's x forced unwritten, IREE writes the caller's x, the check says so."""
    monkeypatch.setenv(CHECK_ENV, "1")
    args = (torch.zeros(4, 5), torch.tensor([0, 2, 2]), torch.ones(3, 5))
    compiled = IreeBackend(driver="local-sync").compile(_program(Accumulated(), args), args)
    forced = attrs.evolve(compiled.plan, unwritten=(True, True, True))
    call = fast_call(forced, compiled.function, host_memory=True)
    with pytest.raises(InputWrittenError, match="wrote into its argument 0"):
        call(args)


def test_a_saved_module_keeps_which_inputs_it_reads_in_place(tmp_path):
    model = Pointwise().eval()
    example = (torch.randn(1, 16, 6, 6, generator=_g(12)),)
    compiled = IreeBackend(driver="local-sync").compile(_program(model, example), example)
    compiled.save(tmp_path / "m.vmfb")
    from fx_rewrites.backends.iree.runtime import load

    loaded = load(tmp_path / "m.vmfb", driver="local-sync")
    assert loaded.plan.unwritten == (True,)
    x = torch.randn(1, 16, 6, 6, generator=_g(13))
    kept = x.clone()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(kept), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x, kept, rtol=0, atol=0)


class Outputs(torch.nn.Module):
    """Results of each kind: a convolution's and what is computed from it (fresh), a view of it beside it (fresh,
    one buffer: the call copies both), the input times one and a weight times one (which IREE may fold to the
    input or the weight), a constant, a `where` between the input and itself (folded to the input) and a
    `zeros_like` (a constant IREE may hoist)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 1)
        self.w = torch.nn.Parameter(torch.randn(4, generator=_g(20)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.conv(x)
        # where(c, x, x) is x (IREE folds it: torch-mlir folds where(c, w, w) with w broadcast to w unbroadcast,
        # a compile error, so both operands are x's shape here)
        return (
            y,
            torch.relu(y),
            y + x,
            y.view(-1),
            x * 1.0,
            self.w * 1.0,
            torch.zeros(3),
            torch.where(y > 0, x, x),
            (torch.zeros_like(y)),
        )


def test_the_results_that_are_the_calls_own_buffers():
    fresh = prepare_program(_program(Outputs(), (torch.randn(1, 4, 3, 3, generator=_g(21)),)))[1].fresh
    assert fresh == (True, True, True, True, False, False, False, False, False)


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_fresh_result_is_handed_out_and_stays_the_callers(driver):
    model = Pointwise().eval()
    example = (torch.randn(1, 16, 6, 6, generator=_g(22)),)
    compiled = IreeBackend(driver=driver).compile(_program(model, example), example)
    assert compiled.plan.fresh == (True,)
    invoker = Invoker.of(compiled.function, compiled.plan.unwritten, compiled.plan.fresh)
    (handed,) = invoker(example[0].numpy())
    assert handed.base is not None and not handed.flags.owndata  # IREE's mapped buffer, not a copy
    xs = [torch.randn(1, 16, 6, 6, generator=_g(23 + i)) for i in range(4)]
    with torch.no_grad():
        wants = [model(x) for x in xs]
    kept = [compiled(x) for x in xs]  # each kept while the next calls run: none is reused under it
    for got, want in zip(kept, wants, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    kept[0].fill_(7.0)  # the caller's to write
    torch.testing.assert_close(compiled(xs[1]), wants[1], rtol=1e-5, atol=1e-6)


def test_results_sharing_a_buffer_are_copied_apart():
    x = torch.randn(1, 4, 3, 3, generator=_g(30))
    model = Outputs()
    compiled = IreeBackend(driver="local-sync").compile(_program(model, (x,)), (x,))
    got = compiled(x)
    with torch.no_grad():
        want = model(x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    y, _, _, flat = got[:4]
    y.fill_(5.0)  # y and its view are one buffer in IREE: the call gave each its own
    torch.testing.assert_close(flat, want[3], rtol=1e-5, atol=1e-6)


class MixedScalar(torch.nn.Module):
    """x imported, the 0-d s copied (a sort reads it): the copy keeps s's rank (a rank mismatch failed the call)."""

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * torch.sort(s.reshape(1)).values


def test_a_copied_scalar_beside_an_imported_input_keeps_its_rank():
    args = (torch.randn(4, 5, generator=_g(40)), torch.tensor(1.5))
    compiled = IreeBackend(driver="local-sync").compile(_program(MixedScalar(), args), args)
    assert compiled.plan.unwritten == (True, False)
    torch.testing.assert_close(compiled(*args), MixedScalar()(*args), rtol=1e-6, atol=1e-6)
