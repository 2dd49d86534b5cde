"""Where a rule finds an op's decomposition: torch's own, else one torch lacks, written here.

`decomposition(op)` looks in `OVERRIDES` (ops whose decomposition in torch
yields prims that lie about their result or that nothing lowers), in torch's
table (`torch._decomp.decomposition_table`), then in `MISSING` (ops torch has
no decomposition for, written with torch ops and checked against torch's
kernel), then at the op's CompositeImplicitAutograd kernel. `Decompose` rules
and the legality-driven phase (`kinds.legalize`) both ask it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch._decomp
from torch._C import DispatchKey
from torch._ops import OpOverload

aten = torch.ops.aten

# ----------------------------------------------------------------------------- anti-aliased resizes
# torch 2.13 decomposes `_upsample_{bilinear,bicubic,lanczos}2d_aa.vec` into their `.default` overloads and
# those into nothing (ATen's CPU and CUDA kernels only). The resize is separable and linear in the input, so
# with static sizes it is two matmuls by [out, in] weight matrices. The weights follow ATen's
# `_compute_weights_aa` (UpSampleKernel.cpp): the filter, stretched by the scale when shrinking, centred on
# each output pixel, cut to its support window, normalised to sum 1 (tests/backends/iree/rules/test_resize_aa.py checks
# them against torch's kernel, exact to float64 rounding).


def _bilinear(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(1.0 - x, min=0.0)


def _bicubic(x: torch.Tensor) -> torch.Tensor:
    a = -0.5  # Keys' cubic with a = -0.5 (PIL's), where non-antialiased bicubic uses -0.75
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    return torch.where(x < 1.0, near, torch.where(x < 2.0, far, torch.zeros_like(x)))


def _lanczos(x: torch.Tensor) -> torch.Tensor:
    lobes = 3.0

    def sinc(t: torch.Tensor) -> torch.Tensor:
        zero = t == 0
        return torch.where(zero, torch.ones_like(t), torch.sin(math.pi * t) / torch.where(zero, 1.0, math.pi * t))

    return torch.where(x < lobes, sinc(x) * sinc(x / lobes), torch.zeros_like(x))


#: filter (of |x|) and its support in input pixels at scale 1, per anti-aliased resize
_FILTERS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
    "bilinear": (_bilinear, 2),
    "bicubic": (_bicubic, 4),
    "lanczos": (_lanczos, 6),
}


def _scale(size_in: int, size_out: int, align_corners: bool, scale: float | None) -> float:
    """ATen's `area_pixel_compute_scale`: input pixels per output pixel."""
    if align_corners:
        return (size_in - 1) / (size_out - 1) if size_out > 1 else 0.0
    if scale is not None and scale > 0:
        return 1.0 / scale
    return size_in / size_out


def _aa_weights(
    mode: str, size_in: int, size_out: int, align_corners: bool, scale: float | None, dtype: torch.dtype
) -> torch.Tensor:
    """The [size_out, size_in] matrix of the resize along one dim."""
    filter_fn, interp_size = _FILTERS[mode]
    ratio = _scale(size_in, size_out, align_corners, scale)
    support = interp_size * 0.5 * ratio if ratio >= 1.0 else interp_size * 0.5
    stretch = 1.0 / ratio if ratio >= 1.0 else 1.0
    center = (torch.arange(size_out, dtype=dtype) + 0.5) * ratio
    first = torch.clamp(torch.trunc(center - support + 0.5), min=0.0)
    stop = torch.clamp(torch.trunc(center + support + 0.5), max=float(size_in))
    source = torch.arange(size_in, dtype=dtype)
    weights = filter_fn(torch.abs((source[None, :] - center[:, None] + 0.5) * stretch))
    window = (source[None, :] >= first[:, None]) & (source[None, :] < stop[:, None])
    weights = torch.where(window, weights, torch.zeros_like(weights))
    total = weights.sum(1, keepdim=True)
    return torch.where(total != 0, weights / torch.where(total != 0, total, torch.ones_like(total)), weights)


def _resize_aa(mode: str) -> Callable[..., Any]:
    def resize(
        x: torch.Tensor,
        output_size: list[int],
        align_corners: bool,
        scales_h: float | None = None,
        scales_w: float | None = None,
    ) -> Any:
        if not all(isinstance(s, int) for s in (*x.shape[-2:], *output_size)):
            # the branches on the scale would fix them
            raise NotImplementedError("an anti-aliased resize decomposes with static image sizes only")
        if not x.is_floating_point():
            raise NotImplementedError(f"an anti-aliased resize of {x.dtype} rounds in fixed point: kept whole")
        (h, w), (out_h, out_w) = x.shape[-2:], output_size
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        rows = _aa_weights(mode, h, out_h, align_corners, scales_h, dtype)
        cols = _aa_weights(mode, w, out_w, align_corners, scales_w, dtype)
        out = torch.matmul(rows, torch.matmul(x.to(dtype), cols.t()))
        return out.to(x.dtype)

    resize.__name__ = f"upsample_{mode}2d_aa"
    return resize


# ----------------------------------------------------------------------------- the sign bit
# torch 2.13 decomposes aten.signbit, and copysign through it, into prims.signbit, whose fake value is float32
# where the op returns bool (a prim that lies about its result: the engine refuses it), and copysign into
# prims.abs too, which no backend here lowers. Written with aten ops instead: a float's sign bit is the sign of
# its bits read as the signed integer of its width, exact for -0.0 and for NaN's sign, which a comparison
# with 0 is not (tests/rules/test_signbit.py).

_SAME_WIDTH_INT = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def _signbit(x: torch.Tensor) -> torch.Tensor:
    if x.dtype in _SAME_WIDTH_INT:
        if x.dim() == 0:  # read through one element: iree-compile 3.13 crashes on a 0-d bitcast
            return _signbit(x.reshape(1)).reshape(())
        return x.view(_SAME_WIDTH_INT[x.dtype]) < 0
    if x.is_floating_point() or x.is_complex():
        raise NotImplementedError(f"the sign bit of {x.dtype}: kept whole")
    return x < 0  # integers (never for unsigned ones) and bool


def _copysign(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch's reference (`where(signbit(b), -abs(a), abs(a))`, integers promoted to float) in aten ops."""
    dtype = torch.result_type(a, b)
    dtype = dtype if dtype.is_floating_point else torch.get_default_dtype()
    magnitude = a.to(dtype).abs()
    return torch.where(_signbit(b.to(dtype)), -magnitude, magnitude)


def _isfinite(x: torch.Tensor) -> torch.Tensor:
    """`|x| < inf`: False for NaN as for the infinities. ATen's composite kernel is `(x == x) * (|x| != inf)`,
    and IREE 3.13 folds `x == x` to True: NaN came out finite (issue 27)."""
    if x.is_complex():
        raise NotImplementedError(f"isfinite of {x.dtype}: kept whole")
    if not x.is_floating_point():
        return torch.ones_like(x, dtype=torch.bool)  # integers and bool are always finite
    return x.abs() < math.inf


# ----------------------------------------------------------------------------- attention with its logsumexp
# torch.compile's training forward calls attention through the CPU flash kernel and saves its logsumexp for the
# kernel's backward (which runs on torch eager). torch 2.13's decomposition of the kernel returns the attention
# weights [N, H, L, S] where the kernel returns the logsumexp [N, H, L]: a backward given those reads garbage.


def flash_attention_for_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`aten._scaled_dot_product_flash_attention_for_cpu` written out: (attention, logsumexp of the scaled, masked
    scores over the keys), as the kernel returns them; a row that masks every key gives 0 for both, as the kernel
    does. Not for dropout, grouped-query heads, or is_causal with more keys than queries (the kernel aligns its
    causal mask to the last key)."""
    if dropout_p != 0.0:
        raise NotImplementedError("flash attention with dropout draws random numbers: kept whole")
    if query.shape[1] != key.shape[1]:
        raise NotImplementedError("flash attention with grouped-query heads: kept whole")
    if is_causal and query.shape[-2] != key.shape[-2]:
        raise NotImplementedError("causal flash attention with a different number of queries and keys: kept whole")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        rows = torch.arange(query.shape[-2], device=query.device)
        cols = torch.arange(key.shape[-2], device=query.device)
        scores = scores.masked_fill(rows.unsqueeze(-1) < cols, -math.inf)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(attn_mask.logical_not(), -math.inf)
    elif attn_mask is not None:
        scores = scores + attn_mask
    top = scores.amax(-1, keepdim=True)
    has_key = top > -math.inf
    top = torch.where(has_key, top, torch.zeros_like(top))
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    out = torch.matmul(weights, value) / total
    out = torch.where(has_key, out, torch.zeros_like(out))
    logsumexp = torch.where(has_key, torch.log(total) + top, torch.zeros_like(top)).squeeze(-1)
    # laid out as the kernel lays them out (the output as empty_like(query), the logsumexp as [N, L, H]
    # transposed): the graph around the kernel views them in that layout (transpose(1, 2).view(N, L, H * E))
    order = sorted(range(query.dim()), key=lambda d: -query.stride(d))
    out = out.permute(order).contiguous().permute([order.index(d) for d in range(query.dim())])
    return out, logsumexp.transpose(1, 2).contiguous().transpose(1, 2)


#: ops whose decomposition in torch yields prims that lie about their result or that nothing lowers, or that
#: a backend folds wrong (isfinite's `x == x`)
OVERRIDES: dict[OpOverload, Callable[..., Any]] = {
    aten.signbit.default: _signbit,
    aten.copysign.Tensor: _copysign,
    aten.isfinite.default: _isfinite,
}


#: decompositions torch 2.13 does not have, by op
MISSING: dict[OpOverload, Callable[..., Any]] = {
    aten._upsample_bilinear2d_aa.default: _resize_aa("bilinear"),
    aten._upsample_bicubic2d_aa.default: _resize_aa("bicubic"),
    aten._upsample_lanczos2d_aa.default: _resize_aa("lanczos"),
}


def decomposition(op: Any) -> Callable[..., Any] | None:
    """`op`'s decomposition: `OVERRIDES`, torch's table, then `MISSING`, then its CompositeImplicitAutograd
    kernel."""
    if not isinstance(op, OpOverload):
        return None
    if op in OVERRIDES:
        return OVERRIDES[op]
    if op in torch._decomp.decomposition_table:
        return torch._decomp.decomposition_table[op]
    if op in MISSING:
        return MISSING[op]
    try:
        composite = op.has_kernel_for_dispatch_key(DispatchKey.CompositeImplicitAutograd)
    except RuntimeError:  # an op make_fx records but the dispatcher does not register (aten.size.default)
        return None
    return op.decompose if composite else None
