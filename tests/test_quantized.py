"""torchao int8 weight-only quantized models (issue 26 item 6): `fx_rewrites.compile` and `fx_rewrites.apply`
take the exported program as `torch.export` leaves it (torchao's `Int8Tensor` weights, a tensor subclass) and
flatten the subclass themselves, so the int8 weights reach IREE as int8 parameters with the dequantize in the
program, and the compiled model matches the quantized eager one (greedy tokens, logits).

Two small IREE compiles (a one-layer Llama with a Dim on the sequence).
"""

from __future__ import annotations

import copy

import pytest
import torch

import fx_rewrites
from tests.quantized_llama import scaled_llama

quantization = pytest.importorskip(
    "torchao.quantization", reason="torchao is not installed (pip install -e '.[test]' installs it)"
)
transformers = pytest.importorskip("transformers")

VOCAB = 96


class Logits(torch.nn.Module):
    """The causal LM's logits for the whole sequence (no cache): the greedy loop recomputes the prefix."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits


def _llama() -> torch.nn.Module:
    return scaled_llama(vocab_size=VOCAB)


def _quantized() -> torch.nn.Module:
    model = _llama()
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    return Logits(model)


def _dequantized_float64(quantized: Logits) -> Logits:
    """The quantized model's exact weights (int8 x scale, dequantized) in float64: the reference for error."""
    reference = _llama()
    weights = {name: p for name, p in quantized.lm.named_parameters()}
    with torch.no_grad():
        for name, p in reference.named_parameters():
            w = weights[name]
            p.copy_(w.dequantize() if hasattr(w, "dequantize") else w)
    return Logits(reference.double())


@pytest.fixture(scope="module")
def quantized() -> Logits:
    return _quantized()


@pytest.fixture(scope="module")
def compiled(quantized: Logits):
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    seq = torch.export.Dim("seq", min=2, max=48)
    return fx_rewrites.compile(quantized, (ids,), dynamic_shapes={"ids": {1: seq}})


def test_export_leaves_a_subclass_and_apply_flattens_it(quantized: Logits) -> None:
    from fx_rewrites.program import has_tensor_subclasses, unwrap_tensor_subclasses

    ids = torch.randint(0, VOCAB, (1, 8))
    program = torch.export.export(quantized, (ids,))
    assert has_tensor_subclasses(program)  # what the backend would meet without the unwrap
    flat = unwrap_tensor_subclasses(program)
    assert not has_tensor_subclasses(flat)
    int8 = [k for k, v in flat.state_dict.items() if v.dtype == torch.int8]
    assert len(int8) >= 7, int8  # q, k, v, o, gate, up, down, lm_head: their int8 data
    result = fx_rewrites.apply(program)  # the rules' entry takes the subclass program as export left it
    assert not has_tensor_subclasses(result.program)
    with torch.no_grad():
        torch.testing.assert_close(result.program.module()(ids), quantized(ids), rtol=0, atol=1e-5)
    plain = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    assert unwrap_tensor_subclasses(plain) is plain  # nothing to flatten: the program itself


def test_logits_match_quantized_eager_within_its_float32_error(quantized: Logits, compiled) -> None:
    reference = _dequantized_float64(quantized)
    for length in (3, 8, 31):
        ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            exact = reference(ids)
            eager_error = (quantized(ids).double() - exact).abs().max().item()
            got = compiled(ids)
        assert eager_error > 0
        # the compiled model may not err more than twice as much as torch's own float32 run of it
        assert (got.double() - exact).abs().max().item() <= 2 * eager_error, (length, eager_error)


def test_iree_rules_program_runs_on_torch_within_its_float32_error(quantized: Logits) -> None:
    """The quantized program is flattened by `run_decompositions`, which writes the merge of the attention
    heads as a view of SDPA's output (laid out [b, s, h, d] on CPU); written out by the IREE rules that view
    failed on torch eager ("view size is not compatible ..."), and with it `fx_rewrites.localize`."""
    from fx_rewrites import backends

    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    program = torch.export.export(quantized, (ids,), dynamic_shapes={"ids": {1: torch.export.Dim("seq", max=48)}})
    result = fx_rewrites.apply(program, backends.get("iree").rules)
    assert result.report.rewrites.get("attention_as_matmul_softmax") == 1
    reference = _dequantized_float64(quantized)
    for length in (8, 19):
        ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            exact = reference(ids)
            eager_error = (quantized(ids).double() - exact).abs().max().item()
            got = result.program.module()(ids)
        assert (got.double() - exact).abs().max().item() <= 2 * eager_error, (length, eager_error)


def test_greedy_tokens_match_quantized_eager(quantized: Logits, compiled) -> None:
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(7))
    ours, theirs = prompt, prompt
    with torch.no_grad():
        for _ in range(16):
            ours = torch.cat([ours, compiled(ours)[:, -1:].argmax(-1)], 1)
            theirs = torch.cat([theirs, quantized(theirs)[:, -1:].argmax(-1)], 1)
    assert ours.tolist() == theirs.tolist()
    assert len(set(ours[0, 5:].tolist())) > 2  # the tokens vary: a constant output would match trivially


def test_int8_weights_reach_iree_as_int8_parameters(quantized: Logits, monkeypatch) -> None:
    from fx_rewrites.backends.iree.parameters import INLINE_ENV

    monkeypatch.setenv(INLINE_ENV, "0")  # every weight a parameter (.irpa), as a real model's are
    ids = torch.randint(0, VOCAB, (1, 8))
    compiled = fx_rewrites.compile(copy.deepcopy(quantized), (ids,))
    globals_ = [line for line in compiled.runtime.mlir.splitlines() if "util.global private" in line]
    int8 = [line for line in globals_ if "parametrizations_weight_original0" in line]
    assert len(int8) == 8 and all("xi8>" in line for line in int8), int8  # the int8 data, not float copies
    assert not any("xf32>" in line and "_proj_weight" in line for line in globals_)
    # the dequantize runs in the program: int8 -> float32 conversions of those weights
    graph_ops = [n for n in compiled.program.graph.nodes if n.op == "call_function"]
    converts = [
        n
        for n in graph_ops
        if n.args
        and getattr(n.args[0], "meta", {}).get("val", None) is not None
        and n.args[0].meta["val"].dtype == torch.int8
        and n.meta["val"].dtype == torch.float32
    ]
    assert len(converts) >= 8
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), quantized(ids), rtol=0, atol=1e-5)
