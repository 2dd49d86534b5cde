"""Masked attention over long static keys, a block of keys at a time, each block over the query rows it lets in.

A causal prefill over a static cache (`compile_lm`: queries D, keys the whole cache) written out as one
matmul, softmax, matmul computes every score, masked ones included: half of them at a full prompt, most at a
short one. `attention_by_key_blocks` cuts the keys into 2 to `MAX_BLOCKS` static blocks of at least
`KEY_BLOCK`; for each block it reads from the mask the first query row that the block lets any key through to
(an integer the program reads at run time), and computes that block's scores for the rows from there on only;
the rows before it have every key of the block masked, so leaving them out changes no number. Each block's
partial result (its row max, its exponentials' sum and product with the values) is merged into the running one
over the rows it covers, as flash attention merges them. Exact for any mask; the saving comes from masks whose
allowed keys start late for early rows (causal, a prompt shorter than the cache). A row that masks every key
gives 0, as torch 2.13 CPU eager.

The scores are written keys x rows ([b, h, keys, rows]: the block's keys, static, the products' first side), so
that the softmax's reductions run over the outer axis and the exponentials are packed for the product with the
values as contiguous rows; each block's keys are a multiple of `ALIGN`. Measured against the form before (at most
4 blocks, rows x keys, combined in one step) in docs/performance.md ("the prefill's attention merged block by
block").

Where a key-value head serves at least `MIN_GROUP` query heads (transformers' `repeat_kv` read through to the cache's
own heads, as the decode rule does, or `enable_gqa`) and the mask is one for all heads, each block is written per
key-value head with the group's query heads as more rows of its products (`_grouped`): no copy of the keys and values
per query head (docs/performance.md, "MoE prefill's attention: forms tried against flash").
"""

from __future__ import annotations

import operator
from typing import Any

import attrs
import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fx_rewrites.backends.iree.rules.attention import SDPA, Attention, bind, per_query_head
from fx_rewrites.backends.iree.rules.attention_decode import see_through_repeats
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten

#: the fewest keys a block: an attention over fewer than two such blocks is left whole
KEY_BLOCK = 256
#: the most blocks (each is its own products and merge: its dispatches read only its own run-time row count; combined
#: in one dispatch, 9 blocks exceeded IREE 3.13's 64 constants a dispatch, findings section 32)
MAX_BLOCKS = 16
#: the fewest keys per unit of head size: each block adds work on [heads, head size, rows] (its product and merge)
#: against the scores it skips ([heads, keys / 2, rows] at a causal prefill). Measured faster than the whole form
#: down to 32 heads of 128 over 1041 keys (8.1 keys a unit, Qwen3-30B-A3B's layer: docs/performance.md); the form
#: of before (each block padded to every row and combined at once) was slower there; fewer keys a unit: not measured
MIN_KEYS_PER_HEAD_SIZE = 8
NEG_INF = float("-inf")
#: each block's keys a multiple of this (the last block padded with masked zero keys): the data-tiled products'
#: tiles (16 on AVX-512, 8 on AVX2) then hold no padding
ALIGN = 16
#: the fewest query heads a key-value head for the grouped form (`_grouped`: the keys and values read in place, through
#: transformers' `repeat_kv`, the group's query heads as more rows of each product). Real AVX2 (Zen 3), one thread,
#: the attention alone: a group of 8 (32 heads over 4 of 128, 1024 rows over 1041 keys) 601 -> 457 ms; a group of 2
#: (8 over 4 of 64, 2048 over 2081) 287 -> 310 (slower: the group is the innermost axis of its elementwise passes);
#: groups between not measured
MIN_GROUP = 8


@attrs.frozen
class KeyBlocks:
    """An attention whose static keys are cut into `blocks` (start, end) ranges; `grouped`: written per key-value
    head (`_grouped`), its keys and values the cache's own heads."""

    attention: Attention
    blocks: tuple[tuple[int, int], ...]
    grouped: bool = False


def _group_of(a: Attention) -> Attention | None:
    """`a` with its keys and values read before transformers' `repeat_kv` where the query heads a key-value head
    number at least `MIN_GROUP` and the mask is one for every head, else None."""
    a = see_through_repeats(a)
    q, k, mask = (fake_value(x) for x in (a.query, a.key, a.mask))
    if mask is None or mask.dim() != 4 or mask.shape[1] != 1 or q.dim() != 4 or k.dim() != 4:
        return None
    heads, kv_heads = q.shape[1], k.shape[1]
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and a.enable_gqa and heads % kv_heads == 0):
        return None
    return a if heads // kv_heads >= MIN_GROUP else None


def _key_blocks(node: Node) -> KeyBlocks | Miss:
    a = bind(node)
    grouped = _group_of(a)
    a = grouped or a
    q, k, v, mask = (fake_value(x) for x in (a.query, a.key, a.value, a.mask))
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
    size = -(-size // ALIGN) * ALIGN
    return KeyBlocks(a, tuple((s, min(keys, s + size)) for s in range(0, keys, size)), grouped is not None)


def _rows_let_in(rw: Rewriter, block_mask: Node, rows: Any) -> Node:
    """How many query rows, counted back from the last, start at the first row whose block of the mask lets any
    key through (0 when none does): an integer read at run time."""
    through = rw.call(aten.any.dim, block_mask, -1)  # [b, h, rows]
    through = rw.call(aten.any.dim, rw.call(aten.reshape.default, through, [-1, rows]), 0)  # [rows]
    left = rw.call(aten.arange.start_step, rows, 0, -1, dtype=torch.int64)  # rows - i
    count = rw.call(aten.item.default, rw.call(aten.amax.default, rw.call(aten.mul.Tensor, left, through)))
    torch._check(count.meta["val"] >= 0)
    torch._check(count.meta["val"] <= (fake_value(block_mask).shape[-2]))
    return count


@rule(
    roots=(SDPA,),
    when=_key_blocks,
    tags={"iree", "performance", "attention"},
    doc=(
        "float32 scaled_dot_product_attention with a bool mask over at least two blocks of 256 static keys and "
        "at least 8 keys a unit of head size (compile_lm's prefill over its static cache) is written out a block "
        "of keys at a time (up to 16 blocks, each a multiple of 16 keys), scores as keys x rows: each block's "
        "scores only for the query rows from the first one the block's mask lets through (read at run time; the "
        "rows before have every key of the block masked), each block merged into the running result by its row "
        "maxima as flash attention does; a fully masked row gives 0. A causal prefill computes about half the "
        "scores. benchmarks/prefill_attention.py, IREE 3.13 llvm-cpu, one thread, locked: 8 heads of 64, 2048 "
        "queries over 2081 keys 240 ms whole, 178 in 4 blocks of rows x keys combined at once, 153 as now (torch's "
        "is_causal flash: 43); 32 heads of 128 over 1041 keys 317 whole, 293 as now (flash: 92). A group of at least "
        "8 query heads a key-value head (transformers' repeat_kv read through, or enable_gqa) is written per "
        "key-value head, the group's query heads as rows: Qwen3-30B-A3B's layer alone 601 -> 457 ms on real AVX2."
    ),
)
def attention_by_key_blocks(node: Node, rw: Rewriter, *, found: KeyBlocks) -> Any:
    a = found.attention
    if found.grouped:
        return _grouped(node, rw, found)
    q, mask, qv = a.query, a.mask, fake_value(a.query)
    k, v = per_query_head(rw, q, a.key, a.value)
    scale = a.scale_or_default()
    rows = rw.size(q, -2)
    head = [rw.size(q, 0), rw.size(q, 1)]
    q = rw.call(aten.transpose.int, rw.call(aten.mul.Scalar, q, scale), -2, -1)  # [b, h, e, rows]
    ones = rw.call(aten.ones.default, [1, 1], dtype=qv.dtype, device=qv.device)
    state: tuple[Node, ...] = ()  # (max, sum, product) over every row of the blocks so far, rows last
    for start, end in found.blocks:
        block_mask = rw.call(aten.slice.Tensor, mask, -1, start, end)
        block_k = rw.call(aten.slice.Tensor, k, -2, start, end)
        block_v = rw.call(aten.slice.Tensor, v, -2, start, end)
        width = -(-(end - start) // ALIGN) * ALIGN
        if width > end - start:  # masked zero keys up to a multiple of ALIGN
            pad = width - (end - start)
            block_mask = rw.call(aten.constant_pad_nd.default, block_mask, [0, pad], False)
            block_k = rw.call(aten.constant_pad_nd.default, block_k, [0, 0, 0, pad], 0.0)
            block_v = rw.call(aten.constant_pad_nd.default, block_v, [0, 0, 0, pad], 0.0)
        first = rw.call(operator.sub, rows, _rows_let_in(rw, block_mask, rows))
        # [b, h, keys, rows from `first`]
        scores = rw.call(aten.matmul.default, block_k, rw.call(aten.slice.Tensor, q, -1, first, rows))
        shut = rw.call(aten.logical_not.default, rw.call(aten.slice.Tensor, block_mask, -2, first, rows))
        scores = rw.call(aten.masked_fill.Scalar, scores, rw.call(aten.transpose.int, shut, -2, -1), NEG_INF)
        top = rw.call(aten.amax.default, scores, [-2], True)  # [b, h, 1, rows]
        weights = rw.call(aten.exp.default, rw.call(aten.sub.Tensor, scores, _finite(rw, top)))
        # the sums as a product with ones: IREE 3.13's reductions are slow (softmax_matmul_normalized_after)
        total = rw.call(aten.matmul.default, rw.call(aten.expand.default, ones, [1, width]), weights)
        product = rw.call(aten.matmul.default, rw.call(aten.transpose.int, block_v, -2, -1), weights)  # [b, h, e, .]
        block = (top, total, product)
        state = _merge(rw, state, block, first, rows) if state else _from_first(rw, block, first, head, qv)
    _, total, out = state
    has_key = rw.call(aten.gt.Scalar, total, 0.0)
    safe_total = rw.call(aten.masked_fill.Scalar, total, rw.call(aten.logical_not.default, has_key), 1.0)
    out = rw.call(aten.div.Tensor, out, safe_total)
    zero = rw.call(aten.scalar_tensor.default, 0.0, dtype=qv.dtype)
    rw.replace(node, rw.call(aten.transpose.int, rw.call(aten.where.self, has_key, out, zero), -2, -1))


def _finite(rw: Rewriter, top: Node) -> Node:
    """Row maxima with -inf (a row with every key masked) as 0, to subtract from scores without a nan."""
    return rw.call(aten.masked_fill.Scalar, top, rw.call(aten.eq.Scalar, top, NEG_INF), 0.0)


def _from_first(rw: Rewriter, block: tuple[Node, ...], first: Any, head: list[Any], qv: Any) -> tuple[Node, ...]:
    """The first block's (max, sum, product) over every row: the rows before `first` let none of its keys
    through (max -inf, sum 0, product 0)."""
    out = []
    for piece, fill in zip(block, (NEG_INF, 0.0, 0.0), strict=True):
        shape = [*head, fake_value(piece).shape[-2], first]
        before = rw.call(aten.full.default, shape, fill, dtype=qv.dtype, device=qv.device)
        out.append(rw.call(aten.cat.default, [before, piece], -1))
    return tuple(out)


def _merge(
    rw: Rewriter, state: tuple[Node, ...], block: tuple[Node, ...], first: Any, rows: Any, axis: int = -1
) -> tuple[Node, ...]:
    """The running (max, sum, product) with one more block's, over the rows from `first` on (the rows before it
    let none of the block's keys through: kept as they are). Each merge is its own dispatches, reading its block's
    run-time row count only."""
    before = [rw.call(aten.slice.Tensor, x, axis, 0, first) for x in state]
    old = [rw.call(aten.slice.Tensor, x, axis, first, rows) for x in state]
    top, total, product = block
    new_top = rw.call(aten.maximum.default, old[0], top)
    overall = _finite(rw, new_top)
    keep = rw.call(aten.exp.default, rw.call(aten.sub.Tensor, old[0], overall))
    take = rw.call(aten.exp.default, rw.call(aten.sub.Tensor, top, overall))
    merged = (
        new_top,
        rw.call(aten.add.Tensor, rw.call(aten.mul.Tensor, old[1], keep), rw.call(aten.mul.Tensor, total, take)),
        rw.call(aten.add.Tensor, rw.call(aten.mul.Tensor, old[2], keep), rw.call(aten.mul.Tensor, product, take)),
    )
    return tuple(rw.call(aten.cat.default, [b, m], axis) for b, m in zip(before, merged, strict=True))


def _grouped(node: Node, rw: Rewriter, found: KeyBlocks) -> Any:
    """The blocks per key-value head, the group's query heads as rows: queries [b, kv, e, rows, group], each block's
    rows from `first` a contiguous [e, (rows - first) * group] operand; state [b, kv, ., rows, group]."""
    a = found.attention
    q, mask, qv = a.query, a.mask, fake_value(a.query)
    k, v = a.key, a.value
    heads, kv_heads, size = qv.shape[1], fake_value(k).shape[1], qv.shape[-1]
    out_size = fake_value(v).shape[-1]
    group = heads // kv_heads
    scale = a.scale_or_default()
    rows = rw.size(q, -2)
    batch = rw.size(q, 0)
    q = rw.call(aten.reshape.default, rw.call(aten.mul.Scalar, q, scale), [batch, kv_heads, group, rows, size])
    q = rw.call(aten.permute.default, q, [0, 1, 4, 3, 2])  # [b, kv, e, rows, group]
    ones = rw.call(aten.ones.default, [1, 1], dtype=qv.dtype, device=qv.device)
    state: tuple[Node, ...] = ()
    for start, end in found.blocks:
        block_mask = rw.call(aten.slice.Tensor, mask, -1, start, end)
        block_k = rw.call(aten.slice.Tensor, k, -2, start, end)
        block_v = rw.call(aten.slice.Tensor, v, -2, start, end)
        width = -(-(end - start) // ALIGN) * ALIGN
        if width > end - start:
            pad = width - (end - start)
            block_mask = rw.call(aten.constant_pad_nd.default, block_mask, [0, pad], False)
            block_k = rw.call(aten.constant_pad_nd.default, block_k, [0, 0, 0, pad], 0.0)
            block_v = rw.call(aten.constant_pad_nd.default, block_v, [0, 0, 0, pad], 0.0)
        first = rw.call(operator.sub, rows, _rows_let_in(rw, block_mask, rows))
        q_rows = rw.call(aten.slice.Tensor, q, -2, first, rows)  # [b, kv, e, n, group]
        q_rows = rw.call(aten.reshape.default, q_rows, [batch, kv_heads, size, -1])
        scores = rw.call(aten.matmul.default, block_k, q_rows)  # [b, kv, keys, n * group]
        scores = rw.call(aten.reshape.default, scores, [batch, kv_heads, width, -1, group])
        shut = rw.call(aten.logical_not.default, rw.call(aten.slice.Tensor, block_mask, -2, first, rows))
        shut = rw.call(aten.unsqueeze.default, rw.call(aten.transpose.int, shut, -2, -1), -1)  # [b, 1, keys, n, 1]
        scores = rw.call(aten.masked_fill.Scalar, scores, shut, NEG_INF)
        top = rw.call(aten.amax.default, scores, [-3], True)  # [b, kv, 1, n, group]
        weights = rw.call(aten.exp.default, rw.call(aten.sub.Tensor, scores, _finite(rw, top)))
        weights = rw.call(aten.reshape.default, weights, [batch, kv_heads, width, -1])
        total = rw.call(aten.matmul.default, rw.call(aten.expand.default, ones, [1, width]), weights)
        product = rw.call(aten.matmul.default, rw.call(aten.transpose.int, block_v, -2, -1), weights)
        total = rw.call(aten.reshape.default, total, [batch, kv_heads, 1, -1, group])
        product = rw.call(aten.reshape.default, product, [batch, kv_heads, out_size, -1, group])
        block = (top, total, product)
        if state:
            state = _merge(rw, state, block, first, rows, -2)
        else:
            state = _from_first_grouped(rw, block, first, qv)
    _, total, out = state
    has_key = rw.call(aten.gt.Scalar, total, 0.0)
    safe_total = rw.call(aten.masked_fill.Scalar, total, rw.call(aten.logical_not.default, has_key), 1.0)
    out = rw.call(aten.div.Tensor, out, safe_total)
    zero = rw.call(aten.scalar_tensor.default, 0.0, dtype=qv.dtype)
    out = rw.call(aten.where.self, has_key, out, zero)  # [b, kv, e, rows, group]
    out = rw.call(aten.permute.default, out, [0, 1, 4, 3, 2])  # [b, kv, group, rows, e]
    rw.replace(node, rw.call(aten.reshape.default, out, [batch, heads, rows, out_size]))


def _from_first_grouped(rw: Rewriter, block: tuple[Node, ...], first: Any, qv: Any) -> tuple[Node, ...]:
    """`_from_first` for the grouped state [b, kv, ., rows, group]: the rows before `first` filled."""
    out = []
    for piece, fill in zip(block, (NEG_INF, 0.0, 0.0), strict=True):
        pv = fake_value(piece)
        shape = [rw.size(piece, 0), *pv.shape[1:3], first, pv.shape[-1]]
        before = rw.call(aten.full.default, shape, fill, dtype=qv.dtype, device=qv.device)
        out.append(rw.call(aten.cat.default, [before, piece], -2))
    return tuple(out)
