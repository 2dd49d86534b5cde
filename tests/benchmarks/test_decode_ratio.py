"""benchmarks/decode_ratio.py: every generator in every round, the order rotated; the torch loop turns the numpy
steps off for its call only (no timings are asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import decode_ratio

from fx_rewrites.app.lm import greedy


def test_rounds_rotate_the_generators():
    order = []

    def fake(name):
        def run(ids, n):
            order.append((name, n))
            sum(range(20_000 * n))  # some CPU time, more for more tokens (no time is asserted)
            return ids

        return run

    got = decode_ratio.rates({"a": fake("a"), "b": fake("b")}, torch.zeros(1, 2), 5, 2)
    assert [name for name, n in order if n == 5] == ["a", "b", "b", "a"]
    assert [n for _, n in order] == [1, 5] * 4  # each rate from a generate of 1 and of `new` tokens
    assert list(got) == ["a", "b"] and all(len(v) == 2 for v in got.values())


def test_the_torch_loop_turns_the_numpy_steps_off_for_its_call_only():
    seen = []

    class LM:
        def generate(self, ids, max_new_tokens):
            seen.append(greedy.plain(None) is None if greedy.plain is not plain else "numpy")
            return torch.cat([ids, torch.zeros(1, max_new_tokens, dtype=ids.dtype)], dim=1)

    plain = greedy.plain
    ids = torch.ones(1, 3, dtype=torch.long)
    assert decode_ratio.generator(LM(), "torch")(ids, 2).shape == (1, 2)
    assert decode_ratio.generator(LM(), "numpy")(ids, 2).shape == (1, 2)
    assert seen == [True, "numpy"] and greedy.plain is plain
