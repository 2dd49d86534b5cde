"""Stand-ins for the `ttnn` functions the lowering emits, as torch custom ops.

Each `fx_rewrites_ttnn::NAME` op is one `ttnn.NAME(...)` call in the graph.
Its body is the op's meaning in torch, on the logical (unpadded) shape:
the engine evaluates it under the graph's fake mode for `meta["val"]`, and
`program.module()` runs it as a host emulation of the device graph. The
ttnn backend (`backends/ttnn/dispatch.py`) runs the same nodes on the
installed `ttnn` instead.

Values between `from_torch` and `to_torch` are device values: bfloat16
(uint32 indices are carried as int32, torch has no uint32 arithmetic).
The stand-ins live here, not in `backends/`, because the rules that emit
them must not import upward (engine <- rewrites <- backends).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._ops import OpOverload

NAMESPACE = "fx_rewrites_ttnn"
TILE, ROW_MAJOR = "TILE", "ROW_MAJOR"
#: ttnn dtype name -> the torch dtype a device value of that dtype is carried as
DEVICE_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32, "uint32": torch.int32}

#: every stand-in op, by ttnn function name
OPS: dict[str, OpOverload] = {}


def _define(name: str, fn: Callable[..., Tensor]) -> OpOverload:
    """Register `fn` as `fx_rewrites_ttnn::name`, its own fake (it is shape-generic torch code)."""
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=())
    op.register_fake(fn)
    OPS[name] = getattr(getattr(torch.ops, NAMESPACE), name).default
    return OPS[name]


def _round(x: Tensor) -> Tensor:
    """Device results are bfloat16 (fresh storage: custom ops may not alias inputs)."""
    return x.to(torch.bfloat16, copy=True)


# -- data movement ---------------------------------------------------------------


#: the largest finite bfloat16; float32's extremes (torch.finfo(float32).min, the usual "masked out" value)
#: would round to infinity, and 0 * inf is NaN
BF16_MAX = torch.finfo(torch.bfloat16).max


def bf16_finite(x: Any) -> Any:
    """`x` (a number or a float tensor) with finite values beyond bfloat16's range clamped to it."""
    if isinstance(x, Tensor):
        return x.clamp(-BF16_MAX, BF16_MAX) if x.is_floating_point() else x
    return max(-BF16_MAX, min(BF16_MAX, x)) if isinstance(x, float) else x


def _from_torch(x: Tensor, dtype: str, layout: str, on_device: bool) -> Tensor:
    if x.dim() == 0:
        x = x.reshape(1)  # a 0-d operand of an elementwise op: ttnn tensors have rank >= 1, [1] broadcasts alike
    if dtype != "uint32" and not x.is_floating_point():
        x = x.float()  # integers and bools reach bfloat16 through float32, as a host cast to float would take them
    return bf16_finite(x).to(DEVICE_DTYPES[dtype], copy=True)


def _to_torch(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x.to(dtype, copy=True)


def _to_layout(x: Tensor, layout: str) -> Tensor:
    return x.clone()


from_torch = _define("from_torch", _from_torch)
to_torch = _define("to_torch", _to_torch)
to_layout = _define("to_layout", _to_layout)

#: the data-movement stand-ins: not compute, counted apart in coverage
BOUNDARY = frozenset({from_torch, to_torch, to_layout})

# -- elementwise -------------------------------------------------------------------

UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "neg": torch.neg,
    "abs": torch.abs,
    "reciprocal": torch.reciprocal,
    "erf": torch.erf,
    "sin": torch.sin,
    "cos": torch.cos,
    "acos": torch.acos,
    "asin": torch.asin,
    "atan": torch.atan,
    "acosh": torch.acosh,
    "asinh": torch.asinh,
    "atanh": torch.atanh,
    "expm1": torch.expm1,
    "log1p": torch.log1p,
    "log2": torch.log2,
    "log10": torch.log10,
    "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish,
    "logical_not": torch.logical_not,  # 1.0 where the input is 0, else 0.0 (a device "bool")
}
BINARY: dict[str, Callable[[Tensor, Any], Tensor]] = {
    "add": torch.add,
    "subtract": torch.sub,
    "multiply": torch.mul,
    "divide": torch.div,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
}


def _unary(f: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    def unary(x: Tensor) -> Tensor:
        return _round(f(x))

    return unary


def _binary(f: Callable[[Tensor, Any], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    def binary(a: Tensor, b: Tensor) -> Tensor:
        return _round(f(a, b))

    return binary


#: a scalar operand: torch.maximum / minimum take tensors only
_SCALAR_FORMS: dict[Callable[..., Tensor], Callable[[Tensor, float], Tensor]] = {
    torch.maximum: lambda a, b: torch.clamp(a, min=b),
    torch.minimum: lambda a, b: torch.clamp(a, max=b),
}


def _binary_scalar(f: Callable[[Tensor, Any], Tensor]) -> Callable[[Tensor, float], Tensor]:
    g = _SCALAR_FORMS.get(f, f)

    def binary_scalar(a: Tensor, b: float) -> Tensor:
        return _round(g(a, b))

    return binary_scalar


for _name, _f in UNARY.items():
    _define(_name, _unary(_f))
for _name, _f in BINARY.items():
    _define(_name, _binary(_f))
    _define(f"{_name}_scalar", _binary_scalar(_f))


def _pow(x: Tensor, exponent: float) -> Tensor:
    return _round(torch.pow(x, exponent))


pow_scalar = _define("pow", _pow)

#: comparisons: 1.0 / 0.0 in bfloat16 on the device (read back as bool)
COMPARE: dict[str, Callable[[Tensor, Any], Tensor]] = {
    "gt": torch.gt,
    "lt": torch.lt,
    "ge": torch.ge,
    "le": torch.le,
    "eq": torch.eq,
    "ne": torch.ne,
}
for _name, _f in COMPARE.items():
    _define(_name, _binary(_f))
    _define(f"{_name}_scalar", _binary_scalar(_f))


def _where(condition: Tensor, true_value: Tensor, false_value: Tensor) -> Tensor:
    return _round(torch.where(condition != 0, true_value, false_value))


def _where_scalar(condition: Tensor, true_value: float, false_value: Tensor) -> Tensor:
    """masked_fill: `true_value` where the condition is nonzero."""
    return _round(torch.where(condition != 0, torch.tensor(true_value, dtype=false_value.dtype), false_value))


def _leaky_relu(x: Tensor, negative_slope: float) -> Tensor:
    return _round(F.leaky_relu(x, negative_slope))


def _clamp(x: Tensor, min: float | None, max: float | None) -> Tensor:
    return _round(torch.clamp(x, min, max))


def _batch_norm(
    x: Tensor, running_mean: Tensor, running_var: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> Tensor:
    def f(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.float()

    return _round(F.batch_norm(x.float(), f(running_mean), f(running_var), f(weight), f(bias), False, 0.0, eps))


def _sdpa(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float | None
) -> Tensor:
    mask = None if attn_mask is None else attn_mask.float()
    out = F.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), mask, is_causal=is_causal, scale=scale
    )
    return _round(out)


sdpa = _define("scaled_dot_product_attention", _sdpa)
where = _define("where", _where)
where_scalar = _define("where_scalar", _where_scalar)
leaky_relu = _define("leaky_relu", _leaky_relu)
clamp = _define("clamp", _clamp)
batch_norm = _define("batch_norm", _batch_norm)

# -- matmul, normalisation, embedding ----------------------------------------------------


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    return _round(torch.matmul(a, b))


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, transpose_b: bool) -> Tensor:
    out = torch.matmul(x, weight.transpose(-1, -2) if transpose_b else weight)
    return _round(out if bias is None else out + bias)


def _softmax(x: Tensor, dim: int) -> Tensor:
    return _round(torch.softmax(x.float(), dim))


def _layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, epsilon: float) -> Tensor:
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return _round(F.layer_norm(x.float(), (x.shape[-1],), w, b, epsilon))


def _embedding(indices: Tensor, weight: Tensor) -> Tensor:
    return _round(F.embedding(indices.long(), weight))


matmul = _define("matmul", _matmul)
linear = _define("linear", _linear)
softmax = _define("softmax", _softmax)
layer_norm = _define("layer_norm", _layer_norm)
embedding = _define("embedding", _embedding)

# -- shapes ---------------------------------------------------------------------------


def _reshape(x: Tensor, shape: list[int]) -> Tensor:
    return x.reshape(shape).clone()


def _permute(x: Tensor, dims: list[int]) -> Tensor:
    return x.permute(dims).contiguous().clone()


def _transpose(x: Tensor, dim1: int, dim2: int) -> Tensor:
    return x.transpose(dim1, dim2).contiguous().clone()


def _concat(tensors: list[Tensor], dim: int) -> Tensor:
    return torch.cat(tensors, dim)


def _slice(x: Tensor, starts: list[int], ends: list[int], steps: list[int]) -> Tensor:
    return x[tuple(slice(a, b, c) for a, b, c in zip(starts, ends, steps))].clone()


def _expand(x: Tensor, shape: list[int]) -> Tensor:
    return x.expand(shape).clone()


def _pad(x: Tensor, pad: list[int], value: float) -> Tensor:
    """`pad` in torch's order: (last dim before, after, second to last before, after, ...)."""
    return _round(F.pad(x, pad, value=value))


pad = _define("pad", _pad)
slice_ = _define("slice", _slice)
expand = _define("expand", _expand)
reshape = _define("reshape", _reshape)
permute = _define("permute", _permute)
transpose = _define("transpose", _transpose)
concat = _define("concat", _concat)

# -- reductions -------------------------------------------------------------------------


def _sum(x: Tensor, dim: list[int], keepdim: bool) -> Tensor:
    return _round(torch.sum(x.float(), dim, keepdim))


def _mean(x: Tensor, dim: list[int], keepdim: bool) -> Tensor:
    return _round(torch.mean(x.float(), dim, keepdim))


def _max(x: Tensor, dim: list[int], keepdim: bool) -> Tensor:
    return _round(torch.amax(x, dim, keepdim))


reduce_sum = _define("sum", _sum)
reduce_mean = _define("mean", _mean)
reduce_max = _define("max", _max)

# -- convolution and pooling (ttnn's flattened NHWC forms) ---------------------------------


def _conv2d(
    input_tensor: Tensor,
    weight_tensor: Tensor,
    bias_tensor: Tensor | None,
    in_channels: int,
    out_channels: int,
    batch_size: int,
    input_height: int,
    input_width: int,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> Tensor:
    """`input_tensor` is [N, H, W, C]; the result is ttnn's [1, 1, N*OH*OW, out_channels]."""
    nchw = input_tensor.permute(0, 3, 1, 2).float()
    bias = None if bias_tensor is None else bias_tensor.float()
    out = F.conv2d(nchw, weight_tensor.float(), bias, stride, padding, dilation, groups)
    return _round(out.permute(0, 2, 3, 1).reshape(1, 1, -1, out_channels))


def _max_pool2d(
    input_tensor: Tensor,
    batch_size: int,
    input_h: int,
    input_w: int,
    channels: int,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    ceil_mode: bool,
) -> Tensor:
    """`input_tensor` is [1, 1, N*H*W, C]; the result is [1, 1, N*OH*OW, C]."""
    nchw = input_tensor.reshape(batch_size, input_h, input_w, channels).permute(0, 3, 1, 2)
    out = F.max_pool2d(nchw, kernel_size, stride, padding, dilation, ceil_mode)
    return _round(out.permute(0, 2, 3, 1).reshape(1, 1, -1, channels))


def _avg_pool2d(
    input_tensor: Tensor,
    batch_size: int,
    input_h: int,
    input_w: int,
    channels: int,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> Tensor:
    """`input_tensor` is [1, 1, N*H*W, C]; the result is [1, 1, N*OH*OW, C]."""
    nchw = input_tensor.reshape(batch_size, input_h, input_w, channels).permute(0, 3, 1, 2).float()
    out = F.avg_pool2d(nchw, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    return _round(out.permute(0, 2, 3, 1).reshape(1, 1, -1, channels))


def _arange(start: int, end: int, step: int) -> Tensor:
    return torch.arange(start, end, step, dtype=torch.bfloat16)


def _full(shape: list[int], fill_value: float) -> Tensor:
    return torch.full(shape, fill_value, dtype=torch.bfloat16)


conv2d = _define("conv2d", _conv2d)
max_pool2d = _define("max_pool2d", _max_pool2d)
avg_pool2d = _define("avg_pool2d", _avg_pool2d)
arange = _define("arange", _arange)
full = _define("full", _full)
#: ops whose row-major result the lowering converts back to TILE
ROW_MAJOR_RESULTS = frozenset({max_pool2d, avg_pool2d})


def is_standin(target: Any) -> bool:
    """`target` is one of the ttnn stand-in ops."""
    return isinstance(target, OpOverload) and target.namespace == NAMESPACE


def ttnn_name(target: OpOverload) -> str:
    """The ttnn function a stand-in calls: "ttnn.add" for both `add` and `add_scalar`."""
    name = target._opname
    if target is sdpa:
        return "ttnn.transformer.scaled_dot_product_attention"
    return "ttnn." + (name[: -len("_scalar")] if name.endswith("_scalar") else name)
