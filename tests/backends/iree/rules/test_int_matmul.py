"""8-bit integer matmuls for IREE (backends/iree/rules/int_matmul.py). Before the rule: "unimplemented: for
conversion to byte or char type dstOriginalDtype has to be passed to convertScalarToDtype"."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeCompileError
from fx_rewrites.backends.iree.rules.int_matmul import byte_matmul_in_int32_for_iree

aten = torch.ops.aten


def mm(a, b):
    return torch.mm(a, b)


def bmm(a, b):
    return torch.bmm(a, b)


def _bytes(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    low, high = (-128, 128) if dtype == torch.int8 else (0, 256)
    return torch.randint(low, high, shape, generator=g, dtype=dtype)  # products and sums that wrap


CASES = {
    # name: (fn, a's shape, b's shape, the Dims of a and b)
    "mm": (mm, (3, 40), (40, 5), ({0: Dim("m")}, None)),
    "mm_empty_k": (mm, (3, 0), (0, 5), ({0: Dim("m")}, None)),
    "bmm": (bmm, (2, 3, 40), (2, 40, 5), ({0: Dim("b"), 1: Dim("m")}, {0: Dim("b")})),
}


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8], ids=["int8", "uint8"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("name", list(CASES))
def test_byte_matmul_matches_torch_exactly(name, dynamic, dtype):
    fn, a_shape, b_shape, dims = CASES[name]
    grown = [s + 2 if dynamic and i in (dims[0] or {}) else s for i, s in enumerate(a_shape)]
    b_grown = [grown[0] if dynamic and i == 0 and dims[1] else s for i, s in enumerate(b_shape)]
    inputs = [
        (_bytes(a_shape, dtype, 0), _bytes(b_shape, dtype, 1)),
        (_bytes(tuple(grown), dtype, 2), _bytes(tuple(b_grown), dtype, 3)),
    ]
    ep = rt.export(fn, *inputs[0], dynamic_shapes=list(dims) if dynamic else None)
    iree = backends.get("iree")
    with pytest.raises(IreeCompileError, match="dstOriginalDtype has to be passed"):
        iree.compile(ep, inputs[0])
    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, byte_matmul_in_int32_for_iree, times=1)
    rt.assert_matches_eager(result, fn, inputs, rtol=0, atol=0)
    compiled = iree.compile(result.program, inputs[0])
    for args in inputs:
        got, want = compiled(*args), fn(*args)
        assert got.dtype == dtype and torch.equal(got, want)


def test_wider_integers_are_left_alone():
    ep = rt.export(mm, torch.ones(2, 3, dtype=torch.int32), torch.ones(3, 2, dtype=torch.int32))
    rt.assert_not_fired(rt.apply_rules(ep, byte_matmul_in_int32_for_iree), byte_matmul_in_int32_for_iree)
