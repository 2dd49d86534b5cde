"""The host side of `CompiledLM.generate`: transformers' own generation machinery over the module's logits.

`model.generate` prepares a call in steps that need no model, only its configs: the generation config (the
call's `GenerationConfig` or keywords over the model's, `_prepare_generation_config`), the special tokens
(`_prepare_special_tokens`), the attention mask inferred from the pad token, the length (`_prepare_generated_length`,
`_validate_generated_length`), the logits processors and warpers (`_get_logits_processor`: repetition penalty,
min new tokens, temperature, top-k, top-p, ...) and the stopping criteria (`_get_stopping_criteria`: max length,
eos, stop strings with a tokenizer). `GenerationHost` is a `GenerationMixin` with those configs and no model: it
runs transformers' own methods, so a keyword means here what it means to `model.generate` (an explicit
`eos_token_id=None` turns the model's eos off; a keyword left out takes the model's value), and each step
(`Decoding.next_tokens`) is `_sample`'s: processors over the float32 logits of the last position, then
`torch.multinomial` over their softmax (`do_sample`) or argmax, rows that ended padded, the criteria updated.
With the same `torch.manual_seed` the tokens drawn are `model.generate`'s.

The model's generation config is saved with the module (`LMInfo.generation_config`, JSON), so a loaded module
generates as the model did. transformers is imported when a call is prepared, not when this module is.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import attrs
import torch


class _Unset:
    """The default of a `generate` keyword: left out (the generation config's value), unlike an explicit None."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()

#: generation modes `CompiledLM.generate` runs (transformers' `_sample` loop runs both)
_MODES = ("greedy_search", "sample")


def generation_config_json(model: Any) -> str:
    """`model.generation_config` as JSON (the values that differ from transformers' defaults); "" for none."""
    config = getattr(model, "generation_config", None)
    return "" if config is None else json.dumps(json.loads(config.to_json_string(use_diff=True)), sort_keys=True)


def model_generation_config(text: str, pad_token_id: int | None, eos_token_id: tuple[int, ...]) -> Any:
    """The model's `GenerationConfig` from `generation_config_json`'s text; for a module saved before that text
    was kept (empty), the pad and eos tokens it had."""
    from transformers import GenerationConfig

    if text:
        return GenerationConfig.from_dict(json.loads(text))
    eos = None if not eos_token_id else (eos_token_id[0] if len(eos_token_id) == 1 else list(eos_token_id))
    return GenerationConfig(pad_token_id=pad_token_id, eos_token_id=eos)


@functools.cache
def _host_class() -> type:
    from transformers.generation import GenerationMixin

    class GenerationHost(GenerationMixin):
        """A `GenerationMixin` with a model's configs and no model: `generate`'s preparation steps, run as is."""

        device = torch.device("cpu")

        def __init__(self, config: Any, generation_config: Any) -> None:
            self.config = config
            self.generation_config = generation_config

    return GenerationHost


def generation_host(generation_config: Any, max_position_embeddings: int | None, vocab_size: int | None) -> Any:
    """A `GenerationHost` for a decoder-only model with these configs."""
    from transformers import PretrainedConfig

    sizes = {"max_position_embeddings": max_position_embeddings, "vocab_size": vocab_size}
    config = PretrainedConfig(**{k: v for k, v in sizes.items() if v is not None})
    return _host_class()(config, generation_config)


@attrs.define(eq=False)
class Decoding:
    """One `generate` call, prepared as `model.generate` prepares it: `ids` and `mask` (rows expanded by
    `num_return_sequences`), `new_tokens` at most, and the step (`next_tokens`) with its state."""

    config: Any
    ids: torch.Tensor
    mask: torch.Tensor
    new_tokens: int
    processors: Any
    criteria: Any
    streamer: Any = None
    #: a criterion stops rows at eos: rows that ended are padded with `pad` after it
    pad_ended: bool = False
    pad: int | None = None
    unfinished: torch.Tensor = attrs.field(init=False)
    scores: list[torch.Tensor] = attrs.field(factory=list)
    logits: list[torch.Tensor] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        self.unfinished = torch.ones(self.ids.shape[0], dtype=torch.long)

    def begin(self) -> None:
        """The prompt to the streamer, as `model.generate` hands it over before the first step."""
        if self.streamer is not None:
            self.streamer.put(self.ids.cpu())

    @property
    def sample(self) -> bool:
        return bool(self.config.do_sample)

    def next_tokens(self, sequences: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One step of transformers' `_sample` over `logits` (rows, vocab) after `sequences` (rows, length):
        the tokens chosen (rows,), the sequences with them, and whether every row has ended."""
        config = self.config
        next_logits = logits.to(copy=True, dtype=torch.float32)
        scores = self.processors(sequences, next_logits)
        if config.return_dict_in_generate:
            if config.output_scores:
                self.scores.append(scores)
            if config.output_logits:
                self.logits.append(next_logits)
        if self.sample:
            tokens = torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            tokens = torch.argmax(scores, dim=-1)
        if self.pad_ended:
            tokens = tokens * self.unfinished + self.pad * (1 - self.unfinished)
        sequences = torch.cat([sequences, tokens[:, None]], dim=-1)
        recorded = tuple(self.scores) if config.return_dict_in_generate and config.output_scores else None
        self.unfinished = self.unfinished & ~self.criteria(sequences, recorded)
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())
        return tokens, sequences, bool(self.unfinished.max() == 0)

    def result(self, sequences: torch.Tensor) -> Any:
        """What `model.generate` returns: the sequences, or with `return_dict_in_generate` its output record."""
        if self.streamer is not None:
            self.streamer.end()
        config = self.config
        if not config.return_dict_in_generate:
            return sequences
        from transformers.generation import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=tuple(self.scores) if config.output_scores else None,
            logits=tuple(self.logits) if config.output_logits else None,
        )


def prepare(
    host: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    generation_config: Any,
    options: Mapping[str, Any],
    *,
    tokenizer: Any = None,
    streamer: Any = None,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
) -> Decoding:
    """`generate`'s preparation (transformers' `GenerationMixin.generate`, steps 1-8) for `input_ids` (rows,
    length): `options` are the generation keywords given (those left out are not in it)."""
    from transformers.generation import LogitsProcessorList, StoppingCriteriaList

    default_max = (
        options.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and host.generation_config.max_length is None
    )
    default_min = (
        options.get("min_length") is None
        and (generation_config is None or generation_config.min_length is None)
        and host.generation_config.min_length is None
    )
    config, unused = host._prepare_generation_config(generation_config, **options)
    if unused:
        raise TypeError(
            f"generate() got keywords that are not generation options: {sorted(unused)}. A compiled LM takes the "
            "options of transformers.GenerationConfig (and input_ids, attention_mask); the model's other inputs "
            "were fixed when it was compiled"
        )
    _check_supported(config)
    ids = input_ids
    rows = ids.shape[0]
    host._prepare_special_tokens(config, attention_mask is not None, device=ids.device, batch_size=rows)
    if attention_mask is None:
        mask = host._prepare_attention_mask_for_generation(ids, config, {})
    else:
        mask = torch.as_tensor(attention_mask, dtype=torch.long)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}; expected {tuple(ids.shape)} as input_ids")
    # model.generate drops a mask of all ones before building the processors (the repetition penalty's padding)
    model_kwargs = {"attention_mask": None if bool((mask == 1).all()) else mask}
    expand = max(config.num_beams or 1, config.num_return_sequences or 1)
    if expand > 1:
        ids, mask = ids.repeat_interleave(expand, dim=0), mask.repeat_interleave(expand, dim=0)
        if model_kwargs["attention_mask"] is not None:
            model_kwargs["attention_mask"] = mask
    length = ids.shape[1]
    config = host._prepare_generated_length(
        generation_config=config,
        has_default_max_length=default_max,
        has_default_min_length=default_min,
        model_input_name="input_ids",
        inputs_tensor=input_ids,
        input_ids_length=length,
    )
    host._validate_generated_length(config, length, default_max)
    processors = host._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=length,
        encoder_input_ids=input_ids,
        logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
        device=ids.device,
        model_kwargs=model_kwargs,
    )
    criteria = host._get_stopping_criteria(
        generation_config=config,
        stopping_criteria=stopping_criteria if stopping_criteria is not None else StoppingCriteriaList(),
        tokenizer=tokenizer,
    )
    pad = config._pad_token_tensor
    return Decoding(
        config,
        ids,
        mask,
        config.max_length - length,
        processors,
        criteria,
        streamer,
        pad_ended=any(hasattr(c, "eos_token_id") for c in criteria),
        pad=None if pad is None else int(pad),
    )


def _check_supported(config: Any) -> None:
    mode = str(getattr(config.get_generation_mode(), "value", config.get_generation_mode()))
    if mode not in _MODES:
        raise NotImplementedError(
            f"generation mode {mode!r} (num_beams={config.num_beams}, do_sample={config.do_sample}): a compiled LM "
            "runs greedy search and sampling (transformers' _sample loop). Fix: num_beams=1 (and no constraints, "
            "penalty_alpha or assistant)"
        )
    if config.guidance_scale is not None and config.guidance_scale != 1:
        raise NotImplementedError(
            f"guidance_scale={config.guidance_scale}: classifier-free guidance runs the model a second time on a "
            "negative prompt inside its logits processor, which a compiled LM cannot do. Fix: guidance_scale=None"
        )
    for flag in ("output_attentions", "output_hidden_states"):
        if config.return_dict_in_generate and getattr(config, flag, False):
            raise NotImplementedError(
                f"{flag}=True: the compiled module returns the logits only. Fix: leave {flag} out (output_scores "
                "and output_logits work)"
            )
