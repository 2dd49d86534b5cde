"""Zoo fixtures: each model is built, exported, rewritten and compiled once per test module.

The torch.compile route (`Case.dynamo`) compiles and runs a model on every
input set in one go, after `torch._dynamo.reset()`: dynamo's caches are per
code object, and transformers code shared by several models (mask helpers)
would otherwise pile up guards until the recompile limit sends it to eager.

The `zoo` marker is registered here, so the suite stays self-contained:
deselect the zoo with `-m "not zoo"`; the rows kept out of CI are `slow` (deselected by default).

No result may depend on what ran before: `FX_REWRITES_ZOO_SHUFFLE=SEED` runs the zoo's test modules, and
the tests within each, in an order shuffled by SEED (each module's models still built once), e.g.
`FX_REWRITES_ZOO_SHUFFLE=1 pytest tests/zoo`. CI runs the collected order with each model's tests side by side
(`by_model`: under pytest-xdist one worker builds the model's stages for both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
import torch

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites.backends.dynamo import CompiledGraph, dynamo_backend
from tests.zoo import float64, registry, spec


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "zoo: transformers models exported, rewritten with the IREE rules, compiled and run on IREE "
        "(in CI; deselect with -m 'not zoo')",
    )


#: FX_REWRITES_ZOO_SHUFFLE=SEED: the zoo's tests in an order shuffled by SEED (an int)
SHUFFLE_ENV = "FX_REWRITES_ZOO_SHUFFLE"
_HERE = Path(__file__).resolve().parent


def shuffled(items: list[Any], seed: int) -> list[Any]:
    """`items` (pytest items) with the zoo's modules in a shuffled order and each module's tests shuffled; the
    items outside tests/zoo keep their places. A module's tests stay together: its module-scoped Zoo builds
    each model once."""
    rng = random.Random(seed)
    places = [i for i, item in enumerate(items) if _HERE in Path(item.path).resolve().parents]
    modules: dict[Path, list[Any]] = {}
    for i in places:
        modules.setdefault(Path(items[i].path), []).append(items[i])
    order = list(modules)
    rng.shuffle(order)
    reordered = []
    for module in order:
        tests = modules[module]
        rng.shuffle(tests)
        reordered.extend(tests)
    out = list(items)
    for i, item in zip(places, reordered, strict=True):
        out[i] = item
    return out


def by_model(items: list[Any]) -> list[Any]:
    """`items` with each module's tests of one zoo model next to each other (in the order the module's first test
    meets the models; a model's tests in their own order), the other items in their places. pytest-xdist hands each
    worker a run of consecutive tests: a model's tests side by side build its module-scoped stages (export, rules,
    eager outputs) on one worker, where one test function after another split them between the workers and both
    built them."""
    places = [i for i, item in enumerate(items) if _HERE in Path(item.path).resolve().parents]
    groups: dict[tuple[Path, str], list[Any]] = {}
    for i in places:
        callspec = getattr(items[i], "callspec", None)
        model = callspec.params.get("name") if callspec is not None else None
        groups.setdefault((Path(items[i].path), model if model is not None else items[i].name), []).append(items[i])
    out = list(items)
    for i, item in zip(places, [item for group in groups.values() for item in group], strict=True):
        out[i] = item
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seed = os.environ.get(SHUFFLE_ENV, "").strip()
    items[:] = shuffled(items, int(seed)) if seed else by_model(items)


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = os.environ.get(SHUFFLE_ENV, "").strip()
    return f"zoo order shuffled with seed {seed} ({SHUFFLE_ENV})" if seed else None


#: FX_REWRITES_ZOO=full: the rows kept out of CI (`ci=False`, or a route `ci` leaves out) run by default too
FULL = os.environ.get("FX_REWRITES_ZOO", "") == "full"


def model_params(route: str, stage: str) -> list:
    """One pytest param per zoo row for a test of `stage` on `route` ("export" or "compile").

    A row whose `Known` failure stops this stage is a strict expected failure
    (raises KnownFailure) naming the form, the op and the owner; a row whose
    route CI leaves out (`ZooModel.in_ci`) is `slow`: deselected by default,
    run by `-m slow` or FX_REWRITES_ZOO=full.
    """
    params = []
    for m in registry.MODELS:
        marks = []
        known = m.known_at(route, stage)
        if known:
            marks.append(pytest.mark.xfail(raises=registry.KnownFailure, strict=True, reason=known.reason))
        if not m.in_ci(route) and not FULL:
            marks.append(pytest.mark.slow)
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
        self._exact: dict[int, Any] = {}
        self._stages: dict[str, tuple[bool, Any]] = {}

    @cached_property
    def model(self) -> torch.nn.Module:
        return self.entry.model()

    def inputs(self, seed: int) -> registry.Inputs:
        if seed not in self._inputs:
            self._inputs[seed] = self.entry.inputs(seed)
        return self._inputs[seed]

    @contextlib.contextmanager
    def expect(self, route: str, stage: str) -> Iterator[None]:
        """Turn a failure the row's `Known` describes (at this stage or before) into KnownFailure."""
        try:
            yield
        except registry.KnownFailure:
            raise
        except Exception as e:
            known = self.entry.known_at(route, stage)
            if known is None or not known.matches(e):
                raise
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            raise registry.KnownFailure(f"{self.entry.name}: {known.reason}: {type(e).__name__}: {first}") from e

    def _stage(self, route: str, stage: str, make: Any) -> Any:
        """`make()` once: its result, or its error, is kept (later tests of a failed stage fail alike, fast)."""
        if stage not in self._stages:
            try:
                with self.expect(route, stage):
                    self._stages[stage] = (True, make())
            except Exception as e:
                self._stages[stage] = (False, e)
        ok, value = self._stages[stage]
        if not ok:
            raise value
        return value

    @property
    def program(self) -> torch.export.ExportedProgram:
        args, kwargs = self.inputs(registry.SEEDS[0])
        return self._stage("export", "export", lambda: torch.export.export(self.model, args, kwargs or None))

    @property
    def result(self) -> fx_rewrites.Result:
        program = self.program
        return self._stage("export", "rules", lambda: fx_rewrites.apply(program, self.rules))

    @property
    def compiled(self) -> Any:
        args, _ = self.inputs(registry.SEEDS[0])
        program = self.result.program
        return self._stage("export", "iree", lambda: self.backend.compile(program, args))

    @property
    def dynamo(self) -> DynamoRun:
        """torch.compile(model, backend=fx_rewrites_iree, dynamic=False), run on every input set (kept)."""
        return self._stage("compile", "compile", self._run_dynamo)

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

    def exact(self, seed: int) -> float64.Reference:
        """The model's outputs on input set `seed` run in float64 and torch float32's error around them (what
        tells float noise from a fault: tests/zoo/float64.py); made when an output is not close to eager."""
        if seed not in self._exact:
            args, kwargs = self.inputs(seed)
            self._exact[seed] = float64.reference(self.model, args, kwargs, flatten=spec.leaves)
        return self._exact[seed]

    def assert_matches(self, got: Any, seed: int) -> None:
        """`got` (a route's outputs on input set `seed`) matches eager, float noise told from faults."""
        registry.assert_matches(got, self.eager(seed), self.entry.tolerance, exact=lambda: self.exact(seed))

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
