"""A causal LM whose cache is a recurrent state (Mamba2), as exported programs: prefills and a decode.

transformers keeps such a model's state in "linear attention" cache layers: per layer a convolution window
and an SSM state of fixed shapes, whatever the sequence length. `RecurrentLM` holds them as buffers and is
called as `CachedLM` is, `(input_ids, attention_mask, position_ids, cache_position)`, so that one
`CompiledLM` drives both (the positions and the cache position are not read: a recurrent state has no
positions). The mixer branches in Python on whether the layer has a previous state (the recurrent form of one
token, else the chunked scan from a zero state), so prefill and decode are separate programs, each tracing one
branch, and a prefill always starts the state afresh.

The chunked scan pads the sequence to a multiple of its chunk with `(chunk - L % chunk) % chunk`: under a
Dim on L that guard specializes the export to the example's length. The prefill's length is therefore a
multiple of the chunk (`Dim("chunks") * chunk`, at least two chunks: the scan's own code guards a count of
one), with a third function for a prompt of one chunk (`SHORT_PREFILL`, static), and `generate` left-pads a
prompt to the next of those lengths with masked positions. That changes no number of the model: its mixers
zero the padded positions' inputs (`apply_mask_to_padding_states`, before the input projection and after the
convolution), so a zero state stays zero through them, and the convolution sees zeros before the first token
as it does at the start of a sequence; this holds where the input projection has no bias (Mamba2's
`use_bias=False`, the default and every released checkpoint's), and `compile_lm` refuses a model with one.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.export import Dim, ExportedProgram

from fx_rewrites.app.lm.export import example_inputs

#: the module function that prefills a prompt of one chunk (or less, padded): the chunked scan's export with a
#: Dim starts at two chunks (the scan's code guards a count of one)
SHORT_PREFILL = "prefill_chunk"


def _states(cache: Any) -> list[tuple[int, str, int]]:
    """(layer, "conv_states" / "recurrent_states", state index) of every tensor the cache's layers hold."""
    return [
        (i, kind, index)
        for i, layer in enumerate(cache.layers)
        for kind in ("conv_states", "recurrent_states")
        for index, value in sorted(getattr(layer, kind, {}).items())
        if isinstance(value, torch.Tensor)
    ]


def cache_kind(model: Any) -> str:
    """The kind of `model`'s cache: "attention" (key/value layers only), "recurrent" (linear attention layers
    only) or "hybrid" (both)."""
    from transformers import cache_utils

    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    if mixin is None:  # a transformers without recurrent cache layers
        return "attention"
    layers = cache_utils.StaticCache(config=model.config.get_text_config(), max_cache_len=2).layers
    linear = any(isinstance(layer, mixin) for layer in layers)
    keys = any(isinstance(layer, cache_utils.CacheLayerMixin) for layer in layers)
    return "hybrid" if linear and keys else "recurrent" if linear else "attention"


def prompt_multiple(model: Any) -> int:
    """The length a prefill's prompt is a multiple of: the chunk of a chunked scan (Mamba2's `chunk_size`)."""
    return int(getattr(model.config.get_text_config(), "chunk_size", None) or 1)


class RecurrentLM(torch.nn.Module):
    """`model` (a transformers LM with linear-attention cache layers, e.g. `Mamba2ForCausalLM`) with its
    recurrent state held as buffers. `forward(input_ids, attention_mask, position_ids, cache_position)`:
    several tokens start the state afresh (prefill; `attention_mask` is (batch, max_cache_len), its first
    `input_ids.shape[1]` columns the prompt's: 0 for padding), one token continues it (decode); returns the
    logits of the last position, (batch, 1, vocab)."""

    def __init__(self, model: Any, *, max_cache_len: int, batch_size: int = 1) -> None:
        super().__init__()
        from transformers import cache_utils

        self.model = model
        self.max_cache_len = max_cache_len
        self.batch_size = batch_size
        self.multiple = prompt_multiple(model)
        accepted = inspect.signature(model.forward).parameters
        self._cache_arg = "cache_params" if "cache_params" in accepted else "past_key_values"
        self._keep = "logits_to_keep" in accepted
        self.cache = cache_utils.StaticCache(config=model.config.get_text_config(), max_cache_len=max_cache_len)
        # the layers allocate their states on their first update, from its shapes: one call of two tokens
        with torch.no_grad():
            model(torch.zeros(batch_size, 2, dtype=torch.long), use_cache=True, **{self._cache_arg: self.cache})
        self.cache.reset()  # zeros, no previous state
        self._held = _states(self.cache)
        for i, kind, index in self._held:
            state = getattr(self.cache.layers[i], kind)[index]
            self.register_buffer(self._name(i, kind, index), state, persistent=False)

    @staticmethod
    def _name(layer: int, kind: str, index: int) -> str:
        return f"state_{layer}_{kind}_{index}"

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache_position: torch.Tensor,
    ) -> torch.Tensor:
        length = input_ids.shape[1]
        decode = length == 1
        layers = self.cache.layers
        for i, kind, index in self._held:
            # the layers read the module's buffers (what a non-strict export traces as buffers); which branch
            # the mixer takes is decided here, at trace time
            getattr(layers[i], kind)[index] = getattr(self, self._name(i, kind, index))
            layers[i].has_previous_state[index] = decode
        mask = None if decode else attention_mask[:, :length]  # as transformers' generate: no mask to decode
        kwargs: dict[str, Any] = {self._cache_arg: self.cache, "use_cache": True}
        if self._keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids, attention_mask=mask, **kwargs)
        for i, kind, index in self._held:  # a layer that replaced a tensor instead of writing it: write it back
            buffer, value = getattr(self, self._name(i, kind, index)), getattr(layers[i], kind)[index]
            if value is not buffer:
                buffer.copy_(value)
                getattr(layers[i], kind)[index] = buffer
        return out.logits if self._keep else out.logits[:, -1:]


def export_recurrent(wrapper: RecurrentLM, *, strict: bool = False) -> dict[str, ExportedProgram]:
    """`prefill` (the prompt length a multiple of the chunk, 2 chunks .. max_cache_len), `decode` (one token)
    and, for a chunked scan, `SHORT_PREFILL` (exactly one chunk) of `wrapper`, exported over the same
    instance: all read and write its state buffers."""
    n, b, m = wrapper.max_cache_len, wrapper.batch_size, wrapper.multiple
    if n < 2 * m:
        raise ValueError(
            f"max_cache_len={n}: a recurrent model's prefill takes prompts padded to a multiple of its chunk "
            f"({m} tokens), at least two chunks. Fix: compile_lm(model, max_cache_len={2 * m}) or more"
        )
    shapes = None  # one length only (a Dim's min must be below its max)
    if n // m > 2:
        length = Dim("prompt", min=2, max=n) if m == 1 else m * Dim("chunks", min=2, max=n // m)
        shapes = {"input_ids": {1: length}, "attention_mask": None, "position_ids": {1: length}, "cache_position": None}
    with torch.no_grad():
        try:
            prefill = torch.export.export(wrapper, example_inputs(b, 2 * m, n), dynamic_shapes=shapes, strict=strict)
        except torch._dynamo.exc.UserError as e:
            if shapes is None:
                raise
            name = type(wrapper.model).__name__
            raise NotImplementedError(
                f"{name}'s prefill does not export with the prompt length dynamic ({m} * chunks, here 2..{n // m}): "
                f"torch says {' '.join(str(e).split())[:200]!r}. A scan that loops over the sequence in Python "
                "(transformers' Mamba1 `mamba_selective_scan`) fixes the length; compile_lm takes recurrent models "
                "whose prefill is a chunked scan (Mamba2). Fix: fx_rewrites.compile on an export of one step of a "
                "fixed length"
            ) from e
        decode = torch.export.export(wrapper, example_inputs(b, 1, n, start=2 * m), strict=strict)
        programs = {"prefill": prefill, "decode": decode}
        if m > 1:  # a prompt of one chunk or less: its own program (the chunked one's shortest is two)
            programs[SHORT_PREFILL] = torch.export.export(wrapper, example_inputs(b, m, n), strict=strict)
    return programs
