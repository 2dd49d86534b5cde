"""A transformer's MLP over a number of rows that is not a multiple of the matmul tile, padded to it (AVX2).

IREE 3.13's data tiling packs a float32 matmul's rows in tiles of 8 on AVX2. Between the MLP's two linears the
first's result is unpacked, the activation applied and the result packed again for the second, in one
dispatch; over a number of rows that is not a multiple of 8 (ViT: 4 images x 197 tokens = 788 rows) that pack
pads its last tile and the unpack runs a remainder: on a real Zen 3 core, ViT's MLP (788 rows, 256 -> 1024,
GELU, 1024 -> 256) spent 9.1 ms in that dispatch against 2.1 ms at 792 rows, its two matmuls 7-8 ms each
(docs/iree-3.13-findings.md, "An MLP over rows off the 8-row tile"). Padding each linear's input alone does not
help: IREE folds a pad into the pack that follows it and a slice into the unpack before it.

`mlp_rows_padded_to_tiles` pads the MLP's input rows with zeros to a multiple of `TILE` before the first linear
and slices the padded rows off after the second, so the activation between them runs over whole tiles. Every
row is computed as before (a row's products do not read the other rows), so the numbers are the unpadded form's.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten

#: the data-tiled matmul's row tile on AVX2 (8x8x1 `mmt4d` tiles for float32)
TILE = 8
#: element-wise functions of one tensor an MLP applies between its linears
ACTIVATIONS = (
    aten.gelu.default,
    aten.relu.default,
    aten.silu.default,
    aten.tanh.default,
    aten.sigmoid.default,
)


@attrs.frozen
class Mlp:
    """linear `second`(activations(linear `first`(x))) over `rows` rows (the product of x's leading sizes)."""

    first: Node
    activations: tuple[Node, ...]
    rows: int


def linear_args(node: Node) -> tuple[Any, Any, Any]:
    """`aten.linear`'s input, weight and bias (None where absent), bound by its schema."""
    named = schema.arguments(node)
    return named["input"], named["weight"], named.get("bias")


def _single_use(node: Node) -> bool:
    return len(node.users) == 1


def _mlp(node: Node) -> Mlp | Miss:
    x, _, _ = linear_args(node)
    chain: list[Node] = []
    while isinstance(x, Node) and x.target in ACTIVATIONS:
        if not _single_use(x) or len(x.args) != 1 or x.kwargs.get("approximate", "none") not in ("none", "tanh"):
            return Miss(f"{x.name}: used more than once, or an activation with other arguments")
        chain.append(x)
        x = x.args[0]
    if not chain:
        return Miss("the linear's input is not an activation of another linear")
    if not (isinstance(x, Node) and x.target is aten.linear.default and _single_use(x)):
        return Miss("the activation's input is not a linear used once")
    value = fake_value(x)
    if value.dtype != torch.float32:
        return Miss(f"{value.dtype}: measured in float32 only")
    if value.dim() < 2:
        return Miss(f"a linear of rank {value.dim()}: no rows")
    lead = value.shape[:-1]
    if not all(isinstance(s, int) for s in lead):
        return Miss("symbolic leading sizes: whether the rows are a multiple of the tile is not known")
    rows = math.prod(lead)
    if rows % TILE == 0:
        return Miss(f"{rows} rows: a multiple of {TILE} already")
    if rows < TILE:
        return Miss(f"{rows} rows: fewer than a tile (not measured)")
    return Mlp(x, tuple(reversed(chain)), rows)


@rule(
    roots=(aten.linear.default,),
    when=_mlp,
    tags={"iree", "performance", "matmul"},
    doc=(
        "A float32 MLP, linear -> element-wise activations -> linear, over a static number of rows that is not "
        "a multiple of 8 (ViT: 4 x 197 tokens), has its input rows padded with zeros to a multiple of 8 before "
        "the first linear and the padded rows sliced off after the second: the same numbers. IREE 3.13's data "
        "tiling (8-row tiles on AVX2) fuses the unpack, the activation and the pack between the two into one "
        "dispatch that runs 4x slower over a remainder (ViT's MLP on Zen 3: 9.1 ms at 788 rows, 2.1 at 792)."
    ),
)
def mlp_rows_padded_to_tiles(node: Node, rw: Rewriter, *, found: Mlp) -> Any:
    x, w1, b1 = linear_args(found.first)
    _, w2, b2 = linear_args(node)
    value = fake_value(x)
    padded = -(-found.rows // TILE) * TILE
    rows = rw.call(aten.reshape.default, x, [found.rows, value.shape[-1]])
    h = rw.call(
        aten.linear.default, rw.call(aten.constant_pad_nd.default, rows, [0, 0, 0, padded - found.rows], 0.0), w1, b1
    )
    for act in found.activations:
        h = rw.call(act.target, h, **act.kwargs)
    y = rw.call(aten.slice.Tensor, rw.call(aten.linear.default, h, w2, b2), 0, 0, found.rows)
    out = fake_value(node)
    rw.replace(node, rw.call(aten.reshape.default, y, [*out.shape]))
