"""Convolution performance rules for IREE's llvm-cpu target, chosen by measurement (issue 25).

- `strided_pointwise_conv_as_slice`: a 1x1 convolution with a stride
  (ResNet's downsampling shortcuts) reads every stride-th pixel: the input
  sliced with that step, then the same convolution with stride 1. IREE 3.13
  lowers a strided 1x1 convolution, channels last, to a generic reduction
  at about 2 GFLOP/s (ResNet-50's three shortcuts: most of its time); the
  unstrided one is a matmul.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule

aten = torch.ops.aten

_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


def _conv(node: Node) -> dict[str, Any] | Miss:
    """The convolution's arguments by name (spatial lists as long as the kernel's spatial dims), or why not."""
    named = schema.arguments(node)
    w, x = _val(named["weight"]), _val(named["input"])
    if w is None or x is None:
        return Miss("no tensor value on the input or weight")
    spatial = w.dim() - 2
    if x.dim() != spatial + 2:
        return Miss("an unbatched input")
    if named.get("transposed", False):
        return Miss("a transposed convolution")
    if not w.dtype.is_floating_point:
        return Miss(f"a {w.dtype} convolution")
    out: dict[str, Any] = {"input": named["input"], "weight": named["weight"], "bias": named.get("bias")}
    for key, default in (("stride", 1), ("padding", 0), ("dilation", 1)):
        value = named.get(key, [default])
        if isinstance(value, str):
            return Miss(f"{key}={value!r}")
        out[key] = list(value) * spatial if len(value) == 1 else list(value)
    out["groups"] = named.get("groups", 1)
    out["spatial"] = spatial
    return out


def _strided_pointwise(node: Node) -> dict[str, Any] | Miss:
    c = _conv(node)
    if isinstance(c, Miss):
        return c
    kernel = list(_val(c["weight"]).shape[2:])
    if any(k != 1 for k in kernel):
        return Miss(f"a {kernel} kernel: not pointwise")
    if all(s == 1 for s in c["stride"]):
        return Miss("stride 1: nothing to slice")
    if any(p != 0 for p in c["padding"]):
        return Miss(f"padding {c['padding']}: the padded border would be sliced too")
    sizes = _val(c["input"]).shape[2:]
    if any(step != 1 and not isinstance(size, int) for size, step in zip(sizes, c["stride"], strict=True)):
        # the slice's length ((n + s - 1) // s) and the convolution's ((n - 1) // s + 1) are equal, but the
        # engine cannot prove it of two symbolic expressions and rolls the rewrite back
        return Miss(f"a symbolic size {list(sizes)} along a strided dim")
    return c


@rule(
    roots=_CONVS,
    when=_strided_pointwise,
    tags={"iree", "performance", "convolution"},
    doc=(
        "A convolution with a 1x1 (1, 1x1x1) kernel, a stride and no padding reads every stride-th input "
        "position: the input sliced with that step, then the same convolution with stride 1 (the same "
        "products and sums). IREE 3.13 on llvm-cpu lowers the strided form, channels last, to a generic "
        "reduction at about 2 GFLOP/s; ResNet-50's three downsampling shortcuts took most of its time."
    ),
)
def strided_pointwise_conv_as_slice(node: Node, rw: Rewriter, c: dict[str, Any]) -> Any:
    x = c["input"]
    for dim, step in enumerate(c["stride"], start=2):
        if step != 1:
            x = rw.call(aten.slice.Tensor, x, dim, 0, torch.iinfo(torch.int64).max, step)
    ones = [1] * c["spatial"]
    zeros = [0] * c["spatial"]
    rw.replace(
        node,
        rw.call(aten.convolution.default, x, c["weight"], c["bias"], ones, zeros, ones, False, zeros, c["groups"]),
    )


#: the rules of this module, by name (benchmarks/scale_cnn.py measures the route without them)
NAMES: tuple[str, ...] = ("strided_pointwise_conv_as_slice",)
