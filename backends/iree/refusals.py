"""Forms IREE 3.13 cannot compile and no rule rewrites, refused before compiling, naming the op and the fix.

IREE's own message for these is a legalize failure deep in its pipeline ("failed to legalize operation
'arith.truncf'", "unhandled float element bit width 8") that names no ATen op and no way out; each form
here was measured failing so (tests/backends/iree/test_refusals.py). `IreeBackend.compile` raises an
`IreeUnsupportedError` for the first one it finds, before the import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule, Node

from fx_rewrites import schema
from fx_rewrites.backends.iree import wrong_forms
from fx_rewrites.backends.iree.rules.float_scalars import (
    ARANGES,
    NEAREST,
    inexact_in,
    scales_of,
    spatial_sizes_static,
)
from fx_rewrites.backends.iree.wrong_forms import nodes_failing, raise_first

aten = torch.ops.aten


def _symbolic(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not all(isinstance(s, int) for s in value.shape)


def _inexact_nearest_of_dim_sizes(node: Node) -> str:
    args = schema.arguments(node)
    scales = [s for s in scales_of(node, args) if inexact_in(s, torch.float32)]
    if not scales or spatial_sizes_static(node.meta["val"]):
        return ""
    return (
        f"nearest upsampling by scale factor {scales[0]!r}, which float32 does not hold, of a Dim-sized map: "
        'IREE truncates the float64 scale to float32 on the host, which it cannot ("failed to legalize '
        "operation 'arith.truncf'\"), and the rules cannot compute floor(h * scale) without sym_float; fix: "
        "give F.interpolate a `size=` instead of `scale_factor=` (computed from the input's sizes as integers), "
        "or a scale float32 holds exactly (2.0, 0.5, 1.75), or export with static sizes"
    )


def _inexact_arange_of_dim_length(node: Node) -> str:
    out, args = node.meta.get("val"), schema.arguments(node)
    if not _symbolic(out) or not out.dtype.is_floating_point or out.dtype == torch.float64:
        return ""
    if not any(inexact_in(args.get(name), out.dtype) for name in ("start", "step")):
        return ""
    return (
        f"a {out.dtype} arange of a Dim-dependent length whose start or step {out.dtype} does not hold exactly: "
        'IREE truncates them from float64 on the host, which it cannot ("failed to legalize operation '
        "'arith.truncf'\"); fix: build it from an integer arange, `start + step * torch.arange(n)` "
        "(n an int or a size), or use float64 (`dtype=torch.float64`), then convert"
    )


#: op -> why IREE cannot compile this node, and the fix ("" when it can)
_CHECKS: dict[Any, Callable[[Node], str]] = {
    **dict.fromkeys(NEAREST, _inexact_nearest_of_dim_sizes),
    **dict.fromkeys(ARANGES, _inexact_arange_of_dim_length),
}


def refusals(gm: GraphModule) -> list[tuple[Node, str]]:
    """(node, why and the fix) for every node of `gm` in a form IREE 3.13 cannot compile."""
    return nodes_failing(gm, _CHECKS)


def refuse(gm: GraphModule) -> None:
    """Raise `IreeUnsupportedError` naming the first node IREE 3.13 computes wrong (`wrong_forms`), else the
    first it cannot compile and no rule rewrites."""
    wrong_forms.refuse(gm)
    raise_first(refusals(gm), "cannot compile {op} (node {node!r}) in this form")
