"""Fused attention on IREE: one form, guarded, and (where measured faster) written out.

Three rules, over `aten.scaled_dot_product_attention` and the CPU kernel
torch.compile's graphs call (`aten._scaled_dot_product_flash_attention_for_cpu`):

- `flash_attention_for_cpu_to_sdpa`: the CPU kernel, whose logsumexp
  nobody reads, becomes the SDPA op it implements, so one form is left.
- `attention_fully_masked_rows_guard` (a guard, every IREE target): a row
  of the mask that masks every key (a bool row all False, a float row all
  -inf: a padded sequence under a sliding window, Gemma3, ModernBERT) gives 0
  in torch 2.13 CPU eager and NaN in IREE 3.13's attention lowering. The
  output is wrapped in `where(row has a key, attention, 0)`.
- `attention_as_matmul_softmax` (a performance rule, not in the default
  rules): attention written out as matmul, softmax, matmul, which IREE 3.13
  runs faster on llvm-cpu than its own lowering of the fused op (issue 13;
  `rewrites/rules/iree_perf.py` decides per target). It keeps the guard's
  semantics: a fully masked row gives 0.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import attrs
import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule

aten = torch.ops.aten

SDPA = aten.scaled_dot_product_attention.default
FLASH_FOR_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default

GUARD = "attention_fully_masked_rows_guard"


@attrs.frozen
class Attention:
    """The arguments of one SDPA node, by name, defaults filled in."""

    query: Node
    key: Node
    value: Node
    mask: Node | None
    dropout_p: float
    is_causal: bool
    scale: float | None
    enable_gqa: bool


def bind(node: Node) -> Attention:
    """The arguments of an `aten.scaled_dot_product_attention` node."""
    named = schema.bind(node.target, node.args, dict(node.kwargs))
    return Attention(
        query=named["query"],
        key=named["key"],
        value=named["value"],
        mask=named.get("attn_mask"),
        dropout_p=named.get("dropout_p", 0.0),
        is_causal=named.get("is_causal", False),
        scale=named.get("scale"),
        enable_gqa=named.get("enable_gqa", False),
    )


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


# ----------------------------------------------------------------------------- one form


def _logsumexp_unread(node: Node) -> bool | Miss:
    users = list(node.users)
    if not (users and all(u.target is operator.getitem and u.args[1] == 0 for u in users)):
        return Miss("the logsumexp output (index 1) is read: only the fused kernel computes it")
    named = schema.bind(node.target, node.args, dict(node.kwargs))
    mask, query, key = _val(named.get("attn_mask")), _val(named["query"]), _val(named["key"])
    if query.dim() >= 3 and query.shape[-3] != key.shape[-3]:
        # the kernel serves grouped-query heads itself; SDPA would need enable_gqa, left to IREE as it came
        return Miss(f"{query.shape[-3]} query heads and {key.shape[-3]} key heads")
    if named.get("is_causal", False) and query.shape[-2] != key.shape[-2]:
        # the kernel aligns a causal mask to the last key (a cached decoder), SDPA to the first
        return Miss(f"is_causal with {query.shape[-2]} queries and {key.shape[-2]} keys")
    if mask is not None:
        scores = (*query.shape[:-1], key.shape[-2])
        try:
            if tuple(torch.broadcast_shapes(tuple(mask.shape), scores)) != scores:
                raise RuntimeError
        except RuntimeError:
            # the kernel takes masks SDPA refuses (a cached decoder's [2, 2] mask for [2, 4] scores)
            return Miss(f"a mask of shape {tuple(mask.shape)} does not broadcast to the scores {scores}")
    return True


@rule(
    roots=(FLASH_FOR_CPU,),
    name="flash_attention_for_cpu_to_sdpa",
    when=_logsumexp_unread,
    tags={"iree", "attention"},
    doc=(
        "torch.compile's graphs call attention through the CPU kernel "
        "aten._scaled_dot_product_flash_attention_for_cpu (its bool mask already turned into a float mask "
        "of 0 and -inf); with its logsumexp unread it is aten.scaled_dot_product_attention, the form the "
        "attention guard and the llvm-cpu attention rule read."
    ),
)
def flash_attention_for_cpu_to_sdpa(node: Node, rw: Rewriter) -> Any:
    named = schema.bind(node.target, node.args, dict(node.kwargs))
    sdpa = rw.call(
        SDPA,
        named["query"],
        named["key"],
        named["value"],
        named.get("attn_mask"),
        named.get("dropout_p", 0.0),
        named.get("is_causal", False),
        scale=named.get("scale"),
    )
    for user in list(node.users):
        rw.replace(user, sdpa)
    rw.erase(node)  # the kernel's schema marks it nondeterministic (dropout): the dead-node sweep keeps it


# ----------------------------------------------------------------------------- the guard


def is_guarded(node: Node) -> bool:
    """Whether `node`'s only user is the guard's `where` (built for it by the guard or the written-out rule)."""
    users = list(node.users)
    return (
        len(users) == 1
        and users[0].target is aten.where.self
        and any(
            step.get("rule") in (GUARD, "attention_as_matmul_softmax") for step in users[0].meta.get("rewrites", ())
        )
    )


def row_has_key(rw: Rewriter, mask: Node) -> Node:
    """A bool tensor, the mask's shape with its last dim 1: whether that row lets any key through."""
    if _val(mask).dtype == torch.bool:
        return rw.call(aten.any.dim, mask, -1, True)
    return rw.call(aten.gt.Scalar, rw.call(aten.amax.default, mask, [-1], True), float("-inf"))


def zero_fully_masked_rows(rw: Rewriter, out: Node, mask: Node) -> Node:
    """`where(row has a key, out, 0)`: what torch 2.13 CPU eager gives for a row that masks every key."""
    zero = rw.call(aten.scalar_tensor.default, 0.0, dtype=_val(out).dtype)
    return rw.call(aten.where.self, row_has_key(rw, mask), out, zero)


def _maskable(node: Node) -> bool | Miss:
    mask = bind(node).mask
    if not isinstance(mask, Node):
        return Miss("no mask: no row can be fully masked (is_causal keeps the diagonal)")
    if _val(mask).dtype != torch.bool and not _val(mask).dtype.is_floating_point:
        return Miss(f"a {_val(mask).dtype} mask")
    if is_guarded(node):
        return Miss("already guarded")
    return True


@rule(
    roots=(SDPA,),
    name=GUARD,
    when=_maskable,
    tags={"iree", "guard", "attention", "numerics"},
    doc=(
        "scaled_dot_product_attention with a mask that can mask a whole row (a bool row all False, a float "
        "row all -inf: sliding-window attention on a padded sequence, Gemma3, ModernBERT; torch.compile's "
        "float form of a bool mask): torch 2.13 CPU eager gives 0 for that row, IREE 3.13 gives NaN "
        "(silently wrong numbers). The output becomes where(any key in the row, attention, 0)."
    ),
)
def attention_fully_masked_rows_guard(node: Node, rw: Rewriter) -> Any:
    again = rw.call(node.target, *node.args, **node.kwargs)
    rw.replace(node, zero_fully_masked_rows(rw, again, bind(node).mask))


# ----------------------------------------------------------------------------- written out


def _size(rw: Rewriter, node: Node, dim: int) -> Any:
    """`node`'s size along `dim`: an int, or an `aten.sym_size.int` node for a symbolic size."""
    size = _val(node).shape[dim]
    return size if isinstance(size, int) else rw.call(aten.sym_size.int, node, dim)


def _writable(node: Node) -> Attention | Miss:
    a = bind(node)
    q, k = _val(a.query), _val(a.key)
    if a.dropout_p != 0.0:
        return Miss(f"dropout_p={a.dropout_p}: random, training-time attention")
    if q.dtype not in (torch.float32, torch.float64):
        return Miss(f"{q.dtype}: written out, softmax in {q.dtype} loses the precision the fused kernel keeps")
    if a.scale is None and not isinstance(q.shape[-1], int):
        return Miss("a symbolic head size and no scale")
    if q.dim() < 3 or q.shape[-3] != k.shape[-3]:
        if not a.enable_gqa:
            return Miss("query and key heads differ without enable_gqa")
        if not all(isinstance(s, int) for s in (*q.shape[-3:], *k.shape[-3:])):
            return Miss("enable_gqa with symbolic head counts")
    return a


def _repeat_heads(rw: Rewriter, kv: Node, times: int) -> Node:
    """enable_gqa: each key/value head serves `times` query heads (`repeat_interleave` on dim -3)."""
    shape = _val(kv).shape
    expanded = rw.call(aten.unsqueeze.default, kv, -3)
    sizes = [*(-1 for _ in shape[:-3]), shape[-3], times, shape[-2], shape[-1]]
    expanded = rw.call(aten.expand.default, expanded, sizes)
    batch = [_size(rw, kv, d) for d in range(len(shape) - 3)]
    return rw.call(aten.reshape.default, expanded, [*batch, shape[-3] * times, shape[-2], shape[-1]])


@rule(
    roots=(SDPA,),
    name="attention_as_matmul_softmax",
    when=_writable,
    tags={"iree", "performance", "attention"},
    doc=(
        "scaled_dot_product_attention written out: (query * scale) @ key^T, plus the mask (bool: masked_fill "
        "-inf; float: added; is_causal: the lower triangle kept), softmax, @ value; a row that masks every "
        "key gives 0, as torch 2.13 CPU eager. IREE 3.13 lowers the fused op on llvm-cpu (its online "
        "attention) slower than this form (issue 13). Performance only: not in the default rules."
    ),
)
def attention_as_matmul_softmax(node: Node, rw: Rewriter, a: Attention) -> Any:
    q, k, v = a.query, a.key, a.value
    qv, kv = _val(q), _val(k)
    if qv.dim() >= 3 and qv.shape[-3] != kv.shape[-3]:
        k = _repeat_heads(rw, k, qv.shape[-3] // kv.shape[-3])
        v = _repeat_heads(rw, v, qv.shape[-3] // kv.shape[-3])
    scale = a.scale if a.scale is not None else 1.0 / math.sqrt(qv.shape[-1])
    scores = rw.call(aten.matmul.default, rw.call(aten.mul.Scalar, q, scale), rw.call(aten.transpose.int, k, -2, -1))
    if a.is_causal:
        rows = rw.call(aten.arange.default, _size(rw, q, -2), device=qv.device)
        cols = rw.call(aten.arange.default, _size(rw, k, -2), device=qv.device)
        above = rw.call(aten.lt.Tensor, rw.call(aten.unsqueeze.default, rows, -1), cols)
        scores = rw.call(aten.masked_fill.Scalar, scores, above, float("-inf"))
    if a.mask is not None and _val(a.mask).dtype == torch.bool:
        scores = rw.call(aten.masked_fill.Scalar, scores, rw.call(aten.logical_not.default, a.mask), float("-inf"))
    elif a.mask is not None:
        scores = rw.call(aten.add.Tensor, scores, a.mask)
    weights = rw.call(aten._softmax.default, scores, -1, False)
    out = rw.call(aten.matmul.default, weights, v)
    if a.mask is not None and not is_guarded(node):
        out = zero_fully_masked_rows(rw, out, a.mask)
    rw.replace(node, out)


#: every IREE target: one form, guarded
GUARDS = (flash_attention_for_cpu_to_sdpa, attention_fully_masked_rows_guard)
