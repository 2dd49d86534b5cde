"""Quantized matmuls in the form IREE fuses (backends/iree/rules/quantized_matmul.py, weight_layout.py).

Before-graphs from `torch.export` of Linears quantized by torchao 0.18: `Int8WeightOnlyConfig` (the int8
weight transposed, converted to float32, `mm`, the scale after) and `IntxWeightOnlyConfig` int4/int8 in groups
of 32 (`dequantize_affine` feeding `linear`). After the rules: a reduction over the weight re-laid in blocks of
16 rows (`fx_rewrites::blocked_rows`), no float32 weight; the program computes what the quantized eager module
computes (the same dequantized values, the sums in another order). On IREE the blocks are an int8 parameter
and no dispatch converts a whole weight to float32.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.rules import DEFAULT
from tests.backends.iree.rules.float32_error import assert_within_torch_error

quantization = pytest.importorskip(
    "torchao.quantization", reason="torchao is not installed (pip install -e '.[test]' installs it)"
)
from torchao.quantization.granularity import PerGroup  # noqa: E402

from fx_rewrites.backends.iree.invoke import run_iree_compile  # noqa: E402
from fx_rewrites.backends.iree.parameters import INLINE_ENV  # noqa: E402
from fx_rewrites.backends.iree.rules.quantized_matmul import (  # noqa: E402
    DECODE_ROWS,
    grouped_linear_for_iree,
    int8_weight_mm_as_blocked_reduction_for_iree,
)
from fx_rewrites.backends.iree.weight_layout import BLOCKED_ROWS, FUSION_FLAGS, extra_flags  # noqa: E402

aten = torch.ops.aten

SCHEMES = {
    "int8_wo": (lambda: quantization.Int8WeightOnlyConfig(), int8_weight_mm_as_blocked_reduction_for_iree),
    "int4_g32": (
        lambda: quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
        grouped_linear_for_iree,
    ),
    "int4_g32_bf16_scales": (
        lambda: quantization.IntxWeightOnlyConfig(
            weight_dtype=torch.int4, granularity=PerGroup(32), scale_dtype=torch.bfloat16
        ),
        grouped_linear_for_iree,
    ),
    "int8_g32": (
        lambda: quantization.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(32)),
        grouped_linear_for_iree,
    ),
}


def _linear(scheme: str, out_features: int = 48, in_features: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(in_features, out_features)).eval()
    quantization.quantize_(model, SCHEMES[scheme][0]())
    return model


def _x(rows: int, seed: int, features: int = 64) -> torch.Tensor:
    return torch.randn(1, rows, features, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_quantized_linear_becomes_a_blocked_reduction(scheme: str, dynamic: bool) -> None:
    """A decode step's rows (at most `DECODE_ROWS`: static, or a Dim bounded so)."""
    model, rule = _linear(scheme), SCHEMES[scheme][1]
    shapes = {"input": {1: torch.export.Dim("rows", min=1, max=DECODE_ROWS)}} if dynamic else None
    program = torch.export.export(model, (_x(2, 0),), dynamic_shapes=shapes)
    result = rt.apply_rules(program, DEFAULT + rule)  # DEFAULT drops export's metadata asserts first
    rt.assert_fired(result, rule.name, times=1)
    rt.assert_ops(result, present=[BLOCKED_ROWS, aten.sum.dim_IntList], absent=[aten.mm.default, aten.linear.default])
    floats = [
        n
        for n in result.graph_module.graph.nodes
        if n.op == "call_function" and n.target is aten._to_copy.default and n.meta["val"].dim() == 2
    ]
    assert not floats, floats  # no [N, K] float32 copy of the weight: the conversion is of the blocks
    rows = (2, 1) if dynamic else (2, 2)
    with torch.no_grad():  # the same dequantized weights, float32 sums in another order
        rt.assert_matches_eager(result, model, [(_x(rows[0], 1),), (_x(rows[1], 2),)], rtol=0, atol=2e-5)
    rt.assert_idempotent(result, DEFAULT + rule)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_a_prefill_becomes_a_matmul_of_the_dequantized_blocks(scheme: str, dynamic: bool) -> None:
    """More rows than a decode step's (a prefill): the same blocks dequantized by torchao's float32 operations,
    transposed to [K, N], one `mm` (IREE data-tiles it); no reduction. The weight is stored once, as the decode's
    blocks. Numbers: the quantized eager model's dequantized values, float32 sums in another order."""
    model, rule = _linear(scheme), SCHEMES[scheme][1]
    shapes = {"input": {1: torch.export.Dim("rows", min=2, max=64)}} if dynamic else None
    program = torch.export.export(model, (_x(5, 0),), dynamic_shapes=shapes)
    result = rt.apply_rules(program, DEFAULT + rule)
    rt.assert_fired(result, rule.name, times=1)
    rt.assert_ops(result, present=[BLOCKED_ROWS, aten.mm.default], absent=[aten.sum.dim_IntList, aten.linear.default])
    nodes = [n for n in result.graph_module.graph.nodes if n.op == "call_function"]
    (mm,) = [n for n in nodes if n.target is aten.mm.default]
    weight = mm.args[1]
    assert weight.target is aten.view.default and tuple(weight.meta["val"].shape) == (64, 48), weight.meta["val"]
    assert weight.args[0].target is aten.clone.default  # of the permuted float blocks
    blocks = [tuple(n.meta["val"].shape) for n in nodes if n.target is BLOCKED_ROWS]
    grouped = scheme != "int8_wo"
    # the decode's layouts: per channel [N/16, K, 16]; in 2 groups of 32 [N/16, 1, 32, 2, 16], scales [N/16, G, 16]
    assert blocks[0] == ((3, 1, 32, 2, 16) if grouped else (3, 64, 16)), blocks
    assert len(blocks) == (3 if grouped else 1), blocks  # the weight, its scales and its zero points
    rows = (5, 23) if dynamic else (5, 5)
    with torch.no_grad():
        rt.assert_matches_eager(result, model, [(_x(rows[0], 1),), (_x(rows[1], 2),)], rtol=0, atol=2e-5)
    rt.assert_idempotent(result, DEFAULT + rule)


@pytest.mark.parametrize("scheme", ["int4_g32", "int8_g32"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("in_features", [32 * 7, 32 * 8], ids=["7_groups", "8_groups"])
def test_grouped_linear_sums_its_groups_by_halves(scheme: str, dynamic: bool, in_features: int) -> None:
    model, rule = _linear(scheme, in_features=in_features), SCHEMES[scheme][1]
    shapes = {"input": {1: torch.export.Dim("rows", min=1, max=DECODE_ROWS)}} if dynamic else None
    program = torch.export.export(model, (_x(2, 0, in_features),), dynamic_shapes=shapes)
    result = rt.apply_rules(program, DEFAULT + rule)
    rt.assert_fired(result, rule.name, times=1)
    nodes = [n for n in result.graph_module.graph.nodes if n.op == "call_function"]
    groups = in_features // 32
    tile = {7: 1, 8: 4}[groups]  # 4 groups interleaved where 4 divide them, else none
    # the weight laid out [N/16, G/t, 32, t, 16]: t groups' 16 channels side by side at each position of a group
    layouts = [tuple(n.meta["val"].shape) for n in nodes if n.target is BLOCKED_ROWS and n.meta["val"].dim() == 5]
    assert layouts == [(48 // 16, groups // tile, 32, tile, 16)], layouts
    # the partial sums [rows, N/16, G/t, t, 16] are summed over the groups (axes 2 and 3) by halves, not reduced
    reduced = [n.args[1] for n in nodes if n.target is aten.sum.dim_IntList]
    assert [2] not in reduced, reduced
    halves = {axis: [n for n in nodes if n.target is aten.slice.Tensor and n.args[1] == axis] for axis in (2, 3)}
    # 7 groups (t = 1): 3 + 3 (one aside), 1 + 1 (one aside) = 6 slices on axis 2, none on axis 3 (of size 1);
    # 8 groups (t = 4): 1 + 1 on axis 2 (of size 2), 2 + 2, 1 + 1 on axis 3
    expected = {7: (6, 0), 8: (2, 4)}[groups]
    assert (len(halves[2]), len(halves[3])) == expected, {a: [n.args for n in h] for a, h in halves.items()}
    adds = [n for n in nodes if n.target is aten.add.Tensor]
    assert len(adds) >= {7: 4, 8: 3}[groups]
    rows = (2, 1) if dynamic else (2, 2)
    inputs = [(_x(rows[0], 1, in_features),), (_x(rows[1], 2, in_features),)]
    with torch.no_grad():
        rt.assert_matches_eager(result, model, inputs, rtol=0, atol=2e-5)


def test_rows_that_do_not_fill_blocks_are_left_alone() -> None:
    model = _linear("int8_wo", out_features=40)  # 40 rows: not a multiple of 16
    result = rt.apply_rules(
        torch.export.export(model, (_x(5, 0),)), DEFAULT + int8_weight_mm_as_blocked_reduction_for_iree
    )
    rt.assert_not_fired(result, int8_weight_mm_as_blocked_reduction_for_iree)


def test_an_int8_weight_that_is_an_input_is_left_alone() -> None:
    class Dequantized(torch.nn.Module):  # the form of Int8WeightOnlyConfig's graph, the weight passed in
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.mm(x, w.t().to(torch.float32))

    program = torch.export.export(Dequantized(), (torch.randn(2, 64), torch.zeros(32, 64, dtype=torch.int8)))
    result = rt.apply_rules(program, DEFAULT + int8_weight_mm_as_blocked_reduction_for_iree)
    rt.assert_not_fired(result, int8_weight_mm_as_blocked_reduction_for_iree)


@pytest.mark.parametrize("scheme", ["int8_wo", "int4_g32", "int4_g32_bf16_scales"])
def test_iree_reads_int8_blocks_and_writes_no_float_weight(scheme: str, monkeypatch) -> None:
    monkeypatch.setenv(INLINE_ENV, "0")  # every weight a parameter, as a real model's are
    # a decode step (one row); int4 g32 of a decode's rows is the int4 dispatch's on AVX2 (rules/int4_decode.py)
    # where the channels fill its tile of 32: 80 do not, so they keep the byte form
    n = 96 if scheme == "int8_wo" else 80
    model = _linear(scheme, out_features=n)
    x = _x(1, 3)
    compiled = fx_rewrites.compile(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=2e-5)
    params = compiled.runtime.parameters
    blocks = [v for k, v in params.items() if k.endswith(".blocked_rows") and v.dtype == torch.int8]
    # per channel [N/16, K, 16]; in 2 groups of 32, both interleaved: [N/16, G/2, 32, 2, 16]
    layout = (n // 16, 64, 16) if scheme == "int8_wo" else (n // 16, 1, 32, 2, 16)
    assert any(tuple(v.shape) == layout for v in blocks), {k: v.shape for k, v in params.items()}
    assert not any(v.dtype == torch.float32 and v.numel() == n * 64 for v in params.values())
    if scheme == "int4_g32_bf16_scales":  # the scales stay bfloat16 (blocked [N/16, G, 16]), converted in the kernel
        scales = [v for v in params.values() if v.dtype == torch.bfloat16]
        assert [tuple(v.shape) for v in scales] == [(n // 16, 2, 16)], {k: v.shape for k, v in params.items()}
    mlir = compiled.runtime.mlir
    assert extra_flags(mlir) == FUSION_FLAGS
    from fx_rewrites.backends.iree.importing import iree_modules

    backend = fx_rewrites.backends.get("iree")
    with tempfile.TemporaryDirectory() as tmp:
        flags = (
            *backend.flags,
            *backend.perf_flags,
            *extra_flags(mlir),
            f"--iree-hal-dump-executable-sources-to={tmp}",
        )
        run_iree_compile(iree_modules(), mlir, "llvm-cpu", flags, None)
        sources = {p.name: p.read_text() for p in Path(tmp).glob("*.mlir")}
    main = {name: text for name, text in sources.items() if "main" in name}
    # the int8 weight is read where it is reduced: per channel one dispatch, in groups the partial sums per
    # group (N/16 x G x 16 floats, a 32nd of the weight) scaled, then the groups summed; none stores a float32
    # weight. torchao's int4 g32 is symmetric: its zero points (all 0) are dropped with their share, so no
    # dispatch sums x per group for it (it had 3 dispatches with them)
    assert len(main) == (1 if scheme == "int8_wo" else 2), sorted(sources)
    assert not any(v.dtype == torch.int8 and v.dim() == 3 and v.shape[1] == 2 for v in params.values()), {
        k: v.shape for k, v in params.items()
    }  # no zero points [N/16, G, 16]
    for text in main.values():
        stored = [math.prod(map(int, s.split("x"))) for s in re.findall(r"writeonly:tensor<([0-9x]+)xf32>", text)]
        assert all(size < n * 64 for size in stored), stored
    assert os.environ[INLINE_ENV] == "0"


@pytest.mark.parametrize("scheme", ["int8_wo", "int4_g32"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_iree_prefill_packs_the_dequantized_blocks_into_a_data_tiled_matmul(
    scheme: str, dynamic: bool, monkeypatch
) -> None:
    """A prefill's rows: IREE reads the decode's int8 blocks (the only copy of the weight in the module's
    parameters), dequantizes them into the packed operand of a data-tiled matmul (`mmt4d`) in one dispatch, and
    multiplies; the numbers are the quantized eager model's within float32 sums' order. What is written per call:
    that packed float32 operand (the weight's size in the matmul's tiles), not a float32 copy in a parameter."""
    monkeypatch.setenv(INLINE_ENV, "0")
    model = _linear(scheme, out_features=96)
    x = _x(16, 3)
    shapes = ({1: torch.export.Dim("rows", min=3, max=64)},) if dynamic else None
    compiled = fx_rewrites.compile(model, (x,), dynamic_shapes=shapes)
    with torch.no_grad():
        for rows in (16, 37) if dynamic else (16, 16):
            xs = _x(rows, rows)
            torch.testing.assert_close(compiled(xs), model(xs), rtol=0, atol=2e-5)
    params = compiled.runtime.parameters
    weights = [v for v in params.values() if v.numel() >= 96 * 64]
    assert weights and all(v.dtype == torch.int8 for v in weights), {k: (v.dtype, v.shape) for k, v in params.items()}
    from fx_rewrites.backends.iree.importing import iree_modules

    backend = fx_rewrites.backends.get("iree")
    mlir = compiled.runtime.mlir
    with tempfile.TemporaryDirectory() as tmp:
        flags = (
            *backend.flags,
            *backend.perf_flags,
            *extra_flags(mlir),
            f"--iree-hal-dump-executable-sources-to={tmp}",
        )
        run_iree_compile(iree_modules(), mlir, "llvm-cpu", flags, None)
        sources = [p.read_text() for p in Path(tmp).glob("*.mlir")]
    assert any("linalg.mmt4d" in text for text in sources), "no data-tiled matmul"
    packs = [text for text in sources if "linalg.pack" in text and "xi8>" in text]
    assert packs, "no dispatch packs the int8 blocks"  # the dequantize is in the pack's dispatch


def _k_major_product(model: torch.nn.Module):
    """torch's own float32 product in the layout the prefill's rule writes: the weight dequantized as torchao does
    ((q - z) * s in float32) and stored K-major ([K, N], as `mm` reads it). MKL's error in that layout is not its
    error with the [N, K] weight of `linear`: 2.3x it on an AVX-512 Xeon (model 207; RMS over 200 draws of these
    shapes 1.13e-7 against 4.9e-8), so torch's float32 error is the larger of the two."""
    w = model[0].weight
    q, s, z = w.qdata.float(), w.scale.float(), w.zero_point.float()
    n, k = q.shape
    k_major = ((q.view(n, -1, 32) - z[..., None]) * s[..., None]).view(n, k).t().contiguous()
    bias = model[0].bias.detach()
    return lambda x: (x.reshape(-1, k) @ k_major + bias).view(*x.shape[:-1], n)


def _dequantized_float64(model: torch.nn.Module) -> torch.nn.Module:
    """The quantized Linear's weight dequantized in float64 from torchao's own int values, scales and zero
    points ((q - z) * s per group): the exact product the quantized model stands for."""
    w = model[0].weight
    q, s, z = w.qdata.double(), w.scale.double(), w.zero_point.double()
    n, k = q.shape
    exact = ((q.view(n, -1, 32) - z[..., None]) * s[..., None]).view(n, k)
    bias = model[0].bias.detach().double()
    return lambda x: torch.nn.functional.linear(x.double(), exact, bias)


def _run_prepared(prepared: torch.export.ExportedProgram, x: torch.Tensor) -> torch.Tensor:
    """The prepared program's graph on `x`, its state (the folded blocks: plain tensors) bound by input spec."""
    state = {**prepared.state_dict, **prepared.constants}
    specs = prepared.graph_signature.input_specs
    args = [x if s.kind.name == "USER_INPUT" else state[s.target] for s in specs]
    return prepared.graph_module(*args)[0]


@pytest.mark.parametrize("mapping", ["SYMMETRIC", "ASYMMETRIC"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("form", ["decode", "prefill"])
def test_zero_points_of_zero_are_dropped_where_the_weight_is_folded(mapping: str, dynamic: bool, form: str) -> None:
    """torchao's default int4 g32 is symmetric: its zero points are all 0 and `fold_blocked_rows`, which sees
    the values, takes the zero point's share out of the product (no zero-point parameter, no `sub`); an
    asymmetric weight's zero points are not all 0 and keep it. Both as near the float64 dequantized product as
    the quantized eager model is, within a float32 step. A decode's reduction and a prefill's matmul (whose
    `sub` takes the zero points off the weight's values) alike."""
    from torchao.quantization.quant_primitives import MappingType

    from fx_rewrites.backends.iree.preparing import prepare_program

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 48)).eval()
    config = quantization.IntxWeightOnlyConfig(
        weight_dtype=torch.int4, granularity=PerGroup(32), mapping_type=MappingType[mapping]
    )
    quantization.quantize_(model, config)
    zeros = bool((model[0].weight.zero_point == 0).all())
    assert zeros == (mapping == "SYMMETRIC")  # the premise: torchao's symmetric mapping stores zero points of 0
    most = DECODE_ROWS if form == "decode" else 64
    shapes = {"input": {1: torch.export.Dim("rows", min=1 if form == "decode" else 2, max=most)}} if dynamic else None
    program = torch.export.export(model, (_x(2 if form == "decode" else 5, 0, 128),), dynamic_shapes=shapes)
    result = rt.apply_rules(program, DEFAULT + grouped_linear_for_iree)
    assert any(n.target is aten.mm.default for n in result.graph_module.graph.nodes) == (form == "prefill")
    rt.assert_fired(result, grouped_linear_for_iree.name, times=1)
    prepared, _ = prepare_program(result.program)
    nodes = [n for n in prepared.graph.nodes if n.op == "call_function"]
    subs = [n for n in nodes if n.target is aten.sub.Tensor]
    int8_state = {k: tuple(v.shape) for k, v in prepared.state_dict.items() if v.dtype == torch.int8}
    groups = {k: shape for k, shape in int8_state.items() if shape == (48 // 16, 4, 16)}  # [N/16, G, 16]
    if zeros:
        assert not subs and not groups, (subs, int8_state)
        assert not any(n.target is BLOCKED_ROWS for n in nodes)
    else:
        assert len(subs) == 1 and len(groups) == 1, (subs, int8_state)
    rows = {("decode", True): (2, 1), ("decode", False): (2, 2), ("prefill", True): (5, 23)}.get(
        (form, dynamic), (5, 5)
    )
    inputs = [(_x(rows[0], 1, 128),), (_x(rows[1], 2, 128),)]
    assert_within_torch_error(
        lambda x: _run_prepared(prepared, x),
        model,
        inputs,
        torch_forms=[_k_major_product(model)],
        exact_of=_dequantized_float64(model),
    )
