"""Greedy search's decode steps without torch ops on the host (issue 33): `CompiledLM.generate`'s fast loop.

When a step of transformers' `_sample` is only argmax (greedy, no logits processor, no scores or logits
recorded) and its stopping criteria only the length and eos (`plain`), a step needs neither the logits as
a tensor nor torch: `run` reads each decode call's argmax off the module's mapped logits (`UncheckedCall.reduced`:
no copy of the vocab-sized row), writes the next call's token, position and cache position into numpy arrays
it reuses, and keeps the tokens, the rows still running and eos's stop in numpy. torch's single-threaded argmax
over 32000 floats took ~0.1-0.2 ms and the step's other torch ops (copy, cat, the criteria, the inputs) ~0.5-1 ms on
the AVX2 host: ~1.4 ms a token, a tenth of an int4 token. Anything else (sampling, processors, other criteria,
`output_scores` / `output_logits`) takes `Decoding.next_tokens`. The tokens are the same: `argmax_rows` is
torch.argmax's choice (the first maximum, a NaN counting as the maximum: tests/test_lm_greedy.py), over the
float32 logits as `next_tokens` casts them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch

from fx_rewrites.app.lm.sampling import Decoding


def argmax_rows(logits: np.ndarray, rows: int) -> np.ndarray:
    """The argmax over the vocabulary of `logits` (batch, positions, vocab) at the last position, for the first
    `rows` rows, as int64: torch.argmax's choice over those logits as float32."""
    last = logits[:rows, -1, :]
    if last.dtype != np.float32:
        last = last.astype(np.float32)
    return np.argmax(last, axis=-1).astype(np.int64, copy=False)


@attrs.define(eq=False)
class Steps:
    """The state of greedy steps over `rows` rows: the tokens chosen so far, the rows still running."""

    rows: int
    new_tokens: int
    #: the eos ids of the criteria (None: no eos criterion), and the pad that ended rows take (None: not padded)
    eos: np.ndarray | None
    pad: int | None
    streamer: Any = None
    tokens: np.ndarray = attrs.field(init=False)
    count: int = attrs.field(init=False, default=0)
    unfinished: np.ndarray = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.tokens = np.zeros((self.rows, self.new_tokens), np.int64)
        self.unfinished = np.ones(self.rows, bool)

    def take(self, chosen: np.ndarray) -> bool:
        """Record the step's argmax `chosen` (rows,), an ended row's as the pad; whether every row has ended."""
        if self.pad is not None:
            chosen = np.where(self.unfinished, chosen, self.pad)
        self.tokens[:, self.count] = chosen
        self.count += 1
        if self.eos is not None:
            self.unfinished &= ~np.isin(chosen, self.eos)
        if self.streamer is not None:
            self.streamer.put(torch.from_numpy(self.tokens[:, self.count - 1].copy()))
        return not self.unfinished.any()

    def sequences(self, ids: torch.Tensor) -> torch.Tensor:
        """The prompt `ids` (rows, length) with the tokens chosen after it."""
        return torch.cat([ids, torch.from_numpy(self.tokens[:, : self.count].copy())], dim=-1)


def plain(decoding: Decoding) -> Steps | None:
    """`decoding`'s steps as `Steps` where each is argmax and the criteria are the length and eos alone; None
    where a step needs `Decoding.next_tokens` (sampling, a logits processor, scores or logits recorded, any other
    criterion, or a length criterion that would stop early or warn about the model's positions)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    config = decoding.config
    if decoding.sample or len(decoding.processors):
        return None
    if config.return_dict_in_generate and (config.output_scores or config.output_logits):
        return None
    rows, length = decoding.ids.shape
    end = length + decoding.new_tokens
    eos = []
    for criterion in decoding.criteria:
        if type(criterion) is MaxLengthCriteria:
            positions = criterion.max_position_embeddings
            if criterion.max_length < end or (positions is not None and end > positions):
                return None
        elif type(criterion) is EosTokenCriteria:
            eos.append(torch.as_tensor(criterion.eos_token_id).reshape(-1).to(torch.int64).numpy())
        else:
            return None
    if decoding.pad_ended and decoding.pad is None:
        return None  # next_tokens fails there as transformers does
    return Steps(
        rows,
        decoding.new_tokens,
        np.concatenate(eos) if eos else None,
        decoding.pad if decoding.pad_ended else None,
        decoding.streamer,
    )


def reduced_call(step: Any) -> Callable[..., Any]:
    """`step` (an unchecked module function) as `call(reduce, *arrays)`: its `reduced` where it has one (IREE:
    the result read in place), else the call on tensors over copies of the arrays, `reduce` of its result as
    float32 numpy."""
    reduced = getattr(step, "reduced", None)
    if callable(reduced):
        return reduced

    def call(reduce: Callable[[np.ndarray], Any], *arrays: np.ndarray) -> Any:
        out = step(*(torch.from_numpy(a.copy()) for a in arrays))
        return reduce(out.detach().to(torch.float32).numpy())

    return call


def run(
    steps: Steps,
    logits: torch.Tensor,
    decode: Any,
    cache_mask: torch.Tensor,
    position: torch.Tensor,
    start: int,
    batch: int,
) -> None:
    """The steps after the prefill's `logits`: each token chosen, then (unless it was the last or every row has
    ended) `decode` called on it at the next position (`position`: the prompt's last, (batch, 1); `start`: the
    first new token's cache position) over `cache_mask` (batch, cache), rows past `steps.rows` fed token 0."""
    call = reduced_call(decode)
    rows, new = steps.rows, steps.new_tokens
    ids = np.zeros((batch, 1), np.int64)
    mask = np.ascontiguousarray(cache_mask.numpy(), dtype=np.int64)
    positions = np.array(position.numpy(), dtype=np.int64, order="C")
    at = np.array([start], np.int64)

    def choose(values: np.ndarray) -> np.ndarray:
        return argmax_rows(values, rows)

    chosen = choose(logits.detach().to(torch.float32).numpy())
    for i in range(new):
        if steps.take(chosen) or i == new - 1:
            return
        ids[:rows, 0] = steps.tokens[:, i]
        positions += 1
        at[0] = start + i
        chosen = call(choose, ids, mask, positions, at)
