"""Legality-driven decomposition: an op the backend cannot lower is replaced by torch's own decomposition.

One mechanism instead of a rule per op. The backend says which ops it
cannot lower (IREE: measured, `fx_rewrites.backends.iree.legality`); every
such op that has a decomposition (`fx_rewrites.decompositions`: torch's table,
then the ones torch lacks, then the op's CompositeImplicitAutograd kernel)
becomes a root of one `Decompose` rule, which inlines that op's
decomposition alone, traced on the node's own fake values and
functionalized. What the decomposition emits is offered to the rule again,
so the fixpoint decomposes until every op left is legal or has no
decomposition (the backend's compile error then names it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch._ops import OpOverload
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.kinds.decompose import Decompose, decomposition


def resolve(names: Iterable[str]) -> list[OpOverload]:
    """The OpOverloads of `names` ("aten.xlogy.Tensor") that exist in this torch."""
    ops = []
    for name in names:
        try:
            ops.extend(op for op in schema.resolve_op(name) if isinstance(op, OpOverload))
        except schema.SchemaError:
            continue  # an op of another torch version
    return ops


def legalize(
    illegal: Iterable[str], *, name: str, backend: str, lowered: Iterable[str] = (), tags: Iterable[str] = ()
) -> Decompose:
    """One rule decomposing every op of `illegal` (op names, "aten.xlogy.Tensor") that torch can decompose.

    `lowered` names ops seen lowering: a torch primitive (prims.*) outside it is taken for one the backend
    cannot take, and a decomposition that needs it is declined.

    `backend` names the backend in the rule's doc ("IREE 3.13"). Ops of
    `illegal` without a decomposition are not roots: they stay, and the
    backend's error names them.
    """
    known = frozenset(resolve(illegal))
    roots = [op for op in known if decomposition(op) is not None]
    return Decompose(
        ops=tuple(roots),
        illegal=known,
        lowered=frozenset(lowered),
        name=name,
        doc=(
            f"Ops {backend} cannot lower (measured), each replaced by torch's own decomposition of that op "
            "alone (torch._decomp, else fx_rewrites.decompositions.MISSING, else its CompositeImplicitAutograd "
            "kernel), repeatedly until what is left "
            f"lowers: {len(roots)} ops, e.g. aten.multiply/subtract (aliases), aten.im2col (nn.Unfold), "
            'aten.xlogy, aten.nll_loss_nd. The error they meet otherwise: "failed to legalize operation '
            "'torch.operator' that was explicitly marked illegal\" or \"failed to legalize operation "
            "'torch.aten.xlogy.Tensor'\"."
        ),
        tags=frozenset({"legalize", *tags}),
    )


def legalize_form(
    ops: Iterable[OpOverload],
    *,
    when: Callable[[Node], Any],
    name: str,
    doc: str,
    illegal: Iterable[str] = (),
    lowered: Iterable[str] = (),
    tags: Iterable[str] = (),
) -> Decompose:
    """A rule decomposing `ops` (torch's own decomposition, as `legalize` does) only in the forms `when`
    accepts: for ops the backend lowers in some forms and fails in others."""
    return Decompose(
        ops=tuple(ops),
        illegal=frozenset(resolve(illegal)),
        lowered=frozenset(lowered),
        name=name,
        when=when,
        doc=doc,
        tags=frozenset({"legalize", *tags}),
    )
