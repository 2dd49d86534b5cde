"""Every torchao scheme that exports, end to end through IREE (issue 33): int8 weight-only, W8A8 (dynamic int8 activations, int8
weights), grouped int4/int8 weight-only (`IntxWeightOnlyConfig`) and int8 activations over grouped int4 weights
(`Int8DynamicActivationIntxWeightConfig`). A one-layer Llama's logits, compiled with a Dim on the sequence by
`fx_rewrites.compile`, give the quantized eager model's greedy tokens and logits; `compile_lm` generates its tokens.

One IREE compile per scheme (a few seconds each), and a compile_lm per scheme marked slow.
"""

from __future__ import annotations

import pytest
import torch

import fx_rewrites
from tests.quantized_llama import scaled_llama

quantization = pytest.importorskip(
    "torchao.quantization", reason="torchao is not installed (pip install -e '.[test]' installs it)"
)
transformers = pytest.importorskip("transformers")
from torchao.quantization.granularity import PerGroup  # noqa: E402
from torchao.quantization.quant_primitives import MappingType  # noqa: E402

from fx_rewrites.backends.iree.int4_fold import ZEROS  # noqa: E402
from fx_rewrites.backends.iree.targets import host_isa  # noqa: E402

VOCAB = 96

SCHEMES = {
    "int8_wo": lambda: quantization.Int8WeightOnlyConfig(),
    "w8a8": lambda: quantization.Int8DynamicActivationInt8WeightConfig(),
    "int4_g32": lambda: quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
    "int8_g32": lambda: quantization.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(32)),
    "a8_int4_g32": lambda: quantization.Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(32)
    ),
}
#: schemes compile_lm's test alone takes (the decode's own dispatch; compile and torch.compile run the byte form)
LM_ONLY = {
    "int4_g32_asymmetric": lambda: quantization.IntxWeightOnlyConfig(
        weight_dtype=torch.int4, granularity=PerGroup(32), mapping_type=MappingType.ASYMMETRIC
    ),
}


class Logits(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits


#: a two-layer Llama whose compile_lm W8A8 tokens leave the quantized eager model's within 32 (at the 8th here)
WIDE = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}


def _llama(scheme: str | None, **shape: int) -> torch.nn.Module:
    model = scaled_llama(**({"vocab_size": VOCAB} | shape))
    if scheme is not None:
        quantization.quantize_(model, (SCHEMES | LM_ONLY)[scheme]())
    return model


def _dequantized_float64(model: torch.nn.Module, **shape: int) -> Logits:
    """The quantized model's exact weights (dequantized) in a float64 copy: the reference for error."""
    reference = _llama(None, **shape)
    weights = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in reference.named_parameters():
            w = weights[name]
            p.copy_(w.dequantize() if hasattr(w, "dequantize") else w)
    return Logits(reference.double())


def _per_token_int8(x: torch.Tensor) -> torch.Tensor:
    """torchao's dynamic activation quantization of W8A8 (symmetric per token: scale amax / 127.5, at least float32's
    eps, round half even, clamp to [-128, 127]), dequantized, in `x`'s dtype."""
    scale = (x.abs().amax(-1, keepdim=True) / 127.5).clamp(min=torch.finfo(torch.float32).eps)
    return torch.round(x / scale).clamp(-128, 127) * scale


def _activations_quantized(reference: Logits, quantized: torch.nn.Module) -> Logits:
    """`reference` (float64, dequantized weights) with torchao's per-token quantization of every quantized linear's
    input emulated in float64."""
    weights = dict(quantized.named_parameters())
    for name, module in reference.lm.named_modules():
        if isinstance(module, torch.nn.Linear) and type(weights[f"{name}.weight"]) is not torch.nn.Parameter:
            module.register_forward_pre_hook(lambda _, args: (_per_token_int8(args[0]), *args[1:]))
    return reference


def _eager_steps(model: torch.nn.Module, sequence: torch.Tensor, prompt: int) -> torch.Tensor:
    """The eager model's logits for each token after the prompt of `sequence`, computed as its `generate` computes
    them (a prefill of the prompt, then one token a step with a DynamicCache), fed `sequence`'s tokens: [steps, vocab]."""
    with torch.no_grad():
        out = model(sequence[:, :prompt], use_cache=True)
        logits, cache = [out.logits[0, -1]], out.past_key_values
        for i in range(prompt, sequence.shape[1] - 1):
            out = model(sequence[:, i : i + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1])
            cache = out.past_key_values
    return torch.stack(logits)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_scheme_compiles_and_matches_quantized_eager(scheme: str) -> None:
    model = Logits(_llama(scheme))
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    seq = torch.export.Dim("seq", min=2, max=48)
    compiled = fx_rewrites.compile(model, (ids,), dynamic_shapes={"ids": {1: seq}})
    dynamic_activations = scheme.startswith(("w8a8", "a8"))
    reference = Logits(_llama(None)) if dynamic_activations else _dequantized_float64(model.lm)
    for length in (3, 19):
        ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            expected, exact = model(ids), reference(ids).to(torch.float32 if dynamic_activations else torch.float64)
        got = compiled(ids)
        if dynamic_activations:
            # torchao's symmetric per-token scale is amax / 127.5, so each row's extreme element lands on a
            # rounding tie (-127.5 rounds to -128 half-even): a one-ulp difference of IREE's float32 from torch's
            # upstream (an RMSNorm's rsqrt: measured 2.4e-7) moves it one int8 step, and the logits by up to
            # 0.086 of 2.4 here. The bound is the quantization's own error (quantized eager against the float
            # model); the greedy tokens below are equal
            quantization_error = (expected - exact).abs().max().item()
            assert (got - expected).abs().max().item() <= quantization_error, (length, quantization_error)
        else:  # weight-only: within twice torch's own float32 error against the float64 dequantized model
            eager_error = (expected.double() - exact).abs().max().item()
            assert eager_error > 0
            assert (got.double() - exact).abs().max().item() <= 2 * eager_error, (length, eager_error)
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(7))
    ours, theirs = prompt, prompt
    with torch.no_grad():
        for _ in range(12):
            ours = torch.cat([ours, compiled(ours)[:, -1:].argmax(-1)], 1)
            theirs = torch.cat([theirs, model(theirs)[:, -1:].argmax(-1)], 1)
    assert ours.tolist() == theirs.tolist()
    assert len(set(ours[0, 5:].tolist())) > 2  # the tokens vary: a constant output would match trivially


@pytest.mark.slow
@pytest.mark.parametrize("scheme", sorted(SCHEMES | LM_ONLY))
def test_compile_lm_generates_the_quantized_eager_tokens(scheme: str) -> None:
    model = _llama(scheme)
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(7))
    lm = fx_rewrites.compile_lm(model, max_cache_len=48)
    with torch.no_grad():
        theirs = model.generate(prompt, max_new_tokens=32, do_sample=False)
    ours = lm.generate(prompt, max_new_tokens=32)
    assert ours.tolist() == theirs.tolist()
    assert len(set(ours[0, 5:].tolist())) > 2
    if scheme == "int4_g32_asymmetric" and host_isa() == "avx2":  # the decode's dispatch took the zero points
        assert any(k.endswith(ZEROS) for k in lm.parameters), sorted(lm.parameters)


@pytest.mark.slow
def test_compile_lm_w8a8_logits_are_within_the_quantized_eager_models_own_error() -> None:
    """Issue 33's done-when for W8A8, where the tokens differ. torchao's per-token scale is amax / 127.5, so each
    row's extreme element lands on a rounding tie, which torch's and IREE's float32 (and float64) break differently;
    one int8 step flipped moves the logits and, later, a greedy token: compile_lm's tokens leave the quantized eager
    model's at the 8th of 32 here (the 160M model's too). What the issue allows instead: compile_lm's logits at every
    step are within the quantized eager model's own error against a float64 dequantized reference (its int8 weights
    dequantized, float64, activations not quantized), the eager model fed compile_lm's tokens as its `generate`
    would be. Measured (AMD EPYC Zen 3, AVX2, 2026-11-29): compiled - eager up to 0.60 (logits up to 12), eager's own
    error 1.08. And the compiled route quantizes its activations as torchao does: its logits are nearer the same
    reference with torchao's per-token quantization emulated in float64 (0.36; eager's 0.53) than the reference
    without it (1.06), which a route skipping the activations' quantization would not be."""
    model = _llama("w8a8", **WIDE)
    model.generation_config.eos_token_id = None
    prompt = torch.randint(0, WIDE["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(7))
    lm = fx_rewrites.compile_lm(model, max_cache_len=48)
    out = lm.generate(prompt, max_new_tokens=32, output_logits=True, return_dict_in_generate=True)
    sequence, got = out.sequences, torch.cat(out.logits).double()  # [32, vocab], step by step
    with torch.no_grad():
        theirs = model.generate(prompt, max_new_tokens=32, do_sample=False)
        eager = _eager_steps(model, sequence, prompt.shape[1]).double()
        ids = sequence[:, :-1]
        exact = _dequantized_float64(model, **WIDE)(ids)[0, prompt.shape[1] - 1 :]
        quantized = _activations_quantized(_dequantized_float64(model, **WIDE), model)(ids)[0, prompt.shape[1] - 1 :]
    # the tokens left eager's at the 8th on the AMD EPYC; where another CPU rounds the ties as eager does they are
    # equal, and the logits must still be within eager's own error (not asserted unequal: that would test the CPU)
    assert sequence.shape[1] == prompt.shape[1] + 32 and theirs.shape == sequence.shape
    assert len(set(sequence[0, 5:].tolist())) > 2
    eager_error = (eager - exact).abs().max().item()
    difference = (got - eager).abs().max().item()
    assert difference <= eager_error, (difference, eager_error)
    near, far = (got - quantized).abs().max().item(), (got - exact).abs().max().item()
    assert near < far, (near, far)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_torch_compile_route_matches_quantized_eager(scheme: str, monkeypatch) -> None:
    monkeypatch.setenv("FX_REWRITES_STRICT", "1")  # a graph IREE cannot compile raises instead of running eager
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    quantization.quantize_(model, SCHEMES[scheme]())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fx_rewrites_iree")
    for rows in (3, 7):  # two input sets (the second a new size: dynamo compiles again)
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=1e-5)


def test_a_torchao_op_no_rule_covers_gets_an_error_naming_it_and_what_is_covered() -> None:
    from fx_rewrites.backends.iree.errors import IreeCompileError

    class Float8(torch.nn.Module):  # torchao's float8 quantize, kept whole by export: no rule lowers it
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = torch.ops.torchao.quantize_affine_float8_non_decomposed(x, torch.tensor(0.5), torch.float8_e4m3fn)
            return q.to(torch.float32)

    with pytest.raises(IreeCompileError) as caught:
        fx_rewrites.compile(Float8(), (torch.randn(4, 4),))
    text = str(caught.value)
    assert "`torchao.quantize_affine_float8_non_decomposed` is torchao's; no rule lowers it" in text
    assert "Int8WeightOnlyConfig" in text and "torchao.dequantize_affine" in text
