"""A `torch.cond` on the input sizes, dispatched at run time: only the taken branch runs.

`torch.cond(x.shape[1] <= 512, short, long, (x,))` exported with a Dim has a
predicate that only the call's sizes decide. `cond_to_where` (DEFAULT) would
compute both branches on every call and select; here each side is compiled on
its own (the program with that branch inlined, through the backend's rules)
and a call runs the side its sizes pick. The predicate is the SymBool torch
recorded (`Eq(s0, 3)`, `s0 <= 512`), evaluated on the sizes of the call.

Used when a cond's predicate is a function of sizes alone and the work a dispatch saves (the branch the
sizes rule out, and the select) costs more than the dispatch itself, estimated from the branches' ops and
sizes (`app/branch_cost.py`); where it does not, `cond_to_where` stays. One such cond per program (two
compiled sides).

Where the backend compiles several functions into one module (`backends.base.ModuleBackend`: IREE, state in
the module) the two sides are its functions `when_true` and `when_false`: weights and the state the program
updates are shared inside it.
The predicate is also kept as data (`guard`: sizes, integers, comparisons, +, *, //, %), carried in the
module's reflection, so `save` writes the one module and `fx_rewrites.load` dispatches again without
evaluating code from the file. docs/deploy.md.
"""

from __future__ import annotations

import math
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

from fx_rewrites import backends
from fx_rewrites.api import Result, apply
from fx_rewrites.app.branch_cost import dispatch_cost
from fx_rewrites.backends.base import ArtifactError, ModuleBackend
from fx_rewrites.backends.convention import positional_leaves
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import FunctionRule
from fx_rewrites.subgraphs import subgraph

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


def size_conds(program: ExportedProgram) -> list[SizeCond]:
    """The conds of `program` a size dispatch takes: predicate a SymBool of the user inputs' sizes that no
    shape range decides, and a dispatch that saves more than it costs (`branch_cost.dispatch_cost`)."""
    sizes = _symbol_sizes(program)
    found = []
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is not cond or len(node.args) != 4:
            continue
        if subgraph(node.args[1]) is None or subgraph(node.args[2]) is None:
            continue
        pred = fake_value(node.args[0])
        if not isinstance(pred, torch.SymBool) or statically_known_true(pred) or statically_known_false(pred):
            continue
        expr = pred.node.expr
        if free_unbacked_symbols(pred) or not expr.free_symbols <= sizes.keys():
            continue
        if not dispatch_cost(node).worth_dispatching:  # cheaper to compute both and select (cond_to_where)
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


#: the `iree.reflection` entry of a dispatch module's `when_true` function: the guard as JSON data
DISPATCH_KEY = "fx_rewrites.size_dispatch"
FUNCTIONS = ("when_true", "when_false")
_RELATIONS = {
    sympy.Eq: "eq",
    sympy.Ne: "ne",
    sympy.Lt: "lt",
    sympy.Le: "le",
    sympy.Gt: "gt",
    sympy.Ge: "ge",
}
_LOGIC = {sympy.And: "and", sympy.Or: "or", sympy.Not: "not", sympy.Add: "add", sympy.Mul: "mul"}
_OPS: dict[str, Callable[..., Any]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "and": lambda *a: all(a),
    "or": lambda *a: any(a),
    "not": operator.not_,
    "add": lambda *a: sum(a),
    "mul": lambda *a: math.prod(a),
    "floordiv": operator.floordiv,
    "mod": operator.mod,
}


class GuardError(ValueError):
    """A size predicate outside the forms a saved dispatch carries as data."""


def guard(expr: Any, sizes: dict[Any, tuple[int, int]]) -> Any:
    """`expr` (a sympy predicate of size symbols) as JSON data: `["size", input, dim]`, `["int", n]` or
    `[op, *operands]` with `op` a comparison, and/or/not, add/mul, floordiv/mod (GuardError otherwise)."""
    if isinstance(expr, sympy.Symbol) and expr in sizes:
        return ["size", *sizes[expr]]
    if isinstance(expr, sympy.Integer):
        return ["int", int(expr)]
    if expr is sympy.true or expr is sympy.false:
        return ["int", int(bool(expr))]
    name = _RELATIONS.get(type(expr)) or _LOGIC.get(type(expr))
    if name is None:
        name = {"FloorDiv": "floordiv", "PythonMod": "mod", "Mod": "mod"}.get(type(expr).__name__)
    if name is None:
        raise GuardError(f"{expr} holds {type(expr).__name__}, which a saved size dispatch cannot carry")
    return [name, *(guard(a, sizes) for a in expr.args)]


def check_guard(tree: Any, source: str = "the guard") -> Any:
    """`tree` if it is guard data (`guard`'s form), else GuardError naming `source`."""
    ok = isinstance(tree, list) and tree and isinstance(tree[0], str)
    if ok and tree[0] in ("size", "int"):
        ok = len(tree) == (3 if tree[0] == "size" else 2) and all(type(v) is int for v in tree[1:])
        ok = ok and (tree[0] == "int" or min(tree[1:]) >= 0)
    elif ok and tree[0] in _OPS:
        arity = 1 if tree[0] == "not" else 2 if tree[0] not in ("and", "or", "add", "mul") else len(tree) - 1
        ok = len(tree) - 1 == arity >= 1 and all(check_guard(a, source) is not None for a in tree[1:])
    else:
        ok = False
    if not ok:
        raise GuardError(f"{source}: {str(tree)[:200]} is not a size guard. Fix: load a module saved by fx-rewrites")
    return tree


def evaluate(tree: Any, shapes: list[Any]) -> Any:
    """The value of guard data `tree` for user inputs of `shapes` (no code is evaluated: data only)."""
    head = tree[0]
    if head == "size":
        return int(shapes[tree[1]][tree[2]])
    if head == "int":
        return tree[1]
    return _OPS[head](*(evaluate(a, shapes) for a in tree[1:]))


def guard_function(tree: Any) -> Callable[[Any], Any]:
    """`evaluate` of guard data `tree` as nested closures of the call's flat inputs, built once (a dispatched
    call pays ~0.3 us for `s0 <= 16`, against ~1 us walking the tree): no code is evaluated, data only."""
    head = tree[0]
    if head == "size":
        i, d = tree[1], tree[2]
        return lambda inputs: int(inputs[i].shape[d])
    if head == "int":
        value = tree[1]
        return lambda inputs: value
    op, parts = _OPS[head], [guard_function(a) for a in tree[1:]]
    if len(parts) == 2 and tree[1][0] == "size" and tree[2][0] == "int":  # `s0 <= 16`: one closure
        (i, d), value = tree[1][1:], tree[2][1]
        return lambda inputs: op(int(inputs[i].shape[d]), value)
    if len(parts) == 2:
        left, right = parts
        return lambda inputs: op(left(inputs), right(inputs))
    return lambda inputs: op(*(part(inputs) for part in parts))


@attrs.define(eq=False)
class SizeDispatch:
    """Called like the program: evaluates the predicate on the call's sizes and runs one compiled side.

    `module` is the one module holding both sides (`backends.base.Module`; None when the backend compiled
    two: then `save` raises); `tree` the guard as data (`guard`), None when it cannot be carried (`why`)."""

    found: SizeCond | None
    in_spec: Any = attrs.field(repr=False)
    when_true: Callable[..., Any] = attrs.field(repr=False)
    when_false: Callable[..., Any] = attrs.field(repr=False)
    results: tuple[Result, Result] | None = attrs.field(default=None, repr=False)
    module: Any = attrs.field(default=None, repr=False)
    tree: Any = None
    #: the predicate as text (`s0 <= 16`) and the cond it came from, for messages
    description: str = ""

    #: the predicate as a function of the call's flat inputs (`guard_function`, or sympy's lambdify of the sizes
    #: where the data cannot hold it: sympy's evaluation costs ~0.1 ms a call)
    predicate: Callable[[Any], Any] = attrs.field(init=False, repr=False)
    why: str = attrs.field(init=False, default="", repr=False)
    #: how many positional arguments a call whose arguments are its flat inputs takes (None: every call is
    #: flattened by `in_spec`)
    positional: int | None = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.found is not None:
            self.description = self.description or f"cond {self.found.node!r}: {self.found.expr}"
            try:
                self.tree = guard(self.found.expr, self.found.sizes)
            except GuardError as e:
                self.why, self.tree = str(e), None
        if self.tree is not None:
            self.predicate = guard_function(self.tree)
        else:  # a form the data cannot hold: sympy's own evaluation
            symbols = sorted(self.found.sizes, key=str)
            function = sympy.lambdify(symbols, self.found.expr, modules="math")
            where = [self.found.sizes[s] for s in symbols]
            self.predicate = lambda inputs: function(*(inputs[i].shape[d] for i, d in where))
        self.positional = positional_leaves(self.in_spec)

    def taken(self, *args: Any, **kwargs: Any) -> bool:
        """The predicate's value for a call with these arguments."""
        if kwargs or len(args) != self.in_spec.num_leaves or not all(isinstance(a, torch.Tensor) for a in args):
            args = fx_pytree.tree_flatten_spec((args, kwargs), self.in_spec)  # else the args are the flat inputs
        return bool(self.predicate(args))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and len(args) == self.positional:  # the arguments are the flat inputs: nothing to flatten
            return (self.when_true if self.predicate(args) else self.when_false)(*args)
        return (self.when_true if self.taken(*args, **kwargs) else self.when_false)(*args, **kwargs)

    def save(self, path: Any, *, params: Any = None) -> None:
        """Write the one module (functions `when_true`, `when_false`; the guard in `when_true`'s reflection)
        to `path`, as `IreeCompiled.save` does (`params`: the weights and initial state to that .irpa)."""
        if self.module is None:
            raise ArtifactError(
                f"this program dispatches on the sizes of a call ({self.description}), compiled as two modules "
                "(a backend other than IREE, or IreeBackend(state='host')); saving both is not supported. Fix: export "
                "each side with static sizes (or a Dim range on one side of the threshold) and save each, or compile "
                "with backend='iree' (state in the module), whose one module saves."
            )
        if self.tree is None:
            raise ArtifactError(
                f"this program dispatches on the sizes of a call ({self.description}): {self.why}. Fix: write the "
                "predicate with comparisons, +, *, // and % of sizes and integers, or export each side with "
                "static sizes (or a Dim range on one side of the threshold) and save each."
            )
        self.module.save(path, params=params)


def _writes_state(program: ExportedProgram) -> bool:
    kinds = (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION)
    return any(s.kind in kinds for s in program.graph_signature.output_specs)


def _one_module(target: Any) -> bool:
    """Whether `target` compiles both sides into one module (IREE, keeping state in the module)."""
    return isinstance(target, ModuleBackend) and getattr(target, "state", "module") == "module"


def _compile_one_module(target: Any, found: SizeCond, results: tuple[Result, Result], in_spec: Any) -> SizeDispatch:
    """Both sides as the functions of one module: weights declared once, the state one global each."""
    import json

    dispatch = SizeDispatch(found, in_spec, None, None, results)
    doc = {"cond": found.node, "expr": str(found.expr), "guard": dispatch.tree}
    metadata = {"when_true": {DISPATCH_KEY: json.dumps(doc)}} if dispatch.tree is not None else {}
    module = target.compile_module(dict(zip(FUNCTIONS, (r.program for r in results))), metadata=metadata)
    dispatch.when_true, dispatch.when_false = (module.functions[name] for name in FUNCTIONS)
    dispatch.module = module
    return dispatch


def compile_dispatch(program: ExportedProgram, found: SizeCond, target: Any, args: tuple[Any, ...]) -> SizeDispatch:
    """Both sides of `found` through `target`'s rules and compiler: one module with a function per side where
    the backend builds such modules (`ModuleBackend.compile_module`), else a compiled program per side."""
    results = tuple(apply(specialise(program, found, value), target.rules) for value in (True, False))
    for result in results:
        result.report.warn_unless_converged(target.name)
    if _one_module(target):
        return _compile_one_module(target, found, results, program.call_spec.in_spec)
    if getattr(target, "state", None) == "module" and any(_writes_state(r.program) for r in results):
        target = attrs.evolve(target, state="host")  # both sides read and write the one state: the program's
    runtimes = [target.compile(result.program, args) for result in results]
    return SizeDispatch(found, program.call_spec.in_spec, runtimes[0], runtimes[1], results)


def is_dispatch(metadata: dict[str, dict[str, str]]) -> bool:
    """Whether a module file's function metadata (`ModuleBackend.read_metadata`) is a size dispatch's."""
    return DISPATCH_KEY in metadata.get("when_true", {}) and "when_false" in metadata


def load_dispatch(path: Any, *, params: Any = None, driver: str | None = None, backend: Any = "iree") -> SizeDispatch:
    """A `SizeDispatch` saved with `.save(path)` (its weights from `params`, default the .irpa beside it)."""
    import json

    target = backends.get(backend) if isinstance(backend, str) else backend
    try:
        doc = json.loads(target.read_metadata(path)["when_true"][DISPATCH_KEY])
        tree = check_guard(doc["guard"], f"{path}'s size dispatch")
        description = f"cond {doc['cond']!r}: {doc['expr']}"
    except (ValueError, KeyError, TypeError) as e:
        raise ArtifactError(f"{path}: its size dispatch entry is malformed ({e}). Fix: save it again") from e
    module = target.load_file(path, FUNCTIONS, params=params, driver=driver)
    true, false = (module.functions[name] for name in FUNCTIONS)
    return SizeDispatch(None, true.plan.in_spec, true, false, None, module, tree, description)


__all__ = [
    "DISPATCH_KEY",
    "GuardError",
    "SizeCond",
    "SizeDispatch",
    "check_guard",
    "compile_dispatch",
    "evaluate",
    "guard",
    "guard_function",
    "is_dispatch",
    "load_dispatch",
    "size_conds",
    "specialise",
]
