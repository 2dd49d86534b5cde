"""In-place ops and mutation (seed 003).

`torch.export.export` in torch 2.13 returns training IR that keeps in-place
ops (`add_`, `index_put_`, `copy_`, buffer `add_`) and whose signature has
no mutation outputs. IREE rejects them: "'torch.aten.add_.Tensor' op operand
#0 must be Multi-dimensional array modeling Torch's Tensor type, but got
'!torch.vtensor<...>'". The rule turns `op_(x, ...)` into `op(x, ...)`, makes
later reads of `x` (and of the tensor `x` is a slice/select/view of) read the
new value, and, when the mutated tensor is a program input or buffer, returns
the final value as a USER_INPUT_MUTATION / BUFFER_MUTATION output so that
`ep.module()` has the side effects eager has.

It declines (explain() says why) where a correct rewrite needs full
functionalization: a view created before the mutation and read after it, a
view op it cannot invert, or a mutated input of a plain GraphModule (no
signature to record it in). `ExportedProgram.run_decompositions()` handles
those.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import OpOverload
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import Node

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.program import input_spec, new_mutations
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

_BASES = [
    "add",
    "sub",
    "mul",
    "div",
    "index_put",
    "copy",
    "fill",
    "masked_fill",
    "clamp",
    "clamp_min",
    "clamp_max",
    "relu",
    "sigmoid",
    "tanh",
    "neg",
    "exp",
    "zero",
    "scatter",
    "scatter_add",
    "index_add",
    "addcmul",
    "lerp",
    "abs",
    "sqrt",
    "rsqrt",
    "floor",
    "round",
    "logical_not",
    "bitwise_and",
    "masked_scatter",
    "index_fill",
    "hardtanh",
    "leaky_relu",
    "silu",
    "gelu",
]
#: in-place overloads whose functional twin has another overload name
_RENAMED = {aten.pow_.Scalar: aten.pow.Tensor_Scalar, aten.pow_.Tensor: aten.pow.Tensor_Tensor}


def _same_signature(a: OpOverload, b: OpOverload) -> bool:
    sig = lambda op: [(x.name, str(x.type)) for x in op._schema.arguments]  # noqa: E731
    return sig(a) == sig(b)


def _functional_twins() -> dict[OpOverload, OpOverload]:
    """In-place overload -> functional overload with the same arguments."""
    twins = dict(_RENAMED)
    for base in _BASES:
        inplace, functional = getattr(aten, base + "_"), getattr(aten, base)
        for name in inplace.overloads():
            if name in functional.overloads():
                a, b = getattr(inplace, name), getattr(functional, name)
                if _same_signature(a, b):
                    twins[a] = b
    return twins


FUNCTIONAL = _functional_twins()
#: view ops whose effect on the base can be written back functionally
_SCATTER = {
    aten.slice.Tensor: lambda rw, base, new, args: rw.call(aten.slice_scatter.default, base, new, *args),
    aten.select.int: lambda rw, base, new, args: rw.call(aten.select_scatter.default, base, new, *args),
    aten.alias.default: lambda rw, base, new, args: new,
    aten.detach.default: lambda rw, base, new, args: new,
}


#: meta key on a functional stand-in for a view: (view op, base, view args),
#: so a second mutation through it is written back to the base as well.
ALIAS_OF = "fx_rewrites_alias_of"


def _is_view(node: Node) -> bool:
    return isinstance(node.target, OpOverload) and node.target.is_view


def _view_link(node: Node) -> tuple[Any, Node, tuple] | Miss | None:
    """(view op, base, view args) when `node` aliases another tensor."""
    if ALIAS_OF in node.meta:
        return node.meta[ALIAS_OF]
    if not _is_view(node):
        return None
    if node.target not in _SCATTER:
        return Miss(f"{node.name} is a {node.target} view, which this rule cannot write back through")
    return node.target, node.args[0], tuple(node.args[1:])


def _view_chain(x: Node) -> tuple[list[Node], list[tuple[Any, tuple]]] | Miss:
    """[x, base of x, base of that, ...] and the (view op, args) between them."""
    chain, links = [x], []
    while (link := _view_link(chain[-1])) is not None:
        if isinstance(link, Miss):
            return link
        target, base, args = link
        chain.append(base)
        links.append((target, args))
    return chain, links


def _aliased_reads(chain: list[Node], mutation: Node) -> str | None:
    """A view of a mutated tensor made before `mutation` and read after it."""
    for tensor in chain:
        for user in tensor.users:
            if user in chain or not _is_view(user) or not user < mutation:
                continue
            late = [u.name for u in user.users if mutation < u]
            if late:
                return f"{user.name} views {tensor.name} before the mutation and is read after it by {late}"
    return None


def _mutation_kind(base: Node) -> tuple[OutputKind, str] | Miss:
    spec = input_spec(base)
    if spec is None or new_mutations(base.graph) is None:
        return Miss(f"mutates graph input {base.name}; only an ExportedProgram can record that")
    if spec.kind == InputKind.BUFFER:
        return OutputKind.BUFFER_MUTATION, spec.target
    if spec.kind == InputKind.USER_INPUT:
        return OutputKind.USER_INPUT_MUTATION, base.name
    return Miss(f"mutates {spec.kind.name.lower()} {base.name}, which a program cannot return as mutated")


def _check(node: Node) -> Any:
    found = _view_chain(node.args[0])
    if isinstance(found, Miss):
        return found
    chain, links = found
    why = _aliased_reads(chain, node)
    if why:
        return Miss(why)
    kind = _mutation_kind(chain[-1]) if chain[-1].op == "placeholder" else None
    if isinstance(kind, Miss):
        return kind
    return chain, links, kind


@rule(
    roots=tuple(FUNCTIONAL),
    name="functionalize_inplace",
    when=lambda node: isinstance(node.args[0], Node) or Miss("mutated argument is not a graph value"),
    tags={"mutation"},
    doc=(
        "In-place ops (add_, mul_, index_put_, copy_, fill_, buffer updates such as "
        "num_batches_tracked.add_(1)) become functional ops; later reads see the new value and "
        "mutated inputs/buffers become USER_INPUT_MUTATION / BUFFER_MUTATION outputs. IREE: "
        "\"'torch.aten.add_.Tensor' op operand #0 must be Multi-dimensional array modeling "
        "Torch's Tensor type, but got '!torch.vtensor<...>'\"."
    ),
)
def functionalize_inplace(node: Node, rw: Rewriter) -> Any:
    found = _check(node)
    if isinstance(found, Miss):
        return found
    chain, links, kind = found
    new = rw.call(FUNCTIONAL[node.target], *node.args, **node.kwargs)
    rw.replace(node, new)
    rw.erase(node)
    rw.replace_uses_after(chain[0], new, after=node)
    for (target, args), base in zip(links, chain[1:]):
        updated = _SCATTER[target](rw, base, new, args)
        new.meta[ALIAS_OF] = (target, updated, args)
        rw.replace_uses_after(base, updated, after=node)
        new = updated
    if kind is not None:
        added = new_mutations(node.graph)
        rw.add_output(new, len(added))
        rw.on_commit(lambda: added.append(kind))
    return None


RULES = RuleSet([functionalize_inplace], name="inplace")
