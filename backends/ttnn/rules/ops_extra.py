"""More stand-ins (ops.py's continuation, by the same `_define`): elu, tril, addcmul/addcdiv, min, cumsum,
stack, repeat, roll. Each body is the op's meaning in torch with a bfloat16 result."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fx_rewrites.backends.ttnn.rules.ops import _define, _round


def _elu(x: Tensor, alpha: float) -> Tensor:
    return _round(F.elu(x.float(), alpha))


def _tril(x: Tensor, diagonal: int) -> Tensor:
    return _round(torch.tril(x, diagonal))


def _addcmul(a: Tensor, b: Tensor, c: Tensor, value: float) -> Tensor:
    return _round(torch.addcmul(a.float(), b.float(), c.float(), value=value))


def _addcdiv(a: Tensor, b: Tensor, c: Tensor, value: float) -> Tensor:
    return _round(torch.addcdiv(a.float(), b.float(), c.float(), value=value))


def _min(x: Tensor, dim: list[int], keepdim: bool) -> Tensor:
    return _round(torch.amin(x, dim, keepdim))


def _cumsum(x: Tensor, dim: int) -> Tensor:
    return _round(torch.cumsum(x.float(), dim))


def _stack(tensors: list[Tensor], dim: int) -> Tensor:
    return _round(torch.stack(tensors, dim))


def _repeat(x: Tensor, repeat_dims: list[int]) -> Tensor:
    return _round(x.repeat(repeat_dims))


def _roll(x: Tensor, shifts: list[int], dim: list[int]) -> Tensor:
    return _round(torch.roll(x, shifts, dim))


elu = _define("elu", _elu)
tril = _define("tril", _tril)
addcmul = _define("addcmul", _addcmul)
addcdiv = _define("addcdiv", _addcdiv)
reduce_min = _define("min", _min)
cumsum = _define("cumsum", _cumsum)
stack = _define("stack", _stack)
repeat = _define("repeat", _repeat)
roll = _define("roll", _roll)
