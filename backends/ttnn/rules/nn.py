"""Matmul, linear, softmax, normalisation, embedding and attention -> ttnn."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.backends.ttnn.rules import ops
from fx_rewrites.backends.ttnn.rules.boundary import device_value
from fx_rewrites.backends.ttnn.rules.checks import Bound, lowering, tensors_ok
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

# -- matmul, linear ----------------------------------------------------------------------------------


def _matmul_when(node: Node) -> Any:
    for arg in node.args[:2]:
        val = fake_value(arg)
        if isinstance(val, torch.Tensor) and val.dim() < 2:
            return Miss("a 1-D operand: ttnn.matmul takes matrices (rank >= 2)")
    return tensors_ok(*schema.arg_names(node.target)[:2])(node)


MATMULS = [aten.matmul.default, aten.mm.default, aten.bmm.default]


@lowering("ttnn_matmul", MATMULS, _matmul_when, "matmul/mm/bmm -> ttnn.matmul.")
def lower_matmul(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    a, b = (args[n] for n in schema.arg_names(node.target)[:2])
    return rw.call(ops.matmul, device_value(rw, a), device_value(rw, b))


def _linear_when(node: Node) -> Any:
    weight = node.args[1]
    if isinstance(weight, Node) and getattr(weight.meta.get("val"), "ndim", 2) != 2:
        return Miss("the weight is not 2-D")
    return tensors_ok("input", "weight", "bias")(node)


@lowering(
    "ttnn_linear",
    [aten.linear.default],
    _linear_when,
    "aten.linear(x, W, b) -> ttnn.linear(x, W, bias=b, transpose_b=True) (W stays [out, in]).",
)
def lower_linear(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    bias = args.get("bias")
    b = row_bias(rw, bias) if isinstance(bias, Node) else None
    return rw.call(ops.linear, device_value(rw, args["input"]), device_value(rw, args["weight"]), b, True)


def row_bias(rw: Rewriter, bias: Node) -> Node:
    """A linear bias as ttnn.linear's row vector `[1, N]` on the device (ttnn.linear's docs: most program
    configs take a `[1, N]` bias); reshaped once with the weights, since it is a constant."""
    width = int(bias.meta["val"].shape[-1])
    return rw.call(ops.reshape, device_value(rw, bias), [1, width])


def _addmm_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if args.get("beta", 1) != 1 or args.get("alpha", 1) != 1:
        return Miss("beta or alpha is not 1; ttnn.linear has neither")
    return tensors_ok("self", "mat1", "mat2")(node, args)


def _is_row(val: torch.Tensor) -> bool:
    """A bias ttnn.linear broadcasts over the output rows: `[N]` or `[1, N]` (static)."""
    return all(isinstance(s, int) for s in val.shape) and (val.dim() == 1 or (val.dim() == 2 and val.shape[0] == 1))


@lowering("ttnn_addmm", [aten.addmm.default], _addmm_when, "aten.addmm(b, x, W) -> ttnn.linear(x, W, bias=b).")
def lower_addmm(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    x, w = device_value(rw, args["mat1"]), device_value(rw, args["mat2"])
    bias = args["self"]
    if _is_row(bias.meta["val"]):
        return rw.call(ops.linear, x, w, row_bias(rw, bias), False)
    # a full [M, N] (or broadcast) addend: ttnn.linear's bias is a row vector, so matmul, then add
    return rw.call(ops.OPS["add"], rw.call(ops.matmul, x, w), device_value(rw, bias))


# -- softmax, layer_norm, embedding --------------------------------------------------------------------


def _softmax_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if args.get("dtype") is not None or args.get("half_to_float"):
        return Miss("softmax with a dtype change")
    return tensors_ok("self")(node, args)


@lowering(
    "ttnn_softmax", [aten.softmax.int, aten._softmax.default], _softmax_when, "softmax -> ttnn.softmax(x, dim=d)."
)
def lower_softmax(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops.softmax, device_value(rw, args["self"]), int(args["dim"]))


def _layer_norm_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    val = fake_value(node.args[0])
    shape = list(args["normalized_shape"])
    if isinstance(val, torch.Tensor) and (len(shape) != 1 or shape[0] != val.shape[-1]):
        return Miss(f"normalized_shape {shape} is not the last dimension; ttnn.layer_norm normalises over it only")
    return tensors_ok("input", "weight", "bias")(node, args)


@lowering(
    "ttnn_layer_norm",
    [aten.layer_norm.default],
    _layer_norm_when,
    "aten.layer_norm over the last dimension -> ttnn.layer_norm(x, epsilon=, weight=, bias=).",
)
def lower_layer_norm(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    w, b = (device_value(rw, args[n]) if isinstance(args.get(n), Node) else None for n in ("weight", "bias"))
    return rw.call(ops.layer_norm, device_value(rw, args["input"]), w, b, float(args.get("eps", 1e-5)))


def _embedding_when(node: Node) -> Any:
    indices = node.args[1]
    if isinstance(indices, Node) and getattr(indices.meta.get("val"), "ndim", 2) != 2:
        return Miss("indices are not [batch, sequence]; ttnn.embedding takes 2-D indices")
    return tensors_ok("weight", indices=("indices",))(node)


@lowering(
    "ttnn_embedding",
    [aten.embedding.default],
    _embedding_when,
    "aten.embedding -> ttnn.embedding(uint32 row-major indices, row-major bfloat16 table, layout=TILE).",
)
def lower_embedding(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    indices = device_value(rw, args["indices"], dtype="uint32", layout=ops.ROW_MAJOR)
    weight = device_value(rw, args["weight"], layout=ops.ROW_MAJOR)
    return rw.call(ops.embedding, indices, weight)


def _batch_norm_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if args.get("training"):
        return Miss("training-mode batch norm (batch statistics)")
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() != 4:
        return Miss(f"a {val.dim()}-D input; ttnn.batch_norm takes [N, C, H, W]")
    if args.get("running_mean") is None or args.get("running_var") is None:
        return Miss("no running statistics")
    return tensors_ok("input", "weight", "bias", "running_mean", "running_var")(node, args)


@lowering(
    "ttnn_batch_norm",
    [aten.batch_norm.default],
    _batch_norm_when,
    "eval-mode aten.batch_norm on NCHW -> ttnn.batch_norm(x, running_mean=, running_var=, weight=, bias=, eps=).",
)
def lower_batch_norm(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    mean, var = device_value(rw, args["running_mean"]), device_value(rw, args["running_var"])
    w, b = (device_value(rw, args[n]) if isinstance(args.get(n), Node) else None for n in ("weight", "bias"))
    return rw.call(ops.batch_norm, device_value(rw, args["input"]), mean, var, w, b, float(args.get("eps", 1e-5)))


def _sdpa_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if args.get("dropout_p", 0.0) or args.get("enable_gqa"):
        return Miss("dropout or grouped-query heads (enable_gqa)")
    mask = args.get("attn_mask")
    if mask is not None and args.get("is_causal"):
        return Miss("both attn_mask and is_causal")
    for arg in ("query", "key", "value"):
        val = fake_value(args[arg])
        if isinstance(val, torch.Tensor) and val.dim() != 4:
            return Miss(f"{arg} has rank {val.dim()}; ttnn's attention takes [batch, heads, sequence, head_dim]")
    if isinstance(mask, Node) and _mask_shape(mask, args["query"], args["key"]) is None:
        return Miss("the attn_mask's shape is symbolic; ttnn takes it expanded to [b, heads, s_q, s_k] (constants)")
    return tensors_ok("query", "key", "value", masks=("attn_mask",))(node, args)


def _mask_shape(mask: Node, query: Node, key: Node) -> list[int] | None:
    """The shape ttnn's attention wants the mask in: `[b or 1, heads or 1, s_q, s_k]` (its docs: batch and
    heads may be 1), or None when a size is symbolic."""
    m, q, k = (n.meta["val"].shape for n in (mask, query, key))
    if not all(isinstance(s, int) for s in (*m, *q, *k)):
        return None
    m4 = [1] * (4 - len(m)) + [int(s) for s in m]
    return [1 if m4[0] == 1 else int(q[0]), 1 if m4[1] == 1 else int(q[1]), int(q[2]), int(k[2])]


def _attention_mask(rw: Rewriter, mask: Node, query: Node, key: Node) -> Node:
    """The additive mask as a device value of the shape `_mask_shape` gives (HF's `[b, 1, 1, s]` or a rank-2
    mask is reshaped to rank 4 and expanded over the query rows)."""
    want = _mask_shape(mask, query, key)
    assert want is not None  # _sdpa_when declined symbolic shapes
    shape = [int(s) for s in mask.meta["val"].shape]
    m = device_value(rw, mask)
    if mask.meta["val"].dtype == torch.bool:  # True attends: additive 0 there, the most negative bfloat16 elsewhere
        m = rw.call(ops.OPS["multiply_scalar"], rw.call(ops.OPS["add_scalar"], m, -1.0), ops.BF16_MAX)
    if len(shape) < 4:
        shape = [1] * (4 - len(shape)) + shape
        m = rw.call(ops.reshape, m, shape)
    return m if shape == want else rw.call(ops.expand, m, want)


@lowering(
    "ttnn_sdpa",
    [aten.scaled_dot_product_attention.default],
    _sdpa_when,
    "F.scaled_dot_product_attention -> ttnn.transformer.scaled_dot_product_attention(q, k, v, attn_mask=, "
    "is_causal=, scale=).",
)
def lower_sdpa(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    q, k, v = (device_value(rw, args[n]) for n in ("query", "key", "value"))
    mask = args.get("attn_mask")
    m = _attention_mask(rw, mask, args["query"], args["key"]) if isinstance(mask, Node) else None
    scale = args.get("scale")
    return rw.call(ops.sdpa, q, k, v, m, bool(args.get("is_causal", False)), None if scale is None else float(scale))


def _baddbmm_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if any(isinstance(args.get(k, 1), Node) for k in ("beta", "alpha")):
        return Miss("beta or alpha is a graph value")
    return tensors_ok("self", "batch1", "batch2")(node, args)


@lowering(
    "ttnn_baddbmm",
    [aten.baddbmm.default],
    _baddbmm_when,
    "baddbmm(c, a, b, beta, alpha) -> ttnn.matmul(a, b), scaled by alpha, plus beta * c.",
)
def lower_baddbmm(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    beta, alpha = float(args.get("beta", 1)), float(args.get("alpha", 1))
    out = rw.call(ops.matmul, device_value(rw, args["batch1"]), device_value(rw, args["batch2"]))
    if alpha != 1.0:
        out = rw.call(ops.OPS["multiply_scalar"], out, alpha)
    if beta == 0.0:  # torch ignores self then (even NaN in it)
        return out
    c = device_value(rw, args["self"])
    return rw.call(ops.OPS["add"], out, c if beta == 1.0 else rw.call(ops.OPS["multiply_scalar"], c, beta))


def _log_softmax_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if args.get("dtype") is not None or args.get("half_to_float"):
        return Miss("log_softmax with a dtype change")
    return tensors_ok("self")(node, args)


@lowering(
    "ttnn_log_softmax",
    [aten._log_softmax.default, aten.log_softmax.int],
    _log_softmax_when,
    "log_softmax -> x - max - log(sum(exp(x - max))) with ttnn.max/subtract/exp/sum/log (ttnn has no log_softmax).",
)
def lower_log_softmax(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    x, dim = device_value(rw, args["self"]), [int(args["dim"])]
    shifted = rw.call(ops.OPS["subtract"], x, rw.call(ops.reduce_max, x, dim, True))
    total = rw.call(ops.reduce_sum, rw.call(ops.OPS["exp"], shifted), dim, True)
    return rw.call(ops.OPS["subtract"], shifted, rw.call(ops.OPS["log"], total))


def _index_select_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    table, index = args["self"].meta.get("val"), args["index"]
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or int(args["dim"]) % 2 != 0:
        return Miss("not rows of a 2-D tensor; index_select goes to ttnn.embedding for dim 0 of a matrix only")
    if not isinstance(index, Node) or getattr(index.meta.get("val"), "ndim", None) != 1:
        return Miss("the index is not a 1-D tensor")
    return tensors_ok("self", indices=("index",), static=True)(node, args)


@lowering(
    "ttnn_index_select",
    [aten.index_select.default],
    _index_select_when,
    "index_select(table, 0, ids) -> ttnn.embedding([1, n] uint32 ids, row-major table), reshaped to [n, width].",
)
def lower_index_select(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    n = int(args["index"].meta["val"].shape[0])
    ids = device_value(rw, args["index"], dtype="uint32", layout=ops.ROW_MAJOR)
    rows = rw.call(
        ops.embedding, rw.call(ops.reshape, ids, [1, n]), device_value(rw, args["self"], layout=ops.ROW_MAJOR)
    )
    return rw.call(ops.reshape, rows, [n, int(node.meta["val"].shape[1])])


def _group_norm_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    val = fake_value(args["input"])
    if isinstance(val, torch.Tensor) and val.dim() < 2:
        return Miss("an input without a channel dimension")
    return tensors_ok("input", "weight", "bias", static=True)(node, args)


@lowering(
    "ttnn_group_norm",
    [aten.group_norm.default],
    _group_norm_when,
    "group_norm -> ttnn.layer_norm over [N, groups, C/groups*H*W] (each group's last dimension), then the affine.",
)
def lower_group_norm(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    shape = [int(s) for s in args["input"].meta["val"].shape]
    n, c, groups = shape[0], shape[1], int(args["num_groups"])
    x = rw.call(ops.reshape, device_value(rw, args["input"]), [n, groups, _numel(shape) // (n * groups)])
    # normalising each group is a layer_norm over the last dimension of [N, groups, C/groups*H*W]: one fused op
    normed = rw.call(ops.layer_norm, x, None, None, float(args.get("eps", 1e-5)))
    y = rw.call(ops.reshape, normed, shape)
    per_channel = [1, c] + [1] * (len(shape) - 2)
    for name, op in (("weight", "multiply"), ("bias", "add")):
        if isinstance(args.get(name), Node):
            y = rw.call(ops.OPS[op], y, rw.call(ops.reshape, device_value(rw, args[name]), per_channel))
    return y


def _numel(shape: list[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


RULES = RuleSet(
    [
        lower_group_norm,
        lower_baddbmm,
        lower_log_softmax,
        lower_index_select,
        lower_sdpa,
        lower_batch_norm,
        lower_matmul,
        lower_linear,
        lower_addmm,
        lower_softmax,
        lower_layer_norm,
        lower_embedding,
    ],
    name="ttnn_nn",
)
