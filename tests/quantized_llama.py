"""The tiny seeded Llama the quantized-route tests quantize (no weights are downloaded).

Its 2-D weights are scaled by 8 after transformers' initialisation, so the logits spread and greedy argmax does not
tie within float32 error (nor within a quantization step).
"""

from __future__ import annotations

import torch


def scaled_llama(
    vocab_size: int = 96, hidden_size: int = 64, intermediate_size: int = 128, num_hidden_layers: int = 1
) -> torch.nn.Module:
    """A `LlamaForCausalLM` in eval mode, 4 query / 2 key-value heads, 64 positions, weights from seed 0, scaled."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0 if p.dim() == 2 else 1.0)
    return model
