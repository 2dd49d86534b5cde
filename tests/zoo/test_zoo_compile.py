"""The zoo through torch.compile(model, backend="fx_rewrites_iree"), compared with eager.

Dynamo traces each model (dynamic=False), aot_autograd makes the functional
ATen graph, the IREE rule set rewrites it and IREE compiles and runs it
(backends/dynamo.py). Each model is compiled and run on every input set
once (conftest.Case.dynamo); the test reads that run. What is known to fail
is a strict expected failure that names it (registry rows' `known`).
"""

from __future__ import annotations

import pytest

from tests.zoo import registry
from tests.zoo.conftest import model_params

pytestmark = [
    pytest.mark.zoo,
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),  # DeBERTa-v2's code
]


@pytest.mark.parametrize("name", model_params("compile", "compile"))
def test_compiled_matches_eager(zoo, name):
    """Every graph reached IREE (a fallback to eager would leave fewer), converged, and the outputs match eager."""
    case = zoo.case(name)
    run = case.dynamo
    with case.expect("compile", "compile"):
        assert len(run.graphs) == case.entry.graphs, (
            f"dynamo handed the backend {len(run.graphs)} graphs; the row expects {case.entry.graphs}"
        )
        assert {g.kind for g in run.graphs} == {"inference"}, [g.kind for g in run.graphs]
        for graph in run.graphs:
            report = graph.result.report
            assert report.converged and not report.skips, (report.stop_reason, report.skips)
        for seed in registry.SEEDS:
            case.assert_matches(run.outputs[seed], seed)
