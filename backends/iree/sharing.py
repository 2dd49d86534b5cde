"""What memory a CPU call may share with its caller: arguments IREE never writes, results that are its new buffers.

**Arguments.** A call on a CPU device can pass an input array's own memory as the argument's buffer
(`HalAllocator.import_host_allocation`) instead of a copy (~0.25 ms for a 3.2 MB input). IREE 3.13 does not treat
such an argument as read-only: an op that updates a tensor in destination-passing style (a scatter into `x`, a sort
of `x`, an insert into it) reuses the argument's storage when nothing reads `x` after it, and the caller's tensor
changes (docs/iree-3.13-findings.md, 71). So an argument is handed over only where every op that can see its memory
(the argument's uses, and theirs, to the end of the graph: a view, a clone IREE elides or an `x * 1` it folds
passes the same storage on) is one that computes a new tensor from what it reads: an ATen op listed in `_READERS`,
a pointwise op of torch's `Tag.pointwise`, a view (its schema returns an alias), one of this backend's own
dispatches (`fx_rewrites::*`, spliced as a `flow.dispatch` that writes only its result) or a non-tensor helper
(`getitem`, size arithmetic). Any other op (scatters, `index_put`, sorts, copies, fills, in-place ops, control
flow, an op this list does not know) keeps the argument copied.

**Results.** A result can be handed to the caller as the buffer IREE wrote it into (no copy out: ~0.1 ms for a
1 MB result) only where it is a buffer of this call's own: not an argument (imported above) or a view of one, not
a constant, a weight or a global the module keeps. `fresh_results` says so of a result computed by a product or a
convolution (`_PRODUCERS`) or an `fx_rewrites::*` dispatch, or by any other op whose tensor operands are all such
results (IREE can fold an op to one of its operands, never to a buffer it was not given); a value read from an
argument, a constant or state, or one that also leaves as another result, is copied. `calling.Invoker` also copies
a result whose memory overlaps another result's or an imported argument's.

The test suite checks the argument claim call by call: with `FX_REWRITES_CHECK_INPUTS=1` (tests/conftest.py)
each imported input is compared with a copy taken before the call (`calling.Invoker`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch.fx import Node
from torch.fx.node import map_arg

aten = torch.ops.aten

#: ATen ops (overload packets) that write only a new result: matmuls and convolutions, norms, reductions,
#: pooling, softmax, gathers, joins and pads, copies into a new layout; checked by the whole suite (module doc)
# fmt: off
_READERS = frozenset(getattr(aten, name) for name in (
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "mm", "bmm", "addmm", "matmul", "linear",
    "_softmax", "softmax", "_log_softmax", "log_softmax", "native_layer_norm", "layer_norm", "rms_norm",
    "_native_batch_norm_legit_no_training", "native_batch_norm", "batch_norm", "native_group_norm", "group_norm",
    "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices",
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d",
    "adaptive_max_pool2d", "mean", "sum", "amax", "amin", "max", "min", "argmax", "argmin", "var", "var_mean", "std",
    "prod", "any", "all", "logsumexp", "linalg_vector_norm", "cat", "stack", "embedding", "index", "index_select",
    "gather", "constant_pad_nd", "pad", "reflection_pad2d", "replication_pad2d", "upsample_nearest2d",
    "upsample_bilinear2d", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu", "repeat",
    "flip", "roll", "tril", "triu", "clone", "_to_copy", "to", "contiguous", "zeros_like", "ones_like", "full_like",
    "empty_like", "new_zeros", "new_ones", "new_full", "lift_fresh_copy",
) if hasattr(aten, name))
# fmt: on


def unwritten_arguments(arguments: Sequence[Node]) -> tuple[bool, ...]:
    """Per placeholder of `arguments` (the compiled function's, in order): True where no op that can see its
    memory may write it (the module doc's conditions), so a CPU call may pass the caller's memory uncopied."""
    return tuple(_never_written(node) for node in arguments)


def _never_written(argument: Node) -> bool:
    seen, todo = {argument}, [argument]
    while todo:
        for user in todo.pop().users:
            if user in seen or user.op == "output":
                continue
            if not _reads_only(user):
                return False
            seen.add(user)
            if _may_hold_tensors(user):  # a size or a flag read off it holds none of its memory
                todo.append(user)
    return True


def _reads_only(node: Node) -> bool:
    """Whether `node` writes no tensor it is given (the module doc's list)."""
    if node.op != "call_function":
        return False  # a call_module or call_method: not a prepared ATen graph's op
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        if schema.is_mutable or target.namespace not in ("aten", "prims", "fx_rewrites"):
            return False
        if target.namespace == "fx_rewrites" or target.overloadpacket in _READERS:
            return True
        if torch.Tag.pointwise in target.tags:
            return True
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return True  # a view
        return not any(isinstance(r.type, torch.TensorType) for r in schema.returns)  # a size, an item, a check
    if isinstance(target, torch._ops.HigherOrderOperator):
        return False  # cond, while_loop, ...: their bodies are not looked into
    return target is operator.getitem or not _may_hold_tensors(node)  # size arithmetic, torch.sym_*


def _may_hold_tensors(node: Node) -> bool:
    val = node.meta.get("val")
    if val is None:
        return True  # unknown: followed
    values = val if isinstance(val, (list, tuple)) else (val,)
    return any(isinstance(v, torch.Tensor) for v in values)


#: ATen ops whose result IREE always writes into a buffer of its own (a product, a convolution: never folded away)
_PRODUCERS = frozenset(
    getattr(aten, name)
    for name in ("convolution", "_convolution", "conv2d", "mm", "bmm", "addmm", "linear", "matmul")
    if hasattr(aten, name)
)
#: readers whose result does not depend on an operand's values (IREE may make it a constant, hoisted to a global)
_SHAPE_ONLY = frozenset(
    getattr(aten, name)
    for name in ("zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones", "new_full")
)


def fresh_results(results: Sequence[object]) -> tuple[bool, ...]:
    """Per result of the compiled function (the output node's leaves, in order): True where IREE returns a buffer
    of the call's own, which the caller may keep uncopied (the module doc's conditions)."""
    memo: dict[Node, bool] = {}
    counts: dict[object, int] = {}
    for r in results:
        counts[r] = counts.get(r, 0) + 1
    return tuple(isinstance(r, Node) and counts[r] == 1 and _fresh(r, memo) for r in results)


def _fresh(node: Node, memo: dict[Node, bool]) -> bool:
    """Whether `node`'s value is a buffer IREE makes in the call: a product's, a dispatch's, or one computed from
    such a value by a view, a pointwise op or a listed reader with at most one operand that is not (IREE can fold
    an op to an operand only where the others are known: `x * 1`, `where(c, w, w)`; a fresh one never is)."""
    todo = [node]
    while todo:  # operands first, without recursion (graphs of thousands of nodes)
        current = todo[-1]
        if current in memo:
            todo.pop()
            continue
        rule = _freshness_rule(current)
        if rule in ("own", "never"):
            memo[current] = rule == "own"
            todo.pop()
            continue
        operands = [a for a in _operands(current) if _may_hold_tensors(a)]
        if rule == "source":
            operands = operands[:1]
        waiting = [a for a in operands if a not in memo]
        if waiting:
            todo.extend(waiting)
            continue
        stale = sum(not memo[a] for a in operands)  # with multiplicity: where(c, w, w) is w
        memo[current] = stale < len(operands) and stale <= 1
        todo.pop()
    return memo[node]


def _operands(node: Node) -> list[Node]:
    """`node`'s operand nodes in order, each as often as it is passed (`all_input_nodes` has each once)."""
    found: list[Node] = []
    map_arg((node.args, node.kwargs), found.append)
    return found


def _freshness_rule(node: Node) -> str:
    """ "own" (a product or dispatch), "source" (a view or a tuple's item: fresh where its source is), "any" (fresh
    where an operand is, `_fresh`'s conditions) or "never" (an argument, a constant, any other op)."""
    target = node.target
    if node.op != "call_function":
        return "never"  # an argument, a constant, a weight
    if target is operator.getitem:
        return "source"
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return "never"
    if target.namespace == "fx_rewrites" or target.overloadpacket in _PRODUCERS:
        return "own"
    if target.namespace not in ("aten", "prims") or target.overloadpacket in _SHAPE_ONLY:
        return "never"
    if any(r.alias_info is not None for r in target._schema.returns):
        return "source"
    if torch.Tag.pointwise in target.tags or target.overloadpacket in _READERS:
        return "any"
    return "never"
