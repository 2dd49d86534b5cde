"""aten -> ttnn lowering rules.

Each rule replaces one aten node by the ttnn stand-ins (`ops`) that compute
it, its operands brought to the device and its result read back
(`boundary`). A rule declines with the reason when ttnn cannot take the
node: non-float tensors (ttnn computes in bfloat16 here), rank above 4,
symbolic sizes, a number where a tensor is expected, or arguments the ttnn
op lacks. The coverage report reads those reasons.

Pure data movement (view, permute, transpose, cat, clone) is lowered only
when an operand is already on the device: on host values it would only add
a bfloat16 round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import FunctionRule, rule
from fx_rewrites.rules.ttnn import ops
from fx_rewrites.rules.ttnn.boundary import device_value, on_device, to_host

aten = torch.ops.aten

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32)
MASK_DTYPES = (torch.bool, *FLOAT_DTYPES)
#: ttnn tensors here have rank 1 to 4 (4-D is the tile library's native form)
MAX_RANK = 4

# -- what ttnn can take ------------------------------------------------------------------------


def problem(arg: Any, what: str, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> str | None:
    """Why `arg` cannot be a ttnn tensor, or None."""
    val = arg.meta.get("val") if isinstance(arg, Node) else arg
    if not isinstance(val, torch.Tensor):
        return f"{what} is {type(val).__name__} {val!r}, not a tensor"
    if val.dtype not in dtypes:
        kinds = "float" if dtypes == FLOAT_DTYPES else "/".join(str(d).removeprefix("torch.") for d in dtypes)
        kinds = "bool or float" if dtypes == MASK_DTYPES else kinds
        return f"{what} is {str(val.dtype).removeprefix('torch.')}; the ttnn lowering takes {kinds} tensors"
    if not 1 <= val.dim() <= MAX_RANK:
        return f"{what} has rank {val.dim()}; ttnn tensors here have rank 1 to {MAX_RANK}"
    if any(isinstance(s, int) and s == 0 for s in val.shape):  # no guard on unbacked sizes
        return f"{what} is empty"
    return None


def static_problem(node: Node) -> str | None:
    """Why the node's shape cannot be written into a ttnn call as constants (reshape, conv2d, pooling)."""
    vals = [a.meta.get("val") for a in (node, *node.all_input_nodes)]
    sym = [tuple(v.shape) for v in vals if isinstance(v, torch.Tensor) and not all(isinstance(s, int) for s in v.shape)]
    return f"symbolic sizes {sym[0]}: this ttnn call takes its sizes as constants" if sym else None


def tensors_ok(
    *names: str,
    indices: Iterable[str] = (),
    static: bool = False,
    masks: Iterable[str] = (),
    result: tuple[torch.dtype, ...] = FLOAT_DTYPES,
) -> Callable[[Node], Any]:
    """A `when` predicate: the named arguments (float; `indices`: integer;
    `masks`: bool or float) and the node's result (`result` dtypes) can be
    ttnn tensors (`static`: of static shapes)."""
    index_names, mask_names = tuple(indices), tuple(masks)

    def when(node: Node) -> Any:
        bound = schema.bind(node.target, node.args, dict(node.kwargs))
        for name in names + index_names + mask_names:
            values = bound.get(name)
            dtypes = INDEX_DTYPES if name in index_names else MASK_DTYPES if name in mask_names else FLOAT_DTYPES
            for i, v in enumerate(values if isinstance(values, (list, tuple)) else [values]):
                if v is None:
                    continue
                why = problem(v, f"{name}[{i}]" if isinstance(values, (list, tuple)) else name, dtypes)
                if why:
                    return Miss(why)
        why = problem(node, "the result", result) or (static_problem(node) if static else None)
        return Miss(why) if why else True

    return when


def _lowering(name: str, roots: Iterable[Any], when: Callable[[Node], Any], doc: str) -> Callable:
    """Decorator: `build(node, rw, bound) -> device node | Miss` becomes a rule that
    replaces the node by `to_torch(build(...))`."""

    def wrap(build: Callable[[Node, Rewriter, dict[str, Any]], Any]) -> FunctionRule:
        def fn(node: Node, rw: Rewriter) -> Any:
            out = build(node, rw, schema.bind(node.target, node.args, dict(node.kwargs)))
            if isinstance(out, Miss):
                return out
            rw.replace(node, out if out.target is ops.to_torch else to_host(rw, out, node))
            return None

        for root in roots:
            if hasattr(when, "inner"):  # data movement: sink_data_movement may move it to the device too
                MOVEMENT[root] = (build, when.inner)
        return FunctionRule(fn=fn, ops=tuple(roots), name=name, when=when, doc=doc, tags=frozenset({"ttnn"}))

    return wrap


#: data-movement op -> (build, its check without the "an operand is on the device" condition)
MOVEMENT: dict[Any, tuple[Callable[..., Any], Callable[[Node], Any]]] = {}


def _static(val: Any) -> list[int]:
    return [int(s) for s in val.shape]


# -- elementwise -------------------------------------------------------------------------------

UNARY = {
    aten.relu.default: "relu",
    aten.silu.default: "silu",
    aten.sigmoid.default: "sigmoid",
    aten.tanh.default: "tanh",
    aten.exp.default: "exp",
    aten.log.default: "log",
    aten.sqrt.default: "sqrt",
    aten.rsqrt.default: "rsqrt",
    aten.neg.default: "neg",
    aten.abs.default: "abs",
    aten.reciprocal.default: "reciprocal",
    aten.erf.default: "erf",
    aten.sin.default: "sin",
    aten.cos.default: "cos",
    aten.gelu.default: "gelu",
}


def _unary_when(node: Node) -> Any:
    if node.target is aten.gelu.default and schema.bind(node.target, node.args, dict(node.kwargs)).get(
        "approximate", "none"
    ) not in ("none", None):
        return Miss("gelu(approximate='tanh'): the lowering maps only the exact (erf) gelu to ttnn.gelu")
    return tensors_ok("self")(node)


@_lowering("ttnn_unary", UNARY, _unary_when, "Elementwise unary aten ops -> ttnn.relu/gelu/silu/exp/... .")
def lower_unary(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    return rw.call(ops.OPS[UNARY[node.target]], device_value(rw, bound["self"]))


BINARY = {
    aten.add.Tensor: "add",
    aten.add.Scalar: "add",
    aten.sub.Tensor: "subtract",
    aten.sub.Scalar: "subtract",
    aten.mul.Tensor: "multiply",
    aten.mul.Scalar: "multiply",
    aten.div.Tensor: "divide",
    aten.div.Scalar: "divide",
    aten.maximum.default: "maximum",
    aten.minimum.default: "minimum",
}


def _binary_when(node: Node) -> Any:
    bound = schema.bind(node.target, node.args, dict(node.kwargs))
    if bound.get("alpha", 1) != 1:
        return Miss(f"alpha={bound['alpha']}: ttnn.add/subtract have no alpha")
    other = bound["other"]
    if isinstance(other, Node) and isinstance(other.meta.get("val"), torch.Tensor):
        return tensors_ok("self", "other")(node)
    if isinstance(other, Node):
        return Miss(f"other is a runtime {type(other.meta.get('val')).__name__} ({other.name}); ttnn takes constants")
    if not isinstance(other, (int, float)) or isinstance(other, bool):
        return Miss(f"other is {other!r}, not a number")
    return tensors_ok("self")(node)


@_lowering("ttnn_binary", BINARY, _binary_when, "Elementwise binary aten ops -> ttnn.add/subtract/multiply/...")
def lower_binary(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    name, other = BINARY[node.target], bound["other"]
    a = device_value(rw, bound["self"])
    if isinstance(other, Node):
        return rw.call(ops.OPS[name], a, device_value(rw, other))
    return rw.call(ops.OPS[f"{name}_scalar"], a, ops.bf16_finite(float(other)))


@_lowering(
    "ttnn_rsub", [aten.rsub.Scalar, aten.rsub.Tensor], _binary_when, "rsub(x, y) = y - x -> ttnn.subtract / neg + add."
)
def lower_rsub(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    x, other = device_value(rw, bound["self"]), bound["other"]
    if isinstance(other, Node):
        return rw.call(ops.OPS["subtract"], device_value(rw, other), x)
    return rw.call(ops.OPS["add_scalar"], rw.call(ops.OPS["neg"], x), ops.bf16_finite(float(other)))


def _pow_when(node: Node) -> Any:
    exponent = node.args[1]
    if isinstance(exponent, (Node, bool)):
        return Miss(f"the exponent is a runtime value ({exponent}); ttnn.pow takes a constant")
    return tensors_ok("self")(node)


@_lowering("ttnn_pow", [aten.pow.Tensor_Scalar], _pow_when, "aten.pow(x, constant) -> ttnn.pow.")
def lower_pow(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    return rw.call(ops.pow_scalar, device_value(rw, bound["self"]), float(bound["exponent"]))


# -- matmul, linear ----------------------------------------------------------------------------------


def _matmul_when(node: Node) -> Any:
    for arg in node.args[:2]:
        val = arg.meta.get("val") if isinstance(arg, Node) else None
        if isinstance(val, torch.Tensor) and val.dim() < 2:
            return Miss("a 1-D operand: ttnn.matmul takes matrices (rank >= 2)")
    return tensors_ok(*schema.arg_names(node.target)[:2])(node)


MATMULS = [aten.matmul.default, aten.mm.default, aten.bmm.default]


@_lowering("ttnn_matmul", MATMULS, _matmul_when, "matmul/mm/bmm -> ttnn.matmul.")
def lower_matmul(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    a, b = (bound[n] for n in schema.arg_names(node.target)[:2])
    return rw.call(ops.matmul, device_value(rw, a), device_value(rw, b))


def _linear_when(node: Node) -> Any:
    weight = node.args[1]
    if isinstance(weight, Node) and getattr(weight.meta.get("val"), "ndim", 2) != 2:
        return Miss("the weight is not 2-D")
    return tensors_ok("input", "weight", "bias")(node)


@_lowering(
    "ttnn_linear",
    [aten.linear.default],
    _linear_when,
    "aten.linear(x, W, b) -> ttnn.linear(x, W, bias=b, transpose_b=True) (W stays [out, in]).",
)
def lower_linear(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    bias = bound.get("bias")
    b = row_bias(rw, bias) if isinstance(bias, Node) else None
    return rw.call(ops.linear, device_value(rw, bound["input"]), device_value(rw, bound["weight"]), b, True)


def row_bias(rw: Rewriter, bias: Node) -> Node:
    """A linear bias as ttnn.linear's row vector `[1, N]` on the device (ttnn.linear's docs: most program
    configs take a `[1, N]` bias); reshaped once with the weights, since it is a constant."""
    width = int(bias.meta["val"].shape[-1])
    return rw.call(ops.reshape, device_value(rw, bias), [1, width])


def _addmm_when(node: Node) -> Any:
    bound = schema.bind(node.target, node.args, dict(node.kwargs))
    if bound.get("beta", 1) != 1 or bound.get("alpha", 1) != 1:
        return Miss("beta or alpha is not 1; ttnn.linear has neither")
    return tensors_ok("self", "mat1", "mat2")(node)


def _is_row(val: torch.Tensor) -> bool:
    """A bias ttnn.linear broadcasts over the output rows: `[N]` or `[1, N]` (static)."""
    return all(isinstance(s, int) for s in val.shape) and (val.dim() == 1 or (val.dim() == 2 and val.shape[0] == 1))


@_lowering("ttnn_addmm", [aten.addmm.default], _addmm_when, "aten.addmm(b, x, W) -> ttnn.linear(x, W, bias=b).")
def lower_addmm(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    x, w = device_value(rw, bound["mat1"]), device_value(rw, bound["mat2"])
    bias = bound["self"]
    if _is_row(bias.meta["val"]):
        return rw.call(ops.linear, x, w, row_bias(rw, bias), False)
    # a full [M, N] (or broadcast) addend: ttnn.linear's bias is a row vector, so matmul, then add
    return rw.call(ops.OPS["add"], rw.call(ops.matmul, x, w), device_value(rw, bias))


# -- softmax, layer_norm, embedding --------------------------------------------------------------------


def _softmax_when(node: Node) -> Any:
    bound = schema.bind(node.target, node.args, dict(node.kwargs))
    if bound.get("dtype") is not None or bound.get("half_to_float"):
        return Miss("softmax with a dtype change")
    return tensors_ok("self")(node)


@_lowering(
    "ttnn_softmax", [aten.softmax.int, aten._softmax.default], _softmax_when, "softmax -> ttnn.softmax(x, dim=d)."
)
def lower_softmax(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    return rw.call(ops.softmax, device_value(rw, bound["self"]), int(bound["dim"]))


def _layer_norm_when(node: Node) -> Any:
    bound = schema.bind(node.target, node.args, dict(node.kwargs))
    val = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
    shape = list(bound["normalized_shape"])
    if isinstance(val, torch.Tensor) and (len(shape) != 1 or shape[0] != val.shape[-1]):
        return Miss(f"normalized_shape {shape} is not the last dimension; ttnn.layer_norm normalises over it only")
    return tensors_ok("input", "weight", "bias")(node)


@_lowering(
    "ttnn_layer_norm",
    [aten.layer_norm.default],
    _layer_norm_when,
    "aten.layer_norm over the last dimension -> ttnn.layer_norm(x, epsilon=, weight=, bias=).",
)
def lower_layer_norm(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    w, b = (device_value(rw, bound[n]) if isinstance(bound.get(n), Node) else None for n in ("weight", "bias"))
    return rw.call(ops.layer_norm, device_value(rw, bound["input"]), w, b, float(bound.get("eps", 1e-5)))


def _embedding_when(node: Node) -> Any:
    indices = node.args[1]
    if isinstance(indices, Node) and getattr(indices.meta.get("val"), "ndim", 2) != 2:
        return Miss("indices are not [batch, sequence]; ttnn.embedding takes 2-D indices")
    return tensors_ok("weight", indices=("indices",))(node)


@_lowering(
    "ttnn_embedding",
    [aten.embedding.default],
    _embedding_when,
    "aten.embedding -> ttnn.embedding(uint32 row-major indices, row-major bfloat16 table, layout=TILE).",
)
def lower_embedding(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    indices = device_value(rw, bound["indices"], dtype="uint32", layout=ops.ROW_MAJOR)
    weight = device_value(rw, bound["weight"], layout=ops.ROW_MAJOR)
    return rw.call(ops.embedding, indices, weight)


# -- data movement -----------------------------------------------------------------------------------------


def _follows_device(*names: str, static: bool = False) -> Callable[[Node], Any]:
    check = tensors_ok(*names, static=static)

    def when(node: Node) -> Any:
        bound = schema.bind(node.target, node.args, dict(node.kwargs))
        args = [a for n in names for a in (bound[n] if isinstance(bound[n], (list, tuple)) else [bound[n]])]
        if not any(on_device(a) for a in args):
            return Miss("no operand is on the device and no device op reads it")
        return check(node)

    when.inner = check  # type: ignore[attr-defined]
    return when


RESHAPES = [
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.flatten.using_ints,
]


@_lowering("ttnn_reshape", RESHAPES, _follows_device("self", static=True), "view/reshape/... -> ttnn.reshape.")
def lower_reshape(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    return rw.call(ops.reshape, device_value(rw, bound["self"]), _static(node.meta["val"]))


@_lowering("ttnn_permute", [aten.permute.default], _follows_device("self"), "aten.permute -> ttnn.permute.")
def lower_permute(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    return rw.call(ops.permute, device_value(rw, bound["self"]), list(bound["dims"]))


@_lowering(
    "ttnn_transpose", [aten.transpose.int, aten.t.default], _follows_device("self"), "transpose / t -> ttnn.transpose."
)
def lower_transpose(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    d0, d1 = (bound["dim0"], bound["dim1"]) if node.target is aten.transpose.int else (0, 1)
    if node.target is aten.t.default and node.meta["val"].dim() < 2:
        return Miss("t() of a 1-D tensor is the identity")
    return rw.call(ops.transpose, device_value(rw, bound["self"]), int(d0), int(d1))


@_lowering("ttnn_concat", [aten.cat.default], _follows_device("tensors"), "aten.cat -> ttnn.concat(tensors, dim).")
def lower_concat(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    return rw.call(ops.concat, [device_value(rw, t) for t in bound["tensors"]], int(bound.get("dim", 0)))


def _clone_when(node: Node) -> Any:
    return True if on_device(node.args[0]) else Miss("its input is a host tensor")


@_lowering(
    "ttnn_clone",
    [aten.clone.default, aten.alias.default, aten.contiguous.default],
    _clone_when,
    "clone / alias / contiguous of a device value: the value itself.",
)
def lower_clone(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    return node.args[0]  # already to_torch(d): a fresh host tensor


# -- reductions ----------------------------------------------------------------------------------------------

REDUCTIONS = {aten.sum.dim_IntList: ops.reduce_sum, aten.mean.dim: ops.reduce_mean, aten.amax.default: ops.reduce_max}


def _reduce_when(node: Node) -> Any:
    bound = schema.bind(node.target, node.args, dict(node.kwargs))
    if bound.get("dtype") is not None:
        return Miss("a reduction with a dtype change")
    if not bound.get("dim"):
        return Miss("a reduction over every dimension (dim empty)")
    return tensors_ok("self")(node)


@_lowering("ttnn_reduce", REDUCTIONS, _reduce_when, "sum/mean/amax over dims -> ttnn.sum/mean/max(x, dim, keepdim).")
def lower_reduce(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    dims = [int(d) for d in bound["dim"]]
    return rw.call(REDUCTIONS[node.target], device_value(rw, bound["self"]), dims, bool(bound.get("keepdim", False)))


def _global_pool_when(node: Node) -> Any:
    if list(node.args[1]) != [1, 1]:
        return Miss(f"output_size {list(node.args[1])}: only global pooling (1, 1) maps to a ttnn mean")
    return tensors_ok("self")(node)


@_lowering(
    "ttnn_global_avg_pool",
    [aten.adaptive_avg_pool2d.default],
    _global_pool_when,
    "adaptive_avg_pool2d(x, 1) -> ttnn.mean(x, [-2, -1], keepdim=True).",
)
def lower_global_avg_pool(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    return rw.call(ops.reduce_mean, device_value(rw, bound["self"]), [-2, -1], True)


# -- convolution, pooling ------------------------------------------------------------------------------------


def _pair(value: Any) -> list[int]:
    items = [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return items * 2 if len(items) == 1 else items


def _conv_when(node: Node) -> Any:
    bound = schema.bind(node.target, node.args, dict(node.kwargs))
    if bound.get("transposed"):
        return Miss("a transposed convolution; the lowering maps conv2d only")
    if any(int(p) for p in bound.get("output_padding", []) or []):
        return Miss("output_padding is set")
    val = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
    if isinstance(val, torch.Tensor) and val.dim() != 4:
        return Miss(f"a {val.dim()}-D input; ttnn.conv2d takes batched 2-D images (NCHW -> NHWC)")
    return tensors_ok("input", "weight", "bias", static=True)(node)


@_lowering(
    "ttnn_conv2d",
    [aten.conv2d.default, aten.convolution.default],
    _conv_when,
    "conv2d (NCHW) -> permute to NHWC, ttnn.conv2d (host row-major weights), reshape and permute back.",
)
def lower_conv2d(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    n, c, h, w = _static(bound["input"].meta["val"])
    out_c, _, kh, kw = _static(bound["weight"].meta["val"])
    _, _, oh, ow = _static(node.meta["val"])
    x = rw.call(ops.permute, device_value(rw, bound["input"]), [0, 2, 3, 1])
    weight = device_value(rw, bound["weight"], layout=ops.ROW_MAJOR, to_device=False)
    bias = bound.get("bias")
    b = device_value(rw, bias, layout=ops.ROW_MAJOR, to_device=False) if isinstance(bias, Node) else None
    stride, dilation = _pair(bound.get("stride", 1)), _pair(bound.get("dilation", 1))
    padding = _pair(bound.get("padding", 0))
    y = rw.call(
        ops.conv2d, x, weight, b, c, out_c, n, h, w, [kh, kw], stride, padding, dilation, int(bound.get("groups", 1))
    )
    return rw.call(ops.permute, rw.call(ops.reshape, y, [n, oh, ow, out_c]), [0, 3, 1, 2])


def _conv1d_when(node: Node) -> Any:
    val = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
    if isinstance(val, torch.Tensor) and val.dim() != 3:
        return Miss(f"a {val.dim()}-D input; the lowering takes batched [N, C, L] signals")
    return tensors_ok("input", "weight", "bias", static=True)(node)


@_lowering(
    "ttnn_conv1d",
    [aten.conv1d.default],
    _conv1d_when,
    "conv1d [N, C, L] -> ttnn.conv2d on [N, 1, L, C] with a [1, K] kernel (weights reshaped on the host), and back.",
)
def lower_conv1d(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    n, c, length = _static(bound["input"].meta["val"])
    out_c, c_group, k = _static(bound["weight"].meta["val"])
    out_len = _static(node.meta["val"])[2]
    x = rw.call(ops.permute, device_value(rw, bound["input"]), [0, 2, 1])
    x = rw.call(ops.reshape, x, [n, 1, length, c])
    weight = device_value(rw, bound["weight"], layout=ops.ROW_MAJOR, to_device=False)
    weight = rw.call(ops.reshape, weight, [out_c, c_group, 1, k])
    bias = bound.get("bias")
    b = device_value(rw, bias, layout=ops.ROW_MAJOR, to_device=False) if isinstance(bias, Node) else None
    stride, padding, dilation = (
        int(_pair(bound.get(key, d))[0]) for key, d in (("stride", 1), ("padding", 0), ("dilation", 1))
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
        int(bound.get("groups", 1)),
    )
    return rw.call(ops.permute, rw.call(ops.reshape, y, [n, out_len, out_c]), [0, 2, 1])


def _pool_when(node: Node) -> Any:
    val = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
    if isinstance(val, torch.Tensor) and val.dim() != 4:
        return Miss(f"a {val.dim()}-D input; ttnn.max_pool2d takes batched 2-D images")
    return tensors_ok("self", static=True)(node)


@_lowering(
    "ttnn_max_pool2d",
    [aten.max_pool2d.default],
    _pool_when,
    "max_pool2d (NCHW) -> [1, 1, N*H*W, C] row-major, ttnn.max_pool2d, back to NCHW tiles.",
)
def lower_max_pool2d(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    n, c, h, w = _static(bound["self"].meta["val"])
    _, _, oh, ow = _static(node.meta["val"])
    kernel = _pair(bound["kernel_size"])
    stride = _pair(bound.get("stride") or kernel)
    padding, dilation = _pair(bound.get("padding", 0)), _pair(bound.get("dilation", 1))
    x = rw.call(ops.permute, device_value(rw, bound["self"]), [0, 2, 3, 1])
    x = rw.call(ops.to_layout, rw.call(ops.reshape, x, [1, 1, n * h * w, c]), ops.ROW_MAJOR)
    y = rw.call(ops.max_pool2d, x, n, h, w, c, kernel, stride, padding, dilation, bool(bound.get("ceil_mode", False)))
    y = rw.call(ops.reshape, rw.call(ops.to_layout, y, ops.TILE), [n, oh, ow, c])
    return rw.call(ops.permute, y, [0, 3, 1, 2])


# -- comparisons, where, activations with parameters -----------------------------------------------------

COMPARISONS = {
    getattr(getattr(aten, name), overload): name for name in ops.COMPARE for overload in ("Tensor", "Scalar")
}


def _compare_when(node: Node) -> Any:
    other = node.args[1]
    if isinstance(other, Node):
        return tensors_ok("self", "other", result=(torch.bool,))(node)
    if isinstance(other, bool) or not isinstance(other, (int, float)):
        return Miss(f"other is {other!r}, not a number")
    return tensors_ok("self", result=(torch.bool,))(node)


@_lowering(
    "ttnn_compare", COMPARISONS, _compare_when, "gt/lt/ge/le/eq/ne of floats -> ttnn.gt/... (1.0/0.0, read as bool)."
)
def lower_compare(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    name, other = COMPARISONS[node.target], bound["other"]
    a = device_value(rw, bound["self"])
    if isinstance(other, Node):
        return rw.call(ops.OPS[name], a, device_value(rw, other))
    return rw.call(ops.OPS[f"{name}_scalar"], a, ops.bf16_finite(float(other)))


@_lowering(
    "ttnn_where",
    [aten.where.self],
    tensors_ok("self", "other", masks=("condition",)),
    "aten.where(cond, x, y) -> ttnn.where (a bool condition goes in as bfloat16 1.0/0.0).",
)
def lower_where(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    cond, x, y = (device_value(rw, bound[n]) for n in ("condition", "self", "other"))
    return rw.call(ops.where, cond, x, y)


@_lowering("ttnn_leaky_relu", [aten.leaky_relu.default], tensors_ok("self"), "leaky_relu -> ttnn.leaky_relu.")
def lower_leaky_relu(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    return rw.call(ops.leaky_relu, device_value(rw, bound["self"]), float(bound.get("negative_slope", 0.01)))


def _clamp_when(node: Node) -> Any:
    bound = schema.bind(node.target, node.args, dict(node.kwargs))
    for key in ("min", "max", "min_val", "max_val"):
        if isinstance(bound.get(key), Node):
            return Miss(f"{key} is a graph value; ttnn.clamp takes constants")
    return tensors_ok("self")(node)


@_lowering(
    "ttnn_clamp",
    [aten.clamp.default, aten.hardtanh.default, aten.clamp_min.default, aten.clamp_max.default],
    _clamp_when,
    "clamp / hardtanh / clamp_min / clamp_max with constant bounds -> ttnn.clamp.",
)
def lower_clamp(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    lo = bound.get("min", bound.get("min_val", -1.0 if node.target is aten.hardtanh.default else None))
    hi = bound.get("max", bound.get("max_val", 1.0 if node.target is aten.hardtanh.default else None))
    lo, hi = (None if v is None else float(v) for v in (lo, hi))
    return rw.call(ops.clamp, device_value(rw, bound["self"]), lo, hi)


def _batch_norm_when(node: Node) -> Any:
    bound = schema.bind(node.target, node.args, dict(node.kwargs))
    if bound.get("training"):
        return Miss("training-mode batch norm (batch statistics)")
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() != 4:
        return Miss(f"a {val.dim()}-D input; ttnn.batch_norm takes [N, C, H, W]")
    if bound.get("running_mean") is None or bound.get("running_var") is None:
        return Miss("no running statistics")
    return tensors_ok("input", "weight", "bias", "running_mean", "running_var")(node)


@_lowering(
    "ttnn_batch_norm",
    [aten.batch_norm.default],
    _batch_norm_when,
    "eval-mode aten.batch_norm on NCHW -> ttnn.batch_norm(x, running_mean=, running_var=, weight=, bias=, eps=).",
)
def lower_batch_norm(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    mean, var = device_value(rw, bound["running_mean"]), device_value(rw, bound["running_var"])
    w, b = (device_value(rw, bound[n]) if isinstance(bound.get(n), Node) else None for n in ("weight", "bias"))
    return rw.call(ops.batch_norm, device_value(rw, bound["input"]), mean, var, w, b, float(bound.get("eps", 1e-5)))


def _sdpa_when(node: Node) -> Any:
    bound = schema.bind(node.target, node.args, dict(node.kwargs))
    if bound.get("dropout_p", 0.0) or bound.get("enable_gqa"):
        return Miss("dropout or grouped-query heads (enable_gqa)")
    mask = bound.get("attn_mask")
    if isinstance(mask, Node) and getattr(mask.meta.get("val"), "dtype", None) == torch.bool:
        return Miss("a bool attn_mask; ttnn takes an additive float mask")
    if mask is not None and bound.get("is_causal"):
        return Miss("both attn_mask and is_causal")
    for arg in ("query", "key", "value"):
        val = bound[arg].meta.get("val") if isinstance(bound[arg], Node) else None
        if isinstance(val, torch.Tensor) and val.dim() != 4:
            return Miss(f"{arg} has rank {val.dim()}; ttnn's attention takes [batch, heads, sequence, head_dim]")
    if isinstance(mask, Node) and _mask_shape(mask, bound["query"], bound["key"]) is None:
        return Miss("the attn_mask's shape is symbolic; ttnn takes it expanded to [b, heads, s_q, s_k] (constants)")
    return tensors_ok("query", "key", "value", "attn_mask")(node)


def _mask_shape(mask: Node, query: Node, key: Node) -> list[int] | None:
    """The shape ttnn's attention wants the mask in: `[b or 1, heads or 1, s_q, s_k]` (its docs: batch and
    heads may be 1), or None when a size is symbolic."""
    m, q, k = (n.meta["val"].shape for n in (mask, query, key))
    if not all(isinstance(s, int) for s in (*m, *q, *k)):
        return None
    m4 = [1] * (4 - len(m)) + [int(s) for s in m]
    return [1 if m4[0] == 1 else int(q[0]), 1 if m4[1] == 1 else int(q[1]), int(q[2]), int(k[2])]


def _attention_mask(rw: Rewriter, mask: Node, query: Node, key: Node) -> Node:
    """The additive mask as a device value of the shape `_mask_shape` gives (HF's `[b, 1, 1, s]` or a rank-2
    mask is reshaped to rank 4 and expanded over the query rows)."""
    want = _mask_shape(mask, query, key)
    assert want is not None  # _sdpa_when declined symbolic shapes
    shape = [int(s) for s in mask.meta["val"].shape]
    m = device_value(rw, mask)
    if len(shape) < 4:
        shape = [1] * (4 - len(shape)) + shape
        m = rw.call(ops.reshape, m, shape)
    return m if shape == want else rw.call(ops.expand, m, want)


@_lowering(
    "ttnn_sdpa",
    [aten.scaled_dot_product_attention.default],
    _sdpa_when,
    "F.scaled_dot_product_attention -> ttnn.transformer.scaled_dot_product_attention(q, k, v, attn_mask=, "
    "is_causal=, scale=).",
)
def lower_sdpa(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    q, k, v = (device_value(rw, bound[n]) for n in ("query", "key", "value"))
    mask = bound.get("attn_mask")
    m = _attention_mask(rw, mask, bound["query"], bound["key"]) if isinstance(mask, Node) else None
    scale = bound.get("scale")
    return rw.call(ops.sdpa, q, k, v, m, bool(bound.get("is_causal", False)), None if scale is None else float(scale))


# -- slices and casts (data movement) ------------------------------------------------------------------------


def _slice_bounds(node: Node, bound: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
    shape = _static(bound["self"].meta["val"])
    dim = int(bound.get("dim", 0)) % len(shape)
    start, end, step = bound.get("start"), bound.get("end"), int(bound.get("step", 1))
    size = shape[dim]
    start = 0 if start is None else int(start) + (size if int(start) < 0 else 0)
    end = size if end is None else min(int(end) + (size if int(end) < 0 else 0), size)
    starts, ends, steps = [0] * len(shape), list(shape), [1] * len(shape)
    starts[dim], ends[dim], steps[dim] = max(0, min(start, size)), max(0, end), step
    return starts, ends, steps


@_lowering("ttnn_slice", [aten.slice.Tensor], _follows_device("self", static=True), "aten.slice -> ttnn.slice.")
def lower_slice(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Any:
    for arg in ("start", "end"):
        if isinstance(bound.get(arg), Node):
            return Miss(f"{arg} is a graph value; ttnn.slice takes constants")
    return rw.call(ops.slice_, device_value(rw, bound["self"]), *_slice_bounds(node, bound))


@_lowering(
    "ttnn_expand", [aten.expand.default], _follows_device("self", static=True), "expand -> ttnn.expand (a copy)."
)
def lower_expand(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    return rw.call(ops.expand, device_value(rw, bound["self"]), _static(node.meta["val"]))


@_lowering(
    "ttnn_select", [aten.select.int], _follows_device("self", static=True), "select -> ttnn.slice + ttnn.reshape."
)
def lower_select(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    shape = _static(bound["self"].meta["val"])
    dim = int(bound["dim"]) % len(shape)
    index = int(bound["index"]) % shape[dim]
    starts, ends, steps = [0] * len(shape), list(shape), [1] * len(shape)
    starts[dim], ends[dim] = index, index + 1
    one = rw.call(ops.slice_, device_value(rw, bound["self"]), starts, ends, steps)
    return rw.call(ops.reshape, one, _static(node.meta["val"]))


@_lowering("ttnn_numpy_t", [aten.numpy_T.default], _follows_device("self"), "x.T -> ttnn.permute (dims reversed).")
def lower_numpy_t(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    rank = node.meta["val"].dim()
    return rw.call(ops.permute, device_value(rw, bound["self"]), list(range(rank - 1, -1, -1)))


def _pad_when(node: Node) -> Any:
    bound = schema.bind(node.target, node.args, dict(node.kwargs))
    if bound.get("mode", "constant") != "constant":
        return Miss(f"mode={bound['mode']!r}; ttnn.pad pads with a constant")
    if any(isinstance(p, Node) or int(p) < 0 for p in bound["pad"]):
        return Miss("negative or runtime padding")
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() == 4 and len(bound["pad"]) > 4:
        return Miss("padding a rank-4 tensor in 3 or more dimensions: ttnn.pad is used on rank <= 3 here")
    return tensors_ok("self", static=True)(node)


@_lowering(
    "ttnn_pad",
    [aten.pad.default, aten.constant_pad_nd.default],
    _pad_when,
    "constant F.pad -> ttnn.pad(x, padding=[(before, after) per dim], value=).",
)
def lower_pad(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    value, pad = bound.get("value"), [int(p) for p in bound["pad"]]
    return pad_tiles(rw, device_value(rw, bound["self"]), pad, float(value or 0.0))


def pad_tiles(rw: Rewriter, x: Node, pad: list[int], value: float) -> Node:
    """ttnn.pad of a TILE device value; `pad` in torch's order (last dimension first, before and after).

    Front padding goes through row-major: "on device tile padding does not support front padding" (ttnn.pad).
    A rank-4 value is padded as rank 3 (its two leading dimensions merged): ttnn 0.81.1's pad of a rank-4
    tensor grows only its padded shape, not its logical shape (tools/ttnn_check replays it on the host)."""
    shape = [int(s) for s in x.meta["val"].shape]
    if len(shape) == 4:
        merged = rw.call(ops.reshape, x, [shape[0] * shape[1], *shape[2:]])
        out = [s + pad[2 * i] + pad[2 * i + 1] if i < len(pad) // 2 else s for i, s in enumerate(reversed(shape))]
        return rw.call(ops.reshape, pad_tiles(rw, merged, pad, value), list(reversed(out)))
    if not any(pad[0::2]):
        return rw.call(ops.pad, x, pad, value)
    y = rw.call(ops.pad, rw.call(ops.to_layout, x, ops.ROW_MAJOR), pad, value)
    return rw.call(ops.to_layout, y, ops.TILE)


CASTS = [aten._to_copy.default, aten.to.dtype]


def _cast_check(node: Node) -> Any:
    bound = schema.bind(node.target, node.args, dict(node.kwargs))
    if bound.get("memory_format") not in (None, torch.preserve_format) or bound.get("device") is not None:
        return Miss("a copy that changes device or memory format")
    return tensors_ok(masks=("self",))(node)  # bool -> float too: a device mask is already 1.0 / 0.0


def _cast_when(node: Node) -> Any:
    return _cast_check(node) if on_device(node.args[0]) else Miss("its input is a host tensor")


_cast_when.inner = _cast_check  # type: ignore[attr-defined]


@_lowering("ttnn_cast", CASTS, _cast_when, "a float -> float cast of a device value: read back in the new dtype.")
def lower_cast(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    return device_value(rw, bound["self"])  # bfloat16 on the device whatever the host dtype


# -- moving data-movement ops onto the device when a device op reads them --------------------------------------


def _sink_when(node: Node) -> Any:
    source = node.args[0]
    if not isinstance(source, Node) or source.target not in MOVEMENT:
        return Miss("its input is not a data-movement op (view, permute, slice, cat, cast, ...)")
    if tuple(node.args[1:]) != ("bfloat16", ops.TILE, True):
        return Miss("not a bfloat16 tile tensor on the device")
    if len(source.users) != 1:
        return Miss(f"{source.name} is read on the host too")
    ok = MOVEMENT[source.target][1](source)
    return Miss(f"{source.name}: {ok.reason}") if isinstance(ok, Miss) else ok


@rule(roots=(ops.from_torch,), when=_sink_when, tags=("ttnn", "boundary"))
def sink_data_movement(node: Node, rw: Rewriter) -> Any:
    """from_torch(view(x)) -> ttnn.reshape(from_torch(x)), likewise permute, transpose, slice, cat and casts:
    data movement only a device op reads moves to the device, up the chain to where the data comes from."""
    source = node.args[0]
    out = MOVEMENT[source.target][0](source, rw, schema.bind(source.target, source.args, dict(source.kwargs)))
    if isinstance(out, Miss):
        return out
    rw.replace(node, out)
    return None


RULES = [
    lower_sdpa,
    lower_compare,
    lower_where,
    lower_leaky_relu,
    lower_clamp,
    lower_batch_norm,
    lower_slice,
    lower_select,
    lower_numpy_t,
    lower_pad,
    lower_expand,
    lower_cast,
    sink_data_movement,
    lower_unary,
    lower_binary,
    lower_rsub,
    lower_pow,
    lower_matmul,
    lower_linear,
    lower_addmm,
    lower_softmax,
    lower_layer_norm,
    lower_embedding,
    lower_reshape,
    lower_permute,
    lower_transpose,
    lower_concat,
    lower_clone,
    lower_reduce,
    lower_global_avg_pool,
    lower_conv2d,
    lower_conv1d,
    lower_max_pool2d,
]
