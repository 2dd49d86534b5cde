"""Pooling defaults: functional pooling leaves `stride` empty.

`F.max_pool2d(x, 2)` exports as `aten.max_pool2d_with_indices(x, [2, 2])`
(stride absent) and `F.avg_pool3d(x, 2)` as `avg_pool3d(x, [2, 2, 2], [], ...)`.
The schema default `stride=[]` means "same as kernel_size", which importers
that read the list by index do not know.
"""

from __future__ import annotations

import torch

from fx_rewrites.kinds import FillDefaults, from_arg
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

POOLING_OPS = (
    aten.max_pool1d.default,
    aten.max_pool2d.default,
    aten.max_pool3d.default,
    aten.max_pool1d_with_indices.default,
    aten.max_pool2d_with_indices.default,
    aten.max_pool3d_with_indices.default,
    aten.avg_pool1d.default,
    aten.avg_pool2d.default,
    aten.avg_pool3d.default,
)

pool_stride_defaults = FillDefaults(
    name="pool_stride_defaults",
    ops=POOLING_OPS,
    fill={"stride": from_arg("kernel_size")},
    doc=(
        "Pooling with stride omitted or [] (functional F.max_pool2d / F.avg_pool2d and "
        "their 1d/3d and with_indices forms): sets stride = kernel_size and writes every "
        "default out. Fixes importer failures such as SHARK-Turbine's "
        "'compiler_fn raised IndexError: list index out of range' (import_list_arguments)."
    ),
    tags={"pooling", "normalize"},
)

RULES = RuleSet([pool_stride_defaults], name="pooling")
