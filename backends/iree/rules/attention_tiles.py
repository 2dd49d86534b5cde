"""Attention over a length that is not a multiple of the matmul tile, written out padded to the tile (AVX2).

IREE 3.13's data tiling packs the scores' products in 8x8 tiles on AVX2. At a length that is not a multiple of
8 (ViT's 197 tokens, the Whisper encoder's 500 or 1500) the dispatches around the products run a remainder:
on a real Zen 3 core, one head of 500 tokens against 496 (`iree-benchmark-module`, one thread), the row max and
exponentials 0.26 -> 0.62 ms (IREE distributes 25 rows a workgroup, three 8-row vectors and a row of remainder)
and the pack of the exponentials for the product with the values 0.08 -> 0.43 ms (a pack with padding): the
attention 1.5-1.8x the time of 496 tokens (docs/iree-3.13-findings.md, section 42).

`attention_padded_to_tiles` writes such an attention out over query rows and keys padded with zeros to a
multiple of `TILE`: the padded keys' scores are set to -inf (their exponentials are 0: they add nothing to a
row's sum or product), the padded query rows are computed and sliced off. Every real score, row max, sum and
product is the one the unpadded form computes, so the numbers are those of `attention_as_matmul_softmax`; the
softmax that follows is left to the later rules (`softmax_matmul_normalized_after`).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch.fx import Node

from fx_rewrites.backends.iree.rules.attention import SDPA, Attention, _writable, per_query_head
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten

#: the data-tiled matmul's tile on AVX2 (8x8x1 `mmt4d` tiles for float32)
TILE = 8


@attrs.frozen
class Padded:
    """An attention and the query rows and keys it is padded to."""

    attention: Attention
    rows: int
    keys: int


def _up(n: int) -> int:
    return -(-n // TILE) * TILE


def _padded(node: Node) -> Padded | Miss:
    a = _writable(node)
    if isinstance(a, Miss):
        return a
    if a.mask is not None or a.is_causal:
        return Miss("a mask or is_causal: not measured padded (the padded keys would need the mask padded too)")
    q, k = fake_value(a.query), fake_value(a.key)
    if q.dtype != torch.float32:
        return Miss(f"{q.dtype}: measured in float32 only")
    if q.dim() < 2:
        return Miss(f"a query of rank {q.dim()}")
    rows, keys = q.shape[-2], k.shape[-2]
    if not (isinstance(rows, int) and isinstance(keys, int)):
        return Miss("a symbolic query or key length: whether it is a multiple of the tile is not known")
    if rows % TILE == 0 and keys % TILE == 0:
        return Miss(f"{rows} query rows and {keys} keys: multiples of {TILE} already")
    if rows == 0 or keys == 0:
        return Miss("an empty query or key length")
    if rows < TILE:
        return Miss(f"{rows} query rows: fewer than a tile (a decode step; not measured)")
    return Padded(a, _up(rows), _up(keys))


def _pad_rows(rw: Rewriter, x: Node, to: int) -> Node:
    """`x` with zero rows appended on dim -2 up to `to` rows (itself when it has them)."""
    have = fake_value(x).shape[-2]
    return x if have == to else rw.call(aten.constant_pad_nd.default, x, [0, 0, 0, to - have], 0.0)


@rule(
    roots=(SDPA,),
    when=_padded,
    tags={"iree", "performance", "attention"},
    doc=(
        "float32 scaled_dot_product_attention without a mask over static query and key lengths, one of them not "
        "a multiple of 8 (ViT's 197 tokens, the Whisper encoder's 500), is written out over queries and keys "
        "padded with zeros to a multiple of 8, the padded keys' scores -inf, the padded rows sliced off: the same "
        "numbers as the unpadded form. IREE 3.13's data-tiled 8x8 products on AVX2 leave remainders that cost the "
        "row max, exponentials and pack 2.4-5.6x their time at 496 tokens (one head of 500, Zen 3)."
    ),
)
def attention_padded_to_tiles(node: Node, rw: Rewriter, *, found: Padded) -> Any:
    a = found.attention
    q, qv = a.query, fake_value(a.query)
    k, v = per_query_head(rw, q, a.key, a.value)
    rows, keys = qv.shape[-2], fake_value(k).shape[-2]
    q, k, v = _pad_rows(rw, q, found.rows), _pad_rows(rw, k, found.keys), _pad_rows(rw, v, found.keys)
    scale = a.scale_or_default()
    scores = rw.call(aten.mul.Scalar, rw.call(aten.matmul.default, q, rw.call(aten.transpose.int, k, -2, -1)), scale)
    if found.keys != keys:
        padded_key = rw.call(aten.ge.Scalar, rw.call(aten.arange.default, found.keys, device=qv.device), keys)
        scores = rw.call(aten.masked_fill.Scalar, scores, padded_key, float("-inf"))
    out = rw.call(aten.matmul.default, rw.call(aten._softmax.default, scores, -1, False), v)
    if found.rows != rows:
        out = rw.call(aten.slice.Tensor, out, -2, 0, rows)
    rw.replace(node, out)
