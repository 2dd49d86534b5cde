"""torchao's int8-activation x int4 g32 decode linears through the integer a8 int4 dispatch (rules/a8int4_decode.py,
a8int4_fold.py, a8int4_dispatch.py; issue 33).

Before-graphs from `torch.export` of Linears quantized by torchao 0.18 (`Int8DynamicActivationIntxWeightConfig(int4,
PerGroup(32))`: x quantized per token, asymmetric, `dequantize_affine` of x and of the weight feeding `linear`).
After the rule: `a8int4_grouped_linear` over x's int8 values and torchao's frozen weight tensors (eager: torchao's
dequantize of both and a matmul); after `prepare_program`'s fold: `a8int4_matvec` over the packed bytes and groups;
through IREE: the spliced dispatch, which sums int8 x int4 products in integers, within torch's own float32 error
against the float64 product of the same dequantized x and weight.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.rules import DEFAULT
from tests.backends.iree.rules.float32_error import assert_within_torch_error
from tests.quantized_llama import scaled_llama

quantization = pytest.importorskip(
    "torchao.quantization", reason="torchao is not installed (pip install -e '.[test]' installs it)"
)
from torchao.quantization.granularity import PerGroup  # noqa: E402
from torchao.quantization.quant_primitives import MappingType  # noqa: E402

from fx_rewrites.backends.iree import IreeBackend, a8int4_dispatch, cache, legality  # noqa: E402
from fx_rewrites.backends.iree.a8int4_dispatch import A8INT4_MATVEC, MARK, splice, unpack, unpack_scales  # noqa: E402
from fx_rewrites.backends.iree.a8int4_fold import A8INT4_GROUPED_LINEAR, BYTES, GROUPS, TILE  # noqa: E402
from fx_rewrites.backends.iree.int4_fold import INT4_GROUPED_LINEAR  # noqa: E402
from fx_rewrites.backends.iree.parameters import INLINE_ENV  # noqa: E402
from fx_rewrites.backends.iree.preparing import prepare_program  # noqa: E402
from fx_rewrites.backends.iree.rules import phases  # noqa: E402
from fx_rewrites.backends.iree.rules.a8int4_decode import a8int4_decode_for_iree  # noqa: E402
from fx_rewrites.backends.iree.rules.int4_decode import int4_decode_for_iree  # noqa: E402
from fx_rewrites.backends.iree.targets import llvm_cpu  # noqa: E402

aten = torch.ops.aten
RULES = DEFAULT + a8int4_decode_for_iree + int4_decode_for_iree


def _config(mapping: str = "SYMMETRIC") -> object:
    return quantization.Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(32), weight_mapping_type=MappingType[mapping]
    )


def _linear(mapping: str = "SYMMETRIC", out_features: int = 64, in_features: int = 128) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(in_features, out_features)).eval()
    quantization.quantize_(model, _config(mapping))
    return model


def _x(rows: int, seed: int, features: int = 128) -> torch.Tensor:
    return torch.randn(1, rows, features, generator=torch.Generator().manual_seed(seed))


def _exact(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The quantized linear in float64 from torchao's own values: x quantized by torchao's ops (per token,
    asymmetric), (qx - zx) sx, times (q - z) s per group."""
    from torchao.quantization.quant_primitives import choose_qparams_affine, quantize_affine

    block = [1] * (x.dim() - 1) + [x.shape[-1]]
    sx, zx = choose_qparams_affine(x, MappingType.ASYMMETRIC, block, torch.int8, -128, 127, None, None, torch.int8)
    qx = quantize_affine(x, block, sx, zx, torch.int8, -128, 127)
    xd = (qx.double() - zx.double().view(*x.shape[:-1], 1)) * sx.double().view(*x.shape[:-1], 1)
    w = model[0].weight
    q, s, z = w.qdata.double(), w.scale.double(), w.zero_point.double()
    n, k = q.shape
    exact = ((q.view(n, -1, 32) - z[..., None]) * s[..., None]).view(n, k)
    return torch.nn.functional.linear(xd, exact, model[0].bias.detach().double())


def _run_prepared(prepared: torch.export.ExportedProgram, x: torch.Tensor) -> torch.Tensor:
    state = {**prepared.state_dict, **prepared.constants}
    args = [x if s.kind.name == "USER_INPUT" else state[s.target] for s in prepared.graph_signature.input_specs]
    return prepared.graph_module(*args)[0]


def _ops(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_a_decode_linear_becomes_the_a8int4_op_and_is_packed(dynamic: bool) -> None:
    model = _linear()
    shapes = {"input": {1: torch.export.Dim("rows", min=1, max=2)}} if dynamic else None
    program = torch.export.export(model, (_x(2 if dynamic else 1, 0),), dynamic_shapes=shapes)
    result = rt.apply_rules(program, RULES)
    rt.assert_fired(result, a8int4_decode_for_iree.name, times=1)
    rt.assert_not_fired(result, int4_decode_for_iree)
    rt.assert_ops(
        result, present=[A8INT4_GROUPED_LINEAR], absent=[aten.linear.default, aten.mm.default, INT4_GROUPED_LINEAR]
    )
    rows = (1, 2) if dynamic else (1, 1)
    inputs = [(_x(rows[0], 1),), (_x(rows[1], 2),)]
    with torch.no_grad():  # torchao's dequantize of x and of the weight, the same float32 values: equal to eager
        rt.assert_matches_eager(result, model, inputs, rtol=0, atol=0)
    prepared, _ = prepare_program(result.program)
    ops = _ops(prepared.graph_module)
    assert A8INT4_MATVEC in ops and A8INT4_GROUPED_LINEAR not in ops, ops
    state = prepared.state_dict
    packed = [v for k, v in state.items() if k.endswith(BYTES)]
    groups = [v for k, v in state.items() if k.endswith(GROUPS)]
    assert [(v.dtype, v.numel()) for v in packed] == [(torch.int8, 64 * 128 // 2)], sorted(state)
    assert [(v.dtype, v.numel()) for v in groups] == [(torch.float32, 2 * 64 * 128 // 32)], sorted(state)
    w = model[0].weight
    assert torch.equal(unpack(packed[0], 64, TILE), w.qdata)
    assert torch.equal(unpack_scales(groups[0], 64, TILE), w.scale.float())
    for (x,) in inputs:
        exact = _exact(model, x)
        with torch.no_grad():
            torch_error = (model(x).double() - exact).abs().max().item()
            got = _run_prepared(prepared, x)
        assert (got.double() - exact).abs().max().item() <= torch_error


def test_a_prefill_is_not_taken() -> None:
    model = _linear()
    shapes = {"input": {1: torch.export.Dim("rows", min=2, max=64)}}
    program = torch.export.export(model, (_x(3, 0),), dynamic_shapes=shapes)
    result = rt.apply_rules(program, RULES, explain=True)
    rt.assert_not_fired(result, a8int4_decode_for_iree)


def test_a_weight_only_int4_linear_is_left_to_int4_decode() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 64)).eval()
    quantization.quantize_(model, quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    result = rt.apply_rules(torch.export.export(model, (_x(1, 0),)), RULES, explain=True)
    rt.assert_not_fired(result, a8int4_decode_for_iree)
    rt.assert_fired(result, int4_decode_for_iree.name, times=1)
    reasons = [attempt.reason for attempt in result.report.explain(a8int4_decode_for_iree.name)]
    assert any("is not int8 in [-128, 127] ([torch.int8, -8, 7])" in r for r in reasons), reasons  # the weight


def test_asymmetric_weights_fall_back_to_a_float_linear_with_a_warning() -> None:
    model = _linear("ASYMMETRIC")
    assert not bool((model[0].weight.zero_point == 0).all())
    result = rt.apply_rules(torch.export.export(model, (_x(1, 0),)), RULES)
    rt.assert_fired(result, a8int4_decode_for_iree.name, times=1)
    with pytest.warns(UserWarning, match="zero points not all 0"):
        prepared, _ = prepare_program(result.program)
    assert A8INT4_MATVEC not in _ops(prepared.graph_module)
    x = _x(1, 4)
    with torch.no_grad():
        torch_error = (model(x).double() - _exact(model, x)).abs().max().item()
        got = _run_prepared(prepared, x)
    assert (got.double() - _exact(model, x)).abs().max().item() <= torch_error


def test_on_for_avx2_only_and_known_to_legality() -> None:
    assert a8int4_decode_for_iree.name in phases("llvm-cpu", "avx2").names()
    assert a8int4_decode_for_iree.name not in phases("llvm-cpu", "avx512").names()
    assert a8int4_decode_for_iree.name not in phases("cuda", "").names()
    assert "fx_rewrites.a8int4_matvec.default" not in legality.illegal_ops()
    assert "spliced" in legality.why("fx_rewrites.a8int4_matvec.default")
    with pytest.raises(ValueError, match="an a8int4_matvec call of an unknown form"):
        splice(f'module {{\n  %0 = torch.operator "{MARK}"(%x) : (!torch.int) -> !torch.int\n}}')


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_iree_runs_the_spliced_integer_dispatch(dynamic: bool, monkeypatch) -> None:
    monkeypatch.setenv(INLINE_ENV, "0")  # every weight a parameter, as a real model's are
    model = _linear(out_features=96, in_features=1024)  # long sums: torch's own error is the sums'
    shapes = {"input": {1: torch.export.Dim("rows", min=1, max=2)}} if dynamic else None
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback
        compiled = fx_rewrites.compile(
            model,
            (_x(2 if dynamic else 1, 0, 1024),),
            dynamic_shapes=shapes,
            backend=IreeBackend(target=llvm_cpu("avx2")),
        )
    assert MARK in compiled.runtime.mlir
    params = compiled.runtime.parameters
    assert [v.dtype for k, v in params.items() if k.endswith(BYTES)] == [torch.int8], sorted(params)
    inputs = [(_x(1, 5, 1024),), (_x(2 if dynamic else 1, 6, 1024),)]
    assert [compiled(x).shape for (x,) in inputs] == [(1, x.shape[1], 96) for (x,) in inputs]
    # the kernel sums in another order than torch's: within the largest error torch makes at these shapes
    assert_within_torch_error(compiled, model, inputs, exact_of=lambda x: _exact(model, x), redraws=16)
    # the compile cache keys the text the backend compiles, the kernel spliced in: a kernel constant changed (as
    # an A/B of `PREFETCH` does at run time) is a new key, so no module compiled before it is served
    before = cache.cache_key(compiled.runtime.mlir, [])
    assert cache.cache_key(compiled.runtime.mlir, []) == before
    monkeypatch.setattr(a8int4_dispatch, "PREFETCH", a8int4_dispatch.PREFETCH // 2)
    assert cache.cache_key(compiled.runtime.mlir, []) != before


@pytest.mark.slow  # one compile_lm (prefill and decode) of a one-layer Llama
def test_compile_lm_of_an_a8_int4_llama_decodes_through_the_dispatch(tmp_path) -> None:
    """compile_lm's decode (one token) takes the integer dispatch for every linear (the lm_head too), its prefill
    (a Dim over the prompt) the byte form. Greedy tokens equal the quantized eager model's (which computes the same
    quantized values in float32), and after save + load too."""
    pytest.importorskip("transformers")
    model = scaled_llama()
    quantization.quantize_(model, _config())
    lm = fx_rewrites.compile_lm(model, max_cache_len=48, backend=IreeBackend(target=llvm_cpu("avx2")))
    packed = {k: v for k, v in lm.parameters.items() if k.endswith(BYTES)}
    assert len(packed) == 7 + 1 and all(v.dtype == torch.int8 for v in packed.values()), sorted(lm.parameters)
    prompt = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        theirs = model.generate(prompt, max_new_tokens=24, do_sample=False)
    assert lm.generate(prompt, max_new_tokens=24).tolist() == theirs.tolist()
    assert len(set(theirs[0, 5:].tolist())) > 2  # the tokens vary: a constant output would match trivially
    lm.save(tmp_path / "lm.vmfb")
    loaded = fx_rewrites.load(tmp_path / "lm.vmfb")
    assert loaded.generate(prompt, max_new_tokens=24).tolist() == theirs.tolist()


@pytest.mark.slow  # one compile_lm of a two-layer Llama
def test_compile_lm_a8_int4_logits_are_within_the_quantized_eager_models_own_error() -> None:
    """Where the tokens may differ (torchao's per-token int8 quantization of x turns a one-ulp difference upstream,
    IREE's float32 against torch's, into an int8 step, as for W8A8 in tests/test_quantized_schemes.py; the 160M
    model's compile_lm tokens leave eager's): compile_lm's logits at every decode step, through the integer
    dispatch, are within the quantized eager model's own error against a float64 reference (its int4 weights
    dequantized, float64, activations not quantized), eager fed compile_lm's tokens as its `generate` would be.
    Measured (AMD EPYC Zen 3, 2026-11-30): compiled - eager up to 0.178 (logits up to 10.2), eager's own error 0.808;
    the tokens leave eager's at the 4th new one. With this rule off (the float int4 dispatch over torchao's
    dequantized x) the tokens are the same and the logits within 2.4e-7 of these: the difference from eager is
    upstream of the linears' products (x's int8 rounding), not the integer sums."""
    pytest.importorskip("transformers")
    shape = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}
    model = scaled_llama(**shape)
    reference = scaled_llama(**shape)
    quantization.quantize_(model, _config())
    model.generation_config.eos_token_id = None
    weights = dict(model.named_parameters())
    with torch.no_grad():  # the quantized model's exact weights, float64, x not quantized
        for name, p in reference.named_parameters():
            w = weights[name]
            p.copy_(w.dequantize() if hasattr(w, "dequantize") else w)
    reference = reference.double()
    lm = fx_rewrites.compile_lm(model, max_cache_len=48, backend=IreeBackend(target=llvm_cpu("avx2")))
    assert sum(k.endswith(BYTES) for k in lm.parameters) == 2 * 7 + 1, sorted(lm.parameters)
    prompt = torch.randint(0, shape["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(7))
    out = lm.generate(prompt, max_new_tokens=32, output_logits=True, return_dict_in_generate=True)
    sequence, got = out.sequences, torch.cat(out.logits).double()  # [32, vocab], step by step
    assert len(set(sequence[0, 5:].tolist())) > 2
    with torch.no_grad():
        cache_out = model(sequence[:, :5], use_cache=True)
        eager, cache = [cache_out.logits[0, -1]], cache_out.past_key_values
        for i in range(5, sequence.shape[1] - 1):
            step = model(sequence[:, i : i + 1], past_key_values=cache, use_cache=True)
            eager.append(step.logits[0, -1])
            cache = step.past_key_values
        eager = torch.stack(eager).double()
        exact = reference(sequence[:, :-1]).logits[0, 4:]
    eager_error = (eager - exact).abs().max().item()
    difference = (got - eager).abs().max().item()
    assert difference <= eager_error, (difference, eager_error)
