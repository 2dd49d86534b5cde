"""The ttnn pack: aten ops lowered to ttnn stand-ins, with the host/device boundary.

Not part of DEFAULT (it changes what runs where); the ttnn backend's rules
are `Phases(DEFAULT, FOLD, RULES)`, so SymInts are out of tensor slots before
lowering. Modules: `ops` (the stand-ins), `checks` (what ttnn can take; the shape of a
lowering rule), `boundary` (from_torch / to_layout / to_torch), and the
lowering rules by family: `elementwise`, `nn` (matmul, linear, softmax,
normalisation, embedding, attention), `conv` (reductions, convolution,
pooling), `movement` (data movement, padding, casts), `masks` (bool `&`,
`where` with a number), `scatter` (slice_scatter, select_scatter), `factories`
(arange, full, zeros, ones). `FOLD` (`fold.py`) is a phase of its own before
the lowering: batch norm and per-channel affines folded into the convolution
before them; `constants` says what is computed from the program's constants
only (left on the host, computed once).
"""

from torch.fx import Node

from fx_rewrites.backends.ttnn.rules import conv, elementwise, factories, fold, masks, movement, nn, ops, scatter
from fx_rewrites.backends.ttnn.rules.boundary import fuse_round_trip
from fx_rewrites.rules import DEFAULT
from fx_rewrites.ruleset import Phases, RuleSet

#: every ttnn lowering rule; attention and the multi-operand ops first (ties go in this order)
RULES = RuleSet(
    [
        *nn.RULES,
        *elementwise.RULES,
        *movement.RULES,
        *conv.RULES,
        *masks.RULES,
        *scatter.RULES,
        *factories.RULES,
        fuse_round_trip,
    ],
    name="ttnn",
)

#: the phase before the lowering: convolution + batch norm / per-channel affine folds
FOLD = fold.RULES

#: what `fx_rewrites.apply(program, backend.rules)` runs for ttnn: DEFAULT first (SymInts out of tensor slots,
#: in-place ops made functional, ...), then the folds into convolutions, then the ttnn lowering.
PHASES = Phases(DEFAULT, FOLD, RULES, name="ttnn")


def is_device_node(node: Node) -> bool:
    """The partitioner's predicate: ttnn stand-ins (conversions included) run in device regions."""
    return node.op == "call_function" and ops.is_standin(node.target)


__all__ = ["FOLD", "PHASES", "RULES", "is_device_node", "ops"]
