"""A cache held outside the module's buffers (non-strict export lifts it as constants written in place, as
transformers' static-cache wrapper is exported by default) compiles on IREE after the rules and keeps its
state in the module across calls as eager does, static and with a Dim on the sequence (issue 26)."""

from __future__ import annotations

import pytest
import torch

import fx_rewrites
from tests.rules.test_inplace_constants import HeldCache, _export, calls


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_written_constants_compile_and_keep_their_state(dynamic):
    compiled = fx_rewrites.compile(_export(dynamic))
    eager = HeldCache()
    for x, pos in calls(dynamic):
        torch.testing.assert_close(compiled(x, pos), eager(x, pos), rtol=1e-6, atol=1e-6)
