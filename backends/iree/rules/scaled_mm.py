"""`aten._scaled_mm` (float8 operands, float scales) as a float32 matmul for IREE 3.13.

IREE 3.13 has no lowering for `_scaled_mm` on llvm-cpu: its importer verifies CUDA's layout rules ("'torch.aten.
_scaled_mm' op expected mat2 non-contracting dimension to be divisible by 16") and, where they hold, fails
on the op itself ("failed to legalize operation 'torch.constant.bool'"). It compiles float8 -> float32
conversions. The rule writes `(a.float() * scale_a) @ (b.float() * scale_b) (+ bias)` in float32, converted to
`out_dtype` (per-tensor and row-wise scales broadcast alike): torch's CPU kernel gives the same values bit for
bit with row-wise scales and, with per-tensor scales (oneDNN's float8 kernel), others no nearer float64
(measured on a 6x32x16 product: torch 1.45e-5 from float64, this form 1.03e-5). A float8 result (`out_dtype`
float8, or `scale_result`) is left alone. Float8 weights are IREE parameters whatever their size
(`parameters.NEVER_INLINE`): inline, IREE 3.13 cannot compile one over 256 bytes.
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


def _float_result(node: Node, *, args: Mapping[str, Any]) -> bool | Miss:
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dtype.itemsize == 1:
        return Miss(f"a {getattr(out, 'dtype', None)} result (float8 out: the rule computes float32 only)")
    if args.get("scale_result") is not None:
        return Miss("scale_result given (it scales a float8 result)")
    return True


@rule(
    roots=(aten._scaled_mm.default,),
    when=_float_result,
    tags={"iree"},
    doc=(
        "aten._scaled_mm (float8 a, b; scales) with a float result -> (a.float() * scale_a) @ (b.float() * "
        "scale_b) (+ bias), converted to out_dtype: torch's CPU kernel's computation. IREE 3.13: \"expected "
        'mat2 non-contracting dimension to be divisible by 16" / "failed to legalize operation '
        "'torch.constant.bool'\"."
    ),
)
def scaled_mm_in_float32_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    def scaled(operand: Node, scale: Node) -> Node:
        wide = rw.call(aten._to_copy.default, operand, dtype=torch.float32)
        return rw.call(aten.mul.Tensor, wide, rw.call(aten._to_copy.default, scale, dtype=torch.float32))

    y = rw.call(aten.mm.default, scaled(args["self"], args["scale_a"]), scaled(args["mat2"], args["scale_b"]))
    if args.get("bias") is not None:
        bias = args["bias"]  # a bfloat16 bias widened first (torch's promotion would; IREE's mixed add fails)
        if bias.meta["val"].dtype != torch.float32:
            bias = rw.call(aten._to_copy.default, bias, dtype=torch.float32)
        y = rw.call(aten.add.Tensor, y, bias)
    dtype = node.meta["val"].dtype
    rw.replace(node, y if dtype == torch.float32 else rw.call(aten._to_copy.default, y, dtype=dtype))


RULES = RuleSet([scaled_mm_in_float32_for_iree], name="iree-scaled-mm")
