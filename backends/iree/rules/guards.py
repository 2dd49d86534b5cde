"""Guards against IREE 3.13's silent wrong results (and the errors next to them).

Each rule rewrites a form IREE compiles but computes wrong (or rejects) into
one it computes right; docs/iree-3.13-findings.md lists what was measured.
Every guard's test asserts that IREE is wrong without the rule, so a test
fails when IREE fixes the bug and the guard can go.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import optimization_hint

from fx_rewrites import schema
from fx_rewrites.backends.iree.rules.activations import gelu_tanh_written_out_for_iree
from fx_rewrites.backends.iree.rules.compare_guards import (
    float_scalar_in_comparison_for_iree,
    float_self_equality_for_iree,
)
from fx_rewrites.backends.iree.rules.index_guards import int32_index_to_int64_for_iree, negative_put_index_for_iree
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: aten.slice's "to the end" as torch.export writes it
_TO_END = 9223372036854775807


def _pads(node: Node) -> tuple[Node, list[int]] | Miss:
    """(input, pads) of a constant or replicate pad with a negative amount."""
    named = schema.arguments(node)
    if named.get("mode", "constant") not in ("constant", "replicate"):
        return Miss(f"mode={named['mode']!r}: torch rejects negative pads there itself")
    pads = list(named["pad"])
    if not all(isinstance(p, int) for p in pads):
        return Miss("a symbolic pad amount")
    if not any(p < 0 for p in pads):
        return Miss("no negative pad")
    shape = named["self"].meta["val"].shape
    for i in range(len(pads) // 2):
        size = shape[len(shape) - 1 - i]
        # a symbolic size by its example value: slicing it empty would specialise it (the engine refuses)
        size = size if isinstance(size, int) else optimization_hint(size, fallback=-1)
        if size < 0 or size + min(pads[2 * i], 0) + min(pads[2 * i + 1], 0) <= 0:
            return Miss("a crop that leaves nothing of a dim (or of its example size)")
    return named["self"], pads


@rule(
    roots=(aten.constant_pad_nd.default, aten.pad.default),
    when=_pads,
    priority=10,  # before the legalize phase's decomposition of the same node
    tags={"iree", "guard"},
    doc=(
        "A constant or replicate pad with a negative amount (a crop: `F.pad(x, (0, 0, 1, -1))`, RWKV's time "
        "shift `nn.ZeroPad2d((0, 0, 1, -1))`) becomes aten.slice of the cropped sides, then the pad of the "
        "non-negative amounts. IREE 3.13 compiles a negative high pad and silently returns the input "
        "unshifted (wrong numbers, no error; replicate with Dim sizes: the wrong shape too); a negative "
        'low pad fails: "expected offsets to be non-negative, but got -1".'
    ),
)
def negative_pad_to_slice_for_iree(
    node: Node, rw: Rewriter, *, args: Mapping[str, Any], found: tuple[Node, list[int]]
) -> Any:
    x, pads = found
    rank = x.meta["val"].dim()
    for i in range(len(pads) // 2):
        before, after = pads[2 * i], pads[2 * i + 1]
        if before < 0 or after < 0:  # torch's slice takes a negative end from the size, symbolic or not
            start = -before if before < 0 else 0
            x = rw.call(aten.slice.Tensor, x, rank - 1 - i, start, after if after < 0 else _TO_END)
    kept = [max(p, 0) for p in pads]
    if any(kept):
        named = dict(args)
        named.update({"self": x, "pad": kept})
        call_args, kwargs = schema.unbind(node.target, named, explicit=False)
        try:
            x = rw.call(node.target, *call_args, **kwargs)
        except RuntimeError as e:  # replicate of a dim the crop emptied (sizes symbolic): torch refuses it
            return Miss(f"torch rejects the pad of the cropped tensor: {' '.join(str(e).split())[:120]}")
    rw.replace(node, x)
    return None


# -- several index tensors with symbolic sizes -------------------------------------------------


def _multi_index(node: Node) -> tuple[Node, int, list[Node]] | Miss:
    """(input, first indexed dim, the index tensors) of x[..., i0, i1, ...] with two or more adjacent
    integer index tensors of which one has a symbolic size, over indexed dims of static size."""
    named = schema.arguments(node)
    x, indices = named["self"], list(named["indices"])
    first = next((i for i, t in enumerate(indices) if t is not None), None)
    if first is None:
        return Miss("no index tensor")
    tensors = indices[first:]
    if len(tensors) < 2 or any(t is None for t in tensors):
        return Miss("fewer than two adjacent index tensors")
    vals = [t.meta.get("val") for t in tensors]
    if any(v is None or v.dtype not in (torch.int64, torch.int32) for v in vals):
        return Miss("a boolean (mask) or unknown index")
    if all(isinstance(s, int) for v in vals for s in v.shape):
        return Miss("every index has a static size (IREE gathers those right)")
    sizes = x.meta["val"].shape[first : first + len(tensors)]
    if not all(isinstance(s, int) for s in sizes):
        return Miss("an indexed dim has a symbolic size")
    return x, first, tensors


@rule(
    roots=(aten.index.Tensor,),
    when=_multi_index,
    priority=10,
    tags={"iree", "guard"},
    doc=(
        "x[i0, i1, i2, i3] with several broadcast index tensors whose sizes are symbolic (torchvision's "
        "roi_align bilinear gather through torch.compile: the number of boxes is data-dependent) becomes one "
        "gather: the indexed dims flattened and the indices combined into one linear index (negative ones "
        'wrapped first). IREE 3.13 rejects the original: "failed to legalize operation '
        "'torch.aten.index.Tensor_hacked_twin'\" (or an 'arith.cmpi' type error)."
    ),
)
def multi_index_to_flat_gather_for_iree(node: Node, rw: Rewriter, *, found: tuple[Node, int, list[Node]]) -> Any:
    x, first, tensors = found
    shape = x.meta["val"].shape
    sizes = [shape[first + i] for i in range(len(tensors))]
    linear = None
    for index, size in zip(tensors, sizes):
        wrapped = rw.call(aten.add.Tensor, index, size)
        index = rw.call(aten.where.self, rw.call(aten.lt.Scalar, index, 0), wrapped, index)
        linear = index if linear is None else rw.call(aten.add.Tensor, rw.call(aten.mul.Tensor, linear, size), index)
    flat_shape = [*(shape[:first] if first else []), -1, *shape[first + len(tensors) :]]
    if not all(isinstance(s, int) for s in flat_shape):
        return Miss("a dim outside the indexed ones has a symbolic size")
    flat = rw.call(aten.reshape.default, x, flat_shape)
    rw.replace(node, rw.call(aten.index.Tensor, flat, [None] * first + [linear]))
    return None


# -- variance of nothing ------------------------------------------------------------------------

#: var / std (and their _mean pairs) in every functional overload
_VARIANCES = tuple(
    getattr(packet, name)
    for packet in (aten.var, aten.std, aten.var_mean, aten.std_mean)
    for name in packet.overloads()
    if not getattr(packet, name)._schema.is_mutable
)


def _numel(value: Any) -> int | None:
    """The number of elements of a tensor value: 0 when a size is 0, None when a size is symbolic."""
    if not isinstance(value, torch.Tensor):
        return None
    if any(isinstance(s, int) and s == 0 for s in value.shape):
        return 0
    if not all(isinstance(s, int) for s in value.shape):
        return None
    return value.numel()


def empty_variance(node: Node) -> bool | Miss:
    """Whether `node` reduces an empty input (static sizes) to a non-empty result: every group it
    reduces is then empty, and torch gives NaN for each variance and mean."""
    named = schema.arguments(node)
    if _numel(named["self"].meta.get("val")) != 0:
        return Miss("the input is not statically empty")
    outputs = node.meta.get("val")
    outputs = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
    if any(_numel(v) in (None, 0) for v in outputs):
        return Miss("a result that is empty or has symbolic sizes")
    return True


@rule(
    roots=_VARIANCES,
    when=empty_variance,
    tags={"iree", "guard"},
    doc=(
        "aten.var / std / var_mean / std_mean of a statically empty input with a non-empty result (every "
        "group reduced is empty: torch gives NaN) becomes aten.full of NaN. IREE 3.13 compiles the "
        "reduction and returns a number where torch gives NaN (OpInfo var.unbiased, std.unbiased on a (0, 5) "
        "input): wrong numbers, no error."
    ),
)
def empty_variance_for_iree(node: Node, rw: Rewriter) -> Any:
    outputs = node.meta["val"]
    many = isinstance(outputs, (list, tuple))
    nans = [
        rw.call(aten.full.default, list(v.shape), float("nan"), dtype=v.dtype, device=v.device)
        for v in (outputs if many else (outputs,))
    ]
    rw.replace(node, nans if many else nans[0])


# -- products over an empty dim -----------------------------------------------------------------

#: sums of products: a size-0 dim of an operand that the result does not have is summed over
_CONTRACTIONS = tuple(
    getattr(packet, name)
    for packet in (aten.mm, aten.bmm, aten.mv, aten.dot, aten.vdot, aten.matmul, aten.linear, aten.einsum)
    + (aten.tensordot, aten.addmm, aten.addmv, aten.baddbmm, aten.addbmm)
    for name in packet.overloads()
    if not getattr(packet, name)._schema.is_mutable
)

#: operands added to the product (addmm's self, linear's bias), not multiplied into it. mm's, matmul's and
#: tensordot's self is multiplied, but it holds the summed dim, so it is empty whenever the rule applies
_ADDED = frozenset({"self", "bias"})


def _empty_operands(node: Node) -> list[Node] | Miss:
    """The operands of a contraction with a statically empty dim, when its result is not empty."""
    result = node.meta.get("val")
    if not isinstance(result, torch.Tensor) or _numel(result) == 0:
        return Miss("an empty result (IREE compiles those)")
    empty: list[Node] = []
    for name, value in schema.arguments(node).items():
        for operand in value if isinstance(value, (list, tuple)) else (value,):
            val = fake_value(operand)
            if not isinstance(val, torch.Tensor):
                continue
            if _numel(val) == 0:
                empty.append(operand)
            elif name not in _ADDED:
                # zeros times this operand's inf or NaN would be NaN where torch's empty sum is 0
                return Miss(f"a non-empty operand {name!r} in the product")
    return empty or Miss("no operand with a statically empty dim")


@rule(
    roots=_CONTRACTIONS,
    when=_empty_operands,
    tags={"iree", "guard"},
    doc=(
        "A matrix product (mm, bmm, mv, dot, matmul, linear, einsum, addmm, baddbmm, ...) that sums over a "
        "statically empty dim into a non-empty result has each empty operand replaced by zeros with that dim "
        "of size 1: the same op, whose sum is then one zero product, as the empty sum is. iree-compile 3.13 "
        "crashes on the empty contraction (OpInfo mm of (5, 0) by (0, 10): no diagnostic)."
    ),
)
def empty_contraction_for_iree(node: Node, rw: Rewriter, *, found: list[Node]) -> Any:
    zeros = {}
    for operand in dict.fromkeys(found):  # an operand read twice (einsum of e and e) gets one zeros
        val = operand.meta["val"]
        sizes = [1 if isinstance(s, int) and s == 0 else rw.size(operand, d) for d, s in enumerate(val.shape)]
        zeros[operand] = rw.call(aten.zeros.default, sizes, dtype=val.dtype, device=val.device)
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: zeros.get(n, n))
    rw.replace(node, rw.call(node.target, *args, **kwargs))


# -- instance_norm's running statistics ---------------------------------------------------------


def _instance_norm_with_stats(node: Node, *, args: Mapping[str, Any]) -> bool | Miss:
    if not args["use_input_stats"]:
        return Miss("use_input_stats=False: the running statistics are what it normalises by")
    if args["running_mean"] is None and args["running_var"] is None:
        return Miss("no running statistics")
    return True


@rule(
    roots=(aten.instance_norm.default,),
    when=_instance_norm_with_stats,
    priority=10,  # before the legalize phase's decomposition of the same node
    tags={"iree", "guard"},
    doc=(
        "aten.instance_norm with use_input_stats=True normalises by the input's own statistics: its "
        "running_mean / running_var only receive an update, which the exported graph does not keep (it "
        "returns the normalised tensor alone). They are dropped, so torch's decomposition of the op (which "
        "would write to them: the legalize phase declines it) applies. IREE 3.13 lowers the op itself "
        "wrong with dynamic sizes (OpInfo nn.functional.instance_norm exported with Dim.AUTO: max abs diff "
        "11), no error."
    ),
)
def instance_norm_input_stats_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    named = dict(args)
    named.update(running_mean=None, running_var=None)
    call_args, kwargs = schema.unbind(node.target, named, explicit=False)
    rw.replace(node, rw.call(node.target, *call_args, **kwargs))


# -- ones / zeros of symbolic sizes -----------------------------------------------------------

#: the filled-tensor factories IREE 3.13 gets wrong with symbolic sizes -> their fill value
_FILLED = {
    aten.ones.default: 1,
    aten.zeros.default: 0,
    aten.new_ones.default: 1,
    aten.new_zeros.default: 0,
}


def _symbolic_size(node: Node, *, args: Mapping[str, Any]) -> bool | Miss:
    if all(isinstance(s, int) for s in args["size"]):
        return Miss("static sizes (IREE fills those right)")
    return True


@rule(
    roots=tuple(_FILLED),
    when=_symbolic_size,
    tags={"iree", "guard"},
    doc=(
        "aten.ones / zeros / new_ones / new_zeros with a symbolic size become aten.full of 1 or 0 (same "
        "sizes, dtype, device). IREE 3.13 reduces such a tensor as if each dynamic dim had size 1: "
        "`torch.ones(x.shape[0]).sum()` gives 1 for 5, `(torch.zeros(n) + 1).sum()` too (masked.mean's "
        "element count with Dim sizes: a mean twice too large), no error; aten.full of the same sizes "
        "reduces right."
    ),
)
def filled_tensor_to_full_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    val = node.meta["val"]
    options = {"dtype": val.dtype, "layout": val.layout, "device": val.device}
    if args.get("pin_memory") is not None:
        options["pin_memory"] = args["pin_memory"]
    rw.replace(node, rw.call(aten.full.default, list(args["size"]), _FILLED[node.target], **options))


#: in-place fills as the in-place pack functionalizes them (`t.fill_(v)`, `t.zero_()`) -> their fill value
_FILLS = {aten.fill.Scalar: None, aten.zero.default: 0}


def _fill_fits(node: Node) -> bool | Miss:
    value = _FILLS[node.target] if node.target is aten.zero.default else node.args[1]
    dtype = node.meta["val"].dtype
    if dtype.is_floating_point or dtype.is_complex or isinstance(value, bool if dtype is torch.bool else int):
        return True
    return Miss(f"a fill of {value!r} into {dtype} (aten.full would not cast it as fill does)")


@rule(
    roots=tuple(_FILLS),
    when=_fill_fits,
    tags={"iree", "guard"},
    doc=(
        "aten.fill.Scalar(t, v) and aten.zero(t) (what `t.fill_(v)` / `t.zero_()` become) turn into aten.full "
        "of t's sizes, dtype and device. With static sizes IREE 3.13 reduces their result wrong: "
        "`fill(x, 3.0).sum()` over 144 elements gives 27, not 432, and `f - f.sum(3, keepdim=True) / 8` is "
        "off by 1.9, no error (found by the fuzz step view_write; right with Dim sizes); aten.full of the "
        "same sizes is right in both."
    ),
)
def fill_to_full_for_iree(node: Node, rw: Rewriter) -> Any:
    value = _FILLS[node.target] if node.target is aten.zero.default else node.args[1]
    val, filled = node.meta["val"], node.args[0]
    sizes = [rw.size(filled, d) for d in range(val.dim())]  # read from the input: it has the result's sizes
    rw.replace(node, rw.call(aten.full.default, sizes, value, dtype=val.dtype, device=val.device))


RULES = RuleSet(
    [
        filled_tensor_to_full_for_iree,
        fill_to_full_for_iree,
        negative_pad_to_slice_for_iree,
        int32_index_to_int64_for_iree,
        negative_put_index_for_iree,
        multi_index_to_flat_gather_for_iree,
        empty_variance_for_iree,
        empty_contraction_for_iree,
        instance_norm_input_stats_for_iree,
        float_scalar_in_comparison_for_iree,
        float_self_equality_for_iree,
        gelu_tanh_written_out_for_iree,
    ],
    name="iree-guards",
)
