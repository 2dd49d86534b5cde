"""Fused attention on IREE: one form, guarded, and (where measured faster) written out.

Five rules, over `aten.scaled_dot_product_attention` and the CPU kernel
torch.compile's graphs call (`aten._scaled_dot_product_flash_attention_for_cpu`):

- `flash_attention_for_cpu_to_sdpa`: the CPU kernel, whose logsumexp
  nobody reads, becomes the SDPA op it implements, so one form is left.
- `flash_attention_for_cpu_with_logsumexp`: the CPU kernel whose logsumexp
  a training forward saves for the kernel's backward is written out
  (`fx_rewrites.decompositions.flash_attention_for_cpu`), both outputs.
- `attention_fully_masked_rows_guard` (a guard, every IREE target): a row
  of the mask that masks every key (a bool row all False, a float row all
  -inf: a padded sequence under a sliding window, Gemma3, ModernBERT) gives 0
  in torch 2.13 CPU eager and NaN in IREE 3.13's attention lowering. The
  output is wrapped in `where(row has a key, attention, 0)`.
- `attention_mask_that_masks_nothing` (every IREE target): a mask computed
  from no input that lets every key through (transformers 5's encoders
  without padding) is dropped; it changes no number and costs IREE a select.
- `attention_as_matmul_softmax` (a performance rule, not in the default
  rules): attention written out as matmul, scale, softmax, matmul, which IREE 3.13
  runs faster on llvm-cpu than its own lowering of the fused op (issue 13;
  `backends/iree/rules/performance.py` decides per target). It keeps the guard's
  semantics: a fully masked row gives 0.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch.fx import Node
from torch.utils._python_dispatch import _disable_current_modes

from fx_rewrites import decompositions, schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule
from fx_rewrites.kinds.decompose import trace_decomposition
from fx_rewrites.ruleset import RuleSet

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

    def scale_or_default(self) -> float:
        """The scale given, else SDPA's own: 1 / sqrt(the query's head size), which must then be static."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(fake_value(self.query).shape[-1])


def bind(node: Node) -> Attention:
    """The arguments of an `aten.scaled_dot_product_attention` node."""
    named = schema.arguments(node)
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


# ----------------------------------------------------------------------------- one form


def _logsumexp_unread(node: Node) -> bool | Miss:
    users = list(node.users)
    if not (users and all(u.target is operator.getitem and u.args[1] == 0 for u in users)):
        return Miss("the logsumexp output (index 1) is read: flash_attention_for_cpu_with_logsumexp writes it out")
    return _sdpa_can_stand_for(node)


def _sdpa_can_stand_for(node: Node) -> bool | Miss:
    """Whether the CPU kernel's attention output is what SDPA computes from the same arguments."""
    named = schema.arguments(node)
    mask, query, key = fake_value(named.get("attn_mask")), fake_value(named["query"]), fake_value(named["key"])
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
    when=_logsumexp_unread,
    tags={"iree", "attention"},
    doc=(
        "torch.compile's graphs call attention through the CPU kernel "
        "aten._scaled_dot_product_flash_attention_for_cpu (its bool mask already turned into a float mask "
        "of 0 and -inf); with its logsumexp unread it is aten.scaled_dot_product_attention, the form the "
        "attention guard and the llvm-cpu attention rule read."
    ),
)
def flash_attention_for_cpu_to_sdpa(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    sdpa = rw.call(
        SDPA,
        args["query"],
        args["key"],
        args["value"],
        args.get("attn_mask"),
        args.get("dropout_p", 0.0),
        args.get("is_causal", False),
        scale=args.get("scale"),
    )
    for user in list(node.users):
        rw.replace(user, sdpa)
    rw.erase(node)  # the kernel's schema marks it nondeterministic (dropout): the dead-node sweep keeps it


def _logsumexp_read(node: Node) -> bool | Miss:
    users = list(node.users)
    if all(u.target is operator.getitem and u.args[1] == 0 for u in users):
        return Miss("the logsumexp is unread: flash_attention_for_cpu_to_sdpa makes it SDPA")
    if schema.arguments(node).get("dropout_p", 0.0) != 0.0:
        return Miss("dropout_p != 0: random, kept whole")
    return _sdpa_can_stand_for(node)


@rule(
    roots=(FLASH_FOR_CPU,),
    when=_logsumexp_read,
    tags={"iree", "attention"},
    doc=(
        "aten._scaled_dot_product_flash_attention_for_cpu whose logsumexp is read (torch.compile's training "
        "forward saves it for the kernel's backward, which runs on torch eager) is written out: matmul, scale, "
        "mask, a softmax by its max, matmul, and the logsumexp of the scores; a row that masks every key gives 0 "
        "for both, as the kernel. IREE: \"failed to legalize operation 'torch.operator'\" on the kernel. torch "
        "2.13's own decomposition returns the attention weights in the logsumexp's place."
    ),
)
def flash_attention_for_cpu_with_logsumexp(node: Node, rw: Rewriter) -> Any:
    traced = trace_decomposition(node, decompositions.flash_attention_for_cpu, rw.fake_mode)
    if isinstance(traced, Miss):
        return traced
    graph, inputs = traced
    rw.replace(node, rw.inline(graph, inputs))
    return None


# ----------------------------------------------------------------------------- a mask that masks nothing

#: the largest mask (elements) and the most nodes behind it that `attention_mask_that_masks_nothing` evaluates
MAX_MASK_ELEMENTS = 1 << 24
MAX_MASK_NODES = 64


def _mask_from_no_input(node: Node) -> Node | Miss:
    """The SDPA's mask when it is computed from no graph input and, evaluated, lets every key through."""
    mask = bind(node).mask
    if not isinstance(mask, Node):
        return Miss("no mask")
    behind, todo = {}, [mask]
    while todo:
        n = todo.pop()
        if n in behind:
            continue
        if n.op != "call_function":
            return Miss(f"the mask reads {n.name} ({n.op}): it depends on the inputs")
        if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
            return Miss(f"{n.name} ({n.target}) is random: one evaluation says nothing of the next")
        val = fake_value(n)
        if isinstance(val, torch.Tensor) and not all(isinstance(d, int) for d in val.shape):
            return Miss(f"{n.name} has a symbolic size: the mask cannot be evaluated once for every size")
        behind[n] = None
        if len(behind) > MAX_MASK_NODES:
            return Miss(f"more than {MAX_MASK_NODES} nodes compute the mask")
        todo.extend(n.all_input_nodes)
    if fake_value(mask).numel() > MAX_MASK_ELEMENTS:
        return Miss(f"a mask of {fake_value(mask).numel()} elements")
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    values: dict[Node, Any] = {}
    try:
        # real tensors: the engine may call `when` under its fake mode (torch.compile's route does)
        with _disable_current_modes():
            for n in sorted(behind, key=order.__getitem__):
                args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), values.__getitem__)
                values[n] = n.target(*args, **kwargs)
            value = values[mask]
            no_effect = bool(value.all()) if value.dtype == torch.bool else bool((value == 0).all())
    except Exception as e:  # an op that will not run on real tensors here: the mask stays, as it came
        return Miss(f"evaluating the mask raised {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    return mask if no_effect else Miss("the mask masks some key")


@rule(
    roots=(SDPA,),
    when=_mask_from_no_input,
    tags={"iree", "attention", "performance"},
    doc=(
        "scaled_dot_product_attention whose mask is computed from no input (only factories such as arange, "
        "static sizes) and lets every key through (bool: all True; float: all 0): the mask is dropped, which "
        "changes no number. transformers 5 builds such a mask for encoders without padding (ViT: "
        "arange(197) >= 0); on IREE it costs a masked_fill, the fully-masked-row guard's reduction and "
        "a select."
    ),
)
def attention_mask_that_masks_nothing(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    call_args, kwargs = schema.unbind(SDPA, {**args, "attn_mask": None}, explicit=False)
    rw.replace(node, rw.call(SDPA, *call_args, **kwargs))


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
    if fake_value(mask).dtype == torch.bool:
        return rw.call(aten.any.dim, mask, -1, True)
    return rw.call(aten.gt.Scalar, rw.call(aten.amax.default, mask, [-1], True), float("-inf"))


def zero_fully_masked_rows(rw: Rewriter, out: Node, mask: Node) -> Node:
    """`where(row has a key, out, 0)`: what torch 2.13 CPU eager gives for a row that masks every key."""
    zero = rw.call(aten.scalar_tensor.default, 0.0, dtype=fake_value(out).dtype)
    return rw.call(aten.where.self, row_has_key(rw, mask), out, zero)


def _maskable(node: Node, *, args: Mapping[str, Any]) -> Node | Miss:
    """The mask of an SDPA whose fully masked rows want zeros."""
    mask = args.get("attn_mask")
    if not isinstance(mask, Node):
        return Miss("no mask: no row can be fully masked (is_causal keeps the diagonal)")
    if fake_value(mask).dtype != torch.bool and not fake_value(mask).dtype.is_floating_point:
        return Miss(f"a {fake_value(mask).dtype} mask")
    if is_guarded(node):
        return Miss("already guarded")
    return mask


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
def attention_fully_masked_rows_guard(node: Node, rw: Rewriter, *, found: Node) -> Any:
    again = rw.call(node.target, *node.args, **node.kwargs)
    rw.replace(node, zero_fully_masked_rows(rw, again, found))


# ----------------------------------------------------------------------------- written out


def _writable(node: Node) -> Attention | Miss:
    a = bind(node)
    q, k = fake_value(a.query), fake_value(a.key)
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


def per_query_head(rw: Rewriter, q: Node, k: Node, v: Node) -> tuple[Node, Node]:
    """`k` and `v` repeated to `q`'s heads where it has more (enable_gqa, `_repeat_heads`), else as they are."""
    qv, kv = fake_value(q), fake_value(k)
    if qv.dim() < 3 or qv.shape[-3] == kv.shape[-3]:
        return k, v
    times = qv.shape[-3] // kv.shape[-3]
    return _repeat_heads(rw, k, times), _repeat_heads(rw, v, times)


def _repeat_heads(rw: Rewriter, kv: Node, times: int) -> Node:
    """enable_gqa: each key/value head serves `times` query heads (`repeat_interleave` on dim -3)."""
    shape = fake_value(kv).shape
    expanded = rw.call(aten.unsqueeze.default, kv, -3)
    sizes = [*(-1 for _ in shape[:-3]), shape[-3], times, shape[-2], shape[-1]]
    expanded = rw.call(aten.expand.default, expanded, sizes)
    batch = [rw.size(kv, d) for d in range(len(shape) - 3)]
    return rw.call(aten.reshape.default, expanded, [*batch, shape[-3] * times, shape[-2], shape[-1]])


@rule(
    roots=(SDPA,),
    when=_writable,
    tags={"iree", "performance", "attention"},
    doc=(
        "scaled_dot_product_attention written out: (query @ key^T) * scale, plus the mask (bool: masked_fill "
        "-inf; float: added; is_causal: the lower triangle kept), softmax, @ value; a row that masks every "
        "key gives 0, as torch 2.13 CPU eager. IREE 3.13 lowers the fused op on llvm-cpu (its online "
        "attention) slower than this form (issue 13). Performance only: not in the default rules."
    ),
)
def attention_as_matmul_softmax(node: Node, rw: Rewriter, *, found: Attention) -> Any:
    q, qv = found.query, fake_value(found.query)
    k, v = per_query_head(rw, q, found.key, found.value)
    scale = found.scale_or_default()
    # scaled after the matmul, as torch's CPU flash kernel: IREE fuses the scale into the softmax, where scaling the
    # query first is a dispatch of its own. An attention block in a model's layout, iree-benchmark-module, medians:
    # 4x4 heads x 500 tokens (Whisper) 34.4 -> 27.9 ms, 197 (ViT) 8.8 -> 7.3 ms, 128 (BERT) 1.50 -> 1.53 ms
    scores = rw.call(aten.mul.Scalar, rw.call(aten.matmul.default, q, rw.call(aten.transpose.int, k, -2, -1)), scale)
    if found.is_causal:
        rows = rw.call(aten.arange.default, rw.size(q, -2), device=qv.device)
        cols = rw.call(aten.arange.default, rw.size(k, -2), device=qv.device)
        above = rw.call(aten.lt.Tensor, rw.call(aten.unsqueeze.default, rows, -1), cols)
        scores = rw.call(aten.masked_fill.Scalar, scores, above, float("-inf"))
    if found.mask is not None and fake_value(found.mask).dtype == torch.bool:
        scores = rw.call(aten.masked_fill.Scalar, scores, rw.call(aten.logical_not.default, found.mask), float("-inf"))
    elif found.mask is not None:
        scores = rw.call(aten.add.Tensor, scores, found.mask)
    # softmax, then @ value: every target's form. On llvm-cpu the performance phase normalizes after the product
    # (performance.softmax_matmul_normalized_after), a form IREE 3.13's DispatchCreation data tiling computed wrong
    # at some sizes and the llvm-cpu flags' GlobalOptimization data tiling gets right (docs/iree-3.13-findings.md,
    # sections 9 and 10)
    out = rw.call(aten.matmul.default, rw.call(aten._softmax.default, scores, -1, False), v)
    if found.mask is not None and not is_guarded(node):
        out = zero_fully_masked_rows(rw, out, found.mask)
    rw.replace(node, out)


#: every IREE target: one form, guarded
GUARDS = RuleSet(
    [
        flash_attention_for_cpu_to_sdpa,
        flash_attention_for_cpu_with_logsumexp,
        attention_mask_that_masks_nothing,
        attention_fully_masked_rows_guard,
    ],
    name="attention-guards",
)
