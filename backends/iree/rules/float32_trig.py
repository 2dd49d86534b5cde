"""float32 sin and cos computed in float64 for IREE 3.13's llvm-cpu, whose float32 range reduction is coarse.

IREE expands float32 `math.sin`/`math.cos` into a polynomial after reducing x by pi/2 held in float32: the
error grows with |x| (measured against float64, 100000 uniform draws, docs/iree-3.13-findings.md section
24): 1.2e-7 for |x| < 1, 9.4e-7 below 30, 2.8e-5 below 1000, 2.8e-4 below 1e4, 2.8e-3 below 1e5, where
torch's float32 is 3.6e-8 throughout. Rotary position tables (angles up to the context length) and
`torch.polar` read it. Written here as the float64 op (which `float64_math.py` writes out, within 4
float64 steps) rounded to float32: within half a float32 step of the true value, NaN past |x| = 2^29 pi/2
(8.4e8), where the float64 reduction stops being exact (IREE's float32 was off by O(1) long before).
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


def _of_float32(node: Node, *, args: Mapping[str, Any]) -> bool | Miss:
    val = args["self"].meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
        return Miss("not a float32 tensor (float64 is float64_math's; half types were not measured)")
    return True


@rule(
    roots=(aten.sin.default, aten.cos.default),
    when=_of_float32,
    tags={"iree", "precision"},
    doc=(
        "float32 sin and cos computed as the float64 op (written out by float64_math) rounded to float32. "
        "IREE 3.13 llvm-cpu reduces float32 arguments by a float32 pi/2: 2.8e-5 off at |x| < 1000, 2.8e-3 "
        "at |x| < 1e5, against torch's 3.6e-8 (a silent loss of digits in rotary tables and torch.polar)."
    ),
)
def float32_trig_via_float64_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    wide = rw.call(aten._to_copy.default, args["self"], dtype=torch.float64)
    rw.replace(node, rw.call(aten._to_copy.default, rw.call(node.target, wide), dtype=torch.float32))


RULES = RuleSet([float32_trig_via_float64_for_iree], name="iree-float32-trig")
