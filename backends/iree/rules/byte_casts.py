"""Float -> uint8 conversions, which IREE 3.13 saturates at 127 where they fuse into some dispatches.

`round(relu(conv(x)) * s).clamp(0, 255).to(torch.uint8)`, what every PT2E quantize of a conv's output computes,
gives 127 on IREE 3.13 llvm-cpu (AVX-512) for each value in [128, 255] that torch gives (100 of 4096 values of
a 3 -> 8 channel conv; `relu(x * 60).clamp(max=255).to(torch.uint8)` alike), while the same conversion of a
program input is right: the fused conversion narrows as if to a signed byte. Through int32 it is right:
every float torch converts to a byte in [0, 255] is converted the same (out of that range torch's own result
is platform-defined; through int32 it wraps modulo 256 as torch's on x86 does).
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


def _float_to_uint8(node: Node, *, args: Mapping[str, Any]) -> bool | Miss:
    source = getattr(args["self"], "meta", {}).get("val")
    out = node.meta.get("val")
    if not isinstance(source, torch.Tensor) or not isinstance(out, torch.Tensor):
        return Miss("no tensor value on the input or output")
    if out.dtype != torch.uint8 or not source.dtype.is_floating_point:
        return Miss(f"{source.dtype} -> {out.dtype}, not a float -> uint8 conversion")
    return True


@rule(
    roots=(aten._to_copy.default, aten.to.dtype),
    when=_float_to_uint8,
    tags={"iree", "guard"},
    doc=(
        "A float -> uint8 conversion (_to_copy, to.dtype: always a copy) goes through int32 (the same bytes "
        "as torch's for every value in [0, 255]). "
        "IREE 3.13 saturates the fused conversion at 127: a PT2E quantize of a conv's output (round, clamp to "
        "[0, 255], to uint8) gives 127 for 128..255."
    ),
)
def float_to_uint8_through_int32_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    wide = rw.call(aten._to_copy.default, args["self"], dtype=torch.int32)
    rw.replace(node, rw.call(aten._to_copy.default, wide, dtype=torch.uint8))


RULES = RuleSet([float_to_uint8_through_int32_for_iree], name="iree-byte-casts")
