"""Which ttnn the backend tests run on: the test double always, real ttnn when a device is there.

`ttnn_impl` is parametrized: "double" (tests/backends/ttnn/reference_ttnn/)
and "device" (the installed ttnn with device 0). Without ttnn or a device the
"device" runs are SKIPPED with a reason that says real ttnn was not exercised;
a skip is never a pass.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from fx_rewrites.backends.ttnn import runtime
from tests.backends.ttnn import reference_ttnn

#: bfloat16 on device: 8 bits of mantissa, so about 2 significant digits per op
BF16_RTOL, BF16_ATOL = 3e-2, 3e-2


def _real_ttnn():
    try:
        ttnn = importlib.import_module("ttnn")
        runtime.device(ttnn)
    except Exception as e:
        pytest.skip(f"REAL TTNN NOT EXERCISED: no ttnn with an open device here ({type(e).__name__}: {e})")
    return ttnn


@pytest.fixture(params=["double", "device"])
def ttnn_impl(request):
    """The ttnn module device regions run on, injected for the test and removed after."""
    module = reference_ttnn if request.param == "double" else _real_ttnn()
    previous = runtime.use(module)
    yield module
    runtime.use(previous)


def assert_close_bf16(got, expected, rtol: float = BF16_RTOL, atol: float = BF16_ATOL) -> None:
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
