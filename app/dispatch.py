"""A `torch.cond` on the input sizes, dispatched at run time: only the taken branch runs.

`torch.cond(x.shape[1] <= 512, short, long, (x,))` exported with a Dim has a
predicate that only the call's sizes decide. `cond_to_where` (DEFAULT) would
compute both branches on every call and select; here each side is compiled on
its own (the program with that branch inlined, through the backend's rules)
and a call runs the side its sizes pick. The predicate is the SymBool torch
recorded (`Eq(s0, 3)`, `s0 <= 512`), evaluated on the sizes of the call.

Used when a cond's predicate is a function of sizes alone and a branch does
more than element-wise work; where both branches are element-wise (cheap),
`cond_to_where` stays. One such cond per program (two compiled sides).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import attrs
import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import Node
from torch.fx import _pytree as fx_pytree
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_false, statically_known_true
from torch.utils import _pytree as pytree

from fx_rewrites.api import Result, apply
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import FunctionRule
from fx_rewrites.rules.control_flow import subgraph, walk

cond = torch.ops.higher_order.cond


@attrs.frozen
class SizeCond:
    """A cond whose predicate (`expr`, a sympy boolean) is decided by input sizes: `sizes[symbol]` is
    (the user input's position, its dim) a symbol stands for."""

    node: str
    expr: Any
    sizes: dict[Any, tuple[int, int]]


def _user_inputs(program: ExportedProgram) -> list[Node]:
    kinds = {spec.arg.name: spec.kind for spec in program.graph_signature.input_specs}
    return [n for n in program.graph.nodes if n.op == "placeholder" and kinds.get(n.name) == InputKind.USER_INPUT]


def _symbol_sizes(program: ExportedProgram) -> dict[Any, tuple[int, int]]:
    """Each size symbol that is one input's dim -> (the input's position among the user inputs, the dim)."""
    found: dict[Any, tuple[int, int]] = {}
    for i, node in enumerate(_user_inputs(program)):
        val = node.meta.get("val")
        for d, size in enumerate(getattr(val, "shape", ())):
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                found.setdefault(size.node.expr, (i, d))
    return found


def _elementwise_only(node: Node) -> bool:
    """Whether both branches of cond `node` do element-wise work only (ATen ops tagged pointwise)."""
    for branch in node.args[1:3]:
        for n in walk(subgraph(branch)):
            if n.op != "call_function" or n.target is operator.getitem:
                continue
            if torch.Tag.pointwise not in getattr(n.target, "tags", ()):
                return False
    return True


def size_conds(program: ExportedProgram) -> list[SizeCond]:
    """The conds of `program` a size dispatch takes: predicate a SymBool of the user inputs' sizes that no
    shape range decides, branches not element-wise only."""
    sizes = _symbol_sizes(program)
    found = []
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is not cond or len(node.args) != 4:
            continue
        if subgraph(node.args[1]) is None or subgraph(node.args[2]) is None:
            continue
        pred = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
        if not isinstance(pred, torch.SymBool) or statically_known_true(pred) or statically_known_false(pred):
            continue
        expr = pred.node.expr
        if free_unbacked_symbols(pred) or not expr.free_symbols <= sizes.keys() or _elementwise_only(node):
            continue
        found.append(SizeCond(node.name, expr, {s: sizes[s] for s in expr.free_symbols}))
    return found


def _take(name: str, value: bool) -> FunctionRule:
    """A one-off rule: cond `name` becomes the branch `value` picks."""

    def when(node: Node) -> bool | Miss:
        return node.name == name or Miss("another cond")

    def take_branch(node: Node, rw: Rewriter) -> None:
        outs = pytree.tree_leaves(rw.inline(subgraph(node.args[1] if value else node.args[2]), tuple(node.args[3])))
        rw.replace(node, outs)
        rw.note(f"cond {node.name!r}: the {'true' if value else 'false'} side of a size dispatch")

    return FunctionRule(fn=take_branch, ops=(cond,), when=when, name=f"size_dispatch_{'true' if value else 'false'}")


def specialise(program: ExportedProgram, found: SizeCond, value: bool) -> ExportedProgram:
    """`program` with cond `found` replaced by the branch `value` picks (the rest untouched)."""
    result = apply(program, _take(found.node, value), strict=True)
    if not result.report.rewrites:
        raise RuntimeError(f"the size dispatch found cond {found.node!r} but could not inline its branch")
    return result.program


@attrs.define(eq=False)
class SizeDispatch:
    """Called like the program: evaluates the predicate on the call's sizes and runs one compiled side."""

    found: SizeCond
    in_spec: Any = attrs.field(repr=False)
    when_true: Callable[..., Any] = attrs.field(repr=False)
    when_false: Callable[..., Any] = attrs.field(repr=False)
    results: tuple[Result, Result] = attrs.field(repr=False)

    #: the predicate as a Python function of the sizes `where` names (sympy evaluation costs ~0.1 ms a call)
    predicate: Callable[..., bool] = attrs.field(init=False, repr=False)
    where: list[tuple[int, int]] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        symbols = sorted(self.found.sizes, key=str)
        self.predicate = sympy.lambdify(symbols, self.found.expr, modules="math")
        self.where = [self.found.sizes[s] for s in symbols]

    def taken(self, *args: Any, **kwargs: Any) -> bool:
        """The predicate's value for a call with these arguments."""
        if kwargs or len(args) != self.in_spec.num_leaves or not all(isinstance(a, torch.Tensor) for a in args):
            args = fx_pytree.tree_flatten_spec((args, kwargs), self.in_spec)  # else the args are the flat inputs
        return bool(self.predicate(*(args[i].shape[d] for i, d in self.where)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.when_true if self.taken(*args, **kwargs) else self.when_false)(*args, **kwargs)

    def save(self, path: Any, *, params: Any = None) -> None:
        from fx_rewrites.backends.iree.artifact import ArtifactError

        raise ArtifactError(
            f"this program dispatches on the sizes of a call (cond {self.found.node!r}: {self.found.expr}), "
            "compiled as two modules; saving both is not supported yet. Fix: export each side with static "
            "sizes (or a Dim range on one side of the threshold) and save each."
        )


def _writes_state(program: ExportedProgram) -> bool:
    kinds = (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION)
    return any(s.kind in kinds for s in program.graph_signature.output_specs)


def compile_dispatch(program: ExportedProgram, found: SizeCond, target: Any, args: tuple[Any, ...]) -> SizeDispatch:
    """Both sides of `found` through `target`'s rules and compiler."""
    results = tuple(apply(specialise(program, found, value), target.rules) for value in (True, False))
    for result in results:
        result.report.warn_unless_converged(target.name)
    if getattr(target, "state", None) == "module" and any(_writes_state(r.program) for r in results):
        target = attrs.evolve(target, state="host")  # both sides read and write the one state: the program's
    runtimes = [target.compile(result.program, args) for result in results]
    return SizeDispatch(found, program.call_spec.in_spec, runtimes[0], runtimes[1], results)


__all__ = ["SizeCond", "SizeDispatch", "compile_dispatch", "size_conds", "specialise"]
