"""`aten.conv_tbc` (time, batch, channels: fairseq's convolutions) as a channels-first convolution for IREE.

IREE 3.13's importer types conv_tbc's result in the channels-first layout it lowers it to, and the module is
rejected: "type of return operand 0 ('!torch.vtensor<[4,5,2],f32>') doesn't match function result type
('!torch.vtensor<[5,2,4],f32>')". conv_tbc(x [T, B, C], w [K, C, O], b [O], pad) is conv1d of x as [B, C, T]
with w as [O, C, K], padding `pad`, back to [T', B, O]: the same sums, in another order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.engine import Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


@rule(
    roots=(aten.conv_tbc.default,),
    tags={"iree"},
    doc=(
        "aten.conv_tbc (x [T, B, C], w [K, C, O]) written as aten.convolution of x permuted to [B, C, T] and w "
        "to [O, C, K], the result permuted back to [T', B, O]. IREE 3.13 rejects the module: \"type of return "
        "operand 0 ('!torch.vtensor<[O,T',B]...>') doesn't match function result type\"."
    ),
)
def conv_tbc_as_convolution_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x = rw.call(aten.permute.default, args["self"], [1, 2, 0])
    weight = rw.call(aten.permute.default, args["weight"], [2, 1, 0])
    pad = args.get("pad", 0)
    y = rw.call(aten.convolution.default, x, weight, args["bias"], [1], [pad], [1], False, [0], 1)
    rw.replace(node, rw.call(aten.permute.default, y, [2, 0, 1]))


RULES = RuleSet([conv_tbc_as_convolution_for_iree], name="iree-conv-tbc")
