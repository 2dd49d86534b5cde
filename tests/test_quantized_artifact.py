"""Quantized weights stay quantized in the saved module (issue 33): `compile_lm` of a torchao int8 weight-only
Llama saves an .irpa holding the int8 bytes (re-laid in blocks, not float32 copies), the file size says so, and
`fx_rewrites.load` of the saved module generates the quantized eager model's tokens.

One compile_lm of a two-layer Llama (hidden 128, MLP 256, vocab 512): its matrices are most of the bytes.
"""

from __future__ import annotations

import pytest
import torch

import fx_rewrites

quantization = pytest.importorskip(
    "torchao.quantization", reason="torchao is not installed (pip install -e '.[test]' installs it)"
)
transformers = pytest.importorskip("transformers")

VOCAB = 512


def _llama(quantized: bool) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # randn x 0.05: greedy argmax away from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    model.generation_config.eos_token_id = None
    if quantized:
        quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    return model


@pytest.mark.slow
def test_saved_int8_module_holds_int8_bytes_and_generates_the_same_tokens(tmp_path) -> None:
    model = _llama(quantized=True)
    lm = fx_rewrites.compile_lm(model, max_cache_len=40)
    blocks = {k: v for k, v in lm.parameters.items() if k.endswith(".blocked_rows")}
    assert len(blocks) == 2 * 7 + 1 and all(v.dtype == torch.int8 for v in blocks.values()), sorted(blocks)
    lm.save(tmp_path / "lm.vmfb")
    irpa = (tmp_path / "lm.irpa").stat().st_size
    float_model = _llama(quantized=False)
    matrices = sum(p.numel() for name, p in float_model.named_parameters() if p.dim() == 2 and "embed" not in name)
    embedding = float_model.model.embed_tokens.weight.numel() * 4  # gathered, not quantized by the config
    # int8 matrices (1 byte each) plus the float32 embedding and small state: far from float32's 4 bytes each
    assert irpa < embedding + 1.5 * matrices, (irpa, embedding, matrices)
    assert irpa > embedding + matrices  # and every int8 byte is there
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = model.generate(prompt, max_new_tokens=24, do_sample=False)
    loaded = fx_rewrites.load(tmp_path / "lm.vmfb")
    assert loaded.generate(prompt, max_new_tokens=24).tolist() == theirs.tolist()
    assert lm.generate(prompt, max_new_tokens=24).tolist() == theirs.tolist()
    assert len(set(theirs[0, 6:].tolist())) > 2
