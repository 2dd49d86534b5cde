"""Activations IREE 3.13 computes less accurately than torch's float32: written out in ops it computes right.

`F.gelu(x, approximate="tanh")` (SigLIP, RecurrentGemma, Gemma's `gelu_pytorch_tanh`) is off by 5.1e-5
against float64 on IREE 3.13 llvm-cpu where torch's float32 kernel is off by 4.3e-7 (`linspace(-6, 6,
100001)`). Written out with `tanh` it is 7.3e-7 off (IREE's tanh is 2.6e-7 off on that range, torch's 3e-8);
as `x * sigmoid(2u)` 5.2e-7; split at 0 as below, 2.4e-7, half a float32 step at |x| in [4, 8): as exact as
float32 can be there, and below torch's own error (docs/iree-3.13-findings.md section 18).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten

#: gelu's tanh approximation is 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3); 2u = x (A + B x^2)
_A = 2.0 * math.sqrt(2.0 / math.pi)
_B = _A * 0.044715
#: past this x, x sigmoid(-2u) is below float32's smallest normal times 10: x itself (and inf stays inf)
_SATURATED = 10.0


def _tanh_gelu_of_float32(node: Node, *, args: Mapping[str, Any]) -> bool | Miss:
    if args.get("approximate", "none") != "tanh":
        return Miss("approximate='none': IREE's erf form was not measured wrong")
    val = fake_value(args["self"])
    if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
        return Miss("not a float32 tensor (only float32 was measured)")
    return True


@rule(
    roots=(aten.gelu.default,),
    when=_tanh_gelu_of_float32,
    tags={"iree", "guard"},
    doc=(
        "gelu(x, approximate='tanh') of float32 becomes x - x sigmoid(-2u) for x > 0 and x sigmoid(2u) "
        "otherwise (2u = x (A + B x^2): the same function, 0.5 x (1 + tanh u)), each side without "
        "cancellation. IREE 3.13's own gelu is 5.1e-5 off float64 on [-6, 6], torch's float32 4.3e-7; this "
        "form 2.4e-7 on IREE. NaN, infinities and -0.0 come out as torch's."
    ),
)
def gelu_tanh_written_out_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x = args["self"]

    def two_u(v: Node) -> Node:
        squared = rw.call(aten.mul.Tensor, v, v)
        return rw.call(aten.mul.Tensor, v, rw.call(aten.add.Tensor, rw.call(aten.mul.Tensor, squared, _B), _A))

    capped = rw.call(aten.clamp.default, x, None, _SATURATED)  # keeps inf - inf * 0 out of the x > 0 side
    rest = rw.call(aten.mul.Tensor, capped, rw.call(aten.sigmoid.default, rw.call(aten.neg.default, two_u(capped))))
    positive = rw.call(aten.sub.Tensor, x, rest)
    other = rw.call(aten.mul.Tensor, x, rw.call(aten.sigmoid.default, two_u(x)))  # -0.0 stays -0.0
    rw.replace(node, rw.call(aten.where.self, rw.call(aten.gt.Scalar, x, 0.0), positive, other))
