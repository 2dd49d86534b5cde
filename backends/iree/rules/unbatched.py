"""Pooling and convolution on an unbatched input, for IREE 3.13: given a batch of one.

torch's pooling and convolution ops take an input without its batch dim
(`F.max_pool3d(x, 2, return_indices=True)` on a [c, d, h, w] tensor);
IREE 3.13 compiles none of them on such an input, static or Dim-sized:
max_pool1d/2d/3d and their `_with_indices` forms and adaptive_max_pool2d
("failed to legalize operation 'torch.aten.max_pool2d'"), avg_pool2d
("'linalg.pooling_nchw_sum' op expected indexing_map #0 to have 4 dim(s)"),
avg_pool1d/3d and conv2d/3d (iree-compile crashes), conv1d ("failed to
legalize operation 'torch.aten.convolution'"). The rule unsqueezes a batch
dim of one and reshapes it off the result; max pooling's indices are
positions within each channel's map, which the batch dim does not change.
docs/iree-3.13-findings.md section 8 has the measurements.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.backends.iree.rules.conv import CONVS
from fx_rewrites.backends.iree.rules.pooling import POOLS_BY_RANK
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: measured failing on an unbatched input (adaptive_max_pool1d/3d compile and match; aten.convolution takes
#: batched inputs only)
ROOTS = (*POOLS_BY_RANK, aten.adaptive_max_pool2d.default, *(op for op in CONVS if op is not aten.convolution.default))


def spatial_dims(op: Any) -> int:
    """How many spatial dims `op` works on: the fixed length of its first list argument (`int[2] kernel_size`,
    `int[2] output_size`, conv2d's `SymInt[2] stride`), from its schema."""
    return next(arg.N for arg in op._schema.arguments if arg.N is not None)


def _unbatched(node: Node) -> bool | Miss:
    x = fake_value(node.args[0])
    if not isinstance(x, torch.Tensor):
        return Miss("no tensor value for the input")
    n = spatial_dims(node.target)
    if x.dim() != n + 1:
        return Miss(f"a {x.dim()}-d input to a {n}-d op: batched")
    return True


@rule(
    roots=ROOTS,
    when=_unbatched,
    tags={"iree", "pooling", "convolution"},
    doc=(
        "max_pool / avg_pool 1d-3d (with indices too), adaptive_max_pool2d and conv1d/2d/3d on an input without "
        "its batch dim (`F.max_pool3d(x, 2, return_indices=True)` on [c, d, h, w]) get a batch of one: the input "
        'unsqueezed at dim 0, the result(s) reshaped without it. IREE 3.13 compiles none of them unbatched: "failed to '
        "legalize operation 'torch.aten.max_pool3d_with_indices'\", a linalg.pooling_nchw_sum error, or a crash."
    ),
)
def unbatched_window_op_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> None:
    first = node.target._schema.arguments[0].name
    named = dict(args)
    named[first] = rw.call(aten.unsqueeze.default, named[first], 0)
    call_args, kwargs = schema.unbind(node.target, named, explicit=False)
    batched = rw.call(node.target, *call_args, **kwargs)
    if isinstance(node.meta["val"], (tuple, list)):
        outputs = [rw.getitem(batched, i) for i in range(len(node.meta["val"]))]
        rw.replace(node, [_unbatch(rw, out) for out in outputs])
    else:
        rw.replace(node, _unbatch(rw, batched))


def _unbatch(rw: Rewriter, out: Node) -> Node:
    """`out` without its batch dim of one: a reshape to its other sizes (a squeeze fails to compile after a
    one-window guard with Dim sizes: "failed to legalize unresolved target materialization", the squeeze typed
    [c, h//6, w//6] and its user [c, 1, 1])."""
    return rw.call(aten.reshape.default, out, [rw.size(out, d) for d in range(1, out.meta["val"].dim())])


RULES = RuleSet([unbatched_window_op_for_iree], name="iree-unbatched")
