"""Two buffers a program updates, equal when it is compiled (a key and a value cache, both zeros), must stay
two: IREE 3.13 gives them one storage (issue 26).

The module keeps them as mutable globals (`backends/iree/state.py`). IREE's stream phase updates each in
place and then `iree-util-fuse-globals` fuses the two globals, initialised from one constant: the writes to
the key cache land in the value cache. Found by a tiny Llama's prefill (every position but the first wrong;
the first reads one key, so its softmax is 1 whatever the key). Buffers of 64 KiB or more start from the
parameter archive under their own names and are not fused; nor are buffers of unequal initial values.
A workaround that measured right: initialise each inline global in a `util.initializer` that stores its
constant through `util.optimization_barrier`.
"""

from __future__ import annotations

import pytest
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


@pytest.mark.xfail(strict=True, reason="IREE 3.13 fuses equal mutable globals updated in place (see module doc)")
def test_equal_state_buffers_stay_apart():
    _check(0.0)
