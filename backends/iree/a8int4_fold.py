"""torchao's int8-activation x int4 g32 linear as the rule leaves it (`fx_rewrites::a8int4_grouped_linear`), packed
at build time (issue 33).

`rules/a8int4_decode.py` replaces a decode's `linear(dequantize_affine(qx, [1, K], sx, zx, int8, -128, 127),
dequantize_affine(q, [1, 32], scale, zero, int8, -8, 7))` by `a8int4_grouped_linear(qx, sx, zx, q, scale, zero)`
(qx [rows, K] int8, sx [rows] float32, zx [rows] int32): one op over torchao's frozen weight tensors, since a rule sees
shapes, not values. `fold_a8int4` (run by `preparing.prepare_program`) then writes it as `a8int4_matvec(qx, sx, zx,
bytes, groups, ...)`: the int4 values two a byte and each group's scale and sum of values (`a8int4_dispatch`) in
place of torchao's int8 values and scales. Where the zero points are not all 0 (the kernel has none) the op becomes
`linear` of torchao's dequantized x over the float32 dequantized weight, with a warning.
"""

from __future__ import annotations

import warnings

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, Node

from fx_rewrites.backends.iree.a8int4_dispatch import A8INT4_MATVEC, pack_bytes, pack_groups
from fx_rewrites.backends.iree.frozen_fold import FrozenWeight, Replaced, fold_frozen, packed
from fx_rewrites.backends.iree.int4_fold import dequantized
from fx_rewrites.backends.iree.weight_layout import SUFFIX

#: output channels of the kernel's tile (4 x 8 lanes)
TILE = 4
#: channel tiles per workgroup
PER = 8
#: the packed parameters' key suffixes
BYTES, GROUPS = ".a8int4_bytes" + SUFFIX, ".a8int4_groups" + SUFFIX


def dequantized_x(qx: torch.Tensor, sx: torch.Tensor, zx: torch.Tensor) -> torch.Tensor:
    """torchao's `dequantize_affine` of x per row: (qx - zx) * sx in float32."""
    return (qx.to(torch.int32) - zx.to(torch.int32).unsqueeze(1)).to(torch.float32) * sx.unsqueeze(1)


@torch.library.custom_op("fx_rewrites::a8int4_grouped_linear", mutates_args=())
def a8int4_grouped_linear(
    qx: torch.Tensor,
    sx: torch.Tensor,
    zx: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
) -> torch.Tensor:
    """torchao's dequantized x [rows, K] @ its dequantized int4 g32 weight.T, before `fold_a8int4` packs it."""
    return dequantized_x(qx, sx, zx) @ dequantized(q, scale, zero).t()


@a8int4_grouped_linear.register_fake
def _(
    qx: torch.Tensor,
    sx: torch.Tensor,
    zx: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
) -> torch.Tensor:
    return qx.new_empty(qx.shape[0], q.shape[0], dtype=torch.float32)


A8INT4_GROUPED_LINEAR = torch.ops.fx_rewrites.a8int4_grouped_linear.default
aten = torch.ops.aten


def _rewrite(graph: Graph, node: Node, weight: FrozenWeight) -> tuple[Node, list[Replaced]]:
    qx, sx, zx = node.args[:3]
    if weight.symmetric_int4():
        args = (qx, sx, zx, weight.q, weight.scale, weight.qv.shape[0], TILE, PER)
        groups = packed(weight.sv, GROUPS, lambda t, qv=weight.qv: pack_groups(qv, t, TILE))
        return graph.call_function(A8INT4_MATVEC, args), [
            (weight.q, BYTES, packed(weight.qv, BYTES, lambda t: pack_bytes(t, TILE))),
            (weight.scale, GROUPS, groups),
        ]
    warnings.warn(
        f"{weight.name}: int4 zero points not all 0 (an asymmetric mapping): the int8 x int4 dispatch has "
        "no zero point, so this linear reads a float32 copy of the dequantized weight (8x its bytes)",
        stacklevel=4,
    )
    # torchao's dequantize of x: (qx - zx) * sx, float32
    zu = graph.call_function(aten.unsqueeze.default, (zx, 1))
    d = graph.call_function(aten.sub.Tensor, (qx, zu))
    su = graph.call_function(aten.unsqueeze.default, (sx, 1))
    x = graph.call_function(aten.mul.Tensor, (d, su))
    for made in (zu, d, su, x):
        made.meta["val"] = _val(made)
    new = graph.call_function(aten.linear.default, (x, weight.q))
    return new, [(weight.q, ".int4_dequantized" + SUFFIX, dequantized(weight.qv, weight.sv, weight.zv))]


def fold_a8int4(program: ExportedProgram) -> ExportedProgram:
    """`program` (a private copy: `prepare_program`'s) with each `a8int4_grouped_linear` over frozen weight tensors
    written as `a8int4_matvec` over the packed bytes and groups (or, where the zero points are not all 0, torchao's
    float32 form: a `linear` of the dequantized x over the dequantized weight)."""
    return fold_frozen(program, A8INT4_GROUPED_LINEAR, slice(3, 6), _rewrite)


def _val(node: Node) -> torch.Tensor:
    """The fake value of a node made here, from its arguments' (an aten op of fake tensors)."""
    args = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in node.args]
    with next(a for a in args if isinstance(a, torch.Tensor)).fake_mode:
        return node.target(*args)
