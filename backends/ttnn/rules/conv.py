"""Reductions, convolution and pooling -> ttnn (ttnn's NHWC and flattened [1, 1, N*H*W, C] forms)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.ttnn.rules import ops, ops_extra
from fx_rewrites.backends.ttnn.rules.boundary import device_value
from fx_rewrites.backends.ttnn.rules.checks import Bound, bind, lowering, pair, static, tensors_ok
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

# -- reductions ----------------------------------------------------------------------------------------------

REDUCTIONS = {
    aten.sum.dim_IntList: ops.reduce_sum,
    aten.mean.dim: ops.reduce_mean,
    aten.amax.default: ops.reduce_max,
    aten.amin.default: ops_extra.reduce_min,
}


def _reduce_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if args.get("dtype") is not None:
        return Miss("a reduction with a dtype change")
    if not args.get("dim"):
        return Miss("a reduction over every dimension (dim empty)")
    return tensors_ok("self")(node, args)


@lowering("ttnn_reduce", REDUCTIONS, _reduce_when, "sum/mean/amax over dims -> ttnn.sum/mean/max(x, dim, keepdim).")
def lower_reduce(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    dims = [int(d) for d in args["dim"]]
    return rw.call(REDUCTIONS[node.target], device_value(rw, args["self"]), dims, bool(args.get("keepdim", False)))


def _all_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    dims = args.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return Miss("all() over every dimension (a 0-d result); the lowering takes all(x, dim)")
    return tensors_ok(masks=("self",), result=(torch.bool,))(node, args)


@lowering(
    "ttnn_all",
    [aten.all.dim, aten.all.dims, aten.all.default],
    _all_when,
    "all(x, dim) of a bool or float tensor -> ttnn.min(ttnn.ne(x, 0), dim) (1.0 / 0.0, read back as bool).",
)
def lower_all(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    dims = args["dim"]
    dims = [int(d) for d in dims] if isinstance(dims, (list, tuple)) else [int(dims)]
    nonzero = rw.call(ops.OPS["ne_scalar"], device_value(rw, args["self"]), 0.0)
    return rw.call(ops_extra.reduce_min, nonzero, dims, bool(args.get("keepdim", False)))


def _global_pool_when(node: Node) -> Any:
    if list(node.args[1]) != [1, 1]:
        return Miss(f"output_size {list(node.args[1])}: only global pooling (1, 1) maps to a ttnn mean")
    return tensors_ok("self")(node)


@lowering(
    "ttnn_global_avg_pool",
    [aten.adaptive_avg_pool2d.default],
    _global_pool_when,
    "adaptive_avg_pool2d(x, 1) -> ttnn.mean(x, [-2, -1], keepdim=True).",
)
def lower_global_avg_pool(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops.reduce_mean, device_value(rw, args["self"]), [-2, -1], True)


# -- convolution, pooling ------------------------------------------------------------------------------------


def _conv_when(node: Node) -> Any:
    bound = bind(node)
    if bound.get("transposed"):
        return Miss("a transposed convolution; the lowering maps conv2d only")
    if any(int(p) for p in bound.get("output_padding", []) or []):
        return Miss("output_padding is set")
    val = fake_value(node.args[0])
    if isinstance(val, torch.Tensor) and val.dim() != 4:
        return Miss(f"a {val.dim()}-D input; ttnn.conv2d takes batched 2-D images (NCHW -> NHWC)")
    return tensors_ok("input", "weight", "bias", static=True)(node, bound)


@lowering(
    "ttnn_conv2d",
    [aten.conv2d.default, aten.convolution.default],
    _conv_when,
    "conv2d (NCHW) -> permute to NHWC, ttnn.conv2d (host row-major weights), reshape and permute back.",
)
def lower_conv2d(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    n, c, h, w = static(args["input"].meta["val"])
    out_c, _, kh, kw = static(args["weight"].meta["val"])
    _, _, oh, ow = static(node.meta["val"])
    x = rw.call(ops.permute, device_value(rw, args["input"]), [0, 2, 3, 1])
    weight = device_value(rw, args["weight"], layout=ops.ROW_MAJOR, to_device=False)
    bias = args.get("bias")
    b = device_value(rw, bias, layout=ops.ROW_MAJOR, to_device=False) if isinstance(bias, Node) else None
    stride, dilation = pair(args.get("stride", 1)), pair(args.get("dilation", 1))
    padding = pair(args.get("padding", 0))
    y = rw.call(
        ops.conv2d, x, weight, b, c, out_c, n, h, w, [kh, kw], stride, padding, dilation, int(args.get("groups", 1))
    )
    return rw.call(ops.permute, rw.call(ops.reshape, y, [n, oh, ow, out_c]), [0, 3, 1, 2])


def _conv1d_when(node: Node) -> Any:
    val = fake_value(node.args[0])
    if isinstance(val, torch.Tensor) and val.dim() != 3:
        return Miss(f"a {val.dim()}-D input; the lowering takes batched [N, C, L] signals")
    return tensors_ok("input", "weight", "bias", static=True)(node)


@lowering(
    "ttnn_conv1d",
    [aten.conv1d.default],
    _conv1d_when,
    "conv1d [N, C, L] -> ttnn.conv2d on [N, 1, L, C] with a [1, K] kernel (weights reshaped on the host), and back.",
)
def lower_conv1d(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    n, c, length = static(args["input"].meta["val"])
    out_c, c_group, k = static(args["weight"].meta["val"])
    out_len = static(node.meta["val"])[2]
    x = rw.call(ops.permute, device_value(rw, args["input"]), [0, 2, 1])
    x = rw.call(ops.reshape, x, [n, 1, length, c])
    weight = device_value(rw, args["weight"], layout=ops.ROW_MAJOR, to_device=False)
    weight = rw.call(ops.reshape, weight, [out_c, c_group, 1, k])
    bias = args.get("bias")
    b = device_value(rw, bias, layout=ops.ROW_MAJOR, to_device=False) if isinstance(bias, Node) else None
    stride, padding, dilation = (
        int(pair(args.get(key, d))[0]) for key, d in (("stride", 1), ("padding", 0), ("dilation", 1))
    )
    y = rw.call(
        ops.conv2d,
        x,
        weight,
        b,
        c,
        out_c,
        n,
        1,
        length,
        [1, k],
        [1, stride],
        [0, padding],
        [1, dilation],
        int(args.get("groups", 1)),
    )
    return rw.call(ops.permute, rw.call(ops.reshape, y, [n, out_len, out_c]), [0, 2, 1])


def conv_problem(node: Node) -> str | None:
    """Why the ttnn lowering keeps convolution `node` on the host, or None when it lowers it."""
    when = _conv1d_when if node.target is aten.conv1d.default else _conv_when
    found = when(node)
    return found.reason if isinstance(found, Miss) else None


def _pool_when(node: Node) -> Any:
    val = fake_value(node.args[0])
    if isinstance(val, torch.Tensor) and val.dim() != 4:
        return Miss(f"a {val.dim()}-D input; ttnn.max_pool2d takes batched 2-D images")
    return tensors_ok("self", static=True)(node)


@lowering(
    "ttnn_max_pool2d",
    [aten.max_pool2d.default],
    _pool_when,
    "max_pool2d (NCHW) -> [1, 1, N*H*W, C] row-major, ttnn.max_pool2d, back to NCHW tiles.",
)
def lower_max_pool2d(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    n, c, h, w = static(args["self"].meta["val"])
    _, _, oh, ow = static(node.meta["val"])
    kernel = pair(args["kernel_size"])
    stride = pair(args.get("stride") or kernel)
    padding, dilation = pair(args.get("padding", 0)), pair(args.get("dilation", 1))
    x = rw.call(ops.permute, device_value(rw, args["self"]), [0, 2, 3, 1])
    x = rw.call(ops.to_layout, rw.call(ops.reshape, x, [1, 1, n * h * w, c]), ops.ROW_MAJOR)
    y = rw.call(ops.max_pool2d, x, n, h, w, c, kernel, stride, padding, dilation, bool(args.get("ceil_mode", False)))
    y = rw.call(ops.reshape, rw.call(ops.to_layout, y, ops.TILE), [n, oh, ow, c])
    return rw.call(ops.permute, y, [0, 3, 1, 2])


def _avg_pool_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    val = fake_value(args["self"])
    if isinstance(val, torch.Tensor) and val.dim() != 4:
        return Miss(f"a {val.dim()}-D input; ttnn.avg_pool2d takes batched 2-D images")
    return tensors_ok("self", static=True)(node, args)


@lowering(
    "ttnn_avg_pool2d",
    [aten.avg_pool2d.default],
    _avg_pool_when,
    "avg_pool2d (NCHW) -> [1, 1, N*H*W, C] row-major, ttnn.avg_pool2d, back to NCHW tiles.",
)
def lower_avg_pool2d(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    n, c, h, w = static(args["self"].meta["val"])
    _, _, oh, ow = static(node.meta["val"])
    kernel = pair(args["kernel_size"])
    stride, padding = pair(args.get("stride") or kernel), pair(args.get("padding", 0))
    divisor = args.get("divisor_override")
    x = rw.call(ops.permute, device_value(rw, args["self"]), [0, 2, 3, 1])
    x = rw.call(ops.to_layout, rw.call(ops.reshape, x, [1, 1, n * h * w, c]), ops.ROW_MAJOR)
    y = rw.call(
        ops.avg_pool2d,
        x,
        n,
        h,
        w,
        c,
        kernel,
        stride,
        padding,
        bool(args.get("ceil_mode", False)),
        bool(args.get("count_include_pad", True)),
        None if divisor is None else int(divisor),
    )
    y = rw.call(ops.reshape, rw.call(ops.to_layout, y, ops.TILE), [n, oh, ow, c])
    return rw.call(ops.permute, y, [0, 3, 1, 2])


def _cumsum_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if args.get("dtype") is not None:
        return Miss("a cumsum with a dtype change")
    return tensors_ok("self")(node, args)


@lowering("ttnn_cumsum", [aten.cumsum.default], _cumsum_when, "cumsum of a float tensor -> ttnn.cumsum(x, dim).")
def lower_cumsum(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops_extra.cumsum, device_value(rw, args["self"]), int(args["dim"]))


def _argmax_when(node: Node) -> Any:
    return Miss(
        f"{node.target._opname}: the index of the largest bfloat16-rounded value can differ from eager's when two "
        "values round together (an index is never off by a little); kept on the host"
    )


@lowering("ttnn_argmax", [aten.argmax.default, aten.argmin.default], _argmax_when, "argmax / argmin: declined.")
def lower_argmax(node: Node, rw: Rewriter) -> Node:
    """Never reached: `_argmax_when` always declines, so the coverage report says why they stay on the host."""
    raise AssertionError("ttnn_argmax never fires")


RULES = RuleSet(
    [
        lower_reduce,
        lower_all,
        lower_cumsum,
        lower_argmax,
        lower_global_avg_pool,
        lower_conv2d,
        lower_conv1d,
        lower_max_pool2d,
        lower_avg_pool2d,
    ],
    name="ttnn_conv",
)
