"""Tiny seeded causal LMs of each architecture issue 26 lists, built from configs (no weights are downloaded).

`build(name)` returns `(model, config)`: the model in eval mode, its weights drawn from `torch.manual_seed(0)`
with `initializer_range` 0.3 (transformers' 0.02 leaves logits ~0.1 apart, and greedy argmax then ties within
float32 error: the margin between the first and second logit must stay far above it), no end-of-sequence token
(generation runs the full `max_new_tokens`) and `pad_token_id` 0. Every model: 2 layers, hidden 32-64, vocab 96.

`prompt()` is the seeded prompt the tests generate from; `top2_margin` the smallest distance between the best
and second logit along a sequence (the check that greedy decoding cannot flip on float32 error).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

VOCAB = 96
INIT = 0.3
#: the prompt length and the tokens generated; the sliding window of Gemma3 is shorter than their sum
PROMPT, NEW = 7, 32


def _common() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "num_hidden_layers": 2,
        "initializer_range": INIT,
        "max_position_embeddings": 128,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }


def _attention(hidden: int = 32, heads: int = 4, kv: int = 2) -> dict[str, Any]:
    return {
        **_common(),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hidden // heads,
    }


def _llama(t: Any) -> tuple[Any, Any]:
    return t.LlamaForCausalLM, t.LlamaConfig(**_attention())


def _qwen3(t: Any) -> tuple[Any, Any]:
    return t.Qwen3ForCausalLM, t.Qwen3Config(**_attention())


def _mistral(t: Any) -> tuple[Any, Any]:
    return t.MistralForCausalLM, t.MistralConfig(**_attention(), sliding_window=None)


def _gemma3(t: Any) -> tuple[Any, Any]:
    """Sliding-window layers: a window of 8, shorter than the 39 tokens generated, one sliding and one full layer."""
    config = t.Gemma3TextConfig(
        **_attention(),
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=8,
    )
    return t.Gemma3ForCausalLM, config


def _phi3(t: Any) -> tuple[Any, Any]:
    config = t.Phi3Config(**_attention(), sliding_window=None)
    return t.Phi3ForCausalLM, config


def _qwen3_moe(t: Any) -> tuple[Any, Any]:
    """4 experts, 2 per token, every layer sparse."""
    config = t.Qwen3MoeConfig(
        **_attention(),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )
    return t.Qwen3MoeForCausalLM, config


def _gpt2(t: Any) -> tuple[Any, Any]:
    """Learned positions (`wpe`), no rotary embedding."""
    common = _common()
    config = t.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=128,
        initializer_range=INIT,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=common["pad_token_id"],
        tie_word_embeddings=False,
    )
    return t.GPT2LMHeadModel, config


def _mamba2(t: Any) -> tuple[Any, Any]:
    """A recurrent state (the convolution window and the SSM state) instead of a key/value cache."""
    config = t.Mamba2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_heads=4,
        head_dim=16,
        expand=2,
        state_size=16,
        n_groups=1,
        conv_kernel=4,
        chunk_size=16,
        initializer_range=INIT,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return t.Mamba2ForCausalLM, config


BUILDERS: dict[str, Callable[[Any], tuple[Any, Any]]] = {
    "llama": _llama,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "qwen3_moe": _qwen3_moe,
    "gpt2": _gpt2,
    "mamba2": _mamba2,
}


def build(name: str) -> tuple[torch.nn.Module, Any]:
    """The tiny model `name` (a key of `BUILDERS`) and its config, weights from seed 0, in eval mode."""
    import transformers

    cls, config = BUILDERS[name](transformers)
    torch.manual_seed(0)
    model = cls(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model, config


def prompt(length: int = PROMPT, seed: int = 1) -> torch.Tensor:
    """A seeded [1, length] prompt of token ids."""
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def reference(model: torch.nn.Module, ids: torch.Tensor, new: int = NEW) -> torch.Tensor:
    """`model.generate(do_sample=False)`'s new tokens: what a compiled model must reproduce."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new)
    return out[:, ids.shape[1] :]


def top2_margin(model: torch.nn.Module, sequence: torch.Tensor, start: int) -> float:
    """The smallest gap between the best and the second logit over the positions from `start` on."""
    with torch.no_grad():
        logits = model(sequence).logits[0, start:]
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


class Mamba2Scan(torch.nn.Module):
    """transformers' Mamba2 chunked scan alone (`mamba2_chunk_scan`, 4 heads of 8, one group, SSM state 16), its
    A_log, D and dt_bias drawn from `generator`: `(x, dt, b, c)` -> (output, final state)."""

    def __init__(self, chunk: int, generator: torch.Generator) -> None:
        super().__init__()
        self.chunk = chunk
        self.a_log, self.d, self.dt_bias = (torch.rand(4, generator=generator) for _ in range(3))

    def forward(self, x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Any:
        from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

        return mamba2_chunk_scan(
            x, dt, -torch.exp(self.a_log), b, c, chunk_size=self.chunk, D=self.d, dt_bias=self.dt_bias,
            dt_softplus=True, return_final_states=True,
        )  # fmt: skip

    @staticmethod
    def inputs(length: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        """`(x, dt, b, c)` for a sequence of `length`, drawn from `generator`."""
        shapes = ((2, length, 4, 8), (2, length, 4), (2, length, 1, 16), (2, length, 1, 16))
        return tuple(torch.randn(*s, generator=generator) for s in shapes)
