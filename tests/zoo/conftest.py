"""Zoo fixtures: each model is built, exported, rewritten and compiled once per test module.

The torch.compile route (`Case.dynamo`) compiles and runs a model on every
input set in one go, after `torch._dynamo.reset()`: dynamo's caches are per
code object, and transformers code shared by several models (mask helpers)
would otherwise pile up guards until the recompile limit sends it to eager.

The `zoo` marker is registered here, so the suite stays self-contained:
deselect the zoo with `-m "not zoo"` (it is also `slow`).
"""

from __future__ import annotations

import dataclasses
import re
from functools import cached_property
from typing import Any

import pytest
import torch

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites.backends.dynamo import CompiledGraph, dynamo_backend
from tests.zoo import registry


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "zoo: transformers models exported, rewritten with the IREE rules, compiled and run on IREE "
        "(in CI; deselect with -m 'not zoo')",
    )


class ExportFailed(Exception):
    """torch.export failed the way the registry says it does (an expected failure)."""


class CompileFailed(Exception):
    """torch.compile failed the way the registry says it does (an expected failure)."""


#: route -> (the registry field naming torch's error, the exception its stage raises, what fails)
_ROUTES = {
    "export": ("export_error", ExportFailed, "torch.export"),
    "compile": ("compile_error", CompileFailed, "torch.compile"),
}


def model_params(route: str) -> list:
    """One pytest param per zoo model; a model torch cannot take on `route`
    ("export" or "compile") is a strict expected failure naming torch's error."""
    field, raises, what = _ROUTES[route]
    params = []
    for m in registry.MODELS:
        error = getattr(m, field)
        marks = (
            pytest.mark.xfail(raises=raises, strict=True, reason=f"{what} fails: /{error}/ ({m.note})") if error else ()
        )
        params.append(pytest.param(m.name, marks=marks, id=m.name))
    return params


@dataclasses.dataclass(frozen=True)
class DynamoRun:
    """What torch.compile(model, backend=fx_rewrites_iree) did: outputs per seed and the graphs compiled."""

    outputs: dict[int, Any]
    graphs: list[CompiledGraph]


class Case:
    """One zoo model: every stage computed on first use, then kept."""

    def __init__(self, entry: registry.ZooModel, backend: Any, rules: Any) -> None:
        self.entry = entry
        self.backend = backend
        self.rules = rules
        self._inputs: dict[int, registry.Inputs] = {}
        self._eager: dict[int, Any] = {}
        self._export_error: BaseException | None = None
        self._compile_error: BaseException | None = None

    @cached_property
    def model(self) -> torch.nn.Module:
        return self.entry.model()

    def inputs(self, seed: int) -> registry.Inputs:
        if seed not in self._inputs:
            self._inputs[seed] = self.entry.inputs(seed)
        return self._inputs[seed]

    @cached_property
    def program(self) -> torch.export.ExportedProgram:
        if self._export_error is not None:
            raise self._export_error
        args, kwargs = self.inputs(registry.SEEDS[0])
        try:
            return torch.export.export(self.model, args, kwargs or None)
        except Exception as e:
            error: BaseException = e
            if self.entry.export_error and re.search(self.entry.export_error, str(e)):
                first = str(e).strip().splitlines()[0][:300]
                error = ExportFailed(f"{self.entry.name}: torch.export fails: {type(e).__name__}: {first}")
                error.__cause__ = e
            self._export_error = error
            raise error from e

    @cached_property
    def result(self) -> fx_rewrites.Result:
        return fx_rewrites.apply(self.program, self.rules)

    @cached_property
    def compiled(self) -> Any:
        args, _ = self.inputs(registry.SEEDS[0])
        return self.backend.compile(self.result.program, args)

    @property
    def dynamo(self) -> DynamoRun:
        """torch.compile(model, backend=fx_rewrites_iree, dynamic=False), run on every input set (kept)."""
        if self._compile_error is not None:
            raise self._compile_error
        if not hasattr(self, "_dynamo"):
            try:
                self._dynamo = self._run_dynamo()
            except Exception as e:
                error: BaseException = e
                if self.entry.compile_error and re.search(self.entry.compile_error, str(e)):
                    first = str(e).strip().splitlines()[0][:300]
                    error = CompileFailed(f"{self.entry.name}: torch.compile fails: {type(e).__name__}: {first}")
                    error.__cause__ = e
                self._compile_error = error
                raise error from e
        return self._dynamo

    def _run_dynamo(self) -> DynamoRun:
        graphs: list[CompiledGraph] = []
        torch._dynamo.reset()
        compiled = torch.compile(
            self.model, backend=dynamo_backend(self.backend, on_graph=graphs.append), dynamic=False
        )
        try:
            outputs = {seed: self.run(compiled, seed) for seed in registry.SEEDS}
        finally:
            torch._dynamo.reset()  # the compiled code holds the model; the next model starts clean
        return DynamoRun(outputs, graphs)

    def eager(self, seed: int) -> Any:
        if seed not in self._eager:
            args, kwargs = self.inputs(seed)
            with torch.no_grad():
                self._eager[seed] = self.model(*args, **kwargs)
        return self._eager[seed]

    def run(self, fn: Any, seed: int) -> Any:
        args, kwargs = self.inputs(seed)
        with torch.no_grad():
            return fn(*args, **kwargs)


class Zoo:
    def __init__(self) -> None:
        self.backend = backends.get("iree")
        self.rules = self.backend.rules  # DEFAULT (with the vmap and view_or_copy packs) | IREE's pack
        self._cases: dict[str, Case] = {}

    def case(self, name: str) -> Case:
        if name not in self._cases:
            self._cases[name] = Case(registry.BY_NAME[name], self.backend, self.rules)
        return self._cases[name]


@pytest.fixture(scope="module")
def zoo() -> Zoo:
    return Zoo()
