"""On a CPU device a call's input arrays are read where they lie (`calling.Invoker`: imported, not copied into
device buffers): the calls that can be imported are, the others (a misaligned view, a read-only array, an empty
one) are copied as before, and either way the result is eager's and the caller's own: a later write to the input
changes neither a result already returned nor the state the module kept from it. Small compiles (ms each)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from fx_rewrites import apply, backends
from fx_rewrites.backends.iree import IreeBackend
from fx_rewrites.backends.iree.calling import Invoker
from fx_rewrites.backends.iree.runtime import is_host_device

DRIVERS = ("local-task", "local-sync")


def _compile(model: torch.nn.Module, args: tuple, driver: str = "local-task") -> Any:
    rules = backends.get("iree").rules
    program = apply(torch.export.export(model, args), rules).program
    return IreeBackend(driver=driver).compile(program, args)


class Scaled(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 3


class Copied(torch.nn.Module):
    """Returns a copy of its input: IREE may hand back the argument's own buffer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


class Previous(torch.nn.Module):
    """Returns the input of the call before (zeros at first): the module keeps each input as its state."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("last", torch.zeros(4, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.last.clone()
        self.last.copy_(x)
        return out


class _CountingPacker:
    """iree.runtime's argument packer, counting the calls that copy their arguments."""

    def __init__(self, packer: Any) -> None:
        self.packer, self.calls = packer, 0

    def pack(self, *args: Any) -> Any:
        self.calls += 1
        return self.packer.pack(*args)


def _x(seed: int, shape: tuple[int, ...] = (4, 64)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _counted(compiled: Any) -> tuple[Invoker, _CountingPacker]:
    invoker = Invoker.of(compiled.function, is_host_device(compiled.function._device))
    assert invoker is not None
    invoker._packer = counting = _CountingPacker(invoker._packer)
    return invoker, counting


@pytest.mark.parametrize("driver", DRIVERS)
def test_aligned_inputs_are_imported_and_the_others_copied(driver):
    compiled = _compile(Scaled(), (_x(0),), driver)
    assert is_host_device(compiled.function._device)
    invoker, packer = _counted(compiled)
    flat = _x(1, (4 * 64 + 1,))
    aligned = _x(2)
    readonly = aligned.numpy().copy()
    readonly.flags.writeable = False
    cases = {
        "aligned": (aligned.numpy(), 0),
        "a view one float past an aligned block": (flat[1:].view(4, 64).numpy(), 1),
        "read-only": (readonly, 1),
    }
    for name, (array, copies) in cases.items():
        before = packer.calls
        (got,) = invoker(array)
        assert packer.calls - before == copies, name
        want = Scaled()(torch.from_numpy(array.copy()))
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-6, atol=1e-6)


def test_a_device_not_made_for_the_host_copies():
    compiled = _compile(Scaled(), (_x(0),))
    assert not is_host_device(object())
    invoker = Invoker.of(compiled.function)  # host_memory False: what a GPU device's function gets
    invoker._packer = packer = _CountingPacker(invoker._packer)
    (got,) = invoker(_x(3).numpy())
    assert packer.calls == 1
    torch.testing.assert_close(torch.from_numpy(got), Scaled()(_x(3)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_write_to_the_input_after_the_call_does_not_reach_its_result(driver):
    compiled = _compile(Copied(), (_x(0),), driver)
    x = _x(4)
    want = x.clone()
    got = compiled(x)
    x.add_(1000.0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_state_kept_from_an_input_is_the_modules_own(driver):
    compiled = _compile(Previous(), (_x(0),), driver)
    first, second = _x(5), _x(6)
    kept = first.clone()
    torch.testing.assert_close(compiled(first), torch.zeros(4, 64), rtol=0, atol=0)
    first.mul_(-7.0)  # written after the call that kept it
    torch.testing.assert_close(compiled(second), kept, rtol=0, atol=0)
    torch.testing.assert_close(compiled(_x(7)), second, rtol=0, atol=0)


def test_an_empty_input_is_copied():
    invoker_array = np.zeros((0, 64), np.float32)
    compiled = _compile(Copied(), (_x(0, (0, 64)),))
    invoker, packer = _counted(compiled)
    (got,) = invoker(invoker_array)
    assert packer.calls == 1 and got.shape == (0, 64)
