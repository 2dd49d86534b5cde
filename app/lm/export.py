"""A transformers causal LM with a static KV cache as two exported programs, prefill and decode.

`CachedLM` wraps the model with a `transformers.StaticCache` whose keys, values and write positions are
buffers of the wrapper (so torch.export sees them as state the programs update in place), and calls it
with a 2D attention mask over the whole cache (left padding), the tokens' positions and the cache position
of the first token. `export_lm` exports it twice over the same instance: `prefill` (the prompt length a
`torch.export.Dim`, 1..max_cache_len) and `decode` (one token); both read and write the same buffers.
Each returns the logits of its last position only.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch.export import Dim, ExportedProgram


def _static_cache(model: Any, batch_size: int, max_cache_len: int) -> Any:
    """The model's `StaticCache`, initialised, with the layer substitutions of transformers' own export wrapper
    (`TorchExportableModuleWithStaticCache`): a sliding-window layer rolls its buffer with Python control flow,
    so it becomes a full-length `StaticLayer` (the model's sliding-window mask still limits what each token
    sees, over absolute cache positions, as HF's dynamic cache does while the sequence fits the cache); a
    KV-sharing consumer (`DummyLayer`) never reads its cache and gets an empty one."""
    from transformers import cache_utils
    from transformers.configuration_utils import get_head_shapes

    config = model.config.get_text_config()
    cache = cache_utils.StaticCache(max_cache_len=max_cache_len, config=config)
    dummy = getattr(cache_utils, "DummyLayer", ())
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, cache_utils.StaticSlidingWindowLayer):
            cache.layers[i] = cache_utils.StaticLayer(max_cache_len)
        elif dummy and isinstance(layer, dummy):
            cache.layers[i] = cache_utils.StaticLayer(0)
    if _tensor_parallel(model):  # each rank holds its share of the heads: sized by one eager step, as HF's lazy one
        _initialize_from_a_step(model, cache, batch_size)
        return cache
    num_heads, head_dim = get_head_shapes(config)
    cache.early_initialization(batch_size, num_heads, head_dim, model.dtype, model.device)
    return cache


def _tensor_parallel(model: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _initialize_from_a_step(model: Any, cache: Any, batch_size: int) -> None:
    """`cache`'s layers allocated by one eager step of `model` (a rank of a tensor-parallel model: the keys its
    heads' shard gives), then emptied: zero keys and values, write positions at 0."""
    with torch.no_grad():
        model(input_ids=torch.zeros(batch_size, 1, dtype=torch.long), past_key_values=cache, use_cache=True)
    for layer in cache.layers:
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                value.zero_()


def _layer_tensors(cache: Any) -> list[tuple[int, str]]:
    """(layer index, attribute) of every tensor the cache's layers hold (keys, values, write position, ...)."""
    return [
        (i, attr)
        for i, layer in enumerate(cache.layers)
        for attr, value in sorted(vars(layer).items())
        if isinstance(value, torch.Tensor)
    ]


class CachedLM(torch.nn.Module):
    """`model` with a static cache held as buffers: `forward(input_ids, attention_mask, position_ids,
    cache_position)` writes the tokens' keys and values at `cache_position[0]`.. and returns the logits of
    the last position, (batch, 1, vocab). `attention_mask` is (batch, max_cache_len): 1 for a real token,
    0 for padding (positions not written yet are masked by causality whatever they hold)."""

    def __init__(self, model: Any, *, max_cache_len: int, batch_size: int = 1) -> None:
        super().__init__()
        self.model = model
        self.max_cache_len = max_cache_len
        self.batch_size = batch_size
        accepted = inspect.signature(model.forward).parameters
        self._keep = "logits_to_keep" in accepted  # else the logits are sliced after the call
        self._positions = "position_ids" in accepted
        self._tensor_parallel = _tensor_parallel(model)
        self.static_cache = _static_cache(model, batch_size, max_cache_len)
        self._held = _layer_tensors(self.static_cache)
        for i, attr in self._held:
            self.register_buffer(f"cache_{i}_{attr}", getattr(self.static_cache.layers[i], attr), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache_position: torch.Tensor,
    ) -> torch.Tensor:
        layers = self.static_cache.layers
        for i, attr in self._held:
            # the layers read the module's buffers: under a non-strict export these are what it traces as
            # buffers (the layers' own references would be lifted constants, written in place)
            setattr(layers[i], attr, getattr(self, f"cache_{i}_{attr}"))
        for layer in layers:
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                layer.cumulative_length.copy_(cache_position[0])  # where this call's tokens go
        kwargs: dict[str, Any] = {"logits_to_keep": 1} if self._keep else {}
        if self._positions:
            kwargs["position_ids"] = position_ids
        length, seen = input_ids.shape[1], self.max_cache_len
        # not on a tensor-parallel rank: its segments cannot pass a size read from the data between them
        full = None if self._tensor_parallel else _full_length_layers(layers, self.max_cache_len)
        start = None if full is None else _call_start(cache_position, length, self.max_cache_len)
        if full is not None and isinstance(length, int) and length == 1:
            # a decode step attends to the positions written so far, not the whole cache: at a cache of 2048 and a
            # context of 64, about 2x faster on IREE; a prompt attends to the whole cache (a key length read from
            # the data made IREE's prefill 1.7x slower at 1024 tokens: docs/performance.md)
            seen = start + 1
        with _writes_in_place(full or [], start, seen):
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask.narrow(1, 0, seen),
                past_key_values=self.static_cache,
                use_cache=True,
                **kwargs,
            )
        for i, attr in self._held:  # a layer that replaced a tensor instead of writing it: write it back
            buffer, value = getattr(self, f"cache_{i}_{attr}"), getattr(layers[i], attr)
            if value is not buffer:
                buffer.copy_(value)
                setattr(layers[i], attr, buffer)
        return out.logits if self._keep else out.logits[:, -1:]


def _call_start(cache_position: torch.Tensor, length: int, max_cache_len: int) -> Any:
    """The cache position of this call's first token: a size read from the data in an exported program, checked
    to leave room for the call's `length` tokens."""
    start = cache_position[0].item()
    torch._check(start >= 0)
    torch._check(start <= max_cache_len - length)
    return start


def _full_length_layers(layers: list[Any], max_cache_len: int) -> list[Any] | None:
    """The cache's full-length `StaticLayer`s, if every layer is one or an empty one (a KV-sharing consumer's);
    None where another kind of layer holds keys (then every layer keeps transformers' own update)."""
    from transformers.cache_utils import StaticLayer

    if not all(type(layer) is StaticLayer and layer.max_cache_len in (0, max_cache_len) for layer in layers):
        return None
    return [layer for layer in layers if layer.max_cache_len == max_cache_len]


@contextlib.contextmanager
def _writes_in_place(layers: list[Any], start: Any, seen: Any) -> Iterator[None]:
    """While inside, `layers` write a call's keys and values as one slice at `start` and hand attention their
    first `seen` positions (the mask sized to them). transformers' `index_copy_` at positions computed from
    `cumulative_length` becomes a scatter that IREE runs as a copy of the whole cache; the slice is an update in
    place."""
    for layer in layers:

        def update(key_states: Any, value_states: Any, *args: Any, _layer: Any = layer, **kwargs: Any) -> Any:
            end = start + key_states.shape[-2]
            _layer.keys.copy_(torch.slice_scatter(_layer.keys, key_states, 2, start, end))
            _layer.values.copy_(torch.slice_scatter(_layer.values, value_states, 2, start, end))
            _layer.cumulative_length.add_(key_states.shape[-2])
            return _layer.keys.narrow(2, 0, seen), _layer.values.narrow(2, 0, seen)

        layer.update = update
        layer.get_mask_sizes = lambda query_length: (seen, 0)
    try:
        yield
    finally:
        for layer in layers:
            del layer.update, layer.get_mask_sizes


def example_inputs(batch_size: int, length: int, max_cache_len: int, start: int = 0) -> tuple[torch.Tensor, ...]:
    """Inputs of one call of `length` tokens from cache position `start` (every token real)."""
    ids = torch.zeros(batch_size, length, dtype=torch.long)
    mask = torch.ones(batch_size, max_cache_len, dtype=torch.long)
    positions = torch.arange(start, start + length).expand(batch_size, length).contiguous()
    return ids, mask, positions, torch.tensor([start], dtype=torch.long)


def export_lm(wrapper: CachedLM, *, strict: bool = False, min_prompt: int = 2) -> dict[str, ExportedProgram]:
    """`prefill` (the prompt length dynamic, `min_prompt`..max_cache_len) and `decode` (one token) of `wrapper`,
    exported over the same instance: both programs read and write its cache buffers."""
    n, b = wrapper.max_cache_len, wrapper.batch_size
    length = Dim("prompt", min=min_prompt, max=n)
    shapes = {"input_ids": {1: length}, "attention_mask": None, "position_ids": {1: length}, "cache_position": None}
    example = example_inputs(b, min(max(4, min_prompt), n), n)
    with torch.no_grad():
        prefill = torch.export.export(wrapper, example, dynamic_shapes=shapes, strict=strict)
        decode = torch.export.export(wrapper, example_inputs(b, 1, n, start=min(4, n - 1)), strict=strict)
    return {"prefill": prefill, "decode": decode}
