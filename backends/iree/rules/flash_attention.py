"""A masked attention over a run-time number of query rows through the hand-written flash dispatch (issue 34).

    sdpa(q [b, h, rows (a Dim), D], k, v [b, kv or h, keys, D], mask [b, 1 or h, rows, keys] bool)
    -> flash_attention(q, pack_keys(k), pad_values(v), mask as int8, scale)

compile_lm's prefill over its static cache (transformers' `repeat_kv` read through to the cache's own heads, as the
decode rule does). IREE 3.13 writes such an attention out as products and passes over the whole [heads, rows, keys]
scores (`attention_by_key_blocks` cuts them into key blocks); the dispatch (flash_attention_dispatch.py) keeps a row
block's scores in registers, skips the key blocks its mask shuts, and merges the blocks as flash attention does.
Measured on AVX-512 only (docs/performance.md, "MoE prefill's attention as a dispatch of our own"): the rule is
`_avx512`, on in that ISA's performance rules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fx_rewrites.backends.iree.flash_attention_dispatch import BLOCKS, FLASH_ATTENTION, KEYS, LANES
from fx_rewrites.backends.iree.rules.attention import SDPA, Attention, bind
from fx_rewrites.backends.iree.rules.attention_decode import see_through_repeats
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten

#: the largest head size (the row block's queries and outputs are on the workgroup's stack)
MAX_HEAD_SIZE = 256


def _checked(a: Attention) -> Attention | Miss:
    """`a` where its sizes fit the dispatch (static but for the query rows), else why not."""
    q, k, v, mask = (fake_value(x) for x in (a.query, a.key, a.value, a.mask))
    if a.dropout_p != 0.0 or a.is_causal:
        return Miss(f"dropout_p={a.dropout_p}, is_causal={a.is_causal}: inference without is_causal only")
    if not all(x.dtype == torch.float32 for x in (q, k, v)):
        return Miss(f"{q.dtype}, {k.dtype}, {v.dtype}: the dispatch is float32")
    if not (q.dim() == k.dim() == v.dim() == 4 and (mask is None or mask.dim() == 4)):
        return Miss("4-D query, key, value and mask only")
    b, heads, rows, size = q.shape
    static = (b, heads, size, *k.shape, *v.shape, *(() if mask is None else (*mask.shape[:2], mask.shape[3])))
    if not all(isinstance(s, int) for s in static):
        return Miss("a symbolic size other than the query rows")
    kv, keys = k.shape[1], k.shape[2]
    if tuple(v.shape) != (b, kv, keys, size) or k.shape[0] != b or k.shape[3] != size:
        return Miss(f"keys {tuple(k.shape)} and values {tuple(v.shape)} for queries {tuple(q.shape)}")
    if kv != heads and not (a.enable_gqa and heads % kv == 0):
        return Miss(f"{heads} query heads over {kv} key heads without enable_gqa")
    if size % LANES or size > MAX_HEAD_SIZE:
        return Miss(f"a head size of {size}: a multiple of {LANES} up to {MAX_HEAD_SIZE}")
    if mask is not None and (mask.shape[0] != b or mask.shape[1] not in (1, heads) or mask.shape[3] != keys):
        return Miss(f"a mask of shape {tuple(mask.shape)}: [b, 1 or heads, rows, keys]")
    if mask is not None and not statically_known_true(mask.shape[2] == rows):
        return Miss("the mask's rows are not the queries'")
    return a


def _flash(node: Node) -> Attention | Miss:
    a = see_through_repeats(bind(node))
    mask = fake_value(a.mask)
    if mask is None or mask.dtype != torch.bool:
        return Miss("no bool mask: the dispatch is for transformers' masked prefill")
    if isinstance(fake_value(a.query).shape[2], int):
        return Miss("static query rows: taken only over a Dim (compile_lm's prefill), where it was measured")
    return _checked(a)


def _unmasked(node: Node) -> Attention | Miss:
    a = see_through_repeats(bind(node))
    if a.mask is not None:
        return Miss("a mask: the unmasked rule is for encoders' attention (ViT, Whisper's encoder)")
    return _checked(a)


def _write(node: Node, rw: Rewriter, a: Attention, isa: str) -> None:
    """The SDPA `node` as `flash_attention` with the keys packed, the values padded and the mask as int8."""
    k, v = a.key, a.value
    b, kv, keys, size = fake_value(k).shape
    padded = -(-keys // KEYS) * KEYS
    if padded > keys:
        k = rw.call(aten.constant_pad_nd.default, k, [0, 0, 0, padded - keys], 0.0)
        v = rw.call(aten.constant_pad_nd.default, v, [0, 0, 0, padded - keys], 0.0)
    k = rw.call(aten.reshape.default, k, [b, kv, padded // KEYS, KEYS, size])
    k = rw.call(aten.clone.default, rw.call(aten.permute.default, k, [0, 1, 2, 4, 3]))  # [b, kv, blocks, D, KEYS]
    mask = None if a.mask is None else rw.call(aten._to_copy.default, a.mask, dtype=torch.int8)
    lanes = BLOCKS[isa].lanes
    rw.replace(node, rw.call(FLASH_ATTENTION, a.query, k, v, mask, a.scale_or_default(), keys, lanes))


_MASKED_DOC = (
    "float32 scaled_dot_product_attention with a bool mask over a run-time number of query rows and static "
    "keys (compile_lm's prefill over its static cache; transformers' repeat_kv read through) becomes the "
    "hand-written flash attention dispatch (`fx_rewrites::flash_attention`) with {isa}'s register block: a row "
    "block's scores in registers, the key blocks its mask shuts skipped, online softmax. The keys laid out "
    "[keys / 64, D, 64] and the mask as int8 in the graph; a fully masked row gives 0."
)
_UNMASKED_DOC = (
    "float32 scaled_dot_product_attention without a mask, is_causal or dropout, over static keys (encoders: "
    "ViT, Whisper's encoder) becomes the hand-written flash attention dispatch with {isa}'s register block "
    "(no mask read); the keys laid out [keys / 64, D, 64] in the graph."
)
_TAGS = {"iree", "performance", "attention"}


@rule(roots=(SDPA,), when=_flash, tags=_TAGS, doc=_MASKED_DOC.format(isa="AVX-512"))
def attention_as_flash_dispatch_avx512(node: Node, rw: Rewriter, *, found: Attention) -> Any:
    _write(node, rw, found, "avx512")


@rule(roots=(SDPA,), when=_flash, tags=_TAGS, doc=_MASKED_DOC.format(isa="AVX2"))
def attention_as_flash_dispatch(node: Node, rw: Rewriter, *, found: Attention) -> Any:
    _write(node, rw, found, "avx2")


@rule(roots=(SDPA,), when=_unmasked, tags=_TAGS, doc=_UNMASKED_DOC.format(isa="AVX-512"))
def unmasked_attention_as_flash_dispatch_avx512(node: Node, rw: Rewriter, *, found: Attention) -> Any:
    _write(node, rw, found, "avx512")


@rule(roots=(SDPA,), when=_unmasked, tags=_TAGS, doc=_UNMASKED_DOC.format(isa="AVX2"))
def unmasked_attention_as_flash_dispatch(node: Node, rw: Rewriter, *, found: Attention) -> Any:
    _write(node, rw, found, "avx2")


RULES = (
    attention_as_flash_dispatch_avx512,
    attention_as_flash_dispatch,
    unmasked_attention_as_flash_dispatch_avx512,
    unmasked_attention_as_flash_dispatch,
)
