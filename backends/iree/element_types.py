"""torch dtypes as IREE element types: one table for MLIR tensor types and iree-run-module's `--input` values.

MLIR's builtin tensor types are signless (`tensor<4xi8>` for int8 and uint8 alike); iree-run-module's
`--input=4xui8=250` says the sign, so a uint8 value parses as unsigned. Both come from `ELEMENT_TYPES`.
"""

from __future__ import annotations

import torch

#: torch dtype -> IREE's element type name (iree-run-module's spelling: uint8 is `ui8`)
ELEMENT_TYPES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "ui8",
    torch.bool: "i1",
}


def element_type(dtype: torch.dtype, *, signless: bool = False) -> str | None:
    """`dtype`'s IREE element type (`ui8`), or its signless MLIR form (`i8`) with `signless`; None if unknown."""
    name = ELEMENT_TYPES.get(dtype)
    return name.removeprefix("u") if name is not None and signless else name


__all__ = ["ELEMENT_TYPES", "element_type"]
