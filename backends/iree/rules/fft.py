"""DFTs of static size written out as matmuls by cosine and sine matrices, for IREE.

IREE 3.13 has no FFT and no complex lowering ("failed to legalize operation 'torch.operator'"). Complex
values are tracked as (real part, imaginary part) pairs of real nodes through what a real model does
between its FFTs: forward FFTs (fft, fft2, fftn, rfft; `_fft_c2c`, `_fft_r2c` as aot_autograd leaves them),
conj, clone, and +, -, * of complex values. The roots are where a real value comes out: the real part of
such a chain (FNet's `torch.fft.fftn(x).real`), or an inverse real FFT (`irfft`, `_fft_c2r`), as in
`irfft(rfft(q) * conj(rfft(k)), n)` (a circular correlation).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten

#: forward FFTs of a real or complex input, as export leaves them (CIA ops) and as aot_autograd does
_FFTS = (
    aten.fft_fftn.default,
    aten.fft_fft2.default,
    aten.fft_fft.default,
    aten.fft_rfft.default,
    aten._fft_c2c.default,
    aten._fft_r2c.default,
)
_CONJ = (aten._conj.default, aten.conj_physical.default, aten.conj.default)
_ARITHMETIC = (aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor)
_PASS = (aten.clone.default, aten.alias.default)
_INVERSE = (aten.fft_irfft.default, aten._fft_c2r.default)
#: normalization codes of `_fft_c2c` (0 none, 1 1/sqrt(n), 2 1/n), forward and inverse
_SCALE = {"backward": 0, None: 0, "ortho": 1, "forward": 2}
_INVERSE_SCALE = {"backward": 2, None: 2, "ortho": 1, "forward": 0}

Parts = tuple[Node, "Node | None"]


def _fft_plan(node: Node, args: Mapping[str, Any]) -> tuple[Node, list[int], int, bool] | Miss:
    """(input, dims, normalization code, one-sided last dim) of a forward FFT over whole static dims."""
    x = args["self"]
    rank = x.meta["val"].dim()
    onesided = False
    if node.target is aten._fft_c2c.default or node.target is aten._fft_r2c.default:
        if node.target is aten._fft_c2c.default and not args["forward"]:
            return Miss("an inverse FFT")
        onesided = node.target is aten._fft_r2c.default and bool(args.get("onesided"))
        dims, code = list(args["dim"]), args["normalization"]
    else:
        if args.get("s", args.get("n")) is not None:
            return Miss("an FFT with an explicit size (padding or trimming)")
        if node.target in (aten.fft_fft.default, aten.fft_rfft.default):
            dims = [args.get("dim", -1)]
            onesided = node.target is aten.fft_rfft.default
        elif node.target is aten.fft_fft2.default:
            dims = list(args.get("dim", [-2, -1]))
        else:
            dims = list(args["dim"]) if args.get("dim") is not None else list(range(rank))
        code = _SCALE.get(args.get("norm"), -1)
        if code < 0:
            return Miss(f"norm={args.get('norm')!r}")
    dims = [d % rank for d in dims]
    shape = x.meta["val"].shape
    if not all(isinstance(shape[d], int) for d in dims):
        return Miss("a transformed dim has a symbolic size")
    return x, dims, code, onesided


def complex_parts(value: Any, rw: Rewriter, depth: int = 0) -> Parts | Miss:
    """(real part, imaginary part or None for zero) of `value` as real nodes: a real tensor, a real tensor
    converted to complex, a forward FFT, conj, clone, or +, -, * of these."""
    val = fake_value(value)
    if not isinstance(val, torch.Tensor):
        return Miss("not a tensor")
    if not val.is_complex():
        return value, None
    if depth > 16:
        return Miss("more than 16 complex ops in a chain")
    if value.op != "call_function":
        return Miss(f"a complex {value.op}")
    target, args = value.target, value.args
    if target is aten._to_copy.default:
        source = args[0]
        if isinstance(source, Node) and not source.meta["val"].is_complex():
            return source, None
        return Miss("a copy of a complex value")
    if target in _PASS:
        return complex_parts(args[0], rw, depth + 1)
    if target in _CONJ:
        parts = complex_parts(args[0], rw, depth + 1)
        if isinstance(parts, Miss) or parts[1] is None:
            return parts
        return parts[0], rw.call(aten.neg.default, parts[1])
    if target in _ARITHMETIC:
        return _arithmetic(value, rw, depth)
    if target not in _FFTS:
        return Miss(f"a complex value made by {target}")
    plan = _fft_plan(value, schema.arguments(value))
    if isinstance(plan, Miss):
        return plan
    x, dims, code, onesided = plan
    parts = complex_parts(x, rw, depth + 1)
    if isinstance(parts, Miss):
        return parts
    re, im = parts
    shape = x.meta["val"].shape
    for i, dim in enumerate(dims):
        kept = shape[dim] // 2 + 1 if onesided and i == len(dims) - 1 else shape[dim]
        re, im = _dft_along(rw, re, im, dim, shape[dim], kept, code, val.real.dtype)
    return re, im


def _arithmetic(value: Node, rw: Rewriter, depth: int) -> Parts | Miss:
    """a + b, a - b, a * b (without alpha) of complex or real tensors, in real and imaginary parts."""
    if len(value.args) != 2 or value.kwargs:
        return Miss(f"{value.target} with alpha or more arguments")
    sides = [complex_parts(a, rw, depth + 1) for a in value.args]
    for side in sides:
        if isinstance(side, Miss):
            return side
    (ar, ai), (br, bi) = sides  # type: ignore[misc]
    if value.target is aten.mul.Tensor:
        re = rw.call(aten.mul.Tensor, ar, br)
        if ai is not None and bi is not None:
            re = rw.call(aten.sub.Tensor, re, rw.call(aten.mul.Tensor, ai, bi))
        cross = [rw.call(aten.mul.Tensor, ar, bi) if bi is not None else None]
        cross.append(rw.call(aten.mul.Tensor, ai, br) if ai is not None else None)
        present = [c for c in cross if c is not None]
        im = rw.call(aten.add.Tensor, *present) if len(present) == 2 else (present[0] if present else None)
        return re, im
    op = value.target
    re = rw.call(op, ar, br)
    if bi is None:
        return re, ai
    im = rw.call(op, ai, bi) if ai is not None else (bi if op is aten.add.Tensor else rw.call(aten.neg.default, bi))
    return re, im


def _dft_matrices(
    rw: Rewriter, rows: int, cols: int, n: int, scale: float, dtype: torch.dtype, device: torch.device
) -> tuple[Node, Node]:
    """cos(2 pi j k / n) and sin(...) for j < rows, k < cols, times `scale`, built in the graph: an
    ExportedProgram takes no new tensor constants. j k mod n is exact in integers, so the angle stays small."""
    j = rw.call(aten.arange.default, rows, dtype=torch.int64, device=device)
    k = rw.call(aten.arange.default, cols, dtype=torch.int64, device=device)
    products = rw.call(aten.mul.Tensor, rw.call(aten.unsqueeze.default, j, 1), rw.call(aten.unsqueeze.default, k, 0))
    turns = rw.call(aten._to_copy.default, rw.call(aten.remainder.Scalar, products, n), dtype=dtype)
    theta = rw.call(aten.mul.Tensor, turns, 2 * math.pi / n)
    cos, sin = rw.call(aten.cos.default, theta), rw.call(aten.sin.default, theta)
    if scale != 1.0:
        cos, sin = rw.call(aten.mul.Tensor, cos, scale), rw.call(aten.mul.Tensor, sin, scale)
    return cos, sin


def _along(rw: Rewriter, t: Node, matrix: Node, dim: int) -> Node:
    """`t` contracted with `matrix` [size of dim, new size] along `dim`."""
    moved = rw.call(aten.transpose.int, t, dim, -1)
    return rw.call(aten.transpose.int, rw.call(aten.matmul.default, moved, matrix), dim, -1)


def _dft_along(
    rw: Rewriter, re: Node, im: Node | None, dim: int, n: int, kept: int, code: int, dtype: torch.dtype
) -> Parts:
    """One forward DFT along `dim` (its first `kept` outputs): X = (C - iS) x, C[j, k] = cos(2 pi j k / n)."""
    scale = {0: 1.0, 1: 1 / math.sqrt(n), 2: 1 / n}[code]
    cos, sin = _dft_matrices(rw, n, kept, n, scale, dtype, re.meta["val"].device)
    if re.meta["val"].dtype != dtype:
        re = rw.call(aten._to_copy.default, re, dtype=dtype)
    new_re, new_im = _along(rw, re, cos, dim), rw.call(aten.neg.default, _along(rw, re, sin, dim))
    if im is not None:
        new_re = rw.call(aten.add.Tensor, new_re, _along(rw, im, sin, dim))
        new_im = rw.call(aten.add.Tensor, new_im, _along(rw, im, cos, dim))
    return new_re, new_im


def _real_of(node: Node) -> Node | Miss:
    """The complex node whose real part `node` takes (aten.real, or view_as_real(z)[..., 0])."""
    if node.target is aten.real.default:
        return node.args[0]
    source = node.args[0]
    if (
        isinstance(source, Node)
        and source.op == "call_function"
        and source.target is aten.view_as_real.default
        and node.args[1] in (-1, source.meta["val"].dim() - 1)
        and node.args[2] == 0
    ):
        return source.args[0]
    return Miss("not the real part of a complex value")


def _real_of_fft(node: Node) -> Node | Miss:
    """The complex value whose real part `node` takes: an FFT, or conj, +, -, * of one."""
    z = _real_of(node)
    if isinstance(z, Miss):
        return z
    if not isinstance(z, Node) or z.op != "call_function" or z.target not in (*_FFTS, *_CONJ, *_ARITHMETIC):
        return Miss("the complex value is not an FFT, or conj, +, -, * of one")
    return z


@rule(
    roots=(aten.real.default, aten.select.int),
    when=_real_of_fft,
    tags={"iree"},
    doc=(
        "The real part of forward FFTs of a real input over dims of static size (FNet's token mixing, "
        "`torch.fft.fftn(x, dim=(1, 2)).real`; fft, fft2, fftn, rfft as exported, _fft_c2c / _fft_r2c with "
        "view_as_real(...)[..., 0] as aot_autograd leaves them; conj, +, -, * between them) becomes matmuls by "
        "constant cosine and sine matrices, one dim at a time, tracking real and imaginary parts. IREE 3.13 "
        "has no FFT and no complex lowering: \"failed to legalize operation 'torch.operator'\" (aten.fft_fftn "
        "/ aten._fft_c2c)."
    ),
)
def real_fft_to_matmul_for_iree(node: Node, rw: Rewriter, *, found: Node) -> Any:
    parts = complex_parts(found, rw)
    if isinstance(parts, Miss):
        return parts
    rw.replace(node, parts[0])
    return None


def _inverse_plan(node: Node, args: Mapping[str, Any]) -> tuple[Node, int, int, int] | Miss:
    """(input, dim, output size n, normalization code) of a 1-d inverse real FFT over a static dim."""
    x = args["self"]
    rank = x.meta["val"].dim()
    if node.target is aten._fft_c2r.default:
        if len(args["dim"]) != 1:
            return Miss("a multi-dim _fft_c2r (irfftn)")
        dim, code, n = args["dim"][0] % rank, args["normalization"], args["last_dim_size"]
    else:
        dim = args.get("dim", -1) % rank
        size = x.meta["val"].shape[dim]
        n = args.get("n")
        n = 2 * (size - 1) if n is None and isinstance(size, int) else n
        code = _INVERSE_SCALE.get(args.get("norm"), -1)
        if code < 0:
            return Miss(f"norm={args.get('norm')!r}")
    if not isinstance(n, int) or not isinstance(x.meta["val"].shape[dim], int):
        return Miss("a symbolic transformed size")
    return x, dim, n, code


def _transforms_a_tracked_value(node: Node, args: Mapping[str, Any]) -> tuple[Node, int, int, int] | Miss:
    """`_inverse_plan`'s plan where the input is an FFT, or conj, +, -, * of one."""
    plan = _inverse_plan(node, args)
    if isinstance(plan, Miss):
        return plan
    x = plan[0]
    if x.op != "call_function" or x.target not in (*_FFTS, *_CONJ, *_ARITHMETIC, *_PASS):
        return Miss("its input is not an FFT, or conj, +, -, * of one")
    return plan


@rule(
    roots=_INVERSE,
    when=_transforms_a_tracked_value,
    tags={"iree"},
    doc=(
        "An inverse real FFT (irfft, _fft_c2r over one static dim) of an FFT chain the real-part rule tracks "
        "(`irfft(rfft(q) * conj(rfft(k)), n)`) becomes x[t] = sum_k w_k (Re X[k] cos(2 pi k t / n) - Im X[k] "
        "sin(2 pi k t / n)), w_k 1 at k = 0 and n/2 and 2 between, over the first n // 2 + 1 inputs (as "
        "torch: the rest ignored, missing ones zero, the imaginary parts at 0 and n/2 ignored). IREE 3.13: "
        "\"failed to legalize operation 'torch.operator'\" (aten.fft_irfft)."
    ),
)
def inverse_real_fft_to_matmul_for_iree(node: Node, rw: Rewriter, *, found: tuple[Node, int, int, int]) -> Any:
    x, dim, n, code = found
    parts = complex_parts(x, rw)
    if isinstance(parts, Miss):
        return parts
    re, im = parts
    rows = min(x.meta["val"].shape[dim], n // 2 + 1)
    if rows < x.meta["val"].shape[dim]:
        re = rw.call(aten.slice.Tensor, re, dim, 0, rows)
        im = rw.call(aten.slice.Tensor, im, dim, 0, rows) if im is not None else None
    dtype = node.meta["val"].dtype
    cos, sin = _dft_matrices(
        rw, rows, n, n, {0: 1.0, 1: 1 / math.sqrt(n), 2: 1 / n}[code], dtype, re.meta["val"].device
    )
    k = rw.call(aten.arange.default, rows, dtype=dtype, device=re.meta["val"].device)
    inner = rw.call(
        aten.logical_and.default,
        rw.call(aten.gt.Scalar, k, 0),
        rw.call(aten.lt.Scalar, rw.call(aten.mul.Tensor, k, 2), n),
    )
    weight = rw.call(
        aten.unsqueeze.default, rw.call(aten.add.Tensor, rw.call(aten._to_copy.default, inner, dtype=dtype), 1.0), 1
    )
    out = _along(rw, re, rw.call(aten.mul.Tensor, cos, weight), dim)
    if im is not None:
        out = rw.call(aten.sub.Tensor, out, _along(rw, im, rw.call(aten.mul.Tensor, sin, weight), dim))
    rw.replace(node, out)
    return None
