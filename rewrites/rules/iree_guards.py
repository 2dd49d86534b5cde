"""Guards against IREE 3.13's silent wrong results (and the errors next to them).

Each rule rewrites a form IREE compiles but computes wrong (or rejects) into
one it computes right; docs/iree-3.13-findings.md lists what was measured.
Every guard's test asserts that IREE is wrong without the rule, so a test
fails when IREE fixes the bug and the guard can go.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule

aten = torch.ops.aten

#: aten.slice's "to the end" as torch.export writes it
_TO_END = 9223372036854775807


def _pads(node: Node) -> tuple[Node, list[int]] | Miss:
    """(input, pads) of a constant pad with a negative amount."""
    named = schema.bind(node.target, node.args, dict(node.kwargs))
    if named.get("mode", "constant") != "constant":
        return Miss(f"mode={named['mode']!r}: torch rejects negative pads there itself")
    pads = list(named["pad"])
    if not all(isinstance(p, int) for p in pads):
        return Miss("a symbolic pad amount")
    if not any(p < 0 for p in pads):
        return Miss("no negative pad")
    return named["self"], pads


def _negative_pad(node: Node) -> bool | Miss:
    found = _pads(node)
    return found if isinstance(found, Miss) else True


@rule(
    roots=(aten.constant_pad_nd.default, aten.pad.default),
    name="negative_pad_to_slice_for_iree",
    when=_negative_pad,
    tags={"iree", "guard"},
    doc=(
        "A constant pad with a negative amount (a crop: `F.pad(x, (0, 0, 1, -1))`, RWKV's time shift "
        "`nn.ZeroPad2d((0, 0, 1, -1))`) becomes aten.slice of the cropped sides, then the pad of the "
        "non-negative amounts. IREE 3.13 compiles a negative high pad and silently returns the input "
        'unshifted (wrong numbers, no error); a negative low pad fails: "expected offsets to be '
        'non-negative, but got -1".'
    ),
)
def negative_pad_to_slice_for_iree(node: Node, rw: Rewriter) -> Any:
    x, pads = _pads(node)
    rank = x.meta["val"].dim()
    for i in range(len(pads) // 2):
        before, after = pads[2 * i], pads[2 * i + 1]
        if before < 0 or after < 0:  # torch's slice takes a negative end from the size, symbolic or not
            start = -before if before < 0 else 0
            x = rw.call(aten.slice.Tensor, x, rank - 1 - i, start, after if after < 0 else _TO_END)
    kept = [max(p, 0) for p in pads]
    if any(kept):
        named = schema.bind(node.target, node.args, dict(node.kwargs))
        named.update({"self": x, "pad": kept})
        args, kwargs = schema.unbind(node.target, named, explicit=False)
        x = rw.call(node.target, *args, **kwargs)
    rw.replace(node, x)


RULES = (negative_pad_to_slice_for_iree,)
