"""Greedy generation through IREE, token for token against `model.generate(do_sample=False)` (issue 26 item 4).

Each architecture of `tests/lm_models.py` (tiny, seeded) goes through `fx_rewrites.compile_lm` (`GENERATE`):
one IREE module whose prefill and decode share the weights and the KV cache. `single_program` is the other
way in: transformers' own static-cache wrapper (`TorchExportableModuleWithStaticCache`) exported with a Dim on
the sequence and compiled once (`fx_rewrites.compile`), one program for the prefill and every decode step.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import fx_rewrites
from tests import lm_models

pytestmark = pytest.mark.slow  # an export and an IREE compile per case: ~5-15 s each on the shared machine

#: the cache length: the prompt and the tokens generated fit (Gemma3's window of 8 is shorter)
MAX_CACHE = 48
#: the architectures that generate through IREE as the reference does
ARCHITECTURES = [
    "llama",
    "qwen3",
    "mistral",
    "gemma3",
    "phi3",
    "gpt2",
    # wrong with a Dim (a segfault through compile_lm) until the routers' topk and the experts' sort became ranks
    # (backends/iree/rules/topk.py: IREE 3.13 shared one sorted iota between the layers)
    "qwen3_moe",
]


def single_program(model: torch.nn.Module, ids: torch.Tensor, new: int, *, strict: bool = True) -> list[int]:
    """Greedy tokens from one compiled program (prefill and decode steps), transformers' wrapper exported."""
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    model.generation_config.cache_implementation = "static"
    wrapper = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=MAX_CACHE)
    seq = torch.export.Dim("seq", min=1, max=MAX_CACHE)
    with torch.no_grad():
        program = torch.export.export(
            wrapper,
            (),
            {"input_ids": ids, "cache_position": torch.arange(ids.shape[1])},
            dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}},
            strict=strict,
        )
    compiled = fx_rewrites.compile(program)
    logits = compiled(input_ids=ids, cache_position=torch.arange(ids.shape[1]))
    tokens = [int(logits[0, -1].argmax())]
    for position in range(ids.shape[1], ids.shape[1] + new - 1):
        logits = compiled(input_ids=torch.tensor([[tokens[-1]]]), cache_position=torch.tensor([position]))
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


def compiled_lm(model: torch.nn.Module, ids: torch.Tensor, new: int) -> list[int]:
    """Greedy tokens from `fx_rewrites.compile_lm`: one module, prefill and decode over shared weights and cache."""
    lm = fx_rewrites.compile_lm(model, max_cache_len=MAX_CACHE)
    return lm.generate(ids, max_new_tokens=new)[0, ids.shape[1] :].tolist()


#: (model, prompt ids, new tokens) -> the new tokens
GENERATE: Callable[..., list[int]] = compiled_lm


def _expected(name: str) -> tuple[torch.nn.Module, torch.Tensor, list[int]]:
    model, _ = lm_models.build(name)
    ids = lm_models.prompt()
    expected = lm_models.reference(model, ids)
    sequence = torch.cat([ids, expected], dim=1)
    # greedy argmax far from a tie: float32 error cannot flip a token (IREE is ~1e-6 off on these logits)
    assert lm_models.top2_margin(model, sequence, ids.shape[1] - 1) > 1e-3
    return model, ids, expected[0].tolist()


def _padded_pair(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two prompts, the second left-padded by 3, and HF's greedy sequences for them (no step near a tie)."""
    ids = torch.cat([lm_models.prompt(seed=1), lm_models.prompt(seed=2)])
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=lm_models.NEW,
            output_scores=True,
            return_dict_in_generate=True,
        )
    for step, scores in enumerate(out.scores):
        top = scores.topk(2, dim=-1).values
        assert (top[:, 0] - top[:, 1]).min() > 1e-3, f"step {step}: a greedy choice within 1e-3 of a tie"
    return ids, mask, out.sequences


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_tokens_match_generate(name, tmp_path):
    """One module for 2 sequences: a batch of 2 left-padded, a batch of 1 (the filler row finished), and both
    again after save + load, each token for token as `model.generate`."""
    model, ids, expected = _expected(name)
    lm = fx_rewrites.compile_lm(model, max_cache_len=MAX_CACHE, batch_size=2)
    assert lm.generate(ids, max_new_tokens=lm_models.NEW)[0, ids.shape[1] :].tolist() == expected
    pair, mask, sequences = _padded_pair(model)
    assert torch.equal(lm.generate(pair, attention_mask=mask, max_new_tokens=lm_models.NEW), sequences)
    lm.save(tmp_path / "lm.vmfb")
    loaded = fx_rewrites.load(tmp_path / "lm.vmfb")
    assert torch.equal(loaded.generate(pair, attention_mask=mask, max_new_tokens=lm_models.NEW), sequences)
    assert loaded.generate(ids, max_new_tokens=lm_models.NEW)[0, ids.shape[1] :].tolist() == expected


def test_non_strict_export_matches_generate():
    """torch.export's default: the cache is lifted as constants written in place (made state by the rules)."""
    model, ids, expected = _expected("llama")
    assert single_program(model, ids, lm_models.NEW, strict=False) == expected


class _RecurrentStep(torch.nn.Module):
    """Mamba2 for one call with its recurrent state explicit (each layer's convolution window and SSM state in,
    their new values out). transformers' static-cache wrapper cannot take Mamba2 (`get_head_shapes` reads
    `num_attention_heads`, which Mamba2Config has not), and Mamba2's mixer branches in Python on the sequence
    length (`seq_len == 1`: the recurrent form; else the chunked scan) and on the cache layer's
    `has_previous_state`: prefill and decode are two programs (a Dim on the prefill length specializes too: the
    chunk padding's guards), which compile_lm's two entry points over one state fit."""

    def __init__(self, model: torch.nn.Module, cache: object) -> None:
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, input_ids: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for i, layer in enumerate(self.cache.layers):
            layer.conv_states[0].copy_(state[2 * i])
            layer.recurrent_states[0].copy_(state[2 * i + 1])
        logits = self.model(input_ids, cache_params=self.cache, use_cache=True).logits
        new = [t * 1 for layer in self.cache.layers for t in (layer.conv_states[0], layer.recurrent_states[0])]
        return (logits, *new)


def recurrent_programs(model: torch.nn.Module, ids: torch.Tensor, new: int) -> list[int]:
    """Greedy tokens from two compiled programs (prefill of the prompt's length, decode of one token), the
    recurrent state passed from call to call by the caller."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :2], cache_params=cache, use_cache=True)  # the layers allocate their state
    step = _RecurrentStep(model, cache)
    zeros = [torch.zeros_like(t) for layer in cache.layers for t in (layer.conv_states[0], layer.recurrent_states[0])]
    programs = []
    for inputs, previous in ((ids, False), (ids[:, :1], True)):
        for layer in cache.layers:
            layer.has_previous_state[0] = previous  # which branch the trace takes
        with torch.no_grad():
            programs.append(fx_rewrites.compile(torch.export.export(step, (inputs, *zeros))))
    prefill, decode = programs
    logits, *state = prefill(ids, *zeros)
    tokens = [int(logits[0, -1].argmax())]
    while len(tokens) < new:
        logits, *state = decode(torch.tensor([[tokens[-1]]]), *state)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


def test_recurrent_state_mamba2_matches_generate():
    model, ids, expected = _expected("mamba2")
    assert recurrent_programs(model, ids, lm_models.NEW) == expected
