"""Elementwise ops and reductions in the double: each result rounded to bfloat16."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tests.backends.ttnn.reference_ttnn._core import DataType, MemoryConfig, Tensor, TtnnDoubleError, need, result


def unary(name: str, f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Tensor]:
    def op(
        input_tensor: Tensor,
        *,
        memory_config: MemoryConfig | None = None,
        output_tensor: Tensor | None = None,
        sub_core_grids: Any = None,
    ) -> Tensor:
        return result(f(need(input_tensor, name)), input_tensor.device())

    op.__name__ = op.__qualname__ = name
    return op


def _operand(t: Tensor | float, name: str) -> torch.Tensor:
    if isinstance(t, Tensor):
        return need(t, name)
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise TtnnDoubleError(f"{name}: the second operand is {type(t).__name__}, not a ttnn.Tensor or a number")
    return torch.tensor(float(t))


def binary(name: str, f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., Tensor]:
    def op(
        input_tensor_a: Tensor,
        input_tensor_b: Tensor | float,
        *,
        dtype: DataType | None = None,
        memory_config: MemoryConfig | None = None,
        output_tensor: Tensor | None = None,
    ) -> Tensor:
        a, b = need(input_tensor_a, name), _operand(input_tensor_b, name)
        return result(f(a, b), input_tensor_a.device())

    op.__name__ = op.__qualname__ = name
    return op


def where(
    predicate: Tensor,
    true_value: Tensor | float,
    false_value: Tensor | float,
    *,
    memory_config: MemoryConfig | None = None,
    output_tensor: Tensor | None = None,
    sub_core_grids: Any = None,
) -> Tensor:
    c = need(predicate, "where")
    x, y = _operand(true_value, "where"), _operand(false_value, "where")
    return result(torch.where(c != 0, x, y), predicate.device())


def leaky_relu(
    input_tensor: Tensor,
    negative_slope: float,
    *,
    memory_config: MemoryConfig | None = None,
    output_tensor: Tensor | None = None,
    sub_core_grids: Any = None,
) -> Tensor:
    return result(F.leaky_relu(need(input_tensor, "leaky_relu"), negative_slope), input_tensor.device())


def clamp(
    input_tensor: Tensor,
    min: float | None = None,
    max: float | None = None,
    *,
    memory_config: MemoryConfig | None = None,
    output_tensor: Tensor | None = None,
) -> Tensor:
    if min is None and max is None:
        raise TtnnDoubleError("clamp: min and max are both None")
    return result(torch.clamp(need(input_tensor, "clamp"), min, max), input_tensor.device())


def pow(
    input_tensor: Tensor,
    exponent: float,
    *,
    memory_config: MemoryConfig | None = None,
    output_tensor: Tensor | None = None,
) -> Tensor:
    return result(torch.pow(need(input_tensor, "pow"), exponent), input_tensor.device())


def reduction(name: str, f: Callable[..., torch.Tensor]) -> Callable[..., Tensor]:
    def op(
        input_tensor: Tensor,
        dim: int | Sequence[int] | None = None,
        keepdim: bool = False,
        *,
        memory_config: MemoryConfig | None = None,
        compute_kernel_config: Any = None,
    ) -> Tensor:
        x = need(input_tensor, name)
        dims = list(range(x.dim())) if dim is None else [dim] if isinstance(dim, int) else list(dim)
        return result(f(x, dims, keepdim), input_tensor.device())

    op.__name__ = op.__qualname__ = name
    return op


def elu(
    input_tensor: Tensor,
    *,
    alpha: float = 1.0,
    memory_config: MemoryConfig | None = None,
    output_tensor: Tensor | None = None,
    sub_core_grids: Any = None,
) -> Tensor:
    return result(F.elu(need(input_tensor, "elu"), alpha), input_tensor.device())


def tril(input_tensor: Tensor, *, diagonal: int = 0, memory_config: MemoryConfig | None = None) -> Tensor:
    return result(torch.tril(need(input_tensor, "tril"), diagonal), input_tensor.device())


def _addc(name: str, f: Callable[..., torch.Tensor]) -> Callable[..., Tensor]:
    def op(
        input_a: Tensor,
        input_b: Tensor,
        input_c: Tensor,
        *,
        value: float = 1.0,
        memory_config: MemoryConfig | None = None,
        output_tensor: Tensor | None = None,
    ) -> Tensor:
        a, b, c = (need(t, name) for t in (input_a, input_b, input_c))
        if not a.shape == b.shape == c.shape:
            raise TtnnDoubleError(
                f"{name}: operands of shapes {[tuple(t.shape) for t in (a, b, c)]}; give equal shapes"
            )
        return result(f(a, b, c, value=value), input_a.device())

    op.__name__ = op.__qualname__ = name
    return op


addcmul = _addc("addcmul", torch.addcmul)
addcdiv = _addc("addcdiv", torch.addcdiv)


def cumsum(
    input: Tensor,
    dim: int,
    *,
    dtype: DataType | None = None,
    reverse_order: bool = False,
    out: Tensor | None = None,
    memory_config: MemoryConfig | None = None,
) -> Tensor:
    x = need(input, "cumsum")
    return result(torch.cumsum(x.flip(dim) if reverse_order else x, dim), input.device())
