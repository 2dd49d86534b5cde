"""What the import tells IREE about an ExportedProgram's dynamic input sizes.

With `import_symbolic_shape_expressions`, IREE's FX importer writes a `torch.bind_symbolic_shape` per value of
symbolic size; IREE 3.13's torch input pipeline (`torch-iree-bind-symbolic-shapes`) makes those of the
function's arguments `util.assume.int`: the Dim's range (its minimum taken as 1) and the divisor of a derived
Dim such as `8 * Dim("n")`. A promise: the call convention refuses a size outside it (`convention.size_form`,
docs/iree-3.13-findings.md section 56).
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch.fx import Node

#: pass the Dims to IREE as assumptions. Off by default: IREE 3.13 compiled the same code with them where measured
#: (findings 56), and with them a few modules compile that failed before (tests/backends/iree/rules/
#: test_live_scatters.py's scatter_reduce over a Dim: a behaviour change not yet checked), so on only to measure
ASSUME_SHAPES = False
#: the sympy forms a bound size may take: polynomials of integer coefficients (what `size_form` checks)
_POLYNOMIAL = (sympy.Symbol, sympy.Integer, sympy.Add, sympy.Mul)


def shape_options() -> dict[str, bool]:
    """`FxImporter.import_frozen_program`'s keyword for `ASSUME_SHAPES`."""
    return {"import_symbolic_shape_expressions": ASSUME_SHAPES}


def binds(node: Node, bound: Any) -> bool:
    """Whether the importer writes `node`'s `bind_symbolic_shape`: a function argument (IREE reads only those)
    whose sizes are polynomials (none for Max, Mod, FloorDiv) of symbols in `bound` (the importer's symbols,
    from `range_constraints`: a rule's `item()` size inside the graph has none)."""
    val = node.meta.get("val")
    if node.op != "placeholder" or not isinstance(val, torch.Tensor):
        return False
    exprs = [d.node.expr for d in val.shape if isinstance(d, torch.SymInt)]
    names = {str(s) for e in exprs for s in e.free_symbols}
    plain = all(isinstance(t, _POLYNOMIAL) for e in exprs for t in sympy.preorder_traversal(e))
    return bool(names) and plain and names <= bound.keys()
