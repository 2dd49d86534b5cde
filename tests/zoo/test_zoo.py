"""The transformers zoo on IREE: torch.export -> fx_rewrites.apply(IREE rules) -> compile -> run -> eager.

Each model is exported, rewritten and compiled once (see conftest.py); the
tests read those shared stages. Models torch.export cannot export are
expected failures that name torch's error (registry.ZooModel.export_error).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from fx_rewrites.engine import RewriteError
from tests.zoo import registry
from tests.zoo.conftest import model_params
from tests.zoo.registry import assert_matches

pytestmark = [
    pytest.mark.zoo,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),  # DeBERTa-v2's code
]


@pytest.mark.parametrize("name", model_params("export"))
def test_exports(zoo, name):
    program = zoo.case(name).program
    assert any(n.op == "call_function" for n in program.graph.nodes)


@pytest.mark.parametrize("name", model_params("export"))
def test_rules_converge_as_recorded(zoo, name):
    case = zoo.case(name)
    report = case.result.report
    assert report.converged, report.stop_reason
    assert not report.skips, report.skips
    assert set(report.rewrites) == set(case.entry.fires), (
        f"fired {dict(report.rewrites)}; the registry expects {sorted(case.entry.fires)}"
    )


def _informative(outputs) -> bool:
    """Some float output varies (random weights can leave a deep net with outputs ~1e-26: nothing to compare)."""
    leaves = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return any(t.numel() > 1 and t.std().item() > 1e-3 for t in leaves)


@pytest.mark.parametrize("name", model_params("export"))
def test_rewritten_program_matches_eager(zoo, name):
    case = zoo.case(name)
    assert _informative(case.eager(registry.SEEDS[0])), "eager outputs are ~constant: fix the config's scale"
    for seed in registry.SEEDS:
        assert_matches(case.run(case.result.program.module(), seed), case.eager(seed))


@pytest.mark.parametrize("name", model_params("export"))
def test_iree_matches_eager(zoo, name):
    case = zoo.case(name)
    for seed in registry.SEEDS:
        assert_matches(case.run(case.compiled, seed), case.eager(seed))


@pytest.mark.parametrize("name", [m.name for m in registry.MODELS if m.as_is])
def test_as_is_fails_on_iree_as_recorded(zoo, name):
    """The plain export fails on IREE, naming the op the registry records (the rules are needed)."""
    case = zoo.case(name)
    args, _ = case.inputs(registry.SEEDS[0])
    with pytest.raises(RewriteError) as info:
        case.backend.compile(case.program, args)
    assert getattr(info.value, "op", None) == case.entry.as_is, str(info.value)
