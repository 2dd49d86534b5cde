"""Which zoo rows and routes CI runs: a route a row's `ci` leaves out is `slow` (deselected by default)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.zoo import conftest, registry


def _slow(route: str, stage: str) -> set[str]:
    return {p.id for p in conftest.model_params(route, stage) if any(m.name == "slow" for m in p.marks)}


def test_a_route_left_out_of_ci_is_slow_and_the_others_are_not(monkeypatch):
    monkeypatch.setattr(conftest, "FULL", False)
    by_ci = {ci: {m.name for m in registry.MODELS if m.ci == ci} for ci in (True, "export", False)}
    assert all(by_ci.values()), by_ci  # each kind has rows
    assert _slow("export", "rules") == _slow("export", "iree") == by_ci[False]
    assert _slow("compile", "compile") == by_ci[False] | by_ci["export"]


def test_full_runs_every_row(monkeypatch):
    monkeypatch.setattr(conftest, "FULL", True)
    assert not _slow("export", "iree") and not _slow("compile", "compile")


@pytest.mark.parametrize("ci", ["compile", "yes", None])
def test_ci_is_a_bool_or_export(ci):
    row = registry.MODELS[0]
    with pytest.raises(AssertionError, match="expected True, False or 'export'"):
        dataclasses.replace(row, ci=ci)
