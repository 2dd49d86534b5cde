"""The differential localizer: the first node a backend gets wrong (wrong numbers or no compile).

found = fx_rewrites.localize(program, (x,), backend="iree", rules=False)
print(found.text())                 # the node, its source line, shapes, errors against eager and float64
found.write("localize-model/")      # repro.py, guard_rule.py, test_guard_rule.py

The program runs on torch with every intermediate recorded. Pieces of its graph (all of it, then halves,
down to one node) are rebuilt as GraphModules whose inputs are the recorded values and compiled on the
backend; a piece is wrong when an output's error against the op run in float64 is well above torch's own
float32 error (`compare.judge`). The first node in graph order that is wrong alone is reported.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import Graph, GraphModule, Interpreter, Node
from torch.utils import _pytree as pytree

from fx_rewrites.app.localize_compare import Judgement, float64_reference, judge
from fx_rewrites.schema import op_name

#: the factor over torch's own float32 error (against float64) above which a backend's error is wrong
FACTOR = 10.0


@attrs.define
class Finding:
    """What went wrong: `kind` is "wrong numbers", "compile failure" or "run failure"; `nodes` the
    smallest piece that shows it (one node, unless only their combination fails)."""

    kind: str
    nodes: list[Node]
    judgement: Judgement | None = None
    error: str = ""
    #: the recorded values the piece read (its placeholders, in order) and the piece itself
    inputs: list[Any] = attrs.field(factory=list)
    piece: GraphModule | None = None
    #: a reason the backend refuses this form by default (IREE's known wrong forms), else ""
    refused: str = ""

    @property
    def node(self) -> Node:
        return self.nodes[0]

    @property
    def op(self) -> str:
        return op_name(self.node.target)


@attrs.define
class Localization:
    """The result: `finding` (None when the backend matches eager on every node), the whole program's
    outcome on the backend as given, and what the search cost."""

    backend: str
    label: str
    rules: bool
    finding: Finding | None
    whole: str
    nodes: int
    compiles: int
    seconds: float
    written: list[Path] = attrs.field(factory=list)
    reproduced: bool | None = None
    #: nodes not checked (torch could not rebuild them as a piece), with why
    skipped: list[tuple[Node, str]] = attrs.field(factory=list)
    #: the name the reproduction gets the backend by (`backends.get`)
    registered: str = ""
    #: what the result cannot say (ttnn's host emulation), "" if nothing
    note: str = ""

    def text(self) -> str:
        from fx_rewrites.app.localize_files import report

        return report(self)

    def write(self, out: str | Path, *, verify: bool = True) -> list[Path]:
        """Write repro.py, guard_rule.py and test_guard_rule.py for the finding into `out`; with `verify`, run
        the reproduction here and set `reproduced`."""
        from fx_rewrites.app.localize_files import write

        if self.finding is None:
            raise ValueError("nothing to write: the backend matches eager on every node")
        self.written, self.reproduced = write(self, Path(out), verify=verify)
        return self.written


# ----------------------------------------------------------------------------- recording


def flat_inputs(program: ExportedProgram, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> list[Any]:
    """The graph module's placeholders' values: parameters, buffers, constants and the user's inputs."""
    from torch.fx import _pytree as fx_pytree

    user = iter(fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs or {})), program.call_spec.in_spec))
    signature = program.graph_signature
    mutated = {*signature.buffers_to_mutate.values(), *signature.user_inputs_to_mutate.values()}
    flat = []
    for spec in signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            value = next(user)
        elif spec.target in program.state_dict:
            value = program.state_dict[spec.target]
        else:
            value = program.constants[spec.target]
        # a copy of what a run writes back into (a compiled program may update the program's own buffers)
        mutable = spec.arg.name in mutated or spec.target in mutated
        flat.append(value.clone() if mutable and isinstance(value, torch.Tensor) else value)
    return flat


class _Recorder(Interpreter):
    def __init__(self, gm: GraphModule, clone: bool) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}
        self.clone = clone

    def run_node(self, n: Node) -> Any:
        value = super().run_node(n)
        keep = pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, value) if self.clone else value
        self.values[n.name] = keep
        return value


def record(gm: GraphModule, flat: Sequence[Any]) -> dict[str, Any]:
    """Every node's value on torch (tensors cloned where an op writes into its inputs)."""
    mutates = any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable for n in gm.graph.nodes)
    recorder = _Recorder(gm, clone=mutates)
    with torch.no_grad():
        recorder.run(*[a.clone() if mutates and isinstance(a, torch.Tensor) else a for a in flat])
    return recorder.values


# ----------------------------------------------------------------------------- pieces


def _has_tensor(value: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(value))


def units(gm: GraphModule, values: Mapping[str, Any]) -> list[Node]:
    """The nodes judged one by one: call_functions producing tensors (a getitem goes with its producer)."""
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem and _has_tensor(values.get(n.name))
    ]


def build_piece(nodes: Sequence[Node], values: Mapping[str, Any]) -> tuple[GraphModule, list[Any], list[tuple]]:
    """`nodes` as a GraphModule of their own: what they read from outside is a placeholder fed the recorded
    value (a tensor) or the recorded value inlined (a number, a list); every tensor they make is an output.
    Returns the module, its inputs and, per output, (node, index in a tuple value or None)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    inside = {n for n in nodes}
    inside |= {u for n in nodes for u in n.users if u.target is operator.getitem}
    graph, root = Graph(), torch.nn.Module()
    env: dict[Node, Any] = {}
    inputs: list[Any] = []

    def outside(n: Node) -> Any:
        if n in env:
            return env[n]
        value = values[n.name]
        if isinstance(value, torch.Tensor):
            env[n] = graph.placeholder(n.name)
            inputs.append(value)
        elif isinstance(value, torch.nn.Module):  # a higher-order op's subgraph
            setattr(root, n.name, value)
            env[n] = graph.get_attr(n.name)
        elif isinstance(value, (tuple, list)) and _has_tensor(value):
            env[n] = [outside_leaf(n.name, i, v) for i, v in enumerate(value)]
        else:
            env[n] = value
        return env[n]

    def outside_leaf(name: str, i: int, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        inputs.append(value)
        return graph.placeholder(f"{name}_{i}")

    ordered = sorted(inside, key=_order(nodes))
    for n in ordered:
        copy = graph.node_copy(n, lambda a: env[a] if a in inside else outside(a))
        copy.meta = {k: v for k, v in n.meta.items() if k in ("stack_trace", "nn_module_stack")}
        env[n] = copy
    outputs: list[tuple[Node, int | None]] = []
    for n in ordered:
        value = values[n.name]
        if isinstance(value, torch.Tensor):
            outputs.append((n, None))
        elif n.target is not operator.getitem:  # a tuple: the elements no getitem here takes
            taken = {u.args[1] for u in n.users if u.target is operator.getitem and u in inside}
            outputs += [(n, i) for i, v in enumerate(value) if isinstance(v, torch.Tensor) and i not in taken]
    results = []
    for n, i in outputs:
        results.append(env[n] if i is None else graph.call_function(operator.getitem, (env[n], i)))
    graph.output(tuple(results))
    _placeholders_first(graph)
    gm = GraphModule(root, graph)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(v) for v in inputs]
    for p, fake in zip([p for p in graph.nodes if p.op == "placeholder"], fakes):
        p.meta["val"] = fake
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level, quiet.level = quiet.level, logging.CRITICAL  # it logs each failing op: the caller says why
    try:
        with mode:
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    finally:
        quiet.setLevel(level)
    return gm, inputs, outputs


def _order(nodes: Sequence[Node]) -> Callable[[Node], int]:
    where = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return lambda n: where[n]


def _placeholders_first(graph: Graph) -> None:
    """Placeholders (made as the copies first read them) moved before every other node, in their order."""
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for p in [n for n in graph.nodes if n.op == "placeholder"]:
        first.prepend(p)
    graph.lint()


def _leaves(out: Any) -> list[Any]:
    return [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]


# ----------------------------------------------------------------------------- the search


@attrs.define
class _Search:
    backend: Any
    values: Mapping[str, Any]
    tolerance: tuple[float, float]
    compiles: int = 0
    #: nodes torch could not rebuild as a piece of their own (not checked), with why
    skipped: list[tuple[Node, str]] = attrs.field(factory=list)
    _references: dict[str, Any] = attrs.field(factory=dict)

    def reference(self, node: Node) -> Any:
        if node.name not in self._references:
            self._references[node.name] = float64_reference(node, self.values)
        return self._references[node.name]

    def try_piece(self, nodes: Sequence[Node]) -> Finding | None:
        """Compile and run `nodes` on the backend; a Finding when it fails or an output is judged wrong."""
        try:
            gm, inputs, outputs = build_piece(nodes, self.values)
        except Exception as e:  # torch cannot rebuild the piece: not the backend's fault; halves may do
            if len(nodes) == 1:
                self.skipped.append((nodes[0], _describe(e)))
                return None
            return Finding("rebuild failure", list(nodes), error=_describe(e))
        self.compiles += 1
        try:
            fn = self.backend.compile(gm, [i.clone() for i in inputs])
        except Exception as e:
            return Finding("compile failure", list(nodes), error=_describe(e), inputs=inputs, piece=gm)
        try:
            with torch.no_grad():
                got = _leaves(fn(*[i.clone() for i in inputs]))
        except Exception as e:
            return Finding("run failure", list(nodes), error=_describe(e), inputs=inputs, piece=gm)
        if len(got) != len(outputs):
            error = f"the backend returned {len(got)} tensors for the piece's {len(outputs)} outputs"
            return Finding("run failure", list(nodes), error=error, inputs=inputs, piece=gm)
        for (node, index), value in zip(outputs, got):
            if _random(node):
                continue
            expected = self.values[node.name] if index is None else self.values[node.name][index]
            source = node if node.target is not operator.getitem else node.args[0]
            index = node.args[1] if node.target is operator.getitem else index
            reference = self.reference(source)
            if isinstance(reference, (tuple, list)):
                reference = reference[index] if index is not None else None
            verdict = judge(value, expected, reference, FACTOR, *self.tolerance)
            if verdict.wrong:
                return Finding("wrong numbers", [source], judgement=verdict, inputs=inputs, piece=gm)
        return None

    def bisect(self, nodes: Sequence[Node]) -> Finding | None:
        """The first node in `nodes` wrong alone: the whole, then each half; a compile failure no half shows
        is the whole's (numbers off in a piece but in no half are float32 error carried along, not a bug)."""
        found = self.try_piece(nodes)
        if found is None or len(nodes) == 1:
            return found
        half = len(nodes) // 2
        for part in (nodes[:half], nodes[half:]):
            inner = self.bisect(part)
            if inner is not None:
                return inner
        return found if found.kind not in ("wrong numbers", "rebuild failure") else None

    def each(self, nodes: Sequence[Node]) -> Finding | None:
        for node in nodes:
            found = self.try_piece([node])
            if found is not None:
                return found
        return None


def _random(node: Node) -> bool:
    target = node.args[0].target if node.target is operator.getitem else node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _describe(e: BaseException) -> str:
    text = " ".join((getattr(e, "summary", "") or str(e)).split())
    return f"{type(e).__name__}: {text}"


def measuring(backend: Any) -> Any:
    """The backend itself: IREE's refusal of the forms it computes wrong turned off, so they are measured."""
    if getattr(backend, "refuse_wrong_forms", False):
        return attrs.evolve(backend, refuse_wrong_forms=False)
    return backend


def _refused(backend: Any, finding: Finding) -> str:
    if not getattr(backend, "refuse_wrong_forms", False) or finding.piece is None:
        return ""
    from fx_rewrites.backends.iree import wrong_forms

    try:
        wrong_forms.refuse(finding.piece)
    except Exception as e:
        return " ".join(str(e).split())
    return ""


def _whole(backend: Any, program: ExportedProgram, args: tuple, kwargs: dict, expected: Any) -> str:
    """The program as a whole on the backend as given, one line."""
    try:
        got = backend.compile(program, args)(*args, **kwargs)
    except Exception as e:
        return f"fails: {_describe(e)[:400]}"
    try:
        diff = max(
            ((g.double() - e.double()).abs().max().item() if g.numel() else 0.0)
            for g, e in zip(_leaves(got), _leaves(expected))
        )
    except Exception as e:  # shapes differ
        return f"runs, but its outputs do not match eager's: {_describe(e)[:200]}"
    return f"compiles and runs; max abs diff vs eager {diff:.2e}"


def localize(
    program: ExportedProgram | torch.nn.Module,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    backend: str | Any = "iree",
    rules: bool = True,
    bisect: bool = True,
    label: str = "model",
) -> Localization:
    """The first node of `program` (a module is exported first) that `backend` gets wrong on `args`, after
    the backend's rules (`rules=False`: as exported). `bisect=False` compiles every node one by one."""
    from fx_rewrites import backends
    from fx_rewrites.api import apply

    start = time.perf_counter()
    given = backends.get(backend) if isinstance(backend, str) else backend
    target = given.for_demo() if hasattr(given, "for_demo") else given  # ttnn without ttnn: emulated
    args, kwargs = tuple(args), dict(kwargs or {})
    if not isinstance(program, ExportedProgram):
        program = torch.export.export(program, args, kwargs or None)
    if rules:
        program = apply(program, target.rules).program
    flat = flat_inputs(program, args, kwargs)
    values = record(program.graph_module, flat)
    output = program.graph_module.graph.output_node()
    specs = program.graph_signature.output_specs
    user = [a for a, spec in zip(output.args[0], specs) if spec.kind == OutputKind.USER_OUTPUT]
    expected = [values[a.name] if isinstance(a, Node) else a for a in user]
    mutated = set(program.graph_signature.buffers_to_mutate.values())
    saved = {k: v.clone() for k, v in program.state_dict.items() if k in mutated}
    copies = pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, (args, kwargs))
    whole = _whole(target, program, *copies, expected)
    for k, v in saved.items():  # the backend may have updated the program's own buffers: put them back
        program.state_dict[k].copy_(v)
    todo = units(program.graph_module, values)
    tolerance = (getattr(target, "rtol", 0.0), getattr(target, "atol", 0.0))
    search = _Search(measuring(target), values, tolerance)
    finding = (search.bisect(todo) if bisect else search.each(todo)) if todo else None
    if finding is not None:
        finding.refused = _refused(target, finding)
    name = getattr(target, "name", str(backend))
    seconds = time.perf_counter() - start
    registered = backend if isinstance(backend, str) else getattr(given, "name", name)
    note = ""
    if target is not given:  # ttnn without ttnn: the recorded run and the emulation both run the stand-ins' bodies
        note = (
            "the device regions ran in their host emulation, the stand-ins' own torch bodies, which the recorded "
            "run on torch ran too: it compares the emulation with itself. Run it where ttnn is installed"
        )
    return Localization(
        name,
        label,
        rules,
        finding,
        whole,
        len(todo),
        search.compiles + 1,
        seconds,
        skipped=search.skipped,
        registered=registered,
        note=note,
    )
