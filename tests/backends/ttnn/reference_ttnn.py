"""TEST DOUBLE of the `ttnn` module: NOT ttnn, only its contract as the lowering uses it.

It implements, in torch, exactly the ttnn functions `backends/ttnn/dispatch.py`
calls, with ttnn's signatures (keyword names as documented on
docs.tenstorrent.com) and its data constraints, so that a wrong argument
order, a wrong layout or a forgotten conversion fails a test without hardware:

- device tensors hold bfloat16 (or uint32 indices); every op result is
  rounded to bfloat16;
- TILE_LAYOUT storage is padded to multiples of 32 in the last two
  dimensions, and the padding is poisoned with NaN: a value that reaches the
  host without `to_torch` unpadding it, or an op that reads padding, shows;
- compute ops want device tensors in TILE_LAYOUT; embedding wants uint32
  row-major indices and a row-major table; conv2d wants NHWC input and host
  row-major weights; max_pool2d wants a [1, 1, N*H*W, C] row-major input and
  returns row-major (its documented output_layout default).

Written independently of the stand-ins' own torch bodies
(`rewrites/rules/ttnn/ops.py`): the tests compare the two paths with eager.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F

TILE = 32
IS_TEST_DOUBLE = True


@attrs.frozen
class DataType:
    name: str
    storage: torch.dtype


@attrs.frozen
class Layout:
    name: str


bfloat16 = DataType("bfloat16", torch.bfloat16)
float32 = DataType("float32", torch.float32)
uint32 = DataType("uint32", torch.int64)
TILE_LAYOUT = Layout("TILE")
ROW_MAJOR_LAYOUT = Layout("ROW_MAJOR")


class TtnnDoubleError(RuntimeError):
    """The double's contract was broken (what real ttnn would reject or compute wrongly)."""


@attrs.define
class Device:
    device_id: int
    is_open: bool = True


def open_device(device_id: int = 0, **_: Any) -> Device:
    return Device(device_id)


def close_device(device: Device) -> None:
    device.is_open = False


@attrs.define
class Tensor:
    storage: torch.Tensor
    shape: tuple[int, ...]
    dtype: DataType
    layout: Layout
    device: Device | None = None

    def logical(self) -> torch.Tensor:
        if self.layout is ROW_MAJOR_LAYOUT:
            return self.storage
        h, w = ((1,) + self.shape)[-2:]
        out = self.storage[..., :h, :w]
        return out.reshape(self.shape)


def _tile(t: torch.Tensor) -> torch.Tensor:
    """Pad the last two dimensions (a 1-D tensor is one row) to multiples of 32, with NaN poison."""
    v = t if t.dim() >= 2 else t.reshape(1, -1)
    h, w = v.shape[-2:]
    ph, pw = math.ceil(h / TILE) * TILE - h, math.ceil(w / TILE) * TILE - w
    if not (ph or pw):
        return v.clone()
    fill = float("nan") if v.is_floating_point() else -1
    return F.pad(v, (0, pw, 0, ph), value=fill)


def _make(t: torch.Tensor, dtype: DataType, layout: Layout, device: Device | None) -> Tensor:
    t = t.to(dtype.storage)
    return Tensor(_tile(t) if layout is TILE_LAYOUT else t.clone(), tuple(t.shape), dtype, layout, device)


def _need(t: Any, what: str, *, layout: Layout | None = TILE_LAYOUT, dtype: DataType | None = bfloat16) -> torch.Tensor:
    if not isinstance(t, Tensor):
        raise TtnnDoubleError(f"{what}: expected a ttnn.Tensor, got {type(t).__name__}")
    if t.device is None or not t.device.is_open:
        raise TtnnDoubleError(f"{what}: the tensor is not on an open device (from_torch(..., device=device))")
    if layout is not None and t.layout is not layout:
        raise TtnnDoubleError(f"{what}: needs {layout.name} layout, got {t.layout.name}")
    if dtype is not None and t.dtype is not dtype:
        raise TtnnDoubleError(f"{what}: needs {dtype.name}, got {t.dtype.name}")
    return t.logical().float()


def _result(t: torch.Tensor, device: Device | None, layout: Layout = TILE_LAYOUT) -> Tensor:
    return _make(t.to(torch.bfloat16), bfloat16, layout, device)


# -- data movement -----------------------------------------------------------------------------


def from_torch(
    tensor: torch.Tensor,
    dtype: DataType | None = None,
    *,
    layout: Layout = ROW_MAJOR_LAYOUT,
    device: Device | None = None,
    **_: Any,
) -> Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TtnnDoubleError(f"from_torch: expected a torch.Tensor, got {type(tensor).__name__}")
    dtype = dtype or (bfloat16 if tensor.dtype == torch.bfloat16 else float32)
    if dtype is uint32 and (tensor.is_floating_point() or bool((tensor < 0).any())):
        raise TtnnDoubleError("from_torch: uint32 needs non-negative integer values")
    if not 1 <= tensor.dim() <= 4:
        raise TtnnDoubleError(f"from_torch: rank {tensor.dim()}; this double takes rank 1 to 4")
    return _make(tensor, dtype, layout, device)


def to_torch(tensor: Tensor, dtype: torch.dtype | None = None, **_: Any) -> torch.Tensor:
    if not isinstance(tensor, Tensor):
        raise TtnnDoubleError(f"to_torch: expected a ttnn.Tensor, got {type(tensor).__name__}")
    out = tensor.logical().clone()
    return out if dtype is None else out.to(dtype)


def to_layout(tensor: Tensor, layout: Layout, **_: Any) -> Tensor:
    return _make(tensor.logical(), tensor.dtype, layout, tensor.device)


def reshape(tensor: Tensor, shape: Sequence[int], **_: Any) -> Tensor:
    data = tensor.logical()
    if math.prod(shape) != data.numel():
        raise TtnnDoubleError(f"reshape: {tuple(tensor.shape)} has {data.numel()} elements, not {math.prod(shape)}")
    return _make(data.reshape(tuple(shape)), tensor.dtype, tensor.layout, tensor.device)


def permute(tensor: Tensor, dims: Sequence[int], **_: Any) -> Tensor:
    data = _need(tensor, "permute", layout=None, dtype=None).to(tensor.dtype.storage)
    return _make(data.permute(tuple(dims)), tensor.dtype, tensor.layout, tensor.device)


def transpose(tensor: Tensor, dim1: int, dim2: int, **_: Any) -> Tensor:
    data = _need(tensor, "transpose", layout=None, dtype=None).to(tensor.dtype.storage)
    return _make(data.transpose(dim1, dim2), tensor.dtype, tensor.layout, tensor.device)


def concat(tensors: Sequence[Tensor], dim: int = 0, **_: Any) -> Tensor:
    datas = [_need(t, "concat", layout=tensors[0].layout) for t in tensors]
    return _result(torch.cat(datas, dim), tensors[0].device, tensors[0].layout)


# -- elementwise -------------------------------------------------------------------------------------


def _unary(name: str, f: Any) -> Any:
    def op(input_tensor: Tensor, **_: Any) -> Tensor:
        return _result(f(_need(input_tensor, name)), input_tensor.device)

    op.__name__ = name
    return op


relu = _unary("relu", torch.relu)
gelu = _unary("gelu", F.gelu)
silu = _unary("silu", F.silu)
sigmoid = _unary("sigmoid", torch.sigmoid)
tanh = _unary("tanh", torch.tanh)
exp = _unary("exp", torch.exp)
log = _unary("log", torch.log)
sqrt = _unary("sqrt", torch.sqrt)
rsqrt = _unary("rsqrt", torch.rsqrt)
neg = _unary("neg", torch.neg)
abs = _unary("abs", torch.abs)
reciprocal = _unary("reciprocal", torch.reciprocal)
erf = _unary("erf", torch.erf)
sin = _unary("sin", torch.sin)
cos = _unary("cos", torch.cos)


def _binary(name: str, f: Any) -> Any:
    def op(input_tensor_a: Tensor, input_tensor_b: Tensor | float, **_: Any) -> Tensor:
        a = _need(input_tensor_a, name)
        b = _need(input_tensor_b, name) if isinstance(input_tensor_b, Tensor) else torch.tensor(float(input_tensor_b))
        return _result(f(a, b), input_tensor_a.device)

    op.__name__ = name
    return op


add = _binary("add", torch.add)
subtract = _binary("subtract", torch.sub)
multiply = _binary("multiply", torch.mul)
divide = _binary("divide", torch.div)
maximum = _binary("maximum", torch.maximum)
minimum = _binary("minimum", torch.minimum)


gt = _binary("gt", torch.gt)
lt = _binary("lt", torch.lt)
ge = _binary("ge", torch.ge)
le = _binary("le", torch.le)
eq = _binary("eq", torch.eq)
ne = _binary("ne", torch.ne)


def where(condition: Tensor, true_value: Tensor, false_value: Tensor, **_: Any) -> Tensor:
    c, x, y = (_need(t, "where") for t in (condition, true_value, false_value))
    return _result(torch.where(c != 0, x, y), condition.device)


class _Transformer:
    """ttnn.transformer: the attention op."""

    @staticmethod
    def scaled_dot_product_attention(
        input_tensor_q: Tensor,
        input_tensor_k: Tensor,
        input_tensor_v: Tensor,
        *,
        attn_mask: Tensor | None = None,
        is_causal: bool = True,
        scale: float | None = None,
        **_: Any,
    ) -> Tensor:
        q, k, v = (_need(t, "scaled_dot_product_attention") for t in (input_tensor_q, input_tensor_k, input_tensor_v))
        if q.dim() != 4:
            raise TtnnDoubleError(f"scaled_dot_product_attention: q of shape {tuple(q.shape)}, expected [b, nh, s, d]")
        mask = None if attn_mask is None else _need(attn_mask, "scaled_dot_product_attention mask")
        if mask is not None and is_causal:
            raise TtnnDoubleError("scaled_dot_product_attention: attn_mask with is_causal=True")
        out = F.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, scale=scale)
        return _result(out, input_tensor_q.device)


transformer = _Transformer()


def leaky_relu(input_tensor: Tensor, negative_slope: float = 0.01, **_: Any) -> Tensor:
    return _result(F.leaky_relu(_need(input_tensor, "leaky_relu"), negative_slope), input_tensor.device)


def clamp(input_tensor: Tensor, min: float | None = None, max: float | None = None, **_: Any) -> Tensor:
    return _result(torch.clamp(_need(input_tensor, "clamp"), min, max), input_tensor.device)


def batch_norm(
    input_tensor: Tensor,
    *,
    running_mean: Tensor,
    running_var: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    training: bool = False,
    **_: Any,
) -> Tensor:
    x = _need(input_tensor, "batch_norm")
    c = x.shape[1]
    stats = []
    for name, t in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)):
        if t is None:
            stats.append(None)
            continue
        v = _need(t, f"batch_norm {name}")
        if tuple(v.shape) != (1, c, 1, 1):
            raise TtnnDoubleError(
                f"batch_norm: {name} of shape {tuple(v.shape)}, expected [1, C, 1, 1] = [1, {c}, 1, 1]"
            )
        stats.append(v.reshape(-1))
    mean, var, w, b = stats
    return _result(F.batch_norm(x, mean, var, w, b, training, 0.0, eps), input_tensor.device)


def slice(
    input_tensor: Tensor,
    slice_start: Sequence[int],
    slice_end: Sequence[int],
    slice_step: Sequence[int] | None = None,
    **_: Any,
) -> Tensor:
    x = _need(input_tensor, "slice", layout=None)
    steps = slice_step or [1] * x.dim()
    if not len(slice_start) == len(slice_end) == len(steps) == x.dim():
        raise TtnnDoubleError(f"slice: starts/ends/steps need one entry per dimension of {tuple(x.shape)}")
    index = tuple(builtins.slice(a, b, c) for a, b, c in zip(slice_start, slice_end, steps))
    return _result(x[index], input_tensor.device, input_tensor.layout)


def pad(input_tensor: Tensor, padding: Sequence[tuple[int, int]], value: float, **_: Any) -> Tensor:
    x = _need(input_tensor, "pad")
    if len(padding) != x.dim():
        raise TtnnDoubleError(f"pad: {len(padding)} (before, after) pairs for a rank-{x.dim()} tensor")
    flat = [n for before, after in reversed(list(padding)) for n in (before, after)]
    return _result(F.pad(x, flat, value=value), input_tensor.device)


def expand(input_tensor: Tensor, output_shape: Sequence[int], **_: Any) -> Tensor:
    x = _need(input_tensor, "expand", layout=None)
    lead = len(output_shape) - x.dim()
    for i, (have, want) in enumerate(zip(x.shape, output_shape[lead:])):
        if have != want and have != 1 and want != -1:
            raise TtnnDoubleError(f"expand: dimension {i} of size {have} cannot become {want}")
    return _result(x.expand(tuple(output_shape)), input_tensor.device, input_tensor.layout)


def pow(input_tensor: Tensor, exponent: float, **_: Any) -> Tensor:
    return _result(torch.pow(_need(input_tensor, "pow"), exponent), input_tensor.device)


# -- matmul, normalisation, embedding ---------------------------------------------------------------


def matmul(
    input_tensor_a: Tensor, input_tensor_b: Tensor, *, transpose_a: bool = False, transpose_b: bool = False, **_: Any
) -> Tensor:
    a, b = _need(input_tensor_a, "matmul"), _need(input_tensor_b, "matmul")
    a = a.transpose(-1, -2) if transpose_a else a
    b = b.transpose(-1, -2) if transpose_b else b
    if a.shape[-1] != b.shape[-2]:
        raise TtnnDoubleError(f"matmul: inner dimensions differ: {tuple(a.shape)} @ {tuple(b.shape)}")
    return _result(a @ b, input_tensor_a.device)


def linear(
    input_tensor_a: Tensor,
    input_tensor_b: Tensor,
    *,
    bias: Tensor | None = None,
    transpose_a: bool = False,
    transpose_b: bool = False,
    **_: Any,
) -> Tensor:
    out = matmul(input_tensor_a, input_tensor_b, transpose_a=transpose_a, transpose_b=transpose_b)
    if bias is None:
        return out
    b = _need(bias, "linear bias")
    if b.shape[-1] != out.shape[-1]:
        raise TtnnDoubleError(f"linear: bias of shape {tuple(b.shape)} for an output of width {out.shape[-1]}")
    return _result(out.logical().float() + b, out.device)


def softmax(input_tensor: Tensor, dim: int = -1, **_: Any) -> Tensor:
    return _result(torch.softmax(_need(input_tensor, "softmax"), dim), input_tensor.device)


def layer_norm(
    input_tensor: Tensor,
    *,
    epsilon: float = 1e-12,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    **_: Any,
) -> Tensor:
    x = _need(input_tensor, "layer_norm")
    w = None if weight is None else _need(weight, "layer_norm weight").reshape(-1)
    b = None if bias is None else _need(bias, "layer_norm bias").reshape(-1)
    return _result(F.layer_norm(x, (x.shape[-1],), w, b, epsilon), input_tensor.device)


def embedding(
    input_tensor: Tensor, weight: Tensor, *, layout: Layout = ROW_MAJOR_LAYOUT, padding_idx: int | None = None, **_: Any
) -> Tensor:
    ids = _need(input_tensor, "embedding indices", layout=ROW_MAJOR_LAYOUT, dtype=uint32).long()
    table = _need(weight, "embedding weight", layout=ROW_MAJOR_LAYOUT)
    if ids.dim() != 2:
        raise TtnnDoubleError(f"embedding: indices of rank {ids.dim()}, expected [batch, sequence]")
    if int(ids.max()) >= table.shape[0]:
        raise TtnnDoubleError(f"embedding: index {int(ids.max())} out of a table of {table.shape[0]} rows")
    return _result(F.embedding(ids, table), input_tensor.device, layout)


# -- reductions ---------------------------------------------------------------------------------------


def _reduce(name: str, f: Any) -> Any:
    def op(input_tensor: Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False, **_: Any) -> Tensor:
        x = _need(input_tensor, name)
        dims = list(range(x.dim())) if dim is None else [dim] if isinstance(dim, int) else list(dim)
        return _result(f(x, dims, keepdim), input_tensor.device)

    op.__name__ = name
    return op


sum = _reduce("sum", torch.sum)
mean = _reduce("mean", torch.mean)
max = _reduce("max", torch.amax)

# -- convolution, pooling --------------------------------------------------------------------------------


def conv2d(
    *,
    input_tensor: Tensor,
    weight_tensor: Tensor,
    device: Device,
    in_channels: int,
    out_channels: int,
    batch_size: int,
    input_height: int,
    input_width: int,
    kernel_size: Sequence[int],
    stride: Sequence[int] = (1, 1),
    padding: Sequence[int] = (0, 0),
    dilation: Sequence[int] = (1, 1),
    groups: int = 1,
    bias_tensor: Tensor | None = None,
    return_output_dim: bool = False,
    return_weights_and_bias: bool = False,
    **_: Any,
) -> Any:
    x = _need(input_tensor, "conv2d input", layout=None)
    nhwc = (batch_size, input_height, input_width, in_channels)
    if tuple(x.shape) not in (nhwc, (1, 1, batch_size * input_height * input_width, in_channels)):
        raise TtnnDoubleError(f"conv2d: input {tuple(x.shape)} is not NHWC {nhwc} (nor flattened [1, 1, NHW, C])")
    if weight_tensor.device is not None or weight_tensor.layout is not ROW_MAJOR_LAYOUT:
        raise TtnnDoubleError("conv2d: weights go in as host row-major tensors (from_torch without device)")
    w = weight_tensor.logical().float()
    if tuple(w.shape) != (out_channels, in_channels // groups, *kernel_size):
        raise TtnnDoubleError(f"conv2d: weight {tuple(w.shape)} is not [out, in/groups, kh, kw]")
    b = None
    if bias_tensor is not None:
        b = bias_tensor.logical().float()
        if tuple(b.shape) != (1, 1, 1, out_channels):
            raise TtnnDoubleError(f"conv2d: bias {tuple(b.shape)} is not [1, 1, 1, out_channels]")
        b = b.reshape(-1)
    nchw = x.reshape(nhwc).permute(0, 3, 1, 2)
    y = F.conv2d(nchw, w, b, tuple(stride), tuple(padding), tuple(dilation), groups)
    oh, ow = y.shape[-2:]
    out = _result(y.permute(0, 2, 3, 1).reshape(1, 1, -1, out_channels), device)
    if return_weights_and_bias:
        return out, [oh, ow], [weight_tensor, bias_tensor]
    return (out, [oh, ow]) if return_output_dim else out


def max_pool2d(
    input_tensor: Tensor,
    batch_size: int,
    input_h: int,
    input_w: int,
    channels: int,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool = False,
    **_: Any,
) -> Tensor:
    x = _need(input_tensor, "max_pool2d", layout=ROW_MAJOR_LAYOUT)
    if tuple(x.shape) != (1, 1, batch_size * input_h * input_w, channels):
        raise TtnnDoubleError(f"max_pool2d: input {tuple(x.shape)} is not [1, 1, N*H*W, C]")
    nchw = x.reshape(batch_size, input_h, input_w, channels).permute(0, 3, 1, 2)
    y = F.max_pool2d(nchw, tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation), ceil_mode)
    return _result(y.permute(0, 2, 3, 1).reshape(1, 1, -1, channels), input_tensor.device, ROW_MAJOR_LAYOUT)
