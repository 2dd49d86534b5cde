"""`CompiledLM`: prefill and decode of one module, and the loop `generate` that `model.generate` would run.

The loop is transformers' `_sample` (greedy search or sampling) over the module's logits: left-padded
prompts, positions from the attention mask's running count, each step's tokens chosen on the host by
transformers' own logits processors and stopping criteria (`sampling.py`), rows that ended padded with the
pad token, the whole batch stopping once every row has ended. The cache stays in the module: each call
passes only the new tokens, their positions, the mask over the cache and the cache position of the first
new token (which also restarts the cache for a new prompt). Greedy steps that are argmax alone run in numpy over
the module's mapped logits (`greedy.py`), the others through transformers' processors (`sampling.py`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from fx_rewrites.app.lm import greedy, sampling
from fx_rewrites.app.lm.recurrent import SHORT_PREFILL
from fx_rewrites.app.lm.sampling import UNSET

#: `iree.reflection` key on `prefill`: what `generate` needs besides the two functions (JSON)
LM_KEY = "fx_rewrites.lm"
FUNCTIONS = ("prefill", "decode")


@attrs.frozen
class LMInfo:
    """What the compiled module was built for."""

    max_cache_len: int
    batch_size: int
    pad_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    #: the cache is a recurrent state (`recurrent.RecurrentLM`): `max_cache_len` bounds the (padded) prompt
    #: only, and every prompt is left-padded to a multiple of `prompt_multiple` tokens (`prefill_length`)
    recurrent: bool = False
    prompt_multiple: int = 1
    #: the module has a function for a prompt of one `prompt_multiple` (`recurrent.SHORT_PREFILL`)
    short_prefill: bool = False
    #: the model's generation config (`sampling.generation_config_json`; "" in files saved before it was kept:
    #: then `pad_token_id` and `eos_token_id` are what it had), and the sizes `model.generate` reads from its config
    generation_config: str = ""
    max_position_embeddings: int | None = None
    vocab_size: int | None = None
    #: the shortest prompt of two tokens or more the prefill takes; shorter ones are left-padded to it (a rank of
    #: a tensor-parallel model: DTensor's sharding guards the prompt length to at least the world size)
    min_prefill: int = 2
    #: a longer prompt is prefilled in calls of this many tokens (`generate`'s `prefill_chunk_size`); None: in one
    prefill_chunk_size: int | None = None

    def to_json(self) -> str:
        doc = attrs.asdict(self)
        doc["generation_config"] = json.loads(self.generation_config) if self.generation_config else None
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> LMInfo:
        doc = json.loads(text)
        generation = doc.get("generation_config")
        return cls(
            doc["max_cache_len"],
            doc["batch_size"],
            doc["pad_token_id"],
            tuple(doc["eos_token_id"]),
            doc.get("recurrent", False),
            doc.get("prompt_multiple", 1),
            doc.get("short_prefill", False),
            "" if generation is None else json.dumps(generation, sort_keys=True),
            doc.get("max_position_embeddings"),
            doc.get("vocab_size"),
            doc.get("min_prefill", 2),
            doc.get("prefill_chunk_size"),
        )

    def prefill_length(self, length: int) -> int:
        """The length a prompt of `length` tokens is prefilled at: itself, or for a recurrent state the
        multiple of `prompt_multiple` at or above it: one with the short prefill function, else two at least."""
        if not self.recurrent:
            return length if length < 2 else max(length, self.min_prefill)
        m = self.prompt_multiple
        return max(m if self.short_prefill else 2 * m, -(-length // m) * m)


def _ids(value: int | Sequence[int] | torch.Tensor | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        return tuple(int(v) for v in value.reshape(-1).tolist())
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def _token_ids(value: Any) -> Any:
    """An `eos_token_id` as `GenerationConfig` takes it (an int or a list; a tensor becomes a list)."""
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [int(v) for v in value]
    return value


def _unchecked(step: Any) -> Any:
    """`step` called without the call convention's per-call checks where its backend offers that
    (`IreeCompiled.unchecked`): `generate` builds every input itself, of the compiled dtypes and shapes."""
    unchecked = getattr(step, "unchecked", None)
    return unchecked() if callable(unchecked) else step


@attrs.define(eq=False)
class CompiledLM:
    """A causal LM compiled to one module with `prefill` and `decode` functions sharing weights and cache.

    `generate(input_ids, attention_mask=None, **generation options)` returns what `model.generate` returns
    for the same call (greedy search or sampling; docs/generation.md);
    `save(path)` writes the .vmfb and the weights (.irpa beside it, or `params=`), which
    `fx_rewrites.load(path)` reads back. `module` is the backend's module (`backends.base.Module`); its
    functions `prefill` / `decode` are called as the exported wrapper (`CachedLM`) is:
    `(input_ids, attention_mask, position_ids, cache_position)`.
    """

    info: LMInfo
    module: Any = attrs.field(repr=False)
    #: the rewritten programs (function -> ExportedProgram) and what the rules did; None once loaded
    programs: Mapping[str, Any] | None = attrs.field(default=None, repr=False)
    reports: Mapping[str, Any] | None = attrs.field(default=None, repr=False)
    #: the CPU the code is built for (`Compiled.cpu`), and the same compile for another CPU (`save(cpu=)`)
    cpu: str | None = None
    retarget: Callable[[str], CompiledLM] | None = attrs.field(default=None, repr=False)
    #: transformers' generation preparation over the model's configs (`sampling.generation_host`), made once
    _generation_host: Any = attrs.field(default=None, init=False, repr=False)

    @property
    def prefill(self) -> Any:
        return self.module.functions["prefill"]

    @property
    def decode(self) -> Any:
        return self.module.functions["decode"]

    @property
    def prefill_chunk(self) -> Any:
        """A recurrent model's prefill of exactly one chunk (`recurrent.SHORT_PREFILL`), if the module has one."""
        return self.module.functions.get(SHORT_PREFILL)

    @property
    def mlir(self) -> str:
        """The imported module text ("" once loaded)."""
        return getattr(self.module, "mlir", "")

    @property
    def parameters(self) -> Mapping[str, torch.Tensor] | None:
        """The weights the module reads (key -> tensor); None once loaded from a file."""
        return getattr(self.module, "parameters", None)

    def save(
        self, path: str | os.PathLike[str], *, params: str | os.PathLike[str] | None = None, cpu: str | None = None
    ) -> None:
        """Write the module to `path` (.vmfb) and its weights to `params` (default: `path` with suffix .irpa).
        `cpu`: code for that CPU (`fx_rewrites.compile_lm(..., cpu=)`), compiled again from the model."""
        from fx_rewrites.backends.base import save_for_cpu

        if save_for_cpu(self, path, params=params, cpu=cpu):
            return
        path = Path(path)
        self.module.save(path, params=Path(params) if params is not None else path.with_suffix(".irpa"))

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        generation_config: Any = None,
        max_new_tokens: int | None = UNSET,
        min_new_tokens: int | None = UNSET,
        do_sample: bool | None = UNSET,
        temperature: float | None = UNSET,
        top_k: int | None = UNSET,
        top_p: float | None = UNSET,
        repetition_penalty: float | None = UNSET,
        eos_token_id: int | Sequence[int] | torch.Tensor | None = UNSET,
        pad_token_id: int | None = UNSET,
        stop_strings: str | Sequence[str] | None = UNSET,
        tokenizer: Any = None,
        streamer: Any = None,
        logits_processor: Any = None,
        stopping_criteria: Any = None,
        prefill_chunk_size: int | None = UNSET,
        **options: Any,
    ) -> Any:
        """`model.generate(input_ids, attention_mask=..., ...)` on the compiled module: (rows, prompt + new) ids.

        Every keyword means what it means to transformers' `generate` (`app/lm/sampling.py` runs transformers'
        own preparation, logits processors and stopping criteria on the host): a keyword left out takes the
        model's generation config (saved with the module), `generation_config` is the call's own (its unset fields take
        the model's), and any other
        `GenerationConfig` field may be passed (`no_repeat_ngram_size=`, `min_p=`, `num_return_sequences=`,
        `return_dict_in_generate=` with `output_scores` / `output_logits`, ...). `do_sample=True` draws with
        `torch.multinomial` as `model.generate` does: with the same `torch.manual_seed`, the same tokens.
        `eos_token_id=None` turns the stop at eos off (`max_new_tokens` tokens whatever they are);
        `stop_strings` needs `tokenizer=`; `streamer` (`TextStreamer`, any `BaseStreamer`) gets the prompt, then
        each step's tokens as they are chosen. Greedy search and sampling only (no beams).
        `prefill_chunk_size`: a prompt longer than this is prefilled in calls of exactly this many tokens (the last
        call overlaps the one before it: every call's buffers have one size, which IREE's caching allocator reuses);
        None: the whole prompt in one call; left out: the generation config's, else `compile_lm`'s. The tokens are
        the same either way (transformers' `prefill_chunk_size`)."""
        given = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": min_new_tokens,
            "do_sample": do_sample,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "repetition_penalty": repetition_penalty,
            "eos_token_id": _token_ids(eos_token_id),
            "pad_token_id": pad_token_id,
            "stop_strings": stop_strings,
        }
        given = {key: value for key, value in given.items() if value is not UNSET} | options
        info = self.info
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() != 2:
            raise ValueError(f"input_ids has shape {tuple(ids.shape)}; expected (batch, prompt length)")
        decoding = sampling.prepare(
            self._host(),
            ids,
            attention_mask,
            generation_config,
            given,
            tokenizer=tokenizer,
            streamer=streamer,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
        )
        ids, mask = decoding.ids, decoding.mask
        rows, length = ids.shape
        if rows > info.batch_size:
            raise ValueError(
                f"{rows} prompts (num_return_sequences included), and the module was compiled for a batch of "
                f"{info.batch_size}. Fix: fx_rewrites.compile_lm(model, max_cache_len=..., batch_size={rows}), or "
                "split the prompts"
            )
        padded = info.prefill_length(length)
        if info.recurrent and padded > info.max_cache_len:
            raise ValueError(
                f"a prompt of {length} tokens is prefilled as {padded} (a multiple of {info.prompt_multiple}, the "
                f"model's chunk); the module takes prompts of up to {info.max_cache_len}. Fix: a shorter prompt, "
                f"or compile_lm(model, max_cache_len={padded})"
            )
        new = decoding.new_tokens
        if not info.recurrent and padded + new - 1 > info.max_cache_len:
            raise ValueError(
                f"a prompt of {padded} tokens and {new} new ones need {padded + new - 1} cache positions; the module "
                f"holds {info.max_cache_len}. Fix: fewer new tokens (max_new_tokens=), or "
                f"compile_lm(model, max_cache_len={padded + new - 1})"
            )
        filler = decoding.pad or 0
        if rows < info.batch_size:  # filler rows (every token real), never read, dropped at the end
            extra = info.batch_size - rows
            ids = torch.cat([ids, ids.new_full((extra, length), filler)])
            mask = torch.cat([mask, torch.ones(extra, length, dtype=torch.long)])
        if padded > length:  # left padding, masked: the prefill's length for a recurrent state
            ids = torch.cat([ids.new_full((ids.shape[0], padded - length), filler), ids], dim=1)
            mask = torch.cat([mask.new_zeros(mask.shape[0], padded - length), mask], dim=1)
        chunk = self._chunk_size(prefill_chunk_size, decoding.config)
        decoding.begin()
        return decoding.result(self._decode(decoding, ids, mask, rows, chunk))

    def _chunk_size(self, given: Any, config: Any) -> int | None:
        """The prefill's chunk: the call's `prefill_chunk_size`, else its generation config's, else compile_lm's."""
        if given is UNSET:
            given = getattr(config, "prefill_chunk_size", None)
            if given is None:
                given = self.info.prefill_chunk_size
        return None if given is None else check_chunk_size(given, self.info)

    def _host(self) -> Any:
        if self._generation_host is None:
            info = self.info
            config = sampling.model_generation_config(info.generation_config, info.pad_token_id, info.eos_token_id)
            self._generation_host = sampling.generation_host(config, info.max_position_embeddings, info.vocab_size)
        return self._generation_host

    def _decode(
        self, decoding: sampling.Decoding, ids: torch.Tensor, mask: torch.Tensor, rows: int, chunk: int | None = None
    ) -> torch.Tensor:
        """The prefill of `ids` (the module's batch and prompt length; in calls of `chunk` tokens if longer), then a
        decode per token `decoding` chooses for the first `rows` rows: their sequences."""
        batch, length = ids.shape
        prefill, decode = _unchecked(self.prefill), _unchecked(self.decode)
        cache_mask = torch.ones(batch, self.info.max_cache_len, dtype=torch.long)
        cache_mask[:, :length] = mask
        positions = mask.cumsum(-1) - 1
        positions = positions.masked_fill(mask == 0, 1)
        if self.prefill_chunk is not None and length == self.info.prompt_multiple:
            step = _unchecked(self.prefill_chunk)
        else:
            step = prefill if length > 1 else decode
        if chunk is not None and length > chunk and not self.info.recurrent:
            for start in chunk_starts(length, chunk):
                piece = slice(start, start + chunk)
                start_at = torch.tensor([start], dtype=torch.long)
                logits = prefill(ids[:, piece], cache_mask, positions[:, piece], start_at)
        else:
            logits = step(ids, cache_mask, positions, torch.tensor([0], dtype=torch.long))
        position = positions[:, -1:]
        steps = greedy.plain(decoding)
        if steps is not None:  # argmax alone: the steps without torch ops (greedy.py)
            greedy.run(steps, logits, decode, cache_mask, position, length, batch)
            return steps.sequences(decoding.ids)
        sequences = decoding.ids
        fill = ids.new_zeros(batch - rows)
        for i in range(decoding.new_tokens):
            tokens, sequences, done = decoding.next_tokens(sequences, logits[:rows, -1, :])
            if done or i == decoding.new_tokens - 1:
                break
            position = position + 1
            step_ids = torch.cat([tokens, fill])[:, None]
            logits = decode(step_ids, cache_mask, position, torch.tensor([length + i], dtype=torch.long))
        return sequences


def chunk_starts(length: int, chunk: int) -> list[int]:
    """The first positions of the prefill's calls of `chunk` tokens over a prompt of `length` > `chunk`: every
    `chunk`, the last at `length - chunk` (overlapping the one before it: its tokens are written again with the
    same keys and values, and every call is of the one size)."""
    return [*range(0, length - chunk, chunk), length - chunk]


def check_chunk_size(chunk: Any, info: LMInfo) -> int:
    """`chunk` as a prefill chunk for a module built as `info`, or a ValueError saying what fits."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not info.min_prefill <= chunk <= info.max_cache_len:
        raise ValueError(
            f"prefill_chunk_size={chunk!r}: expected an int from {info.min_prefill} (the prefill's shortest call) to "
            f"{info.max_cache_len} (the cache), or None for the whole prompt in one call"
        )
    return chunk
