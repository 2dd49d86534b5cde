"""Masked attention over long static keys, a block of keys at a time, each block over the query rows it lets in.

A causal prefill over a static cache (`compile_lm`: queries D, keys the whole cache) written out as one
matmul, softmax, matmul computes every score, masked ones included: half of them at a full prompt, most at a
short one. `attention_by_key_blocks` cuts the keys into 2 to `MAX_BLOCKS` static blocks of at least
`KEY_BLOCK`; for each block it reads from the mask the first query row that the block lets any key through to
(an integer the program reads at run time), and computes that block's scores for the rows from there on only;
the rows before it have every key of the block masked, so leaving them out changes no number. The blocks'
partial results are combined as flash attention combines them (each block's row max, its exponentials' sum
and product with the values, rescaled to the overall max). Exact for any mask; the saving comes from masks
whose allowed keys start late for early rows (causal, a prompt shorter than the cache). A row that masks
every key gives 0, as torch 2.13 CPU eager.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import attrs
import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fx_rewrites.backends.iree.rules.attention import SDPA, Attention, _repeat_heads, bind
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule

aten = torch.ops.aten

#: the fewest keys a block: an attention over fewer than two such blocks is left whole
KEY_BLOCK = 256
#: the most blocks: each adds a block's run-time row count to the dispatch that combines them, and IREE 3.13's
#: llvm-cpu runtime refuses a dispatch of more than 64 constants ("dispatch requiring 68 constants exceeds limit
#: of 64" at 9 blocks of 2081 keys)
MAX_BLOCKS = 4
#: the fewest keys per unit of head size: each block adds work on [heads, rows, head size] (its product, padded and
#: rescaled) against the scores it skips ([heads, rows, keys / 2] at a causal prefill). One prefill attention,
#: IREE llvm-cpu local-sync, one thread, CPU ms, load 27-35 (docs/performance.md): 8 heads of 64 over 2081 keys
#: (32.5 keys per unit) 759 -> 392; 32 heads of 128 over 1041 keys (8.1) 719 -> 1130, slower: left whole
MIN_KEYS_PER_HEAD_SIZE = 32
NEG_INF = float("-inf")


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


@attrs.frozen
class KeyBlocks:
    """An attention whose static keys are cut into `blocks` (start, end) ranges."""

    attention: Attention
    blocks: tuple[tuple[int, int], ...]


def _key_blocks(node: Node) -> KeyBlocks | Miss:
    a = bind(node)
    q, k, v, mask = (_val(x) for x in (a.query, a.key, a.value, a.mask))
    if mask is None:
        return Miss("no mask: every block sees every row (attention_by_head_groups, attention_as_matmul_softmax)")
    if mask.dtype != torch.bool:
        return Miss(f"a {mask.dtype} mask: only bool masks (transformers' SDPA masks) are written in blocks")
    if a.dropout_p != 0.0 or a.is_causal or q.dtype != torch.float32:
        return Miss(f"dropout_p={a.dropout_p}, is_causal={a.is_causal}, {q.dtype}: float32 inference with a mask only")
    if not (q.dim() == k.dim() == v.dim() == mask.dim() == 4):
        return Miss(f"ranks {q.dim()}/{k.dim()}/{v.dim()}/{mask.dim()}: 4-D query, key, value and mask only")
    keys, size = k.shape[-2], q.shape[-1]
    if not isinstance(keys, int) or keys < 2 * KEY_BLOCK:
        return Miss(f"{keys} keys: fewer than two blocks of {KEY_BLOCK} (or symbolic)")
    if not isinstance(size, int) or (a.scale is None and size <= 0):
        return Miss("a symbolic head size")
    if keys < MIN_KEYS_PER_HEAD_SIZE * size:
        return Miss(
            f"{keys} keys for a head size of {size}: fewer than {MIN_KEYS_PER_HEAD_SIZE} a unit (measured slower)"
        )
    rows = q.shape[-2]
    if isinstance(rows, int) and rows < KEY_BLOCK:
        return Miss(f"{rows} static query rows: too few to skip a block's share of")
    if not statically_known_true(mask.shape[-2] == rows) or mask.shape[-1] != keys:
        return Miss(f"a mask of shape {tuple(mask.shape)} is not one row a query over every key")
    if q.shape[-3] != k.shape[-3] and not (a.enable_gqa and isinstance(q.shape[-3], int)):
        return Miss("query and key heads differ without enable_gqa")
    count = min(MAX_BLOCKS, keys // KEY_BLOCK)
    size = -(-keys // count)
    return KeyBlocks(a, tuple((s, min(keys, s + size)) for s in range(0, keys, size)))


def _rows_let_in(rw: Rewriter, block_mask: Node, rows: Any) -> Node:
    """How many query rows, counted back from the last, start at the first row whose block of the mask lets any
    key through (0 when none does): an integer read at run time."""
    through = rw.call(aten.any.dim, block_mask, -1)  # [b, h, rows]
    through = rw.call(aten.any.dim, rw.call(aten.reshape.default, through, [-1, rows]), 0)  # [rows]
    left = rw.call(aten.arange.start_step, rows, 0, -1, dtype=torch.int64)  # rows - i
    count = rw.call(aten.item.default, rw.call(aten.amax.default, rw.call(aten.mul.Tensor, left, through)))
    torch._check(count.meta["val"] >= 0)
    torch._check(count.meta["val"] <= (_val(block_mask).shape[-2]))
    return count


@rule(
    roots=(SDPA,),
    when=_key_blocks,
    tags={"iree", "performance", "attention"},
    doc=(
        "float32 scaled_dot_product_attention with a bool mask over at least two blocks of 256 static keys and "
        "at least 32 keys a unit of head size (compile_lm's prefill over its static cache) is written out a block "
        "of keys at a time: each block's scores only for the query rows from the first one the block's mask lets "
        "through (read at run time; the rows before have every key of the block masked), the blocks combined by "
        "their row maxima as flash attention does; a fully masked row gives 0. A causal prefill computes about "
        "half the scores: 2048 queries over 2081 keys, 8 heads of 64, IREE 3.13 llvm-cpu 759 -> 392 ms (32 heads "
        "of 128 over 1041 keys ran slower: left whole)."
    ),
)
def attention_by_key_blocks(node: Node, rw: Rewriter, *, found: KeyBlocks) -> Any:
    a = found.attention
    q, k, v, mask = a.query, a.key, a.value, a.mask
    qv, kv = _val(q), _val(k)
    if qv.shape[-3] != kv.shape[-3]:
        k = _repeat_heads(rw, k, qv.shape[-3] // kv.shape[-3])
        v = _repeat_heads(rw, v, qv.shape[-3] // kv.shape[-3])
    scale = a.scale if a.scale is not None else 1.0 / math.sqrt(qv.shape[-1])
    q = rw.call(aten.mul.Scalar, q, scale)  # [b, h, rows, e]
    rows = rw.size(q, -2)
    head = [rw.size(q, 0), rw.size(q, 1)]
    maxima, sums, products = [], [], []
    for start, end in found.blocks:
        block_mask = rw.call(aten.slice.Tensor, mask, -1, start, end)
        count = _rows_let_in(rw, block_mask, rows)
        first = rw.call(operator.sub, rows, count)
        scores = rw.call(
            aten.matmul.default,
            rw.call(aten.slice.Tensor, q, -2, first, rows),
            rw.call(aten.transpose.int, rw.call(aten.slice.Tensor, k, -2, start, end), -2, -1),
        )
        shut = rw.call(aten.logical_not.default, rw.call(aten.slice.Tensor, block_mask, -2, first, rows))
        scores = rw.call(aten.masked_fill.Scalar, scores, shut, NEG_INF)
        top = rw.call(aten.amax.default, scores, [-1], True)
        finite_top = rw.call(aten.masked_fill.Scalar, top, rw.call(aten.eq.Scalar, top, NEG_INF), 0.0)
        weights = rw.call(aten.exp.default, rw.call(aten.sub.Tensor, scores, finite_top))
        # row sums as a matrix-vector product: IREE 3.13's row reductions are slow (softmax_matmul_normalized_after)
        ones = rw.call(aten.ones.default, [end - start, 1], dtype=qv.dtype, device=qv.device)
        total = rw.call(aten.matmul.default, weights, ones)
        product = rw.call(aten.matmul.default, weights, rw.call(aten.slice.Tensor, v, -2, start, end))
        # the rows before `first` (every key of this block masked): max -inf, sum 0, product 0
        for parts, piece, fill, width in (
            (maxima, top, NEG_INF, 1),
            (sums, total, 0.0, 1),
            (products, product, 0.0, qv.shape[-1]),
        ):
            before = rw.call(aten.full.default, [*head, first, width], fill, dtype=qv.dtype, device=qv.device)
            parts.append(rw.call(aten.cat.default, [before, piece], -2))
    overall = maxima[0]
    for top in maxima[1:]:
        overall = rw.call(aten.maximum.default, overall, top)
    overall = rw.call(aten.masked_fill.Scalar, overall, rw.call(aten.eq.Scalar, overall, NEG_INF), 0.0)
    out, total = None, None
    for top, part_sum, product in zip(maxima, sums, products, strict=True):
        factor = rw.call(aten.exp.default, rw.call(aten.sub.Tensor, top, overall))
        scaled_product = rw.call(aten.mul.Tensor, product, factor)
        scaled_sum = rw.call(aten.mul.Tensor, part_sum, factor)
        out = scaled_product if out is None else rw.call(aten.add.Tensor, out, scaled_product)
        total = scaled_sum if total is None else rw.call(aten.add.Tensor, total, scaled_sum)
    has_key = rw.call(aten.gt.Scalar, total, 0.0)
    safe_total = rw.call(aten.masked_fill.Scalar, total, rw.call(aten.logical_not.default, has_key), 1.0)
    out = rw.call(aten.div.Tensor, out, safe_total)
    zero = rw.call(aten.scalar_tensor.default, 0.0, dtype=qv.dtype)
    rw.replace(node, rw.call(aten.where.self, has_key, out, zero))
