"""Complex tensors made by a fill (`torch.zeros(n, dtype=torch.complex64)`, `ones`, `full`, their `_like` and
`new_` forms): IREE 3.13 cannot build them.

iree-compile crashes with no diagnostic on a complex `zeros`, `ones`, `new_zeros` or `empty` (read by
`view_as_real` or by complex arithmetic), the FX importer rejects `full`'s complex fill value ("Unsupported
argument type"), and a complex `zeros_like` fails as `arith.muli`. Complex arithmetic on a tensor built by
`aten.complex(real, imag)` compiles and matches eager, so the fill is written as that: two real fills of the
matching real dtype (float32 for complex64), joined by `aten.complex`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: fill op -> its value (None: the op's `fill_value` argument); the empties take 0 (their values are unspecified)
FILLS: dict[Any, complex | None] = {
    aten.zeros.default: 0,
    aten.ones.default: 1,
    aten.full.default: None,
    aten.empty.memory_format: 0,
    aten.zeros_like.default: 0,
    aten.ones_like.default: 1,
    aten.full_like.default: None,
    aten.empty_like.default: 0,
    aten.new_zeros.default: 0,
    aten.new_ones.default: 1,
    aten.new_full.default: None,
    aten.new_empty.default: 0,
}


def _complex_fill(node: Node, *, args: Mapping[str, Any]) -> complex | Miss:
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or not out.dtype.is_complex:
        return Miss("the result is not complex")
    value = FILLS[node.target]
    if value is None:
        value = args["fill_value"]
        if not isinstance(value, (int, float, complex)):
            return Miss(f"the fill value {value!r} is not a number known when the graph is built")
    return complex(value)


@rule(
    roots=tuple(FILLS),
    when=_complex_fill,
    tags={"iree", "complex"},
    doc=(
        "A complex fill (zeros / ones / full / empty, their _like and new_ forms) -> aten.complex of two real "
        "fills of the matching real dtype. IREE 3.13: iree-compile crashes with no diagnostic (zeros, ones, "
        "new_zeros), the importer rejects a complex fill value (full), zeros_like fails as arith.muli."
    ),
)
def complex_fill_as_real_parts_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any], found: complex) -> Any:
    out = node.meta["val"]
    if "size" in args:
        size = args["size"]
    else:  # the _like forms: the input's sizes
        size = [rw.size(args["self"], d) for d in range(out.dim())]
    real_dtype = out.dtype.to_real()
    parts = [
        rw.call(aten.full.default, size, part, dtype=real_dtype, device=out.device) for part in (found.real, found.imag)
    ]
    rw.replace(node, rw.call(aten.complex.default, *parts))


RULES = RuleSet([complex_fill_as_real_parts_for_iree], name="iree-complex-fills")
