"""Float arguments IREE must round on the host (backends/iree/rules/float_scalars.py): a float32 arange with a
start or step float32 does not hold, nearest upsampling by such a scale factor. Before the rules: "failed to
legalize operation 'arith.truncf' that was explicitly marked illegal"."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeCompileError
from fx_rewrites.backends.iree.backend import IreeBackend
from fx_rewrites.backends.iree.rules.float_scalars import (
    decompose_inexact_nearest_for_iree,
    float_arange_in_float64_for_iree,
)

aten = torch.ops.aten
TRUNCF = "legalize operation 'arith.truncf'"
#: float16's arange fails in the host code around the same truncation
HOST_CODE = "legalize operation '(arith.truncf|util.initializer)'"

ARANGES = {
    "negative_step": lambda x: x + torch.arange(0.0, -3.0, -0.3),  # the corpus's form
    "positive_step": lambda x: x + torch.arange(0.1, 3.0, 0.3),
    "inexact_start": lambda x: x + torch.arange(0.3, 10.3),
    "half": lambda x: x + torch.arange(-1.0, -3.0, -0.2, dtype=torch.float16).float(),
}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("name", list(ARANGES))
def test_float_arange_is_computed_in_float64(name, dynamic):
    fn = ARANGES[name]
    inputs = [(torch.randn(2, 10),), (torch.randn(5 if dynamic else 2, 10),)]
    ep = rt.export(fn, *inputs[0], dynamic_shapes=[{0: Dim("b")}] if dynamic else None)
    raw = IreeBackend(name="iree", refuse_wrong_forms=False)
    with pytest.raises(IreeCompileError, match=HOST_CODE):
        raw.compile(ep, inputs[0])
    iree = backends.get("iree")
    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, float_arange_in_float64_for_iree, times=1)
    rt.assert_matches_eager(result, fn, inputs, rtol=0, atol=0)  # torch's kernel computes start + step*i in float64
    rt.assert_idempotent(result, float_arange_in_float64_for_iree)
    compiled = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(compiled(*args), fn(*args), rtol=0, atol=0)


def test_exact_steps_are_left_alone():
    ep = rt.export(lambda x: x + torch.arange(0.0, -3.3, -0.5), torch.randn(7))  # an inexact end: compiles
    rt.assert_not_fired(rt.apply_rules(ep, float_arange_in_float64_for_iree), float_arange_in_float64_for_iree)


UPSAMPLES = {
    "nearest1d_1.7": (lambda x: F.interpolate(x, scale_factor=1.7), (2, 3, 5)),
    "nearest2d_1.7": (lambda x: F.interpolate(x, scale_factor=1.7), (2, 3, 4, 5)),
    "nearest2d_0.6": (lambda x: F.interpolate(x, scale_factor=0.6), (2, 3, 8, 9)),
}


@pytest.mark.parametrize("name", list(UPSAMPLES))
def test_nearest_upsample_by_inexact_scale(name):
    """Static sizes (with Dim sizes the form is refused by name: tests/backends/iree/test_refusals.py); the
    batch is a Dim in the second case, which the decomposition keeps."""
    fn, shape = UPSAMPLES[name]
    iree = backends.get("iree")
    raw = IreeBackend(name="iree", refuse_wrong_forms=False)
    for dynamic in (False, True):
        inputs = [(torch.randn(shape),), (torch.randn(shape[0] + 3 * dynamic, *shape[1:]),)]
        ep = rt.export(fn, *inputs[0], dynamic_shapes=[{0: Dim("b")}] if dynamic else None)
        if not dynamic:
            with pytest.raises(IreeCompileError, match=TRUNCF):
                raw.compile(ep, inputs[0])
        result = rt.apply_rules(ep, iree.rules)
        rt.assert_fired(result, decompose_inexact_nearest_for_iree, times=1)
        rt.assert_matches_eager(result, fn, inputs, rtol=0, atol=0)
        compiled = iree.compile(result.program, inputs[0])
        for args in inputs:
            torch.testing.assert_close(compiled(*args), fn(*args), rtol=0, atol=0)


def test_exact_scales_are_left_alone():
    ep = rt.export(lambda x: F.interpolate(x, scale_factor=3.0), torch.randn(1, 2, 4, 4))  # IREE compiles 3.0
    result = rt.apply_rules(ep, decompose_inexact_nearest_for_iree)
    rt.assert_not_fired(result, decompose_inexact_nearest_for_iree)
