"""Guards against IREE 3.13's pooling: ceil mode with a one-wide or too wide window; one window over a longer map.

`avg_pool{1,2,3}d(..., ceil_mode=True)` (and `max_pool{1,2,3}d`) where some spatial dim has kernel 1
and stride 1 (Funnel's `F.avg_pool2d(x, (2, 1), stride=(2, 1),
ceil_mode=True)`), or a window wider than the (padded) input (transformers'
EfficientNet pooler, `nn.AvgPool2d(1280, ceil_mode=True)` on a 7x7 map),
fails in IREE: "'linalg.generic' op inferred input/output operand #2 has
shape's dimension #1 to be 10, but found 9", whatever the input's sizes.
The guard writes ceil mode out (a too wide window becomes the padded input's
width: torch gives one output over all of it): the input padded (the
pooling's own padding, and on the high side the extra that ceil mode reads
past the input), window sums (`divisor_override=1`, ceil_mode=False), divided
by the count torch divides by, which is the same pooling of ones padded the
same way (ones in the pooling's own padding when count_include_pad, zeros
elsewhere). Max pooling: the input padded with -inf, then ceil_mode=False.
docs/iree-3.13-findings.md section 8 has the measurements.

One window over a longer map: where a pooling's output along a dim is one
window (statically, or by its Dim range: `h//6` for h in [6, 11]) and the
(padded) input is longer than the window, IREE 3.13 fails to compile it
(static sizes) or, with Dim sizes and a user typed 1 (`F.max_pool2d(x, 6) * 2`),
rejects other sizes at run time or returns wrong values (with indices). The
guard slices the input to what that window reads, so the window covers it
exactly (docs/iree-3.13-findings.md section 8).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: the ops, with their number of spatial dims
_AVG_POOLS = {aten.avg_pool1d.default: 1, aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3}
#: max pooling without indices (with indices, the padded input would shift them)
_MAX_POOLS = {aten.max_pool1d.default: 1, aten.max_pool2d.default: 2, aten.max_pool3d.default: 3}
_POOLS = {**_AVG_POOLS, **_MAX_POOLS}
_MAX_POOLS_WITH_INDICES = {
    aten.max_pool1d_with_indices.default: 1,
    aten.max_pool2d_with_indices.default: 2,
    aten.max_pool3d_with_indices.default: 3,
}
#: every pooling op IREE's one-window guard looks at, with its number of spatial dims
POOLS_BY_RANK = {**_POOLS, **_MAX_POOLS_WITH_INDICES}


def per_dim(value: Any, n: int, default: list[int]) -> list[int]:
    """A pooling argument (int, or list of 1 or n) as n ints; `default` when empty."""
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        return list(default)
    if isinstance(value, int):
        return [value] * n
    values = list(value)
    return values * n if len(values) == 1 else values


def _ceil_extra(size: Any, kernel: int, stride: int, pad: int) -> int | None:
    """How far past the padded input ceil mode's last window reads (None: unknown here).

    With stride <= kernel - pad no window is dropped for starting in the high padding, so padding by
    stride - 1 gives ceil mode's output size for every size, symbolic too."""
    if not isinstance(size, int):
        return stride - 1 if stride <= kernel - pad else None
    out = -(-(size + 2 * pad - kernel) // stride) + 1
    if (out - 1) * stride >= size + pad:  # torch drops a last window that starts in the high padding
        out -= 1
    return max(0, (out - 1) * stride + kernel - (size + 2 * pad))


def _ceil_pool(node: Node, *, args: Mapping[str, Any]) -> dict[str, Any] | Miss:
    if not args.get("ceil_mode", False):
        return Miss("ceil_mode=False")
    n = _POOLS[node.target]
    kernel = per_dim(args["kernel_size"], n, [])
    stride = per_dim(args.get("stride"), n, kernel)
    pad = per_dim(args.get("padding", 0), n, [0] * n)
    dilation = per_dim(args.get("dilation", 1), n, [1] * n)
    span = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    sizes = args["self"].meta["val"].shape[-n:]
    # a window wider than the padded input: one output, over all of it (torch allows no second one)
    wide = [
        isinstance(size, int) and d == 1 and k > size + 2 * p for size, k, p, d in zip(sizes, kernel, pad, dilation)
    ]
    if not any(k == 1 and s == 1 for k, s in zip(kernel, stride)) and not any(wide):
        return Miss(
            "no spatial dim with kernel 1 and stride 1, nor a window wider than the input (IREE 3.13 pools those)"
        )
    kernel = [size + 2 * p if w else k for size, k, p, w in zip(sizes, kernel, pad, wide)]
    span = [size + 2 * p if w else k for size, k, p, w in zip(sizes, span, pad, wide)]
    extra = [_ceil_extra(size, k, s, p) for size, k, s, p in zip(sizes, span, stride, pad)]
    if None in extra:
        return Miss("a symbolic size with stride > kernel - padding: ceil mode's output size is not a fixed pad")
    return {**args, "n": n, "kernel": kernel, "stride": stride, "pad": pad, "dilation": dilation, "extra": extra}


def _pad(rw: Rewriter, x: Node, low: list[int], high: list[int], value: float) -> Node:
    """constant_pad_nd of the last len(low) dims (its pad list runs from the last dim backwards)."""
    if not any(low) and not any(high):
        return x
    pads = [amount for lo, hi in zip(reversed(low), reversed(high)) for amount in (lo, hi)]
    return rw.call(aten.constant_pad_nd.default, x, pads, value)


@rule(
    roots=tuple(_AVG_POOLS),
    when=_ceil_pool,
    tags={"iree", "guard", "pooling"},
    doc=(
        "avg_pool1d/2d/3d with ceil_mode=True and a spatial dim of kernel 1, stride 1 (Funnel's "
        "`F.avg_pool2d(x, (2, 1), stride=(2, 1), ceil_mode=True)`) or a window wider than the input (narrowed "
        "to the padded input): the input padded explicitly (its own "
        "padding, and what ceil mode reads past the end), window sums by the same pooling with ceil_mode=False "
        "and divisor_override=1, divided by torch's divisor (the pooling of ones padded alike; or "
        "divisor_override). IREE 3.13: \"'linalg.generic' op inferred input/output operand #2 has shape's "
        'dimension #1 to be 10, but found 9" for any size.'
    ),
)
def avg_pool_ceil_mode_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    x, n = found["self"], found["n"]
    kernel, stride, pad, extra = found["kernel"], found["stride"], found["pad"], found["extra"]
    high = [p + e for p, e in zip(pad, extra)]
    if n == 1:  # avg_pool1d has no divisor_override: pool as 2d over a unit dim (kernel 1 without ceil mode)
        x = rw.call(aten.unsqueeze.default, x, -2)
        kernel, stride = [1, *kernel], [1, *stride]
        pad, extra, high = [0, *pad], [0, *extra], [0, *high]
    op = aten.avg_pool2d.default if len(kernel) == 2 else aten.avg_pool3d.default

    def sums(t: Node, divisor: int) -> Node:
        return rw.call(op, t, kernel, stride, [0] * len(kernel), False, True, divisor)

    padded = _pad(rw, x, pad, high, 0.0)
    divisor = found.get("divisor_override")
    if divisor is not None:
        out = sums(padded, divisor)
    else:
        # ones of the spatial sizes only (the count broadcasts over batch and channels)
        lead = x.meta["val"].dim() - len(kernel)
        ones_like = x
        for dim in range(lead):
            ones_like = rw.call(aten.slice.Tensor, ones_like, dim, 0, 1)
        ones = rw.call(aten.ones_like.default, ones_like)
        cip = found.get("count_include_pad", True)
        ones = _pad(rw, ones, pad, pad, 1.0 if cip else 0.0)
        ones = _pad(rw, ones, [0] * len(kernel), extra, 0.0)
        count = sums(ones, 1)
        out = rw.call(aten.div.Tensor, sums(padded, 1), count)
    if n == 1:
        out = rw.call(aten.squeeze.dim, out, -2)
    rw.replace(node, out)


def _lowest(dtype: torch.dtype) -> float | int:
    return float("-inf") if dtype.is_floating_point else torch.iinfo(dtype).min


@rule(
    roots=tuple(_MAX_POOLS),
    when=_ceil_pool,
    tags={"iree", "guard", "pooling"},
    doc=(
        "max_pool1d/2d/3d (without indices) with ceil_mode=True and a spatial dim of kernel 1, stride 1 "
        '(Funnel\'s pooling in its "max" / "min" modes) or a window wider than the input: the input padded '
        "with -inf (the lowest integer) by its own padding and what ceil mode reads past the end, then the same "
        "pooling with padding 0 and ceil_mode=False. IREE 3.13 fails as avg_pool does: \"'linalg.generic' op "
        "inferred input/output operand #2 has shape's dimension #1 to be 10, but found 9\"."
    ),
)
def max_pool_ceil_mode_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    x, pad = found["self"], found["pad"]
    high = [p + e for p, e in zip(pad, found["extra"])]
    padded = _pad(rw, x, pad, high, _lowest(x.meta["val"].dtype))
    zeros = [0] * found["n"]
    rw.replace(node, rw.call(node.target, padded, found["kernel"], found["stride"], zeros, found["dilation"], False))


def known(condition: Any) -> bool:
    """True only when `condition` holds for every size the program's Dim ranges allow."""
    return bool(condition) if isinstance(condition, bool) else bool(statically_known_true(condition))


def _pool_args(node: Node) -> dict[str, Any]:
    """A pooling's arguments by name, with kernel, stride, padding, dilation and window span as n ints."""
    named = schema.arguments(node)
    n = POOLS_BY_RANK[node.target]
    kernel = per_dim(named["kernel_size"], n, [])
    stride = per_dim(named.get("stride"), n, kernel)
    pad = per_dim(named.get("padding", 0), n, [0] * n)
    dilation = per_dim(named.get("dilation", 1), n, [1] * n)
    span = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    return {**named, "n": n, "kernel": kernel, "stride": stride, "pad": pad, "dilation": dilation, "span": span}


def one_window_dims(node: Node) -> list[int]:
    """The spatial dims (0 = the first) along which pooling `node` is one window over a longer padded input,
    for every size the Dim ranges allow (`h//6` for h in [6, 11] is 1; an h of 6 exactly is no such dim, nor
    a window wider than the input, which ceil mode allows: the ceil-mode guards take those)."""
    val, x = node.meta.get("val"), node.args[0]
    out = val[0] if isinstance(val, (tuple, list)) else val
    if not isinstance(out, torch.Tensor) or not isinstance(x, Node) or "val" not in x.meta:
        return []
    found = _pool_args(node)
    n, pad, span = found["n"], found["pad"], found["span"]
    sizes = x.meta["val"].shape[-n:]
    padded = [size + 2 * p for size, p in zip(sizes, pad)]
    return [
        d
        for d in range(n)
        if known(out.shape[d - n] == 1) and known(padded[d] >= span[d]) and not known(padded[d] == span[d])
    ]


def _single_window(node: Node) -> dict[str, Any] | Miss:
    dims = one_window_dims(node)
    if not dims:
        return Miss("no spatial dim whose output is one window over a longer input (IREE 3.13 pools those)")
    found = _pool_args(node)
    pad = found["pad"]
    found["rescale"] = 1.0
    count_pad = found.get("count_include_pad", True) or found.get("divisor_override") is not None
    if node.target in _AVG_POOLS and not count_pad and any(pad[d] for d in dims):
        # torch divides by the real positions the window reads there, span - pad when the input is that long
        sizes = found["self"].meta["val"].shape[-found["n"] :]
        if not all(known(sizes[d] >= found["span"][d] - pad[d]) for d in dims):
            return Miss(
                "padding on a one-window dim with count_include_pad=False, and an input shorter than the window "
                "for some sizes: the divisor varies with the size"
            )
        for d in dims:
            found["rescale"] *= found["span"][d] / (found["span"][d] - pad[d])
    return {**found, "dims": dims}


def times(rw: Rewriter, a: Any, b: Any) -> Any:
    """a * b: an int where both are, else an operator.mul node (a symbolic size)."""
    return a * b if isinstance(a, int) and isinstance(b, int) else rw.call(operator.mul, a, b)


def _reindex(rw: Rewriter, index: Node, cut: list[Any], full: list[Any], shift: list[int]) -> Node:
    """Flat indices over maps of sizes `cut` made flat indices over maps of sizes `full`: the same position
    less `shift` per dim (the explicit padding; a position in it, which only an all -inf window picks as its
    start, becomes the first real one, as torch's own pooling gives). Scalar overloads: a symbolic size in a
    Tensor slot does not import in IREE."""
    coords, rest = [], index
    for size in reversed(cut[1:]):
        coords.append(rw.call(aten.remainder.Scalar, rest, size))
        rest = rw.call(aten.div.Scalar_mode, rest, size, rounding_mode="floor")
    coords.append(rest)
    coords.reverse()
    coords = [
        c if not s else rw.call(aten.clamp_min.default, rw.call(aten.sub.Scalar, c, s), 0)
        for c, s in zip(coords, shift)
    ]
    flat, stride = None, 1
    for coord, size in zip(reversed(coords), reversed(full)):
        term = coord if isinstance(stride, int) and stride == 1 else rw.call(aten.mul.Scalar, coord, stride)
        flat = term if flat is None else rw.call(aten.add.Tensor, flat, term)
        stride = times(rw, stride, size)
    return flat


@rule(
    roots=tuple(POOLS_BY_RANK),
    when=_single_window,
    tags={"iree", "guard", "pooling"},
    doc=(
        "max_pool / avg_pool 1d-3d (with indices too) whose output along a spatial dim is one window "
        "(statically or by the Dim range: `F.max_pool2d(x, 6)` on h in [6, 11], output h//6 == 1) over a longer "
        "(padded) input: the input sliced to what that window reads (padding there made explicit: -inf for max, "
        "0 for avg, rescaled to torch's divisor without count_include_pad), pooled again, indices mapped back to "
        "the whole map. IREE 3.13: "
        "\"'linalg.generic' op inferred input/output operand #1 has shape's dimension #0 to be 7, but found 6\" "
        "with static sizes; with Dim sizes and a user typed 1 (`... * 2`) a run-time shape error, or wrong "
        "values and indices, for every map but the window's own size."
    ),
)
def pool_single_window_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    x, n, dims = found["self"], found["n"], found["dims"]
    lead = x.meta["val"].dim() - n
    pad, span = found["pad"], found["span"]
    # the pooling's own padding made explicit on those dims (so the window covers the cut input exactly);
    # the one window then reads the first `span` positions of the padded input
    explicit = [pad[d] if d in dims else 0 for d in range(n)]
    cut = _pad(rw, x, explicit, explicit, 0.0 if node.target in _AVG_POOLS else _lowest(x.meta["val"].dtype))
    for d in dims:
        cut = rw.call(aten.slice.Tensor, cut, lead + d, 0, span[d])
    named = {k: v for k, v in found.items() if k in schema.arg_names(node.target)}
    named.update(self=cut, kernel_size=found["kernel"], stride=found["stride"])
    named["padding"] = [0 if d in dims else p for d, p in enumerate(pad)]
    args, kwargs = schema.unbind(node.target, named, explicit=True)
    pooled = rw.call(node.target, *args, **kwargs)
    if found["rescale"] != 1.0:  # count_include_pad=False counts the explicit padding: torch's divisor is smaller
        pooled = rw.call(aten.mul.Tensor, pooled, found["rescale"])
    if node.target not in _MAX_POOLS_WITH_INDICES:
        rw.replace(node, pooled)
        return
    cut_sizes = [rw.size(cut, lead + d) if d not in dims else span[d] for d in range(n)]
    full_sizes = [rw.size(x, lead + d) for d in range(n)]
    index = _reindex(rw, rw.getitem(pooled, 1), cut_sizes, full_sizes, explicit)
    rw.replace(node, [rw.getitem(pooled, 0), index])


def _adaptive_values_only(node: Node, *, args: Mapping[str, Any]) -> dict[str, Any] | Miss:
    if all(isinstance(size, int) for size in args["self"].meta["val"].shape[-2:]):
        return Miss("static map sizes (IREE lowers it)")
    output_size = per_dim(args["output_size"], 2, [])
    if not all(isinstance(size, int) for size in output_size) or output_size == [1, 1]:
        return Miss(f"output size {output_size}: (1, 1) is torch's decomposition's (legalize.PARTIAL_FORMS)")
    if any(user.target is not operator.getitem or (user.args[1] != 0 and user.users) for user in node.users):
        return Miss("its indices are used (a separable max would name other positions than torch on ties)")
    return args


def window_bounds(rw: Rewriter, size: Any, out: int) -> list[tuple[Any, Any]]:
    """torch's adaptive windows over `size` positions: [floor(i * size / out), ceil((i + 1) * size / out))."""

    def floordiv(a: Any, b: int) -> Any:
        return a // b if isinstance(a, int) else rw.call(operator.floordiv, a, b)

    def plus(a: Any, b: int) -> Any:
        return a + b if isinstance(a, int) or b == 0 else rw.call(operator.add, a, b)

    return [
        (floordiv(times(rw, i, size), out), floordiv(plus(times(rw, i + 1, size), out - 1), out)) for i in range(out)
    ]


@rule(
    roots=(aten.adaptive_max_pool2d.default,),
    when=_adaptive_values_only,
    tags={"iree", "pooling"},
    doc=(
        "aten.adaptive_max_pool2d of a map with a Dim-sized height or width, its indices unused "
        "(`F.adaptive_max_pool2d(x, 2)`): the max over each of torch's adaptive row windows (a slice with "
        "symbolic bounds and amax), stacked, then the same over column windows (max is separable and exact). "
        "IREE 3.13 fails to compile it: \"failed to legalize operation 'torch.aten.max_pool2d'\"."
    ),
)
def adaptive_max_pool2d_values_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    x = found["self"]
    rank = x.meta["val"].dim()
    out_h, out_w = per_dim(found["output_size"], 2, [])
    rows = [
        rw.call(aten.amax.default, rw.call(aten.slice.Tensor, x, rank - 2, start, end), [rank - 2], True)
        for start, end in window_bounds(rw, rw.size(x, rank - 2), out_h)
    ]
    y = rw.call(aten.cat.default, rows, rank - 2) if len(rows) > 1 else rows[0]
    cols = [
        rw.call(aten.amax.default, rw.call(aten.slice.Tensor, y, rank - 1, start, end), [rank - 1], True)
        for start, end in window_bounds(rw, rw.size(x, rank - 1), out_w)
    ]
    y = rw.call(aten.cat.default, cols, rank - 1) if len(cols) > 1 else cols[0]
    for user in list(node.users):
        if user.args[1] == 0:
            rw.replace(user, y)
        else:
            rw.erase(user)  # the unused indices


RULES = RuleSet(
    [
        avg_pool_ceil_mode_for_iree,
        max_pool_ceil_mode_for_iree,
        pool_single_window_for_iree,
        adaptive_max_pool2d_values_for_iree,
    ],
    name="iree-pooling",
)
