"""Matmuls of 8-bit integers (int8 x int8 -> int8, uint8 likewise) for IREE 3.13, which cannot lower them.

`torch.mm` of two int8 tensors is an int8 matmul that wraps modulo 256, as C arithmetic does; IREE's
torch-mlir lowering fails on it: "unimplemented: for conversion to byte or char type dstOriginalDtype has to
be passed to convertScalarToDtype" (mm and bmm; an empty product, K = 0, too). Written as the int32 matmul of
the operands widened, narrowed back: wrapping commutes with sums and products modulo 256, so the result is
torch's exactly. (Quantized models' integer matmuls, int8 operands with an int32 or float result, are
`quantized_matmul.py`'s; this is the plain integer op.)
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

_BYTES = (torch.int8, torch.uint8)


def _byte_matmul(node: Node, *, args: Mapping[str, Any]) -> bool | Miss:
    dtypes = [getattr(args[name].meta.get("val"), "dtype", None) for name in ("self", "mat2")]
    if dtypes[0] not in _BYTES or dtypes[0] != dtypes[1]:
        return Miss(f"operands of {dtypes[0]} and {dtypes[1]}, not two int8 or two uint8 (IREE lowers those)")
    return True


@rule(
    roots=(aten.mm.default, aten.bmm.default),
    when=_byte_matmul,
    tags={"iree"},
    doc=(
        "An int8 (or uint8) mm / bmm computed as the int32 matmul of the widened operands, narrowed back (the "
        "same wrapped values as torch's). IREE 3.13: \"unimplemented: for conversion to byte or char type "
        'dstOriginalDtype has to be passed to convertScalarToDtype" (K = 0 as well).'
    ),
)
def byte_matmul_in_int32_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    dtype = node.meta["val"].dtype
    wide = [rw.call(aten._to_copy.default, args[name], dtype=torch.int32) for name in ("self", "mat2")]
    rw.replace(node, rw.call(aten._to_copy.default, rw.call(node.target, *wide), dtype=dtype))


RULES = RuleSet([byte_matmul_in_int32_for_iree], name="iree-int-matmul")
