"""Ops IREE 3.13 cannot lower and torch has no decomposition for, written out by hand.

Only where `torch._decomp` and the op's CompositeImplicitAutograd kernel
give nothing IREE can take (the legality-driven decomposition,
`kinds.legalize`, handles every other op): aten.histc (transformers' MoE
routing counts tokens per expert with it) and the real part of a DFT
(FNet mixes tokens with `torch.fft.fftn(x).real`; in `fft`) and irfft; and `split_with_sizes` in
the one form IREE fails on (symbolic sizes), as slices; and softmax /
log_softmax of a 0-d tensor, on which iree-compile never returns.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.iree.rules.fft import inverse_real_fft_to_matmul_for_iree, real_fft_to_matmul_for_iree
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


# -- histc -------------------------------------------------------------------------------


def _histc_args(node: Node, *, args: Mapping[str, Any]) -> tuple[Node, int, float, float] | Miss:
    x, bins = args["self"], args.get("bins", 100)
    lo, hi = args.get("min", 0), args.get("max", 0)
    if not all(isinstance(v, (int, float)) for v in (bins, lo, hi)):
        return Miss("symbolic bins or range")
    if not x.meta["val"].is_floating_point():
        return Miss("an integer input (torch's histc takes floating point only)")
    return x, int(bins), float(lo), float(hi)


@rule(
    roots=(aten.histc.default,),
    when=_histc_args,
    tags={"iree"},
    doc=(
        "torch.histc(x, bins, min, max) (transformers 5 MoE routing: tokens per expert) becomes the bin of "
        "each element, floor((x - min) * bins / (max - min)) as torch's CPU kernel computes it (the last "
        "edge in the last bin, values outside [min, max] and NaN dropped; min == max takes the data's "
        "range), compared with arange(bins) and summed. torch has no decomposition of histc; IREE 3.13: "
        "\"failed to legalize operation 'torch.operator' that was explicitly marked illegal\" (aten.histc)."
    ),
)
def histc_to_one_hot_sum_for_iree(node: Node, rw: Rewriter, *, found: tuple[Node, int, float, float]) -> Any:
    x, bins, lo, hi = found
    dtype = node.meta["val"].dtype
    flat = rw.call(aten.reshape.default, x, [-1])
    if lo == hi:  # the data's own range, widened by one on each side when it is a single value
        low, high = rw.call(aten.min.default, flat), rw.call(aten.max.default, flat)
        same = rw.call(aten.eq.Tensor, low, high)
        low = rw.call(aten.where.self, same, rw.call(aten.sub.Tensor, low, 1), low)
        high = rw.call(aten.where.self, same, rw.call(aten.add.Tensor, high, 1), high)
        width = rw.call(aten.sub.Tensor, high, low)
        offset = rw.call(aten.sub.Tensor, flat, low)
        inside = rw.call(
            aten.logical_and.default, rw.call(aten.ge.Tensor, flat, low), rw.call(aten.le.Tensor, flat, high)
        )
    else:
        width = hi - lo
        offset = rw.call(aten.sub.Tensor, flat, lo)
        inside = rw.call(aten.logical_and.default, rw.call(aten.ge.Scalar, flat, lo), rw.call(aten.le.Scalar, flat, hi))
    scaled = rw.call(aten.mul.Tensor, offset, bins)
    position = rw.call(aten.div.Tensor, scaled, width)
    index = rw.call(aten._to_copy.default, rw.call(aten.floor.default, position), dtype=torch.int64)
    index = rw.call(aten.clamp.default, index, 0, bins - 1)  # the last edge belongs to the last bin
    edges = rw.call(aten.arange.default, bins, dtype=torch.int64, device=x.meta["val"].device)
    hit = rw.call(aten.eq.Tensor, rw.call(aten.unsqueeze.default, index, -1), edges)
    hit = rw.call(aten.logical_and.default, hit, rw.call(aten.unsqueeze.default, inside, -1))
    counts = rw.call(aten.sum.dim_IntList, rw.call(aten._to_copy.default, hit, dtype=dtype), [0])
    rw.replace(node, counts)


# -- kthvalue ------------------------------------------------------------------------------


def _kthvalue_ok(node: Node) -> bool | Miss:
    return node.args[0].meta["val"].dim() > 0 or Miss("a 0-d input (its only value is the answer)")


@rule(
    roots=(aten.kthvalue.default,),
    when=_kthvalue_ok,
    tags={"iree"},
    doc=(
        "torch.kthvalue(x, k, dim) becomes the k smallest by aten.topk(largest=False), the last of them "
        "selected (values and indices; keepdim unsqueezes). torch has no decomposition of kthvalue, and IREE "
        "3.13's own lowering fails: \"'tm_tensor.topk' op region block must end with a linalg_ext.yield i1\"."
    ),
)
def kthvalue_to_topk_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x, k = args["self"], args["k"]
    dim, keepdim = args.get("dim", -1), args.get("keepdim", False)
    smallest = rw.call(aten.topk.default, x, k, dim, False, True)
    parts = []
    for i in (0, 1):
        part = rw.call(aten.select.int, rw.getitem(smallest, i), dim, k - 1)
        parts.append(rw.call(aten.unsqueeze.default, part, dim) if keepdim else part)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            rw.replace(user, parts[user.args[1]])
    return None


# -- logcumsumexp ---------------------------------------------------------------------------


def _logcumsumexp_ok(node: Node, args: Mapping[str, Any]) -> bool | Miss:
    x = args["self"].meta["val"]
    if x.dim() == 0:
        return Miss("a 0-d input")
    size = x.shape[args["dim"] % x.dim()]
    return isinstance(size, int) or Miss(f"the scanned dim has symbolic size {size}")


@rule(
    roots=(aten.logcumsumexp.default,),
    when=_logcumsumexp_ok,
    tags={"iree", "guard"},
    doc=(
        "torch.logcumsumexp(x, dim) becomes, for each position i, logsumexp over j <= i: x broadcast to "
        "[..., n, n], positions j > i set to -inf, log-sum-exp over the last dim less each row's max "
        "(stable). torch has no decomposition of it, and IREE 3.13's own lowering is wrong: inf where "
        "eager is finite, no error."
    ),
)
def logcumsumexp_to_masked_logsumexp_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x = args["self"]
    val = x.meta["val"]
    dim = args["dim"] % val.dim()
    n = val.shape[dim]
    last = rw.call(aten.transpose.int, x, dim, -1) if dim != val.dim() - 1 else x
    rows = rw.call(aten.unsqueeze.default, last, -2)  # [..., 1, n]: row i reads every j
    k = rw.call(aten.arange.default, n, dtype=torch.int64, device=val.device)
    keep = rw.call(aten.le.Tensor, rw.call(aten.unsqueeze.default, k, 0), rw.call(aten.unsqueeze.default, k, 1))
    floor = rw.call(aten.full.default, [], float("-inf"), dtype=val.dtype, device=val.device)
    masked = rw.call(aten.where.self, keep, rows, floor)  # [..., n, n]: j <= i kept
    # logsumexp written out (aten.logsumexp imports with a torch.constant.bool IREE 3.13 cannot legalize)
    top = rw.call(aten.amax.default, masked, [-1], True)  # row i's max over j <= i: finite, x_i is kept
    shifted = rw.call(aten.exp.default, rw.call(aten.sub.Tensor, masked, top))
    total = rw.call(aten.log.default, rw.call(aten.sum.dim_IntList, shifted, [-1], True))
    out = rw.call(aten.squeeze.dim, rw.call(aten.add.Tensor, total, top), -1)
    rw.replace(node, rw.call(aten.transpose.int, out, dim, -1) if dim != val.dim() - 1 else out)


# -- split_with_sizes of symbolic sizes ----------------------------------------------------------


def _symbolic_split(node: Node, args: Mapping[str, Any]) -> bool | Miss:
    if all(isinstance(s, int) for s in args["split_sizes"]):
        return Miss("static split sizes (IREE lowers those)")
    if any(u.target is not operator.getitem for u in node.users):
        return Miss("a piece list read other than by index")
    return True


@rule(
    roots=(aten.split_with_sizes.default,),
    when=_symbolic_split,
    tags={"iree"},
    doc=(
        "aten.split_with_sizes whose sizes are symbolic (`x.split([1, x.shape[2] - 1], 2)` with a Dim, a "
        "write through a split piece) becomes one aten.slice per piece, its bounds the running sums of the "
        "sizes. IREE 3.13 fails to compile it: \"failed to legalize operation 'torch.constant.int'\"."
    ),
)
def symbolic_split_to_slices_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x, dim = args["self"], args.get("dim", 0)
    pieces, start = [], 0
    for size in args["split_sizes"]:
        end = start + size if isinstance(start, int) and isinstance(size, int) else rw.call(operator.add, start, size)
        pieces.append(rw.call(aten.slice.Tensor, x, dim, start, end))
        start = end
    rw.replace(node, pieces)
    return None


# -- softmax of a 0-d tensor ---------------------------------------------------------------

_SOFTMAXES = (aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int)


def _zero_dim(node: Node) -> bool | Miss:
    x = fake_value(node.args[0])
    return True if x is not None and x.dim() == 0 else Miss("not a 0-d input")


@rule(
    roots=_SOFTMAXES,
    when=_zero_dim,
    tags={"iree", "lowering"},
    doc=(
        "softmax / log_softmax of a 0-d tensor runs on it reshaped to one element, then reshaped back: the "
        "same op, the same numbers. iree-compile 3.13 spins without end on the 0-d form (measured: no "
        "result after 10 minutes); on [1] it compiles in a second."
    ),
)
def zero_dim_softmax_as_one_element_for_iree(node: Node, rw: Rewriter) -> Any:
    one = rw.call(aten.reshape.default, node.args[0], [1])
    out = rw.call(node.target, one, 0, *node.args[2:], **node.kwargs)
    rw.replace(node, rw.call(aten.reshape.default, out, []))


RULES = RuleSet(
    [
        zero_dim_softmax_as_one_element_for_iree,
        histc_to_one_hot_sum_for_iree,
        symbolic_split_to_slices_for_iree,
        kthvalue_to_topk_for_iree,
        logcumsumexp_to_masked_logsumexp_for_iree,
        real_fft_to_matmul_for_iree,
        inverse_real_fft_to_matmul_for_iree,
    ],
    name="iree-lowerings",
)
