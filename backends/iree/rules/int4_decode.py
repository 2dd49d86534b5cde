"""torchao's int4 g32 weight-only linear, in a decode, through the hand-written int4 dispatch (issue 33).

`IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))` exports `linear(x, dequantize_affine(q,
[1, 32], scale, zero, int8, -8, 7))`. Where x has at most `DECODE_ROWS` rows (a decode step: static, or a `Dim`
bounded so), this rule writes `int4_grouped_linear(x, q, scale, zero)` (`int4_fold.py`), which the backend packs
into `int4_matvec` over int32 words (two values a byte) when the module is built and splices as its own
`stream.executable` (`int4_dispatch.py`). More rows (a prefill) take `quantized_matmul`'s matmul of the weight
dequantized from its byte-form blocks (this kernel reads the whole weight once per row). On for AVX2 only
(`targets.CPU_ISAS`), where it was measured: 1.8-2.4x the
byte form on the 160M Llama's shapes (docs/iree-3.13-findings.md section 49).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.iree.int4_dispatch import GROUP
from fx_rewrites.backends.iree.int4_fold import INT4_GROUPED_LINEAR, TILE
from fx_rewrites.backends.iree.rules.quantized_matmul import (
    DECODE_ROWS,
    _grouped_dequantize,
    _never,
    _OnDequantize,
    each_linear,
    rows_bound,
)
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_tensor
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: `DECODE_ROWS` (quantized_matmul's, shared with the byte form's split): the most rows x may have (a static count,
#: or a Dim's upper bound), one token a step of batch 1 or 2. Each row reads the whole weight (0.5 byte a value), so
#: 2 rows read what the byte form reads once; measured at 1 row
__all__ = ["DECODE_ROWS", "RULES", "int4_decode_for_iree"]


def _int4_decode(node: Node) -> Miss | Node | None:
    """torchao's int4 g32 dequantize read by linears of at most `DECODE_ROWS` rows: its zero point (or None)."""
    found = _grouped_dequantize(node)
    if isinstance(found, Miss):
        return found
    group, zero = found
    args = node.args
    if group != GROUP or list(args[5:7]) != [-8, 7] or args[4] != torch.int8:
        return Miss(f"not int4 in groups of {GROUP} (group {group}, range {list(args[5:7])})")
    n = fake_tensor(args[0]).shape[0]
    if n % (8 * TILE):
        return Miss(f"{n} output channels: the kernel's tile is {8 * TILE}")
    if zero is not None and fake_tensor(zero).dtype not in (torch.int8, torch.int32):
        return Miss(f"zero points of {fake_tensor(zero).dtype}")
    if len(node.users) != 1:  # `int4_fold` packs a weight read by one op
        return Miss(f"the dequantized weight is read by {len(node.users)} linears")
    for linear in node.users:
        bound = rows_bound(linear.args[0])
        if bound is None or bound > DECODE_ROWS:
            return Miss(f"x has up to {bound or 'unbounded'} rows: more than a decode's {DECODE_ROWS}")
    return zero


@rule(
    roots=(_never,),
    when=_int4_decode,
    priority=20,  # before quantized_matmul's byte form of the same dequantize
    tags={"iree", "quantized", "performance"},
    doc=(
        "torchao's int4 g32 weight-only linear with at most 2 rows (a decode step) becomes `int4_grouped_linear`, "
        "which the IREE backend packs into int32 words (two values a byte) and runs through a hand-written "
        "dispatch: 1.8-2.4x IREE's code for the byte form on AVX2 (docs/iree-3.13-findings.md section 49)."
    ),
)
def int4_decode_as_dispatch_for_iree(node: Node, rw: Rewriter, *, found: Node | None) -> None:
    q, scale = node.args[0], node.args[2]

    def product(x: Node, rows: Any) -> Node:
        flat = rw.call(aten.view.default, x, [rows, fake_tensor(x).shape[-1]])
        return rw.call(INT4_GROUPED_LINEAR, flat, q, scale, found)

    each_linear(rw, node, product)


int4_decode_for_iree = _OnDequantize(int4_decode_as_dispatch_for_iree)

RULES = RuleSet([int4_decode_for_iree], name="iree-int4-decode")
