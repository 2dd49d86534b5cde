"""A decode step's attention (one query row over the cache) as grouped multiplies and sums, read in place.

`compile_lm`'s decode attends one query row over the cached keys. Written out as matmul, softmax, matmul
(`attention_as_matmul_softmax`) IREE 3.13 repeats each key-value head for its query heads (a copy of the cache,
`repeat_kv`) and packs the cache for data-tiled products every step. `attention_one_query_as_grouped_sums` writes it
per key-value head, the query heads of its group as rows: the scores `(q * k).sum(-1)` and the output
`(p * v).sum(-2)`, which IREE runs as reductions reading the keys and values where they lie (no copy, no pack), with
the softmax's maximum and sum between, normalized after; a row whose mask lets no key through gives 0, as torch 2.13
CPU eager. transformers' decode under torch.export repeats the cache itself (`repeat_kv`: an expand and a reshape,
SDPA without gqa): the rule reads through that repeat to the cache's own heads, which IREE would otherwise copy every
step. One decode attention alone (benchmarks/decode_attention.py, docs/performance.md), AMD EPYC (AVX2), transformers'
form, before -> after reading through: 8 heads over 4 of 64, 2049 keys 6.5 -> 2.1 ms; 32 over 4 of 128, 1041 keys
29.9 -> 2.9 ms (eager's grouped SDPA 0.66, 1.55; at load 11.5 on 2 cores).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fx_rewrites.backends.iree.rules.attention import SDPA, Attention, bind
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten
NEG_INF = float("-inf")


_VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _repeated(node: Any) -> tuple[Node, int] | None:
    """`(x, n)` when `node` is transformers' `repeat_kv(x, n)` of a [b, kv, T, e] `x`: `x[:, :, None]` expanded
    to [b, kv, n, T, e] and reshaped to [b, kv * n, T, e] (head j * n + r is x's head j), else None."""
    if not (isinstance(node, Node) and node.target in _VIEWS):
        return None
    expanded = node.args[0]
    if not (isinstance(expanded, Node) and expanded.target is aten.expand.default):
        return None
    one = expanded.args[0]
    if not (isinstance(one, Node) and one.target is aten.unsqueeze.default and one.args[1] in (2, -3)):
        return None
    x, big, out = fake_value(one.args[0]), fake_value(expanded), fake_value(node)
    if x.dim() != 4 or big.dim() != 5 or out.dim() != 4 or not isinstance(big.shape[2], int):
        return None
    same = (big.shape[i] == x.shape[j] for i, j in ((0, 0), (1, 1), (3, 2), (4, 3)))
    kept = (out.shape[i] == x.shape[i] for i in (0, 2, 3))
    if not all(statically_known_true(c) for c in (*same, *kept, out.shape[1] == x.shape[1] * big.shape[2])):
        return None
    return one.args[0], big.shape[2]


def see_through_repeats(a: Attention) -> Attention:
    """`a` with keys and values read before a `repeat_kv` of both by one factor (the heads' grouping is then
    the query heads' over the cache's own heads: what `enable_gqa` says), else `a` as it is."""
    k, v = _repeated(a.key), _repeated(a.value)
    if k is None or v is None or k[1] != v[1]:
        return a
    return attrs.evolve(a, key=k[0], value=v[0], enable_gqa=True)


def _one_query(node: Node) -> Attention | Miss:
    a = see_through_repeats(bind(node))
    q, k, v, mask = (fake_value(x) for x in (a.query, a.key, a.value, a.mask))
    if q.dtype != torch.float32 or a.dropout_p != 0.0:
        return Miss(f"{q.dtype}, dropout_p={a.dropout_p}: float32 inference only")
    if a.is_causal:
        return Miss("is_causal: one query row sees only the first key (torch's top-left alignment): left to the others")
    if not (q.dim() == k.dim() == v.dim() == 4):
        return Miss(f"ranks {q.dim()}/{k.dim()}/{v.dim()}: 4-D query, key and value only")
    if q.shape[-2] != 1:
        return Miss(f"{q.shape[-2]} query rows: one (a decode step) only")
    heads, kv_heads = q.shape[1], k.shape[1]
    if not all(isinstance(s, int) for s in (heads, kv_heads, q.shape[-1], v.shape[-1])):
        return Miss("symbolic heads or head sizes")
    if heads != kv_heads and not (a.enable_gqa and heads % kv_heads == 0):
        return Miss(f"{heads} query heads over {kv_heads} key heads without enable_gqa")
    if mask is not None:
        if mask.dtype != torch.bool:
            return Miss(f"a {mask.dtype} mask: bool masks (transformers' SDPA masks) only")
        if mask.dim() != 4 or mask.shape[-2] != 1 or mask.shape[1] not in (1, heads):
            return Miss(f"a mask of shape {tuple(mask.shape)}: [batch or 1, heads or 1, 1, keys] only")
    return a


@rule(
    roots=(SDPA,),
    when=_one_query,
    tags={"iree", "performance", "attention"},
    doc=(
        "float32 scaled_dot_product_attention of one query row (a decode step over its cache; bool or no mask, "
        "grouped-query heads by enable_gqa) is written per key-value head with the query heads of its group as rows: "
        "scores (q * k).sum(-1), output (p * v).sum(-2) over the keys and values in place (IREE 3.13 then neither "
        "repeats them per query head nor packs them every step), the softmax normalized after; a fully masked row "
        "gives 0; transformers' repeat_kv of the keys and values (an expand and a reshape) is read through to the "
        "cache's own heads. One decode attention, IREE llvm-cpu, AVX-512: 8 heads over 4 of 64, 2049 keys 2.34 -> "
        "0.78 ms; 32 over 4 of 128, 1041 keys 18.6 -> 0.90 ms (eager 0.37, 0.65); transformers' repeated form on AVX2: "
        "6.5 -> 2.1 and 29.9 -> 2.9 ms."
    ),
)
def attention_one_query_as_grouped_sums(node: Node, rw: Rewriter, *, found: Attention) -> Any:
    a = found
    qv, kv, vv = fake_value(a.query), fake_value(a.key), fake_value(a.value)
    heads, kv_heads, size, out_size = qv.shape[1], kv.shape[1], qv.shape[-1], vv.shape[-1]
    group = heads // kv_heads
    scale = a.scale_or_default()
    batch = rw.size(a.query, 0)
    rows = rw.call(aten.reshape.default, a.query, [batch, kv_heads, group, 1, size])  # query head h = j * group + g
    rows = rw.call(aten.mul.Scalar, rows, scale)
    keys = rw.call(aten.unsqueeze.default, a.key, 2)  # [b, kv, 1, T, e]
    scores = rw.call(aten.sum.dim_IntList, rw.call(aten.mul.Tensor, rows, keys), [-1])  # [b, kv, group, T]
    if a.mask is not None:
        mv = fake_value(a.mask)
        shape = [rw.size(a.mask, 0), 1, 1] if mv.shape[1] == 1 else [rw.size(a.mask, 0), kv_heads, group]
        allowed = rw.call(aten.reshape.default, a.mask, [*shape, rw.size(a.mask, -1)])
        scores = rw.call(aten.masked_fill.Scalar, scores, rw.call(aten.logical_not.default, allowed), NEG_INF)
    top = rw.call(aten.amax.default, scores, [-1], True)
    top = rw.call(aten.masked_fill.Scalar, top, rw.call(aten.eq.Scalar, top, NEG_INF), 0.0)
    weights = rw.call(aten.exp.default, rw.call(aten.sub.Tensor, scores, top))  # a masked key: 0
    total = rw.call(aten.sum.dim_IntList, weights, [-1], True)  # [b, kv, group, 1]
    values = rw.call(aten.unsqueeze.default, a.value, 2)  # [b, kv, 1, T, ev]
    out = rw.call(
        aten.sum.dim_IntList, rw.call(aten.mul.Tensor, rw.call(aten.unsqueeze.default, weights, -1), values), [-2]
    )
    has_key = rw.call(aten.gt.Scalar, total, 0.0)
    safe_total = rw.call(aten.masked_fill.Scalar, total, rw.call(aten.logical_not.default, has_key), 1.0)
    out = rw.call(aten.div.Tensor, out, safe_total)
    zero = rw.call(aten.scalar_tensor.default, 0.0, dtype=qv.dtype)
    out = rw.call(aten.where.self, has_key, out, zero)  # [b, kv, group, ev]
    rw.replace(node, rw.call(aten.reshape.default, out, [batch, heads, 1, out_size]))
