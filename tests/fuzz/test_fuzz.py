"""Differential fuzzing: random modules holding every family's bad forms, exported,
rewritten with DEFAULT (and with the IREE backend's rules, compiled and run), and
compared with eager; and random ATen graphs built node by node (no export, so
cheaper), rewritten and compared with the graph as built. The properties are in
`properties.py` and `graphs.py`, the module generator in `generate.py`.

Budgets come from the hypothesis profile (tests/conftest.py): "ci" by default,
HYPOTHESIS_PROFILE=local for 10,000 cases per test. The seed is fixed (FUZZ_SEED,
default below) and failing examples are kept in tests/fuzz/examples (written by
local runs, replayed read-only by every run), so a failure replays.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest
from hypothesis import given, seed, settings
from hypothesis.database import DirectoryBasedExampleDatabase, ReadOnlyDatabase

from fx_rewrites import backends
from tests.fuzz.generate import Spec, specs
from tests.fuzz.graphs import check_graph, graph_specs
from tests.fuzz.properties import check_default, check_iree

pytestmark = pytest.mark.fuzz

SEED = int(os.environ.get("FUZZ_SEED", "20261121"))
_EXAMPLES = DirectoryBasedExampleDatabase(Path(__file__).parent / "examples")
DATABASE = _EXAMPLES if os.environ.get("HYPOTHESIS_PROFILE") == "local" else ReadOnlyDatabase(_EXAMPLES)
#: steps whose form IREE 3.13 cannot take even after its rules (docs/reliability.md, "Found by fuzzing")
IREE_GAPS = frozenset(
    {
        "add_batch",  # SymInt / float: the FX importer has no torch.sym_float
        "view_write",  # with Dim sizes: write-backs IREE fails on (docs/reliability.md); its own test is static
    }
)
#: IREE compiles each case (a second or more), so it gets an eighth of the profile's budget
IREE_EXAMPLES = max(4, settings.default.max_examples // 8)


def _logged(check, spec, *args) -> None:
    """Run a check; with FUZZ_LOG=path, append one line per case (outcome, spec; for modules also the dims
    that stayed dynamic after export) for long local runs."""
    log = os.environ.get("FUZZ_LOG")
    try:
        exported = check(spec, *args)
    except BaseException as e:
        if log:
            with open(log, "a") as f:
                f.write(f"FAIL {type(e).__name__}\t{spec!r}\n")
        raise
    if log:
        kept = f"\tkept_dynamic={exported.dynamic}" if isinstance(exported, Spec) else ""
        with open(log, "a") as f:
            f.write(f"ok\t{spec!r}{kept}\n")


@seed(SEED)
@settings(database=DATABASE)
@given(specs())
def test_default_rules_keep_eager_results(spec):
    _logged(check_default, spec)


@seed(SEED)
@settings(database=DATABASE, max_examples=max(4, settings.default.max_examples // 2))
@given(specs(max_steps=3, require="view_write"))
def test_default_rules_keep_writes_through_views(spec):
    """Every case holds in-place writes through chains of views (`view_writes.py`), read after."""
    _logged(check_default, spec)


@seed(SEED)
@settings(database=DATABASE, max_examples=max(4, settings.default.max_examples // 2))
@given(graph_specs())
def test_default_rules_keep_results_of_hand_built_graphs(spec):
    _logged(check_graph, spec)


@seed(SEED)
@settings(database=DATABASE, max_examples=IREE_EXAMPLES)
@given(specs(max_steps=4, exclude=IREE_GAPS))
def test_iree_matches_eager_after_its_rules(spec):
    _logged(check_iree, spec, backends.get("iree"))


@seed(SEED)
@settings(database=DATABASE, max_examples=IREE_EXAMPLES)
@given(specs(max_steps=2, exclude=IREE_GAPS, require="view_write"))
def test_iree_keeps_writes_through_views(spec):
    """In-place writes through chains of views on IREE, static sizes: with Dim sizes IREE 3.13 fails on
    some write-backs that torch runs right (docs/reliability.md, "Found by fuzzing")."""
    _logged(check_iree, attrs.evolve(spec, dynamic=()), backends.get("iree"))
