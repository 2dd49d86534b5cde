"""Forms IREE 3.13 cannot compile and no rule rewrites, refused by name (backends/iree/refusals.py). Each test
shows IREE's own failure first, so it fails once IREE compiles the form (then the refusal can go)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeCompileError, IreeImportError, IreeUnsupportedError
from fx_rewrites.backends.iree.backend import IreeBackend


def _refused(fn, args, dynamic_shapes, iree_error: str, named: str) -> None:
    ep = rt.export(fn, *args, dynamic_shapes=dynamic_shapes)
    iree = backends.get("iree")
    program = rt.apply_rules(ep, iree.rules).program
    raw = IreeBackend(name="iree", refuse_wrong_forms=False)
    with pytest.raises((IreeCompileError, IreeImportError), match=iree_error):
        raw.compile(program, args)
    with pytest.raises(IreeUnsupportedError, match=named):
        iree.compile(program, args)


def test_nearest_upsample_of_dim_sizes_by_inexact_scale_is_refused():
    _refused(
        lambda x: F.interpolate(x, scale_factor=0.6),
        (torch.randn(2, 3, 8, 9),),
        [{2: Dim.AUTO, 3: Dim.AUTO}],
        "arith.truncf",
        r"upsample_nearest2d\.vec.*scale factor 0\.6.*fix: give F\.interpolate a `size=`",
    )


def test_float_arange_of_dim_length_by_inexact_step_is_refused():
    _refused(
        lambda x: torch.arange(0.0, x.shape[0] * 0.3, 0.3),
        (torch.randn(10),),
        [{0: Dim.AUTO}],
        "sym_float|arith.truncf",
        r"arange\.start_step.*fix: build it from an integer arange",
    )
