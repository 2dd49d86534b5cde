"""Eval batch norm folded into the frozen convolution before it (the torch.compile route, after freezing).

aot_autograd hands an inference graph's eval `BatchNorm` over decomposed:
`(conv(x, W) - mean) * (rsqrt(var + eps) * gamma) + beta`, the per-channel
operands computed from the module's running statistics and affine
parameters. Once those are frozen (`backends/freezing.py`: get_attr
tensors), each per-channel `sub` / `add` / `mul` / `div` that reads a
convolution folds into its weight and bias, as Inductor's freezing does
(`torch/_inductor/fx_passes/freezing_patterns.py`): `conv(x, W, b) * s` is
`conv(x, W * s, b * s)`, `conv(x, W, b) + t` is `conv(x, W, b + t)`. The new
weight and bias are computed here once, in the weights' dtype, from the
frozen values, and kept on the graph as `_folded_<k>` attributes; the
compiled module then runs one convolution where it ran a convolution and
three elementwise ops (measured in benchmarks/dynamo_route.py).

Folded only when exact up to float rounding: the convolution is read by
the elementwise op alone, its weight and bias are frozen tensors, the other
operand is computed from frozen tensors only (by view, reshape, unsqueeze,
squeeze and elementwise arithmetic, evaluated here) and is the same over all
but the output channel, the result keeps the convolution's shape and dtype,
and a divisor has no zero. As with Inductor, the folded result differs from
the unfolded one by float32 rounding (`(x * W) * s` against `x * (W * s)`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten

#: the elementwise ops that fold into a convolution: "scale" (weight and bias), "shift" (bias)
AFFINE = {aten.mul.Tensor: "scale", aten.div.Tensor: "scale", aten.add.Tensor: "shift", aten.sub.Tensor: "shift"}
#: ops evaluated on frozen tensors to get the per-channel operand (running statistics -> scale, shift)
EVALUATED = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.add.Tensor,
        aten.sub.Tensor,
        aten.mul.Tensor,
        aten.div.Tensor,
        aten.rsqrt.default,
        aten.sqrt.default,
        aten.reciprocal.default,
        aten.neg.default,
    }
)
#: the attribute prefix of a folded weight or bias on the graph module
ATTR = "_folded_"
#: ops other than `aten.convolution` that compute a convolution (x, w [O, ...], b [O], *rest), by the position of an
#: argument that must be 0 for a fold (a ReLU in the op's store), or None: a backend's dispatch ops, registered by
#: the module defining them (the IREE backend's 1x1 and kxk convolution dispatches)
CONVOLUTIONS: dict[Any, int | None] = {}


def _attribute(gm: GraphModule, node: Node) -> Any:
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value


def _frozen_value(gm: GraphModule, value: Any, cache: dict[Node, Any], depth: int = 8) -> Any:
    """The value of `value` when it is computed from the graph's tensor attributes only (None otherwise)."""
    if not isinstance(value, Node):
        return value
    if value in cache:
        return cache[value]
    result = None
    if value.op == "get_attr":
        attribute = _attribute(gm, value)
        result = attribute if isinstance(attribute, torch.Tensor) else None
    elif value.op == "call_function" and value.target in EVALUATED and value.all_input_nodes and depth > 0:
        args = [_frozen_value(gm, a, cache, depth - 1) for a in value.args]
        kwargs = {k: _frozen_value(gm, v, cache, depth - 1) for k, v in value.kwargs.items()}
        inputs = [a for a, node in zip(args, value.args, strict=True) if isinstance(node, Node)]
        inputs += [v for v, node in zip(kwargs.values(), value.kwargs.values(), strict=True) if isinstance(node, Node)]
        if all(isinstance(i, torch.Tensor) for i in inputs):
            result = value.target(*args, **kwargs)
    cache[value] = result
    return result


def _per_channel(value: Any, out: torch.Tensor) -> torch.Tensor | None:
    """`value` as a flat tensor of one value per output channel of a conv result `out` (None: it is not one)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.full((out.shape[1],), float(value), dtype=out.dtype)
    if not isinstance(value, torch.Tensor) or value.dtype != out.dtype or value.dim() > out.dim():
        return None
    shape = [1] * (out.dim() - value.dim()) + list(value.shape)
    channels = int(out.shape[1])
    if any(s != 1 for i, s in enumerate(shape) if i != 1) or shape[1] not in (1, channels):
        return None
    return value.reshape(-1).expand(channels).contiguous()


def _foldable(gm: GraphModule, node: Node, cache: dict[Node, Any]) -> tuple[Node, torch.Tensor, Any, Any] | None:
    """(the convolution, the per-channel operand, its weight's and bias's values) when `node` folds into the
    convolution it reads."""
    if node.target not in AFFINE or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return None
    first, other = node.args
    candidates = [(first, other)]
    if node.target in (aten.mul.Tensor, aten.add.Tensor):
        candidates.append((other, first))
    for conv, operand in candidates:
        if not (isinstance(conv, Node) and _convolution(conv) and len(conv.users) == 1):
            continue
        transposed = conv.args[6] if conv.target is aten.convolution.default else False
        out, result = conv.meta.get("val"), node.meta.get("val")
        if transposed or not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point:
            continue
        if not isinstance(result, torch.Tensor) or result.shape != out.shape or result.dtype != out.dtype:
            continue
        weight, bias = _frozen_value(gm, conv.args[1], cache), _bias(gm, conv.args[2], out.dtype, cache)
        if not isinstance(conv.args[1], Node) or not isinstance(weight, torch.Tensor) or bias is False:
            continue
        if isinstance(operand, Node) and operand.op == "placeholder":
            continue
        channel = _per_channel(_frozen_value(gm, operand, cache), out)
        if channel is None or (node.target is aten.div.Tensor and bool((channel == 0).any())):
            continue
        return conv, channel, weight, bias
    return None


def _convolution(node: Node) -> bool:
    """`node` is `aten.convolution` or a registered convolution op (`CONVOLUTIONS`) without its ReLU."""
    if node.target is aten.convolution.default:
        return True
    if node.op != "call_function" or node.target not in CONVOLUTIONS:
        return False
    relu = CONVOLUTIONS[node.target]
    return relu is None or not node.args[relu]


def _bias(gm: GraphModule, bias: Any, dtype: torch.dtype, cache: dict[Node, Any]) -> Any:
    """A convolution's bias: None, its frozen value, zeros for `aten.zeros` (a dispatch op's bias where the
    convolution had none), or False where it is none of these."""
    if bias is None:
        return None
    if isinstance(bias, Node) and bias.op == "call_function" and bias.target is aten.zeros.default:
        return torch.zeros(*bias.args[:1], dtype=dtype)
    value = _frozen_value(gm, bias, cache) if isinstance(bias, Node) else None
    return value if isinstance(value, torch.Tensor) else False


def _fold_one(
    gm: GraphModule, node: Node, conv: Node, channel: torch.Tensor, weight: torch.Tensor, bias: Any, count: int
) -> int:
    graph = gm.graph
    op = node.target
    if AFFINE[op] == "scale":
        new_weight = op(weight, channel.reshape([-1] + [1] * (weight.dim() - 1)))
        new_bias = None if bias is None else op(bias, channel)
    else:
        new_weight = weight
        new_bias = op(bias if bias is not None else torch.zeros_like(channel), channel)
    names = []
    for tensor in (new_weight, new_bias):
        if tensor is None or (tensor is weight and conv.args[1].op == "get_attr"):
            names.append(None)
            continue
        name = f"{ATTR}{count}"
        count += 1
        gm.register_buffer(name, tensor.contiguous(), persistent=False)
        names.append(name)
    with graph.inserting_before(conv):
        w = graph.get_attr(names[0]) if names[0] else conv.args[1]
        b = graph.get_attr(names[1]) if names[1] else None
    for attr, tensor in ((w, new_weight), (b, new_bias)):
        if isinstance(attr, Node) and attr.op == "get_attr" and attr is not conv.args[1]:
            attr.meta["val"] = tensor
    with graph.inserting_before(node):
        folded = graph.call_function(conv.target, (conv.args[0], w, b, *conv.args[3:]))
    folded.meta = dict(conv.meta)
    node.replace_all_uses_with(folded)
    graph.erase_node(node)
    graph.erase_node(conv)
    return count


def fold_conv_affine(gm: GraphModule) -> int:
    """Fold each per-channel affine op that reads a frozen convolution into it (in place); how many folded."""
    count = sum(1 for name, _ in gm.named_buffers() if name.startswith(ATTR))
    folded = 0
    changed = True
    while changed:
        changed = False
        cache: dict[Node, Any] = {}
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            found = _foldable(gm, node, cache)
            if found is None:
                continue
            count = _fold_one(gm, node, *found, count)
            folded += 1
            changed = True
            break
    if folded:
        gm.graph.eliminate_dead_code()
        for node in gm.graph.find_nodes(op="get_attr"):
            if not node.users:
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
    return folded


def fold_conv_relu(gm: GraphModule) -> int:
    """Fold each `aten.relu` of a registered convolution op (`CONVOLUTIONS` with a ReLU argument) read by the ReLU
    alone into the op's ReLU (in place; what the export route's rules do before the batch norm is gone: IREE's
    `relu_into_pointwise_conv`); how many folded."""
    folded = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.relu.default)):
        conv = node.args[0]
        if not isinstance(conv, Node) or conv.op != "call_function" or len(conv.users) != 1:
            continue
        relu = CONVOLUTIONS.get(conv.target)
        if relu is None or len(conv.args) <= relu or conv.args[relu]:
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(conv.target, (*conv.args[:relu], 1, *conv.args[relu + 1 :]), conv.kwargs)
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
        gm.graph.erase_node(conv)
        folded += 1
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


__all__ = ["ATTR", "CONVOLUTIONS", "fold_conv_affine", "fold_conv_relu"]
