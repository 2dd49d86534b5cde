"""The models benchmarks/runtime.py (and gpu_runtime.py) measure: transformers models at realistic sizes.

Hidden size 256, 2 layers, batch 4: text at 128 tokens (the last row padded),
images at 224x224, audio as 10 s of log-mel features. Weights are seeded
(`torch.manual_seed(0)` before building); no download. `--quick` sizes are
tiny, for the smoke test.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@attrs.frozen
class Spec:
    """One benchmark model: how to build it and its inputs, at full or quick size."""

    name: str
    what: str
    build: Callable[[bool], torch.nn.Module] = attrs.field(repr=False)
    inputs: Callable[[bool, int], Inputs] = attrs.field(repr=False)

    def model(self, quick: bool = False) -> torch.nn.Module:
        """The model in eval mode, its matrices drawn from one seeded generator.

        transformers' own initialisation (trunc_normal_, sinusoids) differs in
        the last bits between torch versions; `randn` from a seeded CPU
        generator does not, so a GPU machine with another torch rebuilds the
        same weights (benchmarks/gpu_runtime.py checks a checksum).
        """
        torch.manual_seed(0)
        model = self.build(quick).eval()
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.is_floating_point() and tensor.dim() >= 2:
                    tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.05)
        return model


def _tf() -> Any:
    if torch.version.cuda is None and importlib.util.find_spec("torchvision") is not None:
        # PyPI's torchvision is a CUDA build: on CPU torch its import (and so transformers') needs the two
        # ops tests/zoo/torchvision_cpu.py registers. A GPU machine's torchvision matches its torch.
        root = str(Path(__file__).resolve().parents[1])
        if root not in sys.path:
            sys.path.insert(0, root)
        from tests.zoo import torchvision_cpu

        torchvision_cpu.install()
    import transformers

    return transformers


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    return {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 1024}


def _text(quick: bool, seed: int) -> Inputs:
    batch, length = (2, 16) if quick else (4, 128)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, length - length // 4 - seed :] = 0  # the last row padded
    return (ids,), {"attention_mask": mask}


def _image(quick: bool, seed: int) -> Inputs:
    batch, size = (2, 32) if quick else (4, 224)
    return (torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed)),), {}


def _audio(quick: bool, seed: int) -> Inputs:
    batch, frames = (2, 64) if quick else (4, 1000)
    return (torch.randn(batch, 80, frames, generator=torch.Generator().manual_seed(seed)),), {}


def _bert(quick: bool) -> torch.nn.Module:
    t = _tf()
    return t.BertModel(t.BertConfig(vocab_size=1000, max_position_embeddings=256, **_sizes(quick)))


def _llama(quick: bool) -> torch.nn.Module:
    t = _tf()
    sizes = _sizes(quick)
    config = t.LlamaConfig(
        vocab_size=1000,
        max_position_embeddings=256,
        num_key_value_heads=sizes["num_attention_heads"] // 2,  # grouped-query attention
        use_cache=False,
        **sizes,
    )
    return t.LlamaModel(config)


def _gpt2(quick: bool) -> torch.nn.Module:
    t = _tf()
    s = _sizes(quick)
    config = t.GPT2Config(
        vocab_size=1000,
        n_embd=s["hidden_size"],
        n_layer=s["num_hidden_layers"],
        n_head=s["num_attention_heads"],
        n_positions=256,
        use_cache=False,
    )
    return t.GPT2Model(config)


def _vit(quick: bool) -> torch.nn.Module:
    t = _tf()
    return t.ViTModel(t.ViTConfig(image_size=32 if quick else 224, patch_size=8 if quick else 16, **_sizes(quick)))


def _resnet(quick: bool) -> torch.nn.Module:
    t = _tf()
    hidden = [8, 16] if quick else [32, 64, 128, 256]
    config = t.ResNetConfig(embedding_size=hidden[0], hidden_sizes=hidden, depths=[1] * len(hidden), layer_type="basic")
    return t.ResNetModel(config)


def _whisper_encoder(quick: bool) -> torch.nn.Module:
    t = _tf()
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    s = _sizes(quick)
    config = t.WhisperConfig(
        d_model=s["hidden_size"],
        encoder_layers=s["num_hidden_layers"],
        encoder_attention_heads=s["num_attention_heads"],
        encoder_ffn_dim=s["intermediate_size"],
        num_mel_bins=80,
        max_source_positions=32 if quick else 500,
    )
    return WhisperEncoder(config)


MODELS: dict[str, Spec] = {
    spec.name: spec
    for spec in (
        Spec("bert", "BERT encoder, 128 tokens", _bert, _text),
        Spec("llama", "Llama decoder, grouped-query attention (4 heads, 2 KV)", _llama, _text),
        Spec("gpt2", "GPT-2 decoder, causal attention", _gpt2, _text),
        Spec("vit", "ViT, 224x224, 16x16 patches", _vit, _image),
        Spec("resnet", "ResNet (basic blocks, 32-256 channels), 224x224", _resnet, _image),
        Spec("whisper_encoder", "Whisper encoder, 10 s of audio (1000 frames)", _whisper_encoder, _audio),
    )
}
QUICK = ("bert", "vit")
