"""The ttnn pack: aten ops lowered to ttnn stand-ins, with the host/device boundary.

Not part of DEFAULT (it changes what runs where); the ttnn backend applies
DEFAULT first, so SymInts are out of tensor slots before lowering, then
`RULES`. `ops` defines the stand-ins, `lowering` the aten -> ttnn rules,
`boundary` the from_torch / to_layout / to_torch conversions.
"""

from fx_rewrites.rules.ttnn import ops
from fx_rewrites.rules.ttnn.boundary import fuse_round_trip
from fx_rewrites.rules.ttnn.lowering import RULES as LOWERING
from fx_rewrites.ruleset import RuleSet

RULES = RuleSet([*LOWERING, fuse_round_trip], name="ttnn")

__all__ = ["RULES", "ops"]
