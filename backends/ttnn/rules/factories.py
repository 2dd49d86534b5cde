"""Factories -> ttnn: arange, full / zeros / ones and their `new_*` / `*_like` forms, made on the device.

The device holds bfloat16, which carries integers exactly only up to 256 in
magnitude: a factory whose values (or an integer or bool result's fill) it
cannot hold exactly stays on the host, and says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.ttnn.rules import ops
from fx_rewrites.backends.ttnn.rules.checks import MAX_RANK, Bound, lowering, static
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: the largest integer magnitude up to which bfloat16 holds every integer
EXACT_INTEGERS = 256

ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
#: op -> the fill value it makes (None: its `fill_value` argument)
FILLS: dict[Any, float | None] = {
    aten.full.default: None,
    aten.new_full.default: None,
    aten.full_like.default: None,
    aten.zeros.default: 0.0,
    aten.new_zeros.default: 0.0,
    aten.zeros_like.default: 0.0,
    aten.ones.default: 1.0,
    aten.new_ones.default: 1.0,
    aten.ones_like.default: 1.0,
}


def _result_problem(node: Node) -> str | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return "not a tensor"
    if not all(isinstance(s, int) for s in val.shape):
        return f"symbolic sizes {tuple(val.shape)}: ttnn makes factories of constant shapes"
    if not 1 <= val.dim() <= MAX_RANK or val.numel() == 0:
        return f"a result of shape {tuple(val.shape)}; ttnn tensors here have rank 1 to {MAX_RANK} and elements"
    if val.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool):
        return f"a {val.dtype} result"
    return None


def _arange_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    start, end, step = args.get("start", 0), args["end"], args.get("step", 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, step)):
        return Miss(f"arange({start}, {end}, {step}) with non-integer or runtime bounds")
    if max(abs(start), abs(end)) > EXACT_INTEGERS:
        return Miss(f"arange up to {max(abs(start), abs(end))}: bfloat16 holds integers exactly only to 256")
    why = _result_problem(node)
    return Miss(why) if why else args


@lowering("ttnn_arange", ARANGES, _arange_when, "torch.arange of small integers -> ttnn.arange on the device.")
def lower_arange(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops.arange, int(args.get("start", 0)), int(args["end"]), int(args.get("step", 1)))


def _fill_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    fill = FILLS[node.target]
    value = args.get("fill_value") if fill is None else fill
    if isinstance(value, Node) or not isinstance(value, (int, float)):
        return Miss(f"fill_value {value!r} is not a constant")
    why = _result_problem(node)
    if why:
        return Miss(why)
    if not node.meta["val"].is_floating_point() and float(torch.tensor(float(value), dtype=torch.bfloat16)) != value:
        return Miss(f"an integer fill {value} that bfloat16 cannot hold exactly")
    return {**args, "fill": float(value)}


@lowering("ttnn_full", tuple(FILLS), _fill_when, "full / zeros / ones (and new_*, *_like) -> ttnn.full on the device.")
def lower_full(node: Node, rw: Rewriter, *, found: Bound) -> Node:
    return rw.call(ops.full, static(node.meta["val"]), ops.bf16_finite(found["fill"]))


RULES = RuleSet([lower_arange, lower_full], name="ttnn_factories")
