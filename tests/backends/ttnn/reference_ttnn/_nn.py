"""Matmul, normalisation, embedding, attention, convolution and pooling in the double, with ttnn's constraints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tests.backends.ttnn.reference_ttnn._core import (
    _L1_SHARDED,
    ROW_MAJOR_LAYOUT,
    TILE,
    TILE_LAYOUT,
    DataType,
    Layout,
    MemoryConfig,
    MeshDevice,
    Tensor,
    TtnnDoubleError,
    bfloat16,
    logical,
    make,
    need,
    result,
    sizes,
    uint32,
)


def matmul(
    input_tensor_a: Tensor,
    input_tensor_b: Tensor,
    *,
    transpose_a: bool = False,
    transpose_b: bool = False,
    memory_config: MemoryConfig | None = None,
    dtype: DataType | None = None,
    program_config: Any = None,
    activation: str | None = None,
    compute_kernel_config: Any = None,
    core_grid: Any = None,
) -> Tensor:
    a, b = need(input_tensor_a, "matmul"), need(input_tensor_b, "matmul")
    a = a.transpose(-1, -2) if transpose_a else a
    b = b.transpose(-1, -2) if transpose_b else b
    if a.shape[-1] != b.shape[-2]:
        raise TtnnDoubleError(f"matmul: inner dimensions differ: {tuple(a.shape)} @ {tuple(b.shape)}")
    return result(a @ b, input_tensor_a.device())


def linear(
    input_tensor_a: Tensor,
    input_tensor_b: Tensor,
    *,
    bias: Tensor | None = None,
    transpose_a: bool = False,
    transpose_b: bool = False,
    memory_config: MemoryConfig | None = None,
    dtype: DataType | None = None,
    program_config: Any = None,
    activation: str | None = None,
    compute_kernel_config: Any = None,
    core_grid: Any = None,
) -> Tensor:
    out = matmul(input_tensor_a, input_tensor_b, transpose_a=transpose_a, transpose_b=transpose_b)
    if bias is None:
        return out
    b = need(bias, "linear bias")
    width = out.shape[-1]
    if b.dim() < 2 or any(s != 1 for s in b.shape[:-1]) or b.shape[-1] != width:
        raise TtnnDoubleError(f"linear: bias of shape {tuple(b.shape)}; ttnn.linear takes a row vector [1, {width}]")
    return result(logical(out).float() + b.reshape(width), out.device())


def softmax(
    input_tensor: Tensor,
    dim: int = -1,
    *,
    memory_config: MemoryConfig | None = None,
    compute_kernel_config: Any = None,
    numeric_stable: bool = True,
) -> Tensor:
    return result(torch.softmax(need(input_tensor, "softmax"), dim), input_tensor.device())


def layer_norm(
    input_tensor: Tensor,
    *,
    epsilon: float = 1e-12,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    residual_input_tensor: Tensor | None = None,
    memory_config: MemoryConfig | None = None,
    program_config: Any = None,
    compute_kernel_config: Any = None,
) -> Tensor:
    x = need(input_tensor, "layer_norm")
    w = None if weight is None else need(weight, "layer_norm weight").reshape(-1)
    b = None if bias is None else need(bias, "layer_norm bias").reshape(-1)
    return result(F.layer_norm(x, (x.shape[-1],), w, b, epsilon), input_tensor.device())


def batch_norm(
    input: Tensor,
    *,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    training: bool = False,
    eps: float = 1e-5,
    momentum: float = 0.1,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    output: Tensor | None = None,
    memory_config: MemoryConfig | None = None,
    compute_kernel_config: Any = None,
) -> Tensor:
    x = need(input, "batch_norm")
    c = x.shape[1]
    stats = []
    for name, t in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)):
        if t is None:
            stats.append(None)
            continue
        v = need(t, f"batch_norm {name}")
        if tuple(v.shape) != (1, c, 1, 1):
            raise TtnnDoubleError(
                f"batch_norm: {name} of shape {tuple(v.shape)}, expected [1, C, 1, 1] = [1, {c}, 1, 1]"
            )
        stats.append(v.reshape(-1))
    mean, var, w, b = stats
    return result(F.batch_norm(x, mean, var, w, b, training, 0.0, eps), input.device())


def embedding(
    input_tensor: Tensor,
    weight: Tensor,
    *,
    padding_idx: int | None = None,
    layout: Layout | None = None,
    embeddings_type: Any = None,
    dtype: DataType | None = None,
    memory_config: MemoryConfig | None = None,
    output_tensor: Tensor | None = None,
) -> Tensor:
    ids = need(input_tensor, "embedding indices", layout=ROW_MAJOR_LAYOUT, dtype=uint32).long()
    table = need(weight, "embedding weight", layout=ROW_MAJOR_LAYOUT)
    if ids.dim() != 2:
        raise TtnnDoubleError(f"embedding: indices of rank {ids.dim()}, expected [batch, sequence]")
    if int(ids.max()) >= table.shape[0]:
        raise TtnnDoubleError(f"embedding: index {int(ids.max())} out of a table of {table.shape[0]} rows")
    width = table.shape[-1]
    if layout is TILE_LAYOUT and width % TILE:
        raise TtnnDoubleError(f"Embedding dimension {width} must be divisible by tile width ({TILE}) for TILE output")
    return result(F.embedding(ids, table), input_tensor.device(), layout or ROW_MAJOR_LAYOUT)


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
        sliding_window_size: int | None = None,
        memory_config: MemoryConfig | None = None,
        program_config: Any = None,
        compute_kernel_config: Any = None,
    ) -> Tensor:
        what = "scaled_dot_product_attention"
        q, k, v = (need(t, what) for t in (input_tensor_q, input_tensor_k, input_tensor_v))
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise TtnnDoubleError(
                f"{what}: q, k, v of shapes {[tuple(t.shape) for t in (q, k, v)]}, expected [b, nh, s, d]"
            )
        mask = None if attn_mask is None else need(attn_mask, f"{what} mask")
        if mask is not None and is_causal:
            raise TtnnDoubleError(f"{what}: attn_mask with is_causal=True (ttnn's default); pass is_causal=False")
        if mask is not None:
            b, nqh, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
            m = tuple(mask.shape)
            if len(m) != 4 or m[0] not in (1, b) or m[1] not in (1, nqh) or m[2:] != (sq, sk):
                raise TtnnDoubleError(
                    f"{what}: attn_mask of shape {m}; ttnn takes [b x nqh x s x s] = [{b} or 1, {nqh} or 1, {sq}, {sk}]"
                )
        out = F.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, scale=scale)
        return result(out, input_tensor_q.device())


transformer = _Transformer()


def _needs_l1_small(device: MeshDevice, what: str) -> None:
    if device.l1_small_size <= 0:
        raise TtnnDoubleError(
            f"{what}: Out of Memory: not enough space to allocate the L1_SMALL buffer (l1_small_size = "
            f"{device.l1_small_size}); open the device with ttnn.open_device(device_id=0, l1_small_size=...)"
        )


def conv2d(
    *,
    input_tensor: Tensor,
    weight_tensor: Tensor,
    device: MeshDevice,
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
    dtype: DataType | None = None,
    bias_tensor: Tensor | None = None,
    conv_config: Any = None,
    compute_config: Any = None,
    memory_config: MemoryConfig | None = None,
    slice_config: Any = None,
    return_output_dim: bool = False,
    return_weights_and_bias: bool = False,
) -> Any:
    _needs_l1_small(device, "conv2d")
    x = need(input_tensor, "conv2d input", layout=None)
    nhwc = (batch_size, input_height, input_width, in_channels)
    if tuple(x.shape) not in (nhwc, (1, 1, batch_size * input_height * input_width, in_channels)):
        raise TtnnDoubleError(f"conv2d: input {tuple(x.shape)} is not NHWC {nhwc} (nor flattened [1, 1, NHW, C])")
    if weight_tensor.device() is not None or weight_tensor.layout is not ROW_MAJOR_LAYOUT:
        raise TtnnDoubleError("conv2d: weights go in as host row-major tensors (from_torch without device)")
    w = logical(weight_tensor).float()
    if tuple(w.shape) != (out_channels, in_channels // groups, *kernel_size):
        raise TtnnDoubleError(f"conv2d: weight {tuple(w.shape)} is not [out, in/groups, kh, kw]")
    b = None
    if bias_tensor is not None:
        b = logical(bias_tensor).float()
        if tuple(b.shape) != (1, 1, 1, out_channels):
            raise TtnnDoubleError(f"conv2d: bias {tuple(b.shape)} is not [1, 1, 1, out_channels]")
        b = b.reshape(-1)
    nchw = x.reshape(nhwc).permute(0, 3, 1, 2)
    y = F.conv2d(nchw, w, b, sizes(stride), sizes(padding), sizes(dilation), groups)
    oh, ow = y.shape[-2:]
    flat = y.permute(0, 2, 3, 1).reshape(1, 1, -1, out_channels).to(torch.bfloat16)
    out = make(flat, bfloat16, TILE_LAYOUT, device, _L1_SHARDED)
    if return_weights_and_bias:
        return out, (oh, ow), (weight_tensor, bias_tensor)
    return (out, (oh, ow)) if return_output_dim else out


def _pool_input(input_tensor: Tensor, what: str, n: int, h: int, w: int, c: int) -> torch.Tensor:
    device = input_tensor.device()
    if device is not None:
        _needs_l1_small(device, what)
    x = need(input_tensor, what, layout=ROW_MAJOR_LAYOUT)
    if tuple(x.shape) != (1, 1, n * h * w, c):
        raise TtnnDoubleError(f"{what}: input {tuple(x.shape)} is not [1, 1, N*H*W, C]")
    return x.reshape(n, h, w, c).permute(0, 3, 1, 2)


def _pool_output(y: torch.Tensor, c: int, device: MeshDevice | None, layout: Layout) -> Tensor:
    return make(y.permute(0, 2, 3, 1).reshape(1, 1, -1, c).to(torch.bfloat16), bfloat16, layout, device, _L1_SHARDED)


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
    *,
    memory_config: MemoryConfig | None = None,
    applied_shard_scheme: Any = None,
    deallocate_input: bool = False,
    reallocate_halo_output: bool = True,
    return_indices: bool = False,
    dtype: DataType = bfloat16,
    output_layout: Layout = ROW_MAJOR_LAYOUT,
) -> Tensor:
    x = _pool_input(input_tensor, "max_pool2d", batch_size, input_h, input_w, channels)
    y = F.max_pool2d(x, sizes(kernel_size), sizes(stride), sizes(padding), sizes(dilation), ceil_mode)
    return _pool_output(y, channels, input_tensor.device(), output_layout)


def avg_pool2d(
    input_tensor: Tensor,
    batch_size: int,
    input_h: int,
    input_w: int,
    channels: int,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
    *,
    memory_config: MemoryConfig | None = None,
    applied_shard_scheme: Any = None,
    compute_kernel_config: Any = None,
    deallocate_input: bool = False,
    reallocate_halo_output: bool = True,
    dtype: DataType = bfloat16,
    output_layout: Layout = ROW_MAJOR_LAYOUT,
) -> Tensor:
    x = _pool_input(input_tensor, "avg_pool2d", batch_size, input_h, input_w, channels)
    y = F.avg_pool2d(
        x, sizes(kernel_size), sizes(stride), sizes(padding), ceil_mode, count_include_pad, divisor_override
    )
    return _pool_output(y, channels, input_tensor.device(), output_layout)
