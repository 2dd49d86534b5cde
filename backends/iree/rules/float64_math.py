"""float64 math IREE 3.13's llvm-cpu cannot link, written out in float64 ops it compiles.

The backend keeps float64 (`--iree-input-demote-f64-to-f32=false`, targets.py), and llvm-cpu lowers a
float64 `math.cos` to a call of libm's `cos`, which its embedded linker does not have: `iree-lld: undefined
symbol: cos` (also sin, tan, tanh, log2, log10; atan and its kin are in float64_atan.py), as in
`torch.arange(8, dtype=torch.float64).cos()` (sin-cos position tables built in float64). No iree-compile
flag expands them (its polynomial approximations are float32's). exp, log, pow, cosh and sigmoid of float64
compile and are accurate; expm1, log1p and sinh compile but cancel near 0 (silently wrong). Computing any of
them in float32 would silently lose 9 digits, so they are written out in float64:

- sin, cos, tan: x = n pi/2 + r with n = round(2x/pi) and r reduced by Cody-Waite with pi/2 split into six
  24-bit parts and a tail (each n * part exact for |n| < 2^29), then fdlibm's kernels on |r| <= pi/4 and the
  quadrant n mod 4. Past |x| = 2^29 pi/2 (8.4e8) the reduction is no longer exact: NaN there, not a wrong
  number (torch's own float64 is full-range; documented in docs/iree-3.13-findings.md, section 21).
- tanh(x) = -t / (t + 2) with t = expm1(-2|x|), sign of x; log2 and log10 are log(x) times a constant.

Measured against torch's float64 (tests/backends/iree/rules/test_float64_math.py): within 4 ulp.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import Pattern, rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: pi/2 in six 24-bit parts and a tail (mpmath at 400 bits; the test checks their sum against mpmath)
PIO2_PARTS = tuple(
    float.fromhex(h)
    for h in (
        "0x1.921fb40000000p+0",
        "0x1.4442d00000000p-24",
        "0x1.8469880000000p-48",
        "0x1.8cc5160000000p-72",
        "0x1.01b8380000000p-96",
        "0x1.a252040000000p-120",
        "0x1.3822299f31d01p-145",
    )
)
TWO_OVER_PI = float.fromhex("0x1.45f306dc9c883p-1")
#: n * part is exact below 2^29 (24 + 29 bits); past it the reduction would be wrong, so NaN
LARGEST_N = 2.0**29
#: fdlibm's __kernel_sin and __kernel_cos coefficients (|r| <= pi/4)
_SIN = (
    -1.66666666666666324348e-01,
    8.33333333332248946124e-03,
    -1.98412698298579493134e-04,
    2.75573137070700676789e-06,
    -2.50507602534068634195e-08,
    1.58969099521155010221e-10,
)
_COS = (
    4.16666666666666019037e-02,
    -1.38888888888741095749e-03,
    2.48015872894767294178e-05,
    -2.75573143513906633035e-07,
    2.08757232129817482790e-09,
    -1.13596475577881948265e-11,
)


def _of_float64(node: Node) -> bool | Miss:
    val = schema.arguments(node)["self"].meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.float64:
        return Miss("not a float64 tensor (IREE links the float32 forms)")
    return True


def _horner(rw: Rewriter, z: Node, coefficients: tuple[float, ...]) -> Node:
    """c0 + z (c1 + z (c2 + ...))."""
    acc: Any = coefficients[-1]
    for c in reversed(coefficients[:-1]):
        acc = rw.call(aten.add.Tensor, rw.call(aten.mul.Tensor, z, acc), c)
    return acc


def _kernels(rw: Rewriter, x: Node) -> tuple[Node, Node, Node, Node]:
    """(sin r, cos r, n mod 4 as int64, the NaN mask past the reduction's range) for x = n pi/2 + r."""
    n = rw.call(aten.round.default, rw.call(aten.mul.Tensor, x, TWO_OVER_PI))
    r = x
    for part in PIO2_PARTS:
        r = rw.call(aten.sub.Tensor, r, rw.call(aten.mul.Tensor, n, part))
    z = rw.call(aten.mul.Tensor, r, r)
    sin_r = rw.call(aten.add.Tensor, r, rw.call(aten.mul.Tensor, rw.call(aten.mul.Tensor, z, r), _horner(rw, z, _SIN)))
    # musl's __cos: w = 1 - z/2 and the rounding error of w added back
    hz = rw.call(aten.mul.Tensor, z, 0.5)
    w = rw.call(aten.rsub.Scalar, hz, 1.0)
    tail = rw.call(aten.sub.Tensor, rw.call(aten.rsub.Scalar, w, 1.0), hz)
    poly = rw.call(aten.mul.Tensor, rw.call(aten.mul.Tensor, z, z), _horner(rw, z, _COS))
    cos_r = rw.call(aten.add.Tensor, w, rw.call(aten.add.Tensor, tail, poly))
    outside = rw.call(aten.gt.Scalar, rw.call(aten.abs.default, n), LARGEST_N)
    finite_n = rw.call(aten.where.self, outside, rw.call(aten.scalar_tensor.default, 0.0, dtype=torch.float64), n)
    quadrant = rw.call(aten.bitwise_and.Scalar, rw.call(aten._to_copy.default, finite_n, dtype=torch.int64), 3)
    return sin_r, cos_r, quadrant, outside


def _pick(rw: Rewriter, quadrant: Node, outside: Node, by_quadrant: tuple[Node, Node, Node, Node]) -> Node:
    """by_quadrant[n mod 4], NaN where the reduction was out of range."""
    out = by_quadrant[3]
    for q in (2, 1, 0):
        out = rw.call(aten.where.self, rw.call(aten.eq.Scalar, quadrant, q), by_quadrant[q], out)
    nan = rw.call(aten.scalar_tensor.default, math.nan, dtype=torch.float64)
    return rw.call(aten.where.self, outside, nan, out)


def _keep_signed_zero(rw: Rewriter, x: Node, out: Node) -> Node:
    """sin and tan of +-0.0 are x itself (the reduction turns -0.0 into +0.0)."""
    return rw.call(aten.where.self, rw.call(aten.eq.Scalar, x, 0.0), x, out)


_DOC = (
    "IREE 3.13 llvm-cpu: 'iree-lld: undefined symbol: {sym}' (float64 {sym} is a libm call its embedded "
    "linker lacks). Written out in float64: Cody-Waite reduction by pi/2 in seven parts, fdlibm's kernels, "
    "the quadrant; within 4 ulp of torch's float64; NaN past |x| = 2^29 pi/2, where the reduction is inexact."
)


@rule(roots=(aten.sin.default,), when=_of_float64, tags={"iree"}, doc=_DOC.format(sym="sin"))
def float64_sin_written_out_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x = args["self"]
    s, c, quadrant, outside = _kernels(rw, x)
    neg_s, neg_c = rw.call(aten.neg.default, s), rw.call(aten.neg.default, c)
    rw.replace(node, _keep_signed_zero(rw, x, _pick(rw, quadrant, outside, (s, c, neg_s, neg_c))))


@rule(roots=(aten.cos.default,), when=_of_float64, tags={"iree"}, doc=_DOC.format(sym="cos"))
def float64_cos_written_out_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    s, c, quadrant, outside = _kernels(rw, args["self"])
    neg_s, neg_c = rw.call(aten.neg.default, s), rw.call(aten.neg.default, c)
    rw.replace(node, _pick(rw, quadrant, outside, (c, neg_s, neg_c, s)))


@rule(roots=(aten.tan.default,), when=_of_float64, tags={"iree"}, doc=_DOC.format(sym="tan"))
def float64_tan_written_out_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x = args["self"]
    s, c, quadrant, outside = _kernels(rw, x)
    even = rw.call(aten.div.Tensor, s, c)
    odd = rw.call(aten.neg.default, rw.call(aten.div.Tensor, c, s))
    rw.replace(node, _keep_signed_zero(rw, x, _pick(rw, quadrant, outside, (even, odd, even, odd))))


#: Cephes' tanh for |x| <= 0.625: x + x z P(z) / Q(z), z = x^2 (Q's leading 1 implicit)
_TANH_P = (-1.61468768441708447952e3, -9.92877231001918586564e1, -9.64399179425052238628e-1)
_TANH_Q = (4.84406305325125486048e3, 2.23548839060100448583e3, 1.12811678491632931402e2, 1.0)


@rule(
    roots=(aten.tanh.default,),
    when=_of_float64,
    tags={"iree"},
    doc=(
        "IREE 3.13 llvm-cpu: 'iree-lld: undefined symbol: tanh' for float64. Written out as Cephes' tanh: "
        "x + x z P(z) / Q(z) (z = x^2) for |x| <= 0.625, else copysign(1 - 2 / (exp(2|x|) + 1), x) (float64 "
        "exp compiles; IREE's float64 expm1 is not accurate near 0). NaN and -0.0 as torch's."
    ),
)
def float64_tanh_written_out_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x = args["self"]
    z = rw.call(aten.mul.Tensor, x, x)
    ratio = rw.call(aten.div.Tensor, _horner(rw, z, _TANH_P), _horner(rw, z, _TANH_Q))
    small = rw.call(aten.add.Tensor, x, rw.call(aten.mul.Tensor, rw.call(aten.mul.Tensor, x, z), ratio))
    magnitude = rw.call(aten.abs.default, x)
    grown = rw.call(aten.exp.default, rw.call(aten.mul.Tensor, magnitude, 2.0))
    large = rw.call(aten.rsub.Scalar, rw.call(aten.div.Tensor, 2.0, rw.call(aten.add.Tensor, grown, 1.0)), 1.0)
    out = rw.call(aten.where.self, rw.call(aten.gt.Scalar, magnitude, 0.625), large, small)
    rw.replace(node, rw.call(aten.copysign.Tensor, out, x))  # tanh(-0.0) is -0.0


def _expm1(rw: Rewriter, x: Node) -> Node:
    """Kahan's expm1 from exp and log: (u - 1) (x / log(u)), u = exp(x); x where u == 1, -1 where u - 1 == -1
    (x / log(u) first: (u - 1) x overflows near x = 709)."""
    u = rw.call(aten.exp.default, x)
    um1 = rw.call(aten.sub.Tensor, u, 1.0)
    out = rw.call(aten.mul.Tensor, um1, rw.call(aten.div.Tensor, x, rw.call(aten.log.default, u)))
    out = rw.call(aten.where.self, rw.call(aten.eq.Scalar, um1, -1.0), um1, out)
    out = rw.call(aten.where.self, rw.call(aten.eq.Scalar, u, math.inf), u, out)
    return rw.call(aten.where.self, rw.call(aten.eq.Scalar, u, 1.0), x, out)


_NEAR_ZERO = (
    "IREE 3.13 llvm-cpu computes float64 {op} near 0 with cancellation: {op}(1e-4) 2e3 ulp off, {op}(1e-8) "
    "3e7 ulp, 0 below 1e-16 (a silent wrong number). Written out: {how}; within 4 ulp of torch's float64."
)


@rule(
    roots=(aten.expm1.default,),
    when=_of_float64,
    tags={"iree"},
    doc=_NEAR_ZERO.format(op="expm1", how="Kahan's (u - 1) x / log(u), u = exp(x)"),
)
def float64_expm1_written_out_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    rw.replace(node, _expm1(rw, args["self"]))


@rule(
    roots=(aten.log1p.default,),
    when=_of_float64,
    tags={"iree"},
    doc=_NEAR_ZERO.format(op="log1p", how="Kahan's log(u) x / (u - 1), u = 1 + x; x where u == 1"),
)
def float64_log1p_written_out_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x = args["self"]
    u = rw.call(aten.add.Tensor, x, 1.0)
    out = rw.call(
        aten.div.Tensor, rw.call(aten.mul.Tensor, rw.call(aten.log.default, u), x), rw.call(aten.sub.Tensor, u, 1.0)
    )
    out = rw.call(aten.where.self, rw.call(aten.eq.Scalar, u, math.inf), u, out)
    rw.replace(node, rw.call(aten.where.self, rw.call(aten.eq.Scalar, u, 1.0), x, out))


@rule(
    roots=(aten.sinh.default,),
    when=_of_float64,
    tags={"iree"},
    doc=_NEAR_ZERO.format(
        op="sinh",
        how="fdlibm's t = expm1(|x|), (2t - t^2/(t+1)) / 2 below 1, (t + t/(t+1)) / 2 below 22, "
        "then (exp(|x|/2) / 2) exp(|x|/2), finite up to 710.47; the sign of x",
    ),
)
def float64_sinh_written_out_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x = args["self"]
    magnitude = rw.call(aten.abs.default, x)
    t = _expm1(rw, magnitude)
    t_over = rw.call(aten.div.Tensor, t, rw.call(aten.add.Tensor, t, 1.0))
    below_one = rw.call(aten.sub.Tensor, rw.call(aten.mul.Tensor, t, 2.0), rw.call(aten.mul.Tensor, t, t_over))
    middle = rw.call(aten.add.Tensor, t, t_over)
    # torch's own float64 sinh is inf or finite on (709.78, 710.48) depending on the element's position (its
    # vectorised kernel overflows, its scalar tail does not): the true value is finite there
    half = rw.call(aten.exp.default, rw.call(aten.mul.Tensor, magnitude, 0.5))
    large = rw.call(aten.mul.Tensor, rw.call(aten.mul.Tensor, half, 0.5), half)
    out = rw.call(aten.where.self, rw.call(aten.lt.Scalar, magnitude, 1.0), below_one, middle)
    out = rw.call(aten.where.self, rw.call(aten.lt.Scalar, magnitude, 22.0), rw.call(aten.mul.Tensor, out, 0.5), large)
    rw.replace(node, rw.call(aten.copysign.Tensor, out, x))


def _log_times(constant: float, name: str) -> Pattern:
    op = getattr(aten, name).default
    return Pattern(
        pattern=lambda x: op(x),
        replacement=lambda x: aten.mul.Tensor(aten.log.default(x), constant),
        when=_of_float64,
        tags={"iree"},
        name=f"float64_{name}_written_out_for_iree",
        doc=(
            f"IREE 3.13 llvm-cpu: 'iree-lld: undefined symbol: {name}' for float64. Written out as log(x) * "
            f"{constant!r} (float64 log compiles); within 2 ulp of torch's float64."
        ),
    )


RULES = RuleSet(
    [
        float64_sin_written_out_for_iree,
        float64_cos_written_out_for_iree,
        float64_tan_written_out_for_iree,
        float64_tanh_written_out_for_iree,
        float64_expm1_written_out_for_iree,
        float64_log1p_written_out_for_iree,
        float64_sinh_written_out_for_iree,
        _log_times(1.0 / math.log(2.0), "log2"),
        _log_times(1.0 / math.log(10.0), "log10"),
    ],
    name="iree-float64-math",
)
