"""`CompiledLM`: prefill and decode of one module, and the greedy loop `generate` that HF's would run.

The loop mirrors `transformers`' greedy search (`model.generate(..., do_sample=False)`): left-padded
prompts, positions from the attention mask's running count, each row stopping at its end-of-sequence
token and padded with `pad_token_id` after it, the whole batch stopping once every row has ended.
The cache stays in the module: each call passes only the new tokens, their positions, the mask over the
cache and the cache position of the first new token (which also restarts the cache for a new prompt).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from fx_rewrites.app.lm.recurrent import SHORT_PREFILL

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

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> LMInfo:
        doc = json.loads(text)
        return cls(
            doc["max_cache_len"],
            doc["batch_size"],
            doc["pad_token_id"],
            tuple(doc["eos_token_id"]),
            doc.get("recurrent", False),
            doc.get("prompt_multiple", 1),
            doc.get("short_prefill", False),
        )

    def prefill_length(self, length: int) -> int:
        """The length a prompt of `length` tokens is prefilled at: itself, or for a recurrent state the
        multiple of `prompt_multiple` at or above it: one with the short prefill function, else two at least."""
        if not self.recurrent:
            return length
        m = self.prompt_multiple
        return max(m if self.short_prefill else 2 * m, -(-length // m) * m)


def _ids(value: int | Sequence[int] | torch.Tensor | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        return tuple(int(v) for v in value.reshape(-1).tolist())
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def _unchecked(step: Any) -> Any:
    """`step` called without the call convention's per-call checks where its backend offers that
    (`IreeCompiled.unchecked`): `generate` builds every input itself, of the compiled dtypes and shapes."""
    unchecked = getattr(step, "unchecked", None)
    return unchecked() if callable(unchecked) else step


@attrs.define(eq=False)
class CompiledLM:
    """A causal LM compiled to one module with `prefill` and `decode` functions sharing weights and cache.

    `generate(input_ids, attention_mask=None, max_new_tokens=20, eos_token_id=None)` returns what
    `model.generate(input_ids, attention_mask=..., max_new_tokens=..., do_sample=False)` returns;
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

    def save(self, path: str | os.PathLike[str], *, params: str | os.PathLike[str] | None = None) -> None:
        """Write the module to `path` (.vmfb) and its weights to `params` (default: `path` with suffix .irpa)."""
        path = Path(path)
        self.module.save(path, params=Path(params) if params is not None else path.with_suffix(".irpa"))

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 20,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
    ) -> torch.Tensor:
        """Greedy generation, as `model.generate(..., do_sample=False)`: (batch, prompt + generated) ids.
        `eos_token_id` / `pad_token_id` default to the model's generation config's."""
        info = self.info
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() != 2:
            raise ValueError(f"input_ids has shape {tuple(ids.shape)}; expected (batch, prompt length)")
        rows, length = ids.shape
        eos = _ids(eos_token_id) or info.eos_token_id
        pad = pad_token_id if pad_token_id is not None else info.pad_token_id
        if pad is None and eos:
            pad = eos[0]  # as transformers does (with a warning)
        if attention_mask is not None:
            mask = torch.as_tensor(attention_mask, dtype=torch.long)
        elif pad is not None and pad not in eos and bool((ids == pad).any()):
            mask = (ids != pad).long()  # transformers infers the padding from the pad token, where it can
        else:
            mask = torch.ones_like(ids)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}; expected {tuple(ids.shape)} as input_ids")
        if rows > info.batch_size:
            raise ValueError(
                f"{rows} prompts, and the module was compiled for a batch of {info.batch_size}. Fix: "
                f"fx_rewrites.compile_lm(model, max_cache_len=..., batch_size={rows}), or split the prompts"
            )
        if length < 1 or max_new_tokens < 1:
            return ids.clone()
        padded = info.prefill_length(length)
        if info.recurrent and padded > info.max_cache_len:
            raise ValueError(
                f"a prompt of {length} tokens is prefilled as {padded} (a multiple of {info.prompt_multiple}, the "
                f"model's chunk); the module takes prompts of up to {info.max_cache_len}. Fix: a shorter prompt, "
                f"or compile_lm(model, max_cache_len={padded})"
            )
        if not info.recurrent and length + max_new_tokens - 1 > info.max_cache_len:
            raise ValueError(
                f"a prompt of {length} tokens and {max_new_tokens} new ones need {length + max_new_tokens - 1} "
                f"cache positions; the module holds {info.max_cache_len}. Fix: fewer new tokens, or "
                f"compile_lm(model, max_cache_len={length + max_new_tokens - 1})"
            )
        if rows < info.batch_size:  # filler rows (every token real), finished from the start, dropped at the end
            extra = info.batch_size - rows
            ids = torch.cat([ids, ids.new_zeros(extra, length)])
            mask = torch.cat([mask, torch.ones(extra, length, dtype=torch.long)])
        if padded > length:  # left padding, masked: the prefill's length for a recurrent state
            ids = torch.cat([ids.new_full((ids.shape[0], padded - length), pad or 0), ids], dim=1)
            mask = torch.cat([mask.new_zeros(mask.shape[0], padded - length), mask], dim=1)
        return self._greedy(ids, mask, max_new_tokens, eos, pad, rows)[:rows, padded - length :]

    def _greedy(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new_tokens: int,
        eos: tuple[int, ...],
        pad: int | None,
        rows: int,
    ) -> torch.Tensor:
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
        logits = step(ids, cache_mask, positions, torch.tensor([0], dtype=torch.long))
        unfinished = torch.arange(batch) < rows  # filler rows never hold the batch back
        eos_tensor = torch.tensor(eos, dtype=torch.long)
        out = [ids]
        position = positions[:, -1:]
        for i in range(max_new_tokens):
            token = logits[:, -1, :].argmax(-1)
            if eos:
                token = torch.where(unfinished, token, torch.full_like(token, pad))
                unfinished &= ~torch.isin(token, eos_tensor)
            out.append(token[:, None])
            if i == max_new_tokens - 1 or (eos and not bool(unfinished.any())):
                break
            position = position + 1
            logits = decode(token[:, None], cache_mask, position, torch.tensor([length + i], dtype=torch.long))
        return torch.cat(out, dim=1)
