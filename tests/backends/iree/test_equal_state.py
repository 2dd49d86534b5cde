"""Two buffers a program updates, equal when it is compiled (a key and a value cache, both zeros), must stay
two: IREE 3.13 gives them one storage (issue 26).

The module keeps them as mutable globals (`backends/iree/state.py`). IREE's stream phase updates each in
place and then `iree-util-fuse-globals` fuses the two globals, initialised from one constant: the writes to
the key cache land in the value cache. Found by a tiny Llama's prefill (every position but the first wrong;
the first reads one key, so its softmax is 1 whatever the key). Buffers that start from the parameter archive
under their own names are not fused; nor are buffers of unequal initial values.
So every state global starts from a parameter of its own (`parameters.parameter_hooks(...).state_global`);
a `util.initializer` storing the constant through `util.optimization_barrier` was tried and does not help
(the two constants are merged into one allocation before the barriers).
"""

from __future__ import annotations

import torch

import fx_rewrites


class KeysAndValues(torch.nn.Module):
    def __init__(self, start: float) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, 16, 4))
        self.register_buffer("v", torch.full((1, 2, 16, 4), start))

    def forward(self, x: torch.Tensor, y: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.k.index_copy_(2, pos, x)
        self.v.index_copy_(2, pos, y)
        return self.k @ self.v.transpose(-1, -2)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 5, 4, generator=g), torch.arange(3, 8)


def _check(start: float) -> None:
    args = _inputs()
    compiled = fx_rewrites.compile(torch.export.export(KeysAndValues(start), args))
    torch.testing.assert_close(compiled(*args), KeysAndValues(start)(*args), rtol=1e-6, atol=1e-6)


def test_unequal_state_buffers_stay_apart():
    _check(1.0)


def test_equal_state_buffers_stay_apart():
    _check(0.0)


class Counters(torch.nn.Module):
    """Two step counters, both 0 when compiled (BatchNorm's num_batches_tracked in training)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.zeros((), dtype=torch.int64))
        self.register_buffer("b", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.a.add_(1)
        self.b.add_(2)
        return x * 10 + self.a * 100 + self.b


def test_equal_counters_stay_apart_over_calls():
    x = torch.zeros(3)
    compiled = fx_rewrites.compile(torch.export.export(Counters(), (x,)))
    eager = Counters()
    for _ in range(3):
        torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=0)


def test_equal_state_buffers_stay_apart_when_saved(tmp_path):
    args = _inputs()
    compiled = fx_rewrites.compile(torch.export.export(KeysAndValues(0.0), args))
    compiled.save(tmp_path / "kv.vmfb")  # every weight inside the .vmfb
    loaded = fx_rewrites.load(tmp_path / "kv.vmfb")
    torch.testing.assert_close(loaded(*args), KeysAndValues(0.0)(*args), rtol=1e-6, atol=1e-6)
