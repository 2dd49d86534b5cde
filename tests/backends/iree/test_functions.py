"""Several exported programs in one IREE module (`backends/iree/functions.py`): the weights they share are one
parameter global, the buffers they update under one key one mutable global, so what one function stores the
next one reads; each function has its own call plan. One small compile (two functions)."""

from __future__ import annotations

import pytest
import torch

from fx_rewrites import apply, backends
from fx_rewrites.backends.iree.functions import compile_functions
from fx_rewrites.backends.iree.runtime import IreeCompiled


class Accumulator(torch.nn.Module):
    """Mode "add" accumulates `x @ w` into a buffer; "read" returns the sum so far times `x @ w` (it reads the
    buffer, never writes it); "count" touches only the call counter. Every mode counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(8, 8, generator=g))
        self.register_buffer("acc", torch.zeros(2, 8))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        y = x @ self.w
        self.calls.add_(1)
        if mode == "count":
            return y + self.calls
        if mode == "read":
            return self.acc * y + self.calls
        self.acc.add_(y)
        return self.acc + self.calls


def _programs(model: Accumulator, modes: tuple[str, ...] = ("add", "read")) -> dict[str, torch.export.ExportedProgram]:
    x = torch.randn(2, 8)
    iree = backends.get("iree")
    return {mode: apply(torch.export.export(model, (x, mode)), iree.rules).program for mode in modes}


@pytest.fixture(scope="module")
def built():
    model = Accumulator()
    iree = backends.get("iree")
    functions = compile_functions(iree, _programs(model), limit=0)
    bound = iree.load_module(functions.vmfb, functions.parameters)
    calls = {n: IreeCompiled(functions.plans[n], bound[n], functions.mlir, functions.vmfb) for n in ("add", "read")}
    return model, functions, calls


def test_the_functions_share_state_and_weights(built):
    model, _, calls = built
    eager = Accumulator()  # same seed: the same weight, fresh state
    xs = [torch.randn(2, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with torch.no_grad():
        for name, x in zip(("add", "add", "read", "add"), xs, strict=True):
            want = eager(x, name)
            torch.testing.assert_close(calls[name](x, name), want)
    # the model the programs were exported from keeps its own state
    assert not model.acc.any() and model.calls.item() == 0


def test_each_weight_and_state_is_declared_once(built):
    _, functions, _ = built
    declared = [line for line in functions.mlir.splitlines() if line.strip().startswith("util.global private")]
    assert sum('"model"::"w">' in line for line in declared) == 1
    assert sum("@__state_acc " in line for line in declared) == 1
    assert sum("@__state_calls " in line for line in declared) == 1
    assert "func.func @add(" in functions.mlir and "func.func @read(" in functions.mlir
    assert functions.state == {"add": ("acc", "calls"), "read": ("acc", "calls")}  # read reads what add wrote


class Other(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(2, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x)
        return self.total


def test_same_state_refuses_functions_that_update_different_buffers():
    iree = backends.get("iree")
    programs = _programs(Accumulator(), ("add",))
    programs["other"] = apply(torch.export.export(Other(), (torch.randn(2, 8),)), iree.rules).program
    with pytest.raises(ValueError, match="do not update the same state"):
        compile_functions(iree, programs, same_state=True)


def test_one_key_two_tensors_is_refused():
    """Programs from two instances name the same buffers with different tensors: no global can be both."""
    programs = {**_programs(Accumulator(), ("add",)), "read": _programs(Accumulator(), ("read",))["read"]}
    with pytest.raises(ValueError, match=r"with different tensors.*one module instance"):
        compile_functions(backends.get("iree"), programs)
