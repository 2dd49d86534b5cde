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

from engine import Miss, Rewriter
from rewrites import schema
from rewrites.kinds import FunctionRule
from rewrites.rules.ttnn import ops
from rewrites.rules.ttnn.boundary import device_value, on_device, to_host

aten = torch.ops.aten

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32)
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
        return f"{what} is {str(val.dtype).removeprefix('torch.')}; the ttnn lowering takes {kinds} tensors"
    if not 1 <= val.dim() <= MAX_RANK:
        return f"{what} has rank {val.dim()}; ttnn tensors here have rank 1 to {MAX_RANK}"
    if val.numel() == 0:
        return f"{what} is empty"
    return None


def static_problem(node: Node) -> str | None:
    """Why the node's shape cannot be written into a ttnn call as constants (reshape, conv2d, pooling)."""
    vals = [a.meta.get("val") for a in (node, *node.all_input_nodes)]
    sym = [tuple(v.shape) for v in vals if isinstance(v, torch.Tensor) and not all(isinstance(s, int) for s in v.shape)]
    return f"symbolic sizes {sym[0]}: this ttnn call takes its sizes as constants" if sym else None


def tensors_ok(*names: str, indices: Iterable[str] = (), static: bool = False) -> Callable[[Node], Any]:
    """A `when` predicate: the named arguments (float; `indices`: integer) and
    the node's result can be ttnn tensors (`static`: of static shapes)."""
    index_names = tuple(indices)

    def when(node: Node) -> Any:
        bound = schema.bind(node.target, node.args, dict(node.kwargs))
        for name in names + index_names:
            values = bound.get(name)
            dtypes = INDEX_DTYPES if name in index_names else FLOAT_DTYPES
            for i, v in enumerate(values if isinstance(values, (list, tuple)) else [values]):
                if v is None:
                    continue
                why = problem(v, f"{name}[{i}]" if isinstance(values, (list, tuple)) else name, dtypes)
                if why:
                    return Miss(why)
        why = problem(node, "the result") or (static_problem(node) if static else None)
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

        return FunctionRule(fn=fn, ops=tuple(roots), name=name, when=when, doc=doc, tags=frozenset({"ttnn"}))

    return wrap


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
    return rw.call(ops.OPS[f"{name}_scalar"], a, float(other))


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
    b = device_value(rw, bias) if isinstance(bias, Node) else None
    return rw.call(ops.linear, device_value(rw, bound["input"]), device_value(rw, bound["weight"]), b, True)


def _addmm_when(node: Node) -> Any:
    bound = schema.bind(node.target, node.args, dict(node.kwargs))
    if bound.get("beta", 1) != 1 or bound.get("alpha", 1) != 1:
        return Miss("beta or alpha is not 1; ttnn.linear has neither")
    return tensors_ok("self", "mat1", "mat2")(node)


@_lowering("ttnn_addmm", [aten.addmm.default], _addmm_when, "aten.addmm(b, x, W) -> ttnn.linear(x, W, bias=b).")
def lower_addmm(node: Node, rw: Rewriter, bound: dict[str, Any]) -> Node:
    x, w, b = (device_value(rw, bound[n]) for n in ("mat1", "mat2", "self"))
    return rw.call(ops.linear, x, w, b, False)


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
            return Miss("no operand is on the device; moving it there only for this would add a round trip")
        return check(node)

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


@_lowering("ttnn_clone", [aten.clone.default, aten.alias.default], _clone_when, "clone of a device value: itself.")
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


RULES = [
    lower_unary,
    lower_binary,
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
    lower_max_pool2d,
]
