"""Fresh constants: `torch.tensor(...)` in forward (seed 000).

torch.export lifts the literal into a `c_lifted_tensor_N` placeholder and
copies it with `aten.lift_fresh_copy`, often followed by `aten.detach_`;
the aot_autograd graph of torch.compile reads it from a `_tensor_constant0`
get_attr. `lift_fresh_copy` has no lowering in most backends and `detach_`
is an in-place op on a value-semantics tensor.
"""

from __future__ import annotations

import torch

from fx_rewrites.kinds import Forward, Substitute
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

lift_fresh_copy_to_clone = Substitute(
    name="lift_fresh_copy_to_clone",
    op=aten.lift_fresh_copy.default,
    to=aten.clone.default,
    tags={"constants"},
    doc=(
        "aten.lift_fresh_copy on a lifted constant (torch.tensor(...) in forward) becomes clone. "
        "Errors it fixes: 'compiler_fn raised KeyError: (_tensor_constant0, 0)' (SHARK-Turbine "
        "importer), 'failed to legalize operation torch.aten.lift_fresh_copy'."
    ),
)

lift_fresh_forward = Forward(
    name="lift_fresh_forward",
    ops=aten.lift_fresh.default,
    tags={"constants"},
    doc="aten.lift_fresh(t) is t once the graph is traced; backends have no lowering for it.",
)

drop_detach_ = Forward(
    name="drop_detach_",
    ops=aten.detach_.default,
    tags={"constants"},
    doc=(
        "aten.detach_ (after lift_fresh_copy, or on any value) is an in-place no-op in an inference "
        "graph. IREE: \"failed to legalize operation 'torch.operator' that was explicitly marked "
        'illegal: ... name = \\"torch.aten.detach_\\"".'
    ),
)

RULES = RuleSet([lift_fresh_copy_to_clone, lift_fresh_forward, drop_detach_], name="constants")
