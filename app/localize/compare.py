"""When a backend's value of a node is wrong: its error against float64, measured against torch's own.

A float output is wrong when |backend - float64| is more than `factor` times |torch - float64| plus a floor
of a few of the dtype's epsilons of the output's magnitude (and the backend's declared rtol/atol, ttnn's
bfloat16); float64 is the same op run on the recorded inputs upcast. Integer and boolean outputs must be
equal to torch's; NaN and inf must sit where torch's are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch.fx import Node
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

#: the floor, in epsilons of the output's dtype times its magnitude (at least 1)
EPSILONS = 8


@attrs.frozen
class Judgement:
    """One output: `wrong`, and why (`reason`); errors are max abs differences, None where not measured."""

    wrong: bool
    reason: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    vs_eager: float | None = None
    backend_error: float | None = None
    torch_error: float | None = None
    tolerance: float | None = None


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            return value.to(torch.complex128)
        if value.is_floating_point():
            return value.to(torch.float64)
        return value.clone()  # an op writing into its input must not change the recorded value
    return value


def float64_reference(node: Node, values: Mapping[str, Any]) -> Any:
    """`node`'s op on its recorded inputs with floating tensors upcast to float64; None where torch cannot."""
    args = map_arg(node.args, lambda n: values[n.name])
    kwargs = map_arg(node.kwargs, lambda n: values[n.name])
    args, kwargs = pytree.tree_map(_upcast, (args, kwargs))
    try:
        with torch.no_grad():
            return node.target(*args, **kwargs)
    except Exception:
        return None


def _real(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_complex():
        return torch.view_as_real(t.to(torch.complex128))
    return t.to(torch.float64)


def _max(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def judge(
    got: torch.Tensor,
    expected: torch.Tensor,
    reference: Any,
    factor: float,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> Judgement:
    """Is the backend's `got` wrong, given torch's `expected` and the float64 `reference` (or None)?"""
    shape, dtype = tuple(expected.shape), expected.dtype
    if tuple(got.shape) != shape:
        return Judgement(True, f"shape {list(got.shape)} where eager's is {list(shape)}", shape, dtype)
    exact = not (expected.is_floating_point() or expected.is_complex())
    if exact:
        same = torch.equal(got.to(expected.dtype), expected)
        diff = _max(got.to(torch.float64) - expected.to(torch.float64))
        count = int((got.to(expected.dtype) != expected).sum())
        reason = "" if same else f"{count} of {expected.numel()} elements differ from eager's"
        return Judgement(not same, reason, shape, dtype, vs_eager=diff)
    if not (got.is_floating_point() or got.is_complex()):
        return Judgement(True, f"dtype {got.dtype} where eager's is {dtype}", shape, dtype)
    g, e = _real(got), _real(expected)
    nan = torch.isnan(g) != torch.isnan(e)
    if nan.any():
        return Judgement(True, f"NaN at {int(nan.sum())} elements where eager's is not, or the reverse", shape, dtype)
    inf = (torch.isinf(g) | torch.isinf(e)) & (g != e)
    if inf.any():
        return Judgement(True, f"inf at {int(inf.sum())} elements where eager's differs", shape, dtype)
    r = _real(reference) if isinstance(reference, torch.Tensor) and tuple(reference.shape) == shape else e
    finite = torch.isfinite(g) & torch.isfinite(e) & torch.isfinite(r)
    g, e, r = g[finite], e[finite], r[finite]
    vs_eager, backend_error, torch_error = _max(g - e), _max(g - r), _max(e - r)
    magnitude = _max(r)
    eps = torch.finfo(expected.real.dtype if expected.is_complex() else dtype).eps
    tolerance = factor * torch_error + EPSILONS * eps * max(1.0, magnitude) + atol + rtol * magnitude
    wrong = backend_error > tolerance
    name = str(dtype).removeprefix("torch.")
    reason = (
        f"off by {backend_error:.2e} against float64 where torch's {name} is off by {torch_error:.2e} "
        f"(tolerance {tolerance:.2e})"
    )
    return Judgement(wrong, reason, shape, dtype, vs_eager, backend_error, torch_error, tolerance)
