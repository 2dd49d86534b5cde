"""transformers' grouped matmul of MoE experts, written out for IREE.

transformers 5 routes the tokens of its MoE layers (Mixtral, Qwen2-MoE) to
their experts with the custom op `transformers::grouped_mm_fallback(input,
weight, offs)`: rows of `input` sorted by expert, `offs[i]` the end of
expert i's rows, each block multiplied by its expert's weight in a Python
loop (an opaque op to torch.export; IREE has no lowering of it, and torch
no decomposition). The op exists only once transformers has registered it,
so the rule finds it when the rules run.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.kinds.function import FunctionRule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: the custom op transformers 5 registers (transformers/integrations/moe.py)
GROUPED_MM = ("transformers", "grouped_mm_fallback", "default")


def _grouped_mm() -> Any | None:
    """transformers' grouped matmul op, None while transformers has not registered it."""
    try:
        packet = getattr(getattr(torch.ops, GROUPED_MM[0]), GROUPED_MM[1])
    except (AttributeError, RuntimeError):
        return None
    return getattr(packet, GROUPED_MM[2], None)


def _not_registered() -> None:
    """The root of the rule while the op does not exist: no node calls it."""


def _shapes(node: Node) -> Miss | bool:
    """True when the rule can write the op out; else a Miss saying why not (the number of experts becomes a
    literal in the graph, so it must be fixed)."""
    x, weight, offs = (a.meta.get("val") if isinstance(a, Node) else None for a in node.args[:3])
    if not all(isinstance(v, torch.Tensor) for v in (x, weight, offs)):
        return Miss("an argument without a tensor value")
    if x.dim() != 2 or weight.dim() != 3 or offs.dim() != 1:
        return Miss(f"input/weight/offs of ranks {x.dim()}/{weight.dim()}/{offs.dim()}, not 2/3/1")
    if not isinstance(weight.shape[0], int):
        return Miss("a symbolic number of experts (the rewrite writes it as a literal)")
    return True


@rule(
    roots=(_not_registered,),
    when=_shapes,
    tags={"iree"},
    doc=(
        "transformers' `grouped_mm_fallback(input, weight, offs)` (the experts' matmuls of Mixtral and "
        "Qwen2-MoE in transformers 5) becomes one batched matmul: each row's expert is the number of "
        "offsets at or before it, the row is multiplied by that expert's gathered weight, and rows past the "
        "last offset stay 0 as in the op. IREE 3.13: \"failed to legalize operation 'torch.operator'\" "
        "(transformers.grouped_mm_fallback). It gathers a weight per row: memory rows x in x out."
    ),
)
def grouped_mm_to_gathered_bmm_for_iree(node: Node, rw: Rewriter) -> Any:
    x, weight, offs = node.args[:3]
    rows, experts = rw.size(x, 0), weight.meta["val"].shape[0]
    index = rw.call(aten.arange.default, rows, dtype=offs.meta["val"].dtype, device=offs.meta["val"].device)
    started = rw.call(
        aten.ge.Tensor, rw.call(aten.unsqueeze.default, index, 1), rw.call(aten.unsqueeze.default, offs, 0)
    )
    expert = rw.call(aten.sum.dim_IntList, started, [1], dtype=torch.int64)
    inside = rw.call(aten.lt.Scalar, expert, experts)
    gathered = rw.call(aten.index.Tensor, weight, [rw.call(aten.clamp.default, expert, None, experts - 1)])
    product = rw.call(aten.bmm.default, rw.call(aten.unsqueeze.default, x, 1), gathered)
    out = rw.call(aten.squeeze.dim, product, 1)
    zero = rw.call(aten.scalar_tensor.default, 0.0, dtype=out.meta["val"].dtype)
    rw.replace(node, rw.call(aten.where.self, rw.call(aten.unsqueeze.default, inside, 1), out, zero))


class _OnRegisteredOp:
    """A rule whose root is transformers' op as soon as it exists (looked up each time the engine runs its
    rules, which rebuilds their index when it changed), the placeholder `_not_registered` before; everything
    else is the wrapped rule's."""

    def __init__(self, inner: FunctionRule) -> None:
        self._inner = inner

    @property
    def roots(self) -> tuple[Hashable, ...]:
        op = _grouped_mm()
        return (op,) if op is not None else self._inner.roots

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return repr(self._inner)


grouped_mm_for_iree = _OnRegisteredOp(grouped_mm_to_gathered_bmm_for_iree)

RULES = RuleSet([grouped_mm_for_iree], name="iree-moe")
