"""Math that IREE 3.13's own lowerings turn into libm calls its embedded linker lacks.

`float64_math.py` and `float64_atan.py` write out the float64 ops a graph holds. These forms reach libm
later, inside iree-compile, where no rule sees them: torch-mlir lowers `aten.polar` to `cos`/`sin` of the
angle and `aten.randn` to a Box-Muller transform with `cos`, and llvm-cpu links `log10f` for float32
`log10`: "iree-lld: undefined symbol: cos" (sin, log10f). So each is written out here in ATen, where the
float64 rules of the same phase then take the `cos` and `sin` it makes:

- polar: `complex(abs * cos(angle), abs * sin(angle))`, torch's decomposition's arithmetic; it also ends
  IREE's failure on a polar whose two inputs broadcast ("'linalg.generic' op expected operand #1 rank").
- normal (every overload): `mean + std * randn` of the broadcast shape; torch's decomposition calls
  `prims.normal`, which IREE has no lowering for.
- float64 randn / randn_like: Box-Muller in float64, `sqrt(-2 log(1 - u1)) cos(2 pi u2)` of two uniform
  draws (IREE's float64 `rand` is not float32's).
- float32 log10: `log(x)` in float64 times 1/ln(10), rounded to float32 (float64 log links and is accurate):
  torch's float32 log10 within one float32 step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

_NORMALS = (aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.float_float)


def _result(node: Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _float64_result(node: Node) -> bool | Miss:
    val = _result(node)
    if val is None or val.dtype != torch.float64:
        return Miss("not float64 (IREE lowers float32 randn without libm)")
    return True


def _float32_result(node: Node) -> bool | Miss:
    val = _result(node)
    if val is None or val.dtype != torch.float32:
        return Miss("not float32 (float64 log10 is float64_math's; half types were not measured failing)")
    return True


@rule(
    roots=(aten.polar.default,),
    tags={"iree"},
    doc=(
        "aten.polar written out: complex(abs * cos(angle), abs * sin(angle)), as torch's decomposition computes "
        "it (without its writes through view_as_real). IREE 3.13 lowers polar itself to cos and sin, which for "
        "float64 link libm: 'iree-lld: undefined symbol: sin' (the float64 rules then write them out); and it "
        "fails on inputs of two ranks: \"'linalg.generic' op expected operand #1 rank (0) to match the result rank\"."
    ),
)
def polar_written_out_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    magnitude, angle = args["abs"], args["angle"]
    real = rw.call(aten.mul.Tensor, magnitude, rw.call(aten.cos.default, angle))
    imaginary = rw.call(aten.mul.Tensor, magnitude, rw.call(aten.sin.default, angle))
    rw.replace(node, rw.call(aten.complex.default, real, imaginary))


@rule(
    roots=_NORMALS,
    tags={"iree", "random"},
    doc=(
        "aten.normal (torch.normal of tensors or floats) written as mean + std * randn of the result's shape. "
        "IREE 3.13: \"failed to legalize operation 'torch.operator'\" (torch's decomposition calls prims.normal, "
        "which IREE does not lower). Draws from the same distribution (IREE's generator is not torch's)."
    ),
)
def normal_as_scaled_randn_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    out = node.meta["val"]
    mean, std = args.get("mean", 0.0), args.get("std", 1.0)
    if node.target is aten.normal.float_float:
        noise = rw.call(aten.randn.default, args["size"], dtype=out.dtype, device=out.device)
    else:
        # a tensor of the result's shape (mean + std broadcasts both); randn_like reads its shape only
        tensors = [t for t in (mean, std) if isinstance(t, Node)]
        shaped = tensors[0] if len(tensors) == 1 else rw.call(aten.add.Tensor, mean, std)
        noise = rw.call(aten.randn_like.default, shaped, dtype=out.dtype)
    scaled = rw.call(aten.mul.Tensor, noise, std)
    rw.replace(node, rw.call(aten.add.Tensor, scaled, mean))


@rule(
    roots=(aten.randn.default, aten.randn_like.default),
    when=_float64_result,
    tags={"iree", "random"},
    doc=(
        "float64 randn / randn_like written as Box-Muller in float64: sqrt(-2 log(1 - u1)) * cos(2 pi u2) of "
        "two uniform draws. IREE 3.13 lowers float64 randn to the same transform with a libm cos: "
        "'iree-lld: undefined symbol: cos'; here the float64 cos rule writes the cos out."
    ),
)
def float64_randn_by_box_muller_for_iree(node: Node, rw: Rewriter) -> Any:
    uniform = aten.rand.default if node.target is aten.randn.default else aten.rand_like.default
    draws = [rw.call(uniform, *node.args, **node.kwargs) for _ in range(2)]
    radius = rw.call(
        aten.sqrt.default,
        rw.call(aten.mul.Tensor, rw.call(aten.log.default, rw.call(aten.rsub.Scalar, draws[0], 1.0)), -2.0),
    )
    angle = rw.call(aten.mul.Tensor, draws[1], 2.0 * math.pi)
    rw.replace(node, rw.call(aten.mul.Tensor, radius, rw.call(aten.cos.default, angle)))


@rule(
    roots=(aten.log10.default,),
    when=_float32_result,
    tags={"iree"},
    doc=(
        "float32 log10 computed as log(x) in float64 times 1/ln(10), rounded to float32. IREE 3.13 llvm-cpu "
        "lowers float32 log10 to a libm call its embedded linker lacks: 'iree-lld: undefined symbol: log10f'. "
        "Within one float32 step of torch's."
    ),
)
def float32_log10_via_float64_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    wide = rw.call(aten._to_copy.default, args["self"], dtype=torch.float64)
    scaled = rw.call(aten.mul.Tensor, rw.call(aten.log.default, wide), 1.0 / math.log(10.0))
    rw.replace(node, rw.call(aten._to_copy.default, scaled, dtype=torch.float32))


RULES = RuleSet(
    [
        polar_written_out_for_iree,
        normal_as_scaled_randn_for_iree,
        float64_randn_by_box_muller_for_iree,
        float32_log10_via_float64_for_iree,
    ],
    name="iree-libm-forms",
)
