"""Stand-in op -> the real `ttnn` call, with ttnn's argument names.

`call(ttnn, device, target, args, kwargs)` runs one stand-in node of a device
region on ttnn objects. The arguments are the node's (schema order of
`backends/ttnn/rules/ops.py`); each entry below says how ttnn spells them
(signatures from docs.tenstorrent.com, see docs/ttnn.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fx_rewrites.backends.ttnn.rules import ops, ops_extra

Call = Callable[..., Any]
#: ttnn's tile is 32 x 32
TILE_WIDTH = 32


def _dtype(ttnn: Any, name: str) -> Any:
    return getattr(ttnn, name)


def _layout(ttnn: Any, name: str) -> Any:
    return ttnn.TILE_LAYOUT if name == ops.TILE else ttnn.ROW_MAJOR_LAYOUT


def _from_torch(ttnn: Any, dev: Any, x: Any, dtype: str, layout: str, on_device: bool) -> Any:
    if x.dim() == 0:
        x = x.reshape(1)  # ttnn tensors have rank >= 1; a [1] operand broadcasts as the 0-d one did
    if dtype == "uint32":
        x = x.to(torch.int32)  # ttnn converts int32 host data to uint32
    elif not x.is_floating_point():
        x = x.float()  # a bool mask (1.0 / 0.0) or integers: to bfloat16 through float32, as the host cast did
    else:
        x = ops.bf16_finite(x)  # float32's extremes would become +-inf in bfloat16
    device = dev if on_device else None
    return ttnn.from_torch(x, dtype=_dtype(ttnn, dtype), layout=_layout(ttnn, layout), device=device)


def _to_torch(ttnn: Any, dev: Any, x: Any, dtype: Any) -> Any:
    return ttnn.to_torch(x).to(dtype)


def _conv2d(ttnn: Any, dev: Any, x: Any, w: Any, b: Any, c: int, o: int, n: int, h: int, wd: int, *rest: Any) -> Any:
    kernel, stride, padding, dilation, groups = rest
    bias = None if b is None else ttnn.reshape(b, (1, 1, 1, o))  # ttnn.conv2d's bias is [1, 1, 1, out_channels]
    out = ttnn.conv2d(
        input_tensor=x,
        weight_tensor=w,
        bias_tensor=bias,
        device=dev,
        in_channels=c,
        out_channels=o,
        batch_size=n,
        input_height=h,
        input_width=wd,
        kernel_size=tuple(kernel),
        stride=tuple(stride),
        padding=tuple(padding),
        dilation=tuple(dilation),
        groups=groups,
    )
    return interleaved(ttnn, out[0] if isinstance(out, tuple) else out)  # older ttnn returns (output, h, w)


def interleaved(ttnn: Any, x: Any) -> Any:
    """conv2d and pooling may leave their output sharded in L1; the ops after them take interleaved
    tensors (ttnn's conv and pool docs: `sharded_to_interleaved` after them)."""
    return ttnn.sharded_to_interleaved(x, ttnn.DRAM_MEMORY_CONFIG) if x.is_sharded() else x


def _embedding(ttnn: Any, dev: Any, ids: Any, weight: Any) -> Any:
    """ttnn.embedding tilizes its output only for widths that are a multiple of the tile width (32):
    otherwise it returns row-major and `to_layout` tilizes (and pads) it."""
    if weight.shape[-1] % TILE_WIDTH == 0:
        return ttnn.embedding(ids, weight, layout=ttnn.TILE_LAYOUT)
    return ttnn.to_layout(ttnn.embedding(ids, weight, layout=ttnn.ROW_MAJOR_LAYOUT), ttnn.TILE_LAYOUT)


def _max_pool2d(ttnn: Any, dev: Any, x: Any, *args: Any) -> Any:
    return interleaved(ttnn, ttnn.max_pool2d(x, *args[:8], ceil_mode=args[8]))


def _avg_pool2d(ttnn: Any, dev: Any, x: Any, *args: Any) -> Any:
    """ttnn.avg_pool2d(x, batch, h, w, channels, kernel, stride, padding, ceil_mode, count_include_pad,
    divisor_override): the same order as the stand-in."""
    return interleaved(ttnn, ttnn.avg_pool2d(x, *args))


def _arange(ttnn: Any, dev: Any, start: int, end: int, step: int) -> Any:
    return ttnn.arange(start, end, step, dtype=ttnn.bfloat16, device=dev, layout=ttnn.TILE_LAYOUT)


def _full(ttnn: Any, dev: Any, shape: list[int], fill_value: float) -> Any:
    return ttnn.full(list(shape), fill_value, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=dev)


def _batch_norm(ttnn: Any, dev: Any, x: Any, mean: Any, var: Any, w: Any, b: Any, eps: float) -> Any:
    c = x.shape[1]

    def stat(t: Any) -> Any:  # ttnn.batch_norm takes [1, C, 1, 1] statistics and parameters
        return None if t is None else ttnn.reshape(t, (1, c, 1, 1))

    return ttnn.batch_norm(
        x, running_mean=stat(mean), running_var=stat(var), weight=stat(w), bias=stat(b), eps=eps, training=False
    )


def _pad(ttnn: Any, dev: Any, x: Any, pad: list[int], value: float) -> Any:
    """torch's (last before, last after, ...) as ttnn's [(before, after)] for every dimension, first to last."""
    rank = len(x.shape)
    pairs = [(0, 0)] * rank
    for i in range(len(pad) // 2):
        pairs[rank - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return ttnn.pad(x, padding=pairs, value=value)


def _reduce(name: str) -> Call:
    def reduce(ttnn: Any, dev: Any, x: Any, dim: list[int], keepdim: bool) -> Any:
        return getattr(ttnn, name)(x, dim=dim[0] if len(dim) == 1 else list(dim), keepdim=keepdim)

    return reduce


def _plain(name: str) -> Call:
    """ttnn.NAME(*args): same arguments, same order."""

    def call(ttnn: Any, dev: Any, *args: Any) -> Any:
        return getattr(ttnn, name)(*args)

    return call


CALLS: dict[Any, Call] = {
    ops.from_torch: _from_torch,
    ops.to_torch: _to_torch,
    ops.to_layout: lambda ttnn, dev, x, layout: ttnn.to_layout(x, _layout(ttnn, layout)),
    ops.matmul: _plain("matmul"),
    ops.linear: lambda ttnn, dev, x, w, b, tb: ttnn.linear(x, w, bias=b, transpose_b=tb),
    ops.softmax: lambda ttnn, dev, x, dim: ttnn.softmax(x, dim=dim),
    ops.layer_norm: lambda ttnn, dev, x, w, b, eps: ttnn.layer_norm(x, epsilon=eps, weight=w, bias=b),
    ops.embedding: _embedding,
    ops.reshape: lambda ttnn, dev, x, shape: ttnn.reshape(x, tuple(shape)),
    ops.permute: lambda ttnn, dev, x, dims: ttnn.permute(x, tuple(dims)),
    ops.transpose: _plain("transpose"),
    ops.concat: lambda ttnn, dev, xs, dim: ttnn.concat(list(xs), dim=dim),
    ops.pow_scalar: _plain("pow"),
    ops.reduce_sum: _reduce("sum"),
    ops.reduce_mean: _reduce("mean"),
    ops.reduce_max: _reduce("max"),
    ops.conv2d: _conv2d,
    ops.max_pool2d: _max_pool2d,
    ops.avg_pool2d: _avg_pool2d,
    ops.arange: _arange,
    ops.full: _full,
    ops.where: _plain("where"),
    ops.where_scalar: _plain("where"),  # ttnn.where(predicate, true_value: float, false_value: Tensor)
    ops.pad: _pad,
    ops.expand: lambda ttnn, dev, x, shape: ttnn.expand(x, list(shape)),
    ops.sdpa: lambda ttnn, dev, q, k, v, mask, causal, scale: ttnn.transformer.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale
    ),
    ops.leaky_relu: lambda ttnn, dev, x, slope: ttnn.leaky_relu(x, negative_slope=slope),
    ops.clamp: lambda ttnn, dev, x, lo, hi: ttnn.clamp(x, min=lo, max=hi),
    ops.batch_norm: _batch_norm,
    ops.slice_: lambda ttnn, dev, x, starts, ends, steps: ttnn.slice(x, list(starts), list(ends), list(steps)),
    ops_extra.elu: lambda ttnn, dev, x, alpha: ttnn.elu(x, alpha=alpha),
    ops_extra.tril: lambda ttnn, dev, x, diagonal: ttnn.tril(x, diagonal=diagonal),
    ops_extra.addcmul: lambda ttnn, dev, a, b, c, value: ttnn.addcmul(a, b, c, value=value),
    ops_extra.addcdiv: lambda ttnn, dev, a, b, c, value: ttnn.addcdiv(a, b, c, value=value),
    ops_extra.reduce_min: _reduce("min"),
    ops_extra.cumsum: lambda ttnn, dev, x, dim: ttnn.cumsum(x, dim),
    ops_extra.stack: lambda ttnn, dev, xs, dim: ttnn.stack(list(xs), dim),
    ops_extra.repeat: lambda ttnn, dev, x, dims: ttnn.repeat(x, list(dims)),
    ops_extra.roll: lambda ttnn, dev, x, shifts, dims: ttnn.roll(x, list(shifts), list(dims)),
}
for _name in (*ops.UNARY, *ops.BINARY):
    CALLS[ops.OPS[_name]] = _plain(_name)
for _name in (*ops.BINARY, *ops.COMPARE):
    CALLS[ops.OPS[f"{_name}_scalar"]] = _plain(_name)
for _name in ops.COMPARE:
    CALLS[ops.OPS[_name]] = _plain(_name)

_missing = [name for name, op in ops.OPS.items() if op not in CALLS]
assert not _missing, f"stand-ins without a ttnn call: {_missing}"


def call(ttnn: Any, device: Any, target: Any, args: tuple, kwargs: dict) -> Any:
    """Run stand-in `target` on ttnn."""
    return CALLS[target](ttnn, device, *args, **kwargs)
