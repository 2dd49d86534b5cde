"""torchao's quantization ops lowered by their own reference implementation (rewrites/rules/quantized.py).

Before-graphs are `torch.export` of a Linear quantized by torchao 0.18 (W8A8's `choose_qparams_affine` +
`quantize_affine` on the activations, `IntxWeightOnlyConfig`'s grouped `dequantize_affine` of the weight);
after the rule no torchao op is left, and the program computes what the quantized eager module computes.
"""

from __future__ import annotations

import pytest
import torch

from fx_rewrites import testing as rt

quantization = pytest.importorskip(
    "torchao.quantization", reason="torchao is not installed (pip install -e '.[test]' installs it)"
)
from torchao.quantization.granularity import PerGroup  # noqa: E402

from fx_rewrites.rules.quantized import lower_torchao_quantization_ops  # noqa: E402
from fx_rewrites.torchao_ops import torchao_ops  # noqa: E402

torchao = torch.ops.torchao
aten = torch.ops.aten

SCHEMES = {
    "w8a8": lambda: quantization.Int8DynamicActivationInt8WeightConfig(),
    "int4_g32": lambda: quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
    "int8_g32": lambda: quantization.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(32)),
    "a8_int4_g32": lambda: quantization.Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(32)
    ),
}


def _quantized_linear(scheme: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48)).eval()
    quantization.quantize_(model, SCHEMES[scheme]())
    return model


def _inputs(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_torchao_ops_become_their_reference_aten(scheme: str, dynamic: bool) -> None:
    model = _quantized_linear(scheme)
    shapes = {"input": {0: torch.export.Dim("rows", min=2, max=64)}} if dynamic else None
    program = torch.export.export(model, (_inputs(5, 0),), dynamic_shapes=shapes)
    before = {n.target for n in program.run_decompositions({}).graph.nodes if n.op == "call_function"}
    assert before & set(torchao_ops()), before  # the export holds torchao's ops: what the rule is for
    result = rt.apply_rules(program, lower_torchao_quantization_ops)
    rt.assert_fired(result, lower_torchao_quantization_ops)
    rt.assert_ops(result, absent=torchao_ops())
    ops = set(rt.targets(result))
    if scheme.startswith(("w8a8", "a8")):
        assert aten.round.default in ops and aten.amax.default in ops  # the activations' qparams and rounding
    rows = (5, 17) if dynamic else (5, 5)
    with torch.no_grad():  # torchao's own implementation traced: the same floats as the quantized eager module
        rt.assert_matches_eager(result, model, [(_inputs(rows[0], 1),), (_inputs(rows[1], 2),)], rtol=0, atol=1e-6)
    rt.assert_idempotent(result, lower_torchao_quantization_ops)


def test_without_torchao_ops_the_rule_roots_nothing_a_graph_holds() -> None:
    program = rt.export(torch.nn.Linear(4, 4), torch.randn(2, 4))
    result = rt.apply_rules(program, lower_torchao_quantization_ops)
    assert result.report.total_rewrites == 0
    assert all(callable(root) for root in lower_torchao_quantization_ops.roots)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_pt2e_quantize_ops_become_torchs_own_kernels(dynamic: bool) -> None:
    from fx_rewrites.rules.quantized import PT2E_REFERENCE, lower_quantized_decomposed_ops
    from tests.test_pt2e import images, pt2e_residual_net

    shapes = {"x": {0: torch.export.Dim("batch", min=1, max=8)}} if dynamic else None
    quantized = pt2e_residual_net(shapes)
    program = torch.export.export(quantized, (images(2, 0),), dynamic_shapes=shapes)
    assert set(rt.targets(program)) & set(PT2E_REFERENCE)  # PT2E's convert left its q/dq ops
    result = rt.apply_rules(program, lower_quantized_decomposed_ops)
    rt.assert_fired(result, lower_quantized_decomposed_ops)
    rt.assert_ops(result, absent=list(PT2E_REFERENCE), present=[aten.round.default, aten.clamp.default])
    batches = (2, 5) if dynamic else (2, 2)
    with torch.no_grad():  # torch's own kernels inlined: the same floats and bytes as the quantized eager model
        rt.assert_matches_eager(result, quantized, [(images(batches[0], 1),), (images(batches[1], 2),)], rtol=0, atol=0)
    rt.assert_idempotent(result, lower_quantized_decomposed_ops)
