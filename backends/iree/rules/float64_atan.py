"""float64 atan, atan2, asin and acos written out for IREE 3.13's llvm-cpu (libm calls it cannot link).

`iree-lld: undefined symbol: atan` (also atan2, asin, acos) for float64, as float64_math.py's ops. fdlibm's
atan: |x| reduced to one of five intervals (t = x, (2x-1)/(2+x), (x-1)/(x+1), (x-1.5)/(1+1.5x), -1/x), an
odd polynomial of degree 23 in t, plus atan of the interval's point in two parts. atan2 from atan(|y/x|)
with fdlibm's quadrants and special cases; asin(x) = atan2(x, sqrt((1-x)(1+x))), acos(x) = atan2(sqrt(...), x).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.iree.rules.float64_math import _horner, _of_float64
from fx_rewrites.engine import Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: fdlibm s_atan.c: atan at 0.5, 1, 1.5, inf in two parts, and the polynomial's coefficients
_HI = (4.63647609000806093515e-01, 7.85398163397448278999e-01, 9.82793723247329054082e-01, 1.57079632679489655800e00)
_LO = (2.26987774529616870924e-17, 3.06161699786838301793e-17, 1.39033110312309984516e-17, 6.12323399573676603587e-17)
_AT = (
    3.33333333333329318027e-01,
    -1.99999999998764832476e-01,
    1.42857142725034663711e-01,
    -1.11111104054623557880e-01,
    9.09088713343650656196e-02,
    -7.69187620504482999495e-02,
    6.66107313738753120669e-02,
    -5.83357013379057348645e-02,
    4.97687799461593236017e-02,
    -3.65315727442169155270e-02,
    1.62858201153657823623e-02,
)
#: the interval bounds of |x|: 7/16, 11/16, 19/16, 39/16
_BOUNDS = (0.4375, 0.6875, 1.1875, 2.4375)
_PI_LO = 1.2246467991473531772e-16


def _scalar(rw: Rewriter, value: float) -> Node:
    return rw.call(aten.scalar_tensor.default, value, dtype=torch.float64)


def _atan_of_magnitude(rw: Rewriter, a: Node) -> Node:
    """atan(a) for a >= 0 (NaN stays NaN, inf gives pi/2)."""
    reduced = (
        rw.call(
            aten.div.Tensor,
            rw.call(aten.sub.Tensor, rw.call(aten.mul.Tensor, a, 2.0), 1.0),
            rw.call(aten.add.Tensor, a, 2.0),
        ),
        rw.call(aten.div.Tensor, rw.call(aten.sub.Tensor, a, 1.0), rw.call(aten.add.Tensor, a, 1.0)),
        rw.call(
            aten.div.Tensor,
            rw.call(aten.sub.Tensor, a, 1.5),
            rw.call(aten.add.Tensor, rw.call(aten.mul.Tensor, a, 1.5), 1.0),
        ),
        rw.call(aten.reciprocal.default, rw.call(aten.neg.default, a)),
    )
    t, hi, lo = reduced[3], _scalar(rw, _HI[3]), _scalar(rw, _LO[3])
    for i in (2, 1, 0):  # the interval [bounds[i], bounds[i + 1]) takes reduction i
        below = rw.call(aten.lt.Scalar, a, _BOUNDS[i + 1])
        t = rw.call(aten.where.self, below, reduced[i], t)
        hi = rw.call(aten.where.self, below, _scalar(rw, _HI[i]), hi)
        lo = rw.call(aten.where.self, below, _scalar(rw, _LO[i]), lo)
    small = rw.call(aten.lt.Scalar, a, _BOUNDS[0])
    t = rw.call(aten.where.self, small, a, t)
    z = rw.call(aten.mul.Tensor, t, t)
    w = rw.call(aten.mul.Tensor, z, z)
    s1 = rw.call(aten.mul.Tensor, z, _horner(rw, w, _AT[0::2]))
    s2 = rw.call(aten.mul.Tensor, w, _horner(rw, w, _AT[1::2]))
    ts = rw.call(aten.mul.Tensor, t, rw.call(aten.add.Tensor, s1, s2))
    near_zero = rw.call(aten.sub.Tensor, t, ts)
    shifted = rw.call(aten.sub.Tensor, hi, rw.call(aten.sub.Tensor, rw.call(aten.sub.Tensor, ts, lo), t))
    return rw.call(aten.where.self, small, near_zero, shifted)


def _atan2(rw: Rewriter, y: Node, x: Node) -> Node:
    """fdlibm's atan2(y, x): atan(|y/x|) put in the quadrant of (x, y); +-0 and infinities as torch's."""
    both_inf = rw.call(
        aten.logical_and.default,
        rw.call(aten.eq.Scalar, rw.call(aten.abs.default, x), math.inf),
        rw.call(aten.eq.Scalar, rw.call(aten.abs.default, y), math.inf),
    )
    ratio = rw.call(aten.div.Tensor, rw.call(aten.abs.default, y), rw.call(aten.abs.default, x))
    z = _atan_of_magnitude(rw, rw.call(aten.where.self, both_inf, _scalar(rw, 1.0), ratio))
    negative_x = rw.call(aten.lt.Scalar, rw.call(aten.copysign.Tensor, _scalar(rw, 1.0), x), 0.0)  # -0.0 too
    left = rw.call(aten.rsub.Scalar, rw.call(aten.sub.Tensor, z, _PI_LO), math.pi)  # pi - (z - pi_lo)
    r = rw.call(aten.where.self, negative_x, left, z)
    x_is_number = rw.call(aten.logical_not.default, rw.call(aten.ne.Tensor, x, x))  # IREE folds x == x to True
    zero_y = rw.call(aten.logical_and.default, rw.call(aten.eq.Scalar, y, 0.0), x_is_number)
    r = rw.call(
        aten.where.self, zero_y, rw.call(aten.where.self, negative_x, _scalar(rw, math.pi), _scalar(rw, 0.0)), r
    )
    return rw.call(aten.copysign.Tensor, r, y)


_DOC = (
    "IREE 3.13 llvm-cpu: 'iree-lld: undefined symbol: {sym}' for float64 (a libm call its embedded linker "
    "lacks). Written out in float64: {how}; within 4 ulp of torch's float64, NaN, infinities and signed "
    "zeros as torch's."
)


@rule(roots=(aten.atan.default,), when=_of_float64, tags={"iree"}, doc=_DOC.format(sym="atan", how="fdlibm's atan"))
def float64_atan_written_out_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x = args["self"]
    rw.replace(node, rw.call(aten.copysign.Tensor, _atan_of_magnitude(rw, rw.call(aten.abs.default, x)), x))


@rule(
    roots=(aten.atan2.default,),
    when=_of_float64,
    tags={"iree"},
    doc=_DOC.format(sym="atan2", how="atan(|y/x|) in fdlibm's quadrants"),
)
def float64_atan2_written_out_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    rw.replace(node, _atan2(rw, args["self"], args["other"]))


def _cosine_of_arcsine(rw: Rewriter, x: Node) -> Node:
    """sqrt((1 - x)(1 + x)): no cancellation near |x| = 1; NaN past it."""
    return rw.call(
        aten.sqrt.default,
        rw.call(aten.mul.Tensor, rw.call(aten.rsub.Scalar, x, 1.0), rw.call(aten.add.Tensor, x, 1.0)),
    )


@rule(
    roots=(aten.asin.default,),
    when=_of_float64,
    tags={"iree"},
    doc=_DOC.format(sym="asin", how="atan2(x, sqrt((1 - x)(1 + x)))"),
)
def float64_asin_written_out_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x = args["self"]
    rw.replace(node, _atan2(rw, x, _cosine_of_arcsine(rw, x)))


@rule(
    roots=(aten.acos.default,),
    when=_of_float64,
    tags={"iree"},
    doc=_DOC.format(sym="acos", how="atan2(sqrt((1 - x)(1 + x)), x)"),
)
def float64_acos_written_out_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x = args["self"]
    rw.replace(node, _atan2(rw, _cosine_of_arcsine(rw, x), x))


RULES = RuleSet(
    [
        float64_atan_written_out_for_iree,
        float64_atan2_written_out_for_iree,
        float64_asin_written_out_for_iree,
        float64_acos_written_out_for_iree,
    ],
    name="iree-float64-atan",
)
