"""Composite ops that lie about their schema (seed 003), in the forms that
reach backends: eval-mode batch norm, rrelu and dropout.

`run_decompositions` turns eval `BatchNorm` into
`_native_batch_norm_legit_no_training`, which is tagged core (so it stays)
and which IREE cannot legalize; torch's own decomposition of it calls the
mutating `_native_batch_norm_legit`. Eval `rrelu` becomes the non-core
`rrelu_with_noise_functional` with an uninitialised noise buffer.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import Forward, rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


def _statistics_empty_where_read(node: Node) -> bool | Miss:
    """Outputs 1 and 2 (the saved mean and inverse std) may be read where they are empty: what eval-mode batch
    norm saves on CPU (torch.compile's forward of a grad-enabled eval call returns them for the backward, which
    uses the running statistics)."""
    for user in node.users:
        if user.target is not operator.getitem:
            return Miss(f"{user.name} reads the outputs as a tuple")
        if user.args[1] != 0:
            val = user.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.shape != (0,):
                shape = tuple(val.shape) if isinstance(val, torch.Tensor) else val
                return Miss(f"{user.name} reads saved statistics of shape {shape}, not the empty ones of eval mode")
    return True


@rule(
    roots=(aten._native_batch_norm_legit_no_training.default,),
    when=_statistics_empty_where_read,
    tags={"composites"},
    doc=(
        "Eval-mode batch norm as `_native_batch_norm_legit_no_training` (what run_decompositions "
        "and torch.compile produce) becomes (x - mean) * (weight / sqrt(var + eps)) + bias; its saved "
        "statistics (outputs 1 and 2, read by a grad-enabled forward) are empty in eval mode and become "
        "empty tensors. "
        "IREE: \"failed to legalize operation 'torch.operator' that was explicitly marked illegal: "
        'torch.aten._native_batch_norm_legit_no_training".'
    ),
)
def batch_norm_eval_to_affine(node: Node, rw: Rewriter) -> Any:
    x, weight, bias, mean, var, _momentum, eps = node.args
    shape = [1, -1] + [1] * (node.args[0].meta["val"].dim() - 2)
    scale = rw.call(aten.rsqrt.default, rw.call(aten.add.Tensor, var, eps))
    if weight is not None:
        scale = rw.call(aten.mul.Tensor, scale, weight)
    out = rw.call(
        aten.mul.Tensor,
        rw.call(aten.sub.Tensor, x, rw.call(aten.view.default, mean, shape)),
        rw.call(aten.view.default, scale, shape),
    )
    if bias is not None:
        out = rw.call(aten.add.Tensor, out, rw.call(aten.view.default, bias, shape))
    for user in list(node.users):
        if user.args[1] == 0:
            rw.replace(user, out)
        else:
            val = user.meta["val"]
            rw.replace(user, rw.call(aten.zeros.default, [0], dtype=val.dtype, device=val.device))
    rw.erase(node)
    return None


def _replace_output_0(node: Node, out: Node, rw: Rewriter) -> None:
    """`node` returns a tuple read only through getitem 0: `out` takes its
    place. The node goes too, even when torch calls it impure (rrelu)."""
    for user in list(node.users):
        rw.replace(user, out)
    rw.erase(node)


def _eval_slope(args: tuple) -> float:
    lower = args[0] if len(args) > 0 else 1.0 / 8.0
    upper = args[1] if len(args) > 1 else 1.0 / 3.0
    return (lower + upper) / 2


def _rrelu_eval(node: Node, rest: tuple, training: bool, rw: Rewriter) -> Any:
    if training:
        return Miss("training=True: rrelu draws random slopes")
    return rw.call(aten.leaky_relu.default, node.args[0], _eval_slope(rest))


@rule(
    roots=(aten.rrelu.default, aten.rrelu_with_noise_functional.default),
    tags={"composites"},
    doc=(
        "Eval-mode rrelu is leaky_relu with slope (lower + upper) / 2. run_decompositions turns it "
        "into the non-core rrelu_with_noise_functional (with an uninitialised noise buffer), "
        "which backends do not lower."
    ),
)
def rrelu_eval_to_leaky_relu(node: Node, rw: Rewriter) -> Any:
    if node.target is aten.rrelu.default:
        rest = node.args[1:3]
        training = bool(node.args[3]) if len(node.args) > 3 else bool(node.kwargs.get("training", False))
        out = _rrelu_eval(node, rest, training, rw)
        if not isinstance(out, Miss):
            rw.replace(node, out)
        return out
    rest = node.args[2:4]  # (self, noise, lower, upper, training, generator)
    training = bool(node.args[4]) if len(node.args) > 4 else bool(node.kwargs.get("training", False))
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] != 0:
            return Miss(f"{user.name} reads the noise output")
    out = _rrelu_eval(node, rest, training, rw)
    if not isinstance(out, Miss):
        _replace_output_0(node, out, rw)
    return out


dropout_eval = Forward(
    name="dropout_eval",
    ops=aten.dropout.default,
    when=lambda node: (not (node.args[2] if len(node.args) > 2 else node.kwargs.get("train"))) or Miss("train=True"),
    tags={"composites"},
    doc="aten.dropout(x, p, train=False) is x; left in the training IR of torch.export.",
)

RULES = RuleSet([batch_norm_eval_to_affine, rrelu_eval_to_leaky_relu, dropout_eval], name="composites")
