"""Small rules used by the engine tests (not shipped rule packs)."""

from __future__ import annotations

import torch

from fx_rewrites import Miss, Pattern, rule

aten = torch.ops.aten


def relu_relu(x):
    return aten.relu.default(aten.relu.default(x))


def relu(x):
    return aten.relu.default(x)


collapse_relu = Pattern(name="collapse_relu", pattern=relu_relu, replacement=relu)


@rule(roots=(aten.add.Tensor,))
def add_to_sub(node, rw):
    """add(x, w) -> sub(x, neg(w)) (correct, and undone by sub_to_add)."""
    x, w = node.args
    if not isinstance(w, torch.fx.Node):
        return Miss("second operand is a constant")
    rw.replace(node, rw.call(aten.sub.Tensor, x, rw.call(aten.neg.default, w)))
    return None


@rule(roots=(aten.sub.Tensor,))
def sub_to_add(node, rw):
    """sub(x, neg(w)) -> add(x, w)."""
    x, nw = node.args
    if getattr(nw, "target", None) is not aten.neg.default:
        return Miss("second operand is not neg")
    rw.replace(node, rw.call(aten.add.Tensor, x, nw.args[0]))
    return None


@rule(roots=(aten.mul.Tensor,))
def mul_grows(node, rw):
    """mul(a, b) -> mul(mul(a, 1), b): it rewrites its own output's inner
    mul(a, 1) into the same form again, forever."""
    a, b = node.args
    rw.replace(node, rw.call(aten.mul.Tensor, rw.call(aten.mul.Tensor, a, 1), b))


@rule(roots=(aten.mul.Tensor,))
def bump_scalar(node, rw):
    """mul(t, k) -> mul(t, k + 1): a new form every time, so only the budget
    stops it (the numbers change; fine for a test of the budget)."""
    t, k = node.args
    rw.replace(node, rw.call(aten.mul.Tensor, t, k + 1))


@rule(roots=(aten.relu.default,))
def raises_midway(node, rw):
    """Inserts a node, then raises: must leave the graph untouched."""
    rw.call(aten.neg.default, node.args[0])
    raise RuntimeError("boom")


@rule(roots=(aten.relu.default,))
def changes_dtype(node, rw):
    """relu(x) -> relu(x).double(): wrong dtype, must be rolled back."""
    rw.replace(node, rw.call(aten._to_copy.default, rw.call(aten.relu.default, node.args[0]), dtype=torch.float64))


@rule(roots=(aten.relu.default,))
def changes_shape(node, rw):
    """relu(x) -> relu(x)[0]: wrong shape, must be rolled back."""
    rw.replace(node, rw.call(aten.select.int, rw.call(aten.relu.default, node.args[0]), 0, 0))
