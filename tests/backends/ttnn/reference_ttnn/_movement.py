"""Data movement in the double: reshape, permute, transpose, concat, slice, pad, expand."""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import Any

from tests.backends.ttnn.reference_ttnn._core import (
    TILE_LAYOUT,
    MemoryConfig,
    Tensor,
    TtnnDoubleError,
    logical,
    make,
    need,
    result,
    sizes,
)


def reshape(
    input_tensor: Tensor,
    shape: Sequence[int],
    *,
    memory_config: MemoryConfig | None = None,
    pad_value: float | None = None,
) -> Tensor:
    if isinstance(input_tensor, Tensor) and input_tensor.device() is None:  # ttnn reshapes host tensors too
        data = logical(input_tensor)
    else:
        data = need(input_tensor, "reshape", layout=None, dtype=None)
    if math.prod(shape) != data.numel():
        raise TtnnDoubleError(
            f"reshape: {tuple(input_tensor.shape)} has {data.numel()} elements, not {math.prod(shape)}"
        )
    return make(data.reshape(sizes(shape)), input_tensor.dtype, input_tensor.layout, input_tensor.device())


def permute(
    input_tensor: Tensor, dims: Sequence[int], *, memory_config: MemoryConfig | None = None, pad_value: float = 0.0
) -> Tensor:
    data = need(input_tensor, "permute", layout=None, dtype=None)
    return make(data.permute(sizes(dims)), input_tensor.dtype, input_tensor.layout, input_tensor.device())


def transpose(
    input_tensor: Tensor, dim1: int, dim2: int, *, memory_config: MemoryConfig | None = None, pad_value: float = 0.0
) -> Tensor:
    data = need(input_tensor, "transpose", layout=None, dtype=None)
    return make(data.transpose(dim1, dim2), input_tensor.dtype, input_tensor.layout, input_tensor.device())


def concat(
    tensors: Sequence[Tensor],
    dim: int = 0,
    *,
    memory_config: MemoryConfig | None = None,
    output_tensor: Tensor | None = None,
    groups: int = 1,
    sub_core_grids: Any = None,
) -> Tensor:
    import torch

    datas = [need(t, "concat", layout=tensors[0].layout) for t in tensors]
    return result(torch.cat(datas, dim), tensors[0].device(), tensors[0].layout)


def slice(
    input_tensor: Tensor,
    slice_start: Sequence[int],
    slice_end: Sequence[int],
    slice_step: Sequence[int] | None = None,
    *,
    memory_config: MemoryConfig | None = None,
    output_tensor: Tensor | None = None,
    pad_value: float | None = None,
    sub_core_grids: Any = None,
) -> Tensor:
    x = need(input_tensor, "slice", layout=None)
    steps = slice_step or [1] * x.dim()
    if not len(slice_start) == len(slice_end) == len(steps) == x.dim():
        raise TtnnDoubleError(f"slice: starts/ends/steps need one entry per dimension of {tuple(x.shape)}")
    index = tuple(builtins.slice(a, b, c) for a, b, c in zip(slice_start, slice_end, steps))
    return result(x[index], input_tensor.device(), input_tensor.layout)


def pad(
    input_tensor: Tensor,
    padding: Sequence[Sequence[int]],
    value: float,
    *,
    use_multicore: bool = True,
    memory_config: MemoryConfig | None = None,
    sub_core_grids: Any = None,
) -> Tensor:
    import torch.nn.functional as F

    x = need(input_tensor, "pad", layout=None)
    if len(padding) != x.dim():
        raise TtnnDoubleError(f"pad: {len(padding)} (before, after) pairs for a rank-{x.dim()} tensor")
    if x.dim() >= 4 and any(any(p) for p in padding):
        raise TtnnDoubleError(
            "pad: a rank-4 input keeps its logical shape in ttnn 0.81.1 (only its padded shape grows: seen when "
            "tools/ttnn_check replays ttnn.pad on host tensors); pad rank 1 to 3 tensors"
        )
    if input_tensor.layout is TILE_LAYOUT and any(before for before, _ in padding):
        raise TtnnDoubleError("ttnn.pad: on device tile padding does not support front padding")
    flat = [n for before, after in reversed(list(padding)) for n in (before, after)]
    return result(F.pad(x, flat, value=value), input_tensor.device(), input_tensor.layout)


def expand(input_tensor: Tensor, output_shape: Sequence[int], *, memory_config: MemoryConfig | None = None) -> Tensor:
    x = need(input_tensor, "expand", layout=None)
    lead = len(output_shape) - x.dim()
    for i, (have, want) in enumerate(zip(x.shape, output_shape[lead:])):
        if have != want and have != 1 and want != -1:
            raise TtnnDoubleError(f"expand: dimension {i} of size {have} cannot become {want}")
    return result(x.expand(sizes(output_shape)), input_tensor.device(), input_tensor.layout)


def stack(input_tensors: Sequence[Tensor], dim: int) -> Tensor:
    import torch

    datas = [need(t, "stack") for t in input_tensors]
    return result(torch.stack(datas, dim), input_tensors[0].device())


def repeat(
    input_tensor: Tensor,
    repeat_dims: Sequence[int],
    *,
    memory_config: MemoryConfig | None = None,
    optional_output_tensor: Tensor | None = None,
) -> Tensor:
    x = need(input_tensor, "repeat")
    if len(repeat_dims) != x.dim():
        raise TtnnDoubleError(f"repeat: {len(repeat_dims)} repeats for a rank-{x.dim()} tensor")
    return result(x.repeat(sizes(repeat_dims)), input_tensor.device())


def roll(
    input_tensor: Tensor, shifts: Sequence[int], dim: Sequence[int], *, memory_config: MemoryConfig | None = None
) -> Tensor:
    import torch

    return result(torch.roll(need(input_tensor, "roll"), sizes(shifts), sizes(dim)), input_tensor.device())
