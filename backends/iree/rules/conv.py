"""Guard against IREE 3.13's convolution with one window over a longer map (static or by its Dim range).

A convolution whose output along a spatial dim is 1 while the (padded) input
is longer than the window (a 3x3/2 conv with padding 1 on a 2x2 map; a
6x6/6 patch conv on maps of 6 to 11, whose output h//6 is 1 for every size
the Dim range allows) leaves the rest of the input unread. IREE 3.13 fails
to compile it with static sizes; with Dim sizes it derives the input's size
from the static 1 a user is typed with (`conv(x) * 2` is [b, o, 1, 1]) and
rejects every other size at run time, or returns wrong values (with padding:
`conv2d(x, w, stride=4, padding=1)` with a 5x5 kernel on maps of 3 to 6,
wrong on 6x6). The guard pads the input explicitly and cuts it to the
window, so the convolution reads exactly what torch's does, with static
sizes along those dims (docs/iree-3.13-findings.md section 8).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.backends.iree.rules.pooling import known
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: the conv ops as torch.export leaves them (`.padding`: padding="valid" / "same"), and as aot_autograd
#: (torch.compile) and run_decompositions do
CONVS = (
    *(getattr(op, overload) for op in (aten.conv1d, aten.conv2d, aten.conv3d) for overload in ("default", "padding")),
    aten.convolution.default,
)


def _per_dim(value: Any, n: int, default: int) -> list[Any]:
    if value is None:
        return [default] * n
    value = list(value) if isinstance(value, (list, tuple)) else [value]
    return value * n if len(value) == 1 else value


def _conv_args(node: Node) -> dict[str, Any] | Miss:
    """The convolution's arguments by name, with padding, stride, dilation and window span as n ints."""
    named = schema.arguments(node)
    x, w, out = named["input"].meta.get("val"), named["weight"].meta.get("val"), node.meta.get("val")
    if not all(isinstance(v, torch.Tensor) for v in (x, w, out)):
        return Miss("no tensor values")
    n = w.dim() - 2
    if named.get("transposed", False):
        return Miss("a transposed convolution")
    padding = named.get("padding", 0)
    if padding == "valid":
        padding = 0
    elif isinstance(padding, str):
        return Miss(f"padding={padding!r} (an output as long as the input)")
    if not all(isinstance(k, int) for k in w.shape[2:]):
        return Miss("a symbolic kernel size")
    padding = _per_dim(padding, n, 0)
    stride = _per_dim(named.get("stride"), n, 1)
    dilation = _per_dim(named.get("dilation"), n, 1)
    span = [d * (k - 1) + 1 for d, k in zip(dilation, w.shape[2:])]
    return {**named, "n": n, "padding": padding, "stride": stride, "dilation": dilation, "span": span}


def conv_one_window_dims(node: Node) -> list[int]:
    """The spatial dims (0 = the first) along which convolution `node` is one window over a longer padded
    input, for every size the Dim ranges allow (`h//6` for h in [6, 11] is 1; an h of 6 exactly is no such
    dim)."""
    found = _conv_args(node)
    if isinstance(found, Miss):
        return []
    n, out, x = found["n"], node.meta["val"], found["input"].meta["val"]
    sizes, outs = x.shape[x.dim() - n :], out.shape[out.dim() - n :]
    padded = [size + 2 * p for size, p in zip(sizes, found["padding"])]
    return [
        d
        for d in range(n)
        if known(outs[d] == 1) and known(padded[d] >= found["span"][d]) and not known(padded[d] == found["span"][d])
    ]


def _single_window(node: Node) -> dict[str, Any] | Miss:
    found = _conv_args(node)
    if isinstance(found, Miss):
        return found
    dims = conv_one_window_dims(node)
    if not dims:
        return Miss("no output size 1 (for every size the Dim range allows) with a longer padded input")
    return {**found, "dims": dims}


@rule(
    roots=CONVS,
    when=_single_window,
    tags={"iree"},
    doc=(
        "A convolution with an output size of 1 along a dimension whose padded input is longer than the "
        "window, statically (a 3x3/2 conv with padding 1 on a 2x2 map: MobileViT and PoolFormer at 32 px, "
        "the last stage of any CNN on small images) or for every size a Dim range allows (a 6x6/6 patch conv "
        "on maps of 6 to 11), reads exactly its window: the input is padded explicitly (constant_pad_nd) and "
        "sliced to the window; conv1d/2d/3d as exported and aten.convolution as aot_autograd leaves them. "
        "IREE 3.13 miscompiles the original: \"'linalg.generic' op inferred input/output operand #1 has "
        "shape's dimension #2 to be 4, but found 3\" with static sizes; with Dim sizes and a user typed 1 "
        "(`conv(x) * 2`) a run-time shape error (`expected 6 but have 7`) or, with padding, wrong values."
    ),
)
def conv_single_window_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    x, n, padding, span = found["input"], found["n"], found["padding"], found["span"]
    lead = x.meta["val"].dim() - n
    if any(padding):
        pads = [p for p in reversed(padding) for _ in (0, 1)]  # last dimension first, (before, after) each
        x = rw.call(aten.constant_pad_nd.default, x, pads, 0.0)
    for d in found["dims"]:
        x = rw.call(aten.slice.Tensor, x, lead + d, 0, span[d])
    if not all(isinstance(s, int) for s in x.meta["val"].stride()):
        # a cut of a Dim-sized map has symbolic strides: conv1d's and a later reshape's fake kernels guard on
        # them (specialising the Dims); a contiguous copy has strides of the cut's own sizes
        x = rw.call(aten.clone.default, x, memory_format=torch.contiguous_format)
    target = node.target.overloadpacket.default  # conv2d.padding takes padding as a string
    named = {k: v for k, v in found.items() if k in schema.arg_names(target)}
    named.update(input=x, padding=[0] * n, stride=found["stride"], dilation=found["dilation"])
    args, kwargs = schema.unbind(target, named, explicit=True)
    rw.replace(node, rw.call(target, *args, **kwargs))


RULES = RuleSet([conv_single_window_for_iree], name="iree-conv")
