"""`CompiledLM.generate`'s greedy steps without torch ops (app/lm/greedy.py, issue 33): the same tokens as
transformers' `_sample` step (`Decoding.next_tokens`), taken only where a step is argmax alone.

The unit tests need no compile: `argmax_rows` against torch.argmax on ties, NaN, infinities and other dtypes;
`Steps` against `next_tokens` over the same logits (rows ending at eos at different steps, padded after it);
which calls `plain` takes. The compiled tests use one tiny Llama (tests/test_lm.py's) for a batch of 2.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fx_rewrites
from fx_rewrites.app.lm import greedy, sampling
from tests.test_lm import prompts, tiny_llama

VOCAB = 96
EOS = 2
PAD = 0


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def host(eos: int | None = EOS) -> object:
    config = sampling.model_generation_config("", PAD, () if eos is None else (eos,))
    return sampling.generation_host(config, 128, VOCAB)


def prepared(rows: int = 2, length: int = 5, stopping_criteria=None, **options) -> sampling.Decoding:
    ids = torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(0))
    return sampling.prepare(
        host(), ids, None, None, {"max_new_tokens": 8, **options}, stopping_criteria=stopping_criteria
    )


def torch_choice(logits: torch.Tensor) -> list[int]:
    return torch.argmax(logits[:, -1, :].to(torch.float32), dim=-1).tolist()


def test_argmax_rows_is_torchs_choice_on_ties_nans_and_infinities():
    nan, inf = float("nan"), float("inf")
    rows = [
        [1.0, 3.0, 3.0, 2.0],  # a tie: the first
        [1.0, nan, 3.0, nan],  # NaN counts as the maximum: the first NaN
        [nan, 5.0, 1.0, 0.0],
        [1.0, inf, inf, 2.0],
        [-inf, -inf, -inf, -inf],
        [-0.0, 0.0, -0.0, 0.0],
        [0.0, -0.0, 0.0, -1.0],
    ]
    logits = torch.tensor(rows)[:, None, :]
    assert greedy.argmax_rows(logits.numpy(), len(rows)).tolist() == torch_choice(logits)
    assert greedy.argmax_rows(logits.numpy(), 3).tolist() == torch_choice(logits)[:3]  # the first rows only


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_argmax_rows_over_the_last_position_in_other_dtypes(dtype):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 3, 32000, generator=g) * 4).round(decimals=1).to(dtype)  # rounded: ties in each row
    values = logits.view(torch.uint16).numpy().view(_bfloat16()) if dtype == torch.bfloat16 else logits.numpy()
    chosen = greedy.argmax_rows(values, 4)
    assert chosen.dtype == np.int64
    assert chosen.tolist() == torch_choice(logits)


def _bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


@pytest.mark.parametrize("eos_on", [True, False])
def test_steps_choose_what_next_tokens_chooses(eos_on):
    """Three rows over the same logits: row 0 reaches eos at step 2, row 2 at step 4, row 1 at step 6; rows that
    ended are padded, and the steps stop when every row has (with eos off, at max_new_tokens)."""
    rows, steps_n = 3, 8
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(steps_n, rows, 1, VOCAB, generator=g)
    logits[2, 0, 0, EOS] = 50.0
    logits[4, 2, 0, EOS] = 50.0
    logits[5, 1, 0, 7] = float("nan")  # a NaN chosen as torch chooses it
    logits[6, 1, 0, EOS] = 50.0  # the last row to end: the steps stop before max_new_tokens
    options = {} if eos_on else {"eos_token_id": None}
    ids = torch.randint(3, VOCAB, (rows, 5), generator=torch.Generator().manual_seed(0))
    general = sampling.prepare(host(), ids, None, None, {"max_new_tokens": steps_n, **options})
    fast = sampling.prepare(host(), ids, None, None, {"max_new_tokens": steps_n, **options})
    steps = greedy.plain(fast)
    assert steps is not None and (steps.eos is not None) == eos_on and (steps.pad is not None) == eos_on
    sequences = general.ids
    for i in range(steps_n):
        _, sequences, done = general.next_tokens(sequences, logits[i, :, -1, :])
        ended = steps.take(greedy.argmax_rows(logits[i].numpy(), rows))
        assert ended == done or i == steps_n - 1  # the last step: the loop's bound, not a criterion, ends it
        if done:
            break
    assert torch.equal(steps.sequences(fast.ids), sequences)
    assert eos_on == (sequences.shape[1] == 5 + 7)  # with eos on, every row ended at step 6
    assert eos_on == bool((sequences[0, 5 + 3 :] == PAD).all())  # row 0 padded after its eos


def test_plain_takes_argmax_alone():
    assert greedy.plain(prepared()) is not None
    assert greedy.plain(prepared(eos_token_id=None)).eos is None
    for options in (
        {"do_sample": True},
        {"repetition_penalty": 1.3},  # a logits processor
        {"min_new_tokens": 3},  # one too (holds eos back)
        {"return_dict_in_generate": True, "output_scores": True},
        {"return_dict_in_generate": True, "output_logits": True},
    ):
        assert greedy.plain(prepared(**options)) is None, options
    recorded = greedy.plain(prepared(return_dict_in_generate=True))  # nothing recorded per step: still plain
    assert recorded is not None


def test_plain_leaves_other_criteria_and_early_length_stops_to_next_tokens():
    from transformers.generation import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    assert greedy.plain(prepared(stopping_criteria=StoppingCriteriaList([Never()]))) is None
    decoding = prepared()
    for criterion in decoding.criteria:
        if isinstance(criterion, MaxLengthCriteria):
            criterion.max_position_embeddings = 6  # past it, transformers' length criterion warns at each step
    assert greedy.plain(decoding) is None


def test_reduced_call_of_a_plain_function_passes_copies_and_float32():
    seen = []

    def step(*tensors):
        seen.append(tensors)
        return torch.tensor([[[1.0, 3.0, 2.0]]], dtype=torch.bfloat16)

    call = greedy.reduced_call(step)
    a = np.array([[4]], np.int64)
    out = call(lambda values: (values.dtype, greedy.argmax_rows(values, 1)), a)
    a[0, 0] = 9  # the loop writes its arrays in place for the next call
    assert out[0] == np.float32 and out[1].tolist() == [1]
    assert seen[0][0].tolist() == [[4]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def lm(model):
    return fx_rewrites.compile_lm(model, max_cache_len=48, batch_size=2)


def test_iree_reduced_reads_the_result_the_call_returns(lm):
    """`reduced` hands `reduce` the decode's logits as the call returns them (two calls on the same inputs write
    the same cache entry, so they return the same logits)."""
    decode = lm.decode.unchecked()
    arrays = (np.array([[5], [7]], np.int64), np.ones((2, 48), np.int64), np.full((2, 1), 3), np.array([3]))
    copied = decode.reduced(np.copy, *arrays)
    assert isinstance(copied, np.ndarray) and copied.dtype == np.float32 and copied.shape == (2, 1, VOCAB)
    assert np.array_equal(copied, decode(*(torch.from_numpy(a) for a in arrays)).numpy())
    assert decode.reduced(lambda values: greedy.argmax_rows(values, 2), *arrays).tolist() == torch_choice(
        torch.from_numpy(copied)
    )


@pytest.mark.parametrize("eos_on", [True, False])
def test_compiled_greedy_takes_the_fast_steps_with_generates_tokens(model, lm, monkeypatch, eos_on):
    """A left-padded batch of 2, eos on (a token row 0's continuation reaches at its 4th new token or later: it
    stops there, padded after it) and off: the steps never call `next_tokens`, and the tokens equal
    `model.generate`'s and the general loop's."""
    ids, mask = prompts(2)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    new = free[0, ids.shape[1] :].tolist()
    stop = next(new[i] for i in range(3, 24) if new[i] not in new[:i])
    options = {"eos_token_id": stop if eos_on else None}
    want = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, **options)
    assert eos_on != torch.equal(want[0], free[0])  # row 0 stopped at eos (padded after it) only when on
    general = sampling.Decoding.next_tokens
    with monkeypatch.context() as patch:
        patch.setattr(greedy, "plain", lambda decoding: None)
        slow = lm.generate(ids, attention_mask=mask, max_new_tokens=24, **options)

    def refused(*args):
        raise AssertionError("greedy steps took next_tokens")

    monkeypatch.setattr(sampling.Decoding, "next_tokens", refused)
    fast = lm.generate(ids, attention_mask=mask, max_new_tokens=24, **options)
    monkeypatch.setattr(sampling.Decoding, "next_tokens", general)
    assert torch.equal(fast, want) and torch.equal(slow, want)
