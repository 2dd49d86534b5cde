"""The differential localizer: the first node a backend gets wrong (wrong numbers or no compile).

found = fx_rewrites.localize(program, (x,), backend="iree", rules=False)
print(found.text())                 # the node, its source line, shapes, errors against eager and float64
found.write("localize-model/")      # repro.py, guard_rule.py, test_guard_rule.py

The program runs on torch with every intermediate recorded; pieces of its graph (all of it, then halves,
down to one node) are rebuilt as GraphModules whose inputs are the recorded values (`pieces`) and
compiled on the backend; a piece is wrong when an output's error against the op run in float64 is well above
torch's own float32 error (`compare.judge`). The first node in graph order wrong alone is reported.
Where that static search finds nothing and the program has dynamic dims, the same search runs again on
pieces that keep the program's symbolic shapes (`dynamic`): a fault the backend shows only with dynamic dims.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from fx_rewrites.app.localize.compare import Judgement, float64_reference, judge
from fx_rewrites.app.localize.dynamic import describe, has_symbolic_shapes
from fx_rewrites.app.localize.pieces import build_piece, flat_inputs, record, units
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
    #: found by the dynamic pass (wrong only with dynamic shapes): the piece's symbolic shapes; "" when static
    symbolic: str = ""

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
    #: whether the pieces were also searched with the program's symbolic shapes (the static search found nothing)
    dynamic: bool = False

    def text(self) -> str:
        from fx_rewrites.app.localize.files import report

        return report(self)

    def write(self, out: str | Path, *, verify: bool = True) -> list[Path]:
        """Write repro.py, guard_rule.py and test_guard_rule.py for the finding into `out`; with `verify`, run
        the reproduction here and set `reproduced`."""
        from fx_rewrites.app.localize.guard import write

        if self.finding is None:
            raise ValueError("nothing to write: the backend matches eager on every node")
        self.written, self.reproduced = write(self, Path(out), verify=verify)
        return self.written


def _leaves(out: Any) -> list[Any]:
    return [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]


# ----------------------------------------------------------------------------- the search


@attrs.define
class _Search:
    backend: Any
    values: Mapping[str, Any]
    tolerance: tuple[float, float]
    #: pieces keep the program's symbolic shapes (the dynamic pass) rather than the recorded sizes
    symbolic: bool = False
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
        found = self._try_piece(nodes)
        if found is not None and self.symbolic and found.piece is not None:
            found.symbolic = describe(found.piece)
        return found

    def _try_piece(self, nodes: Sequence[Node]) -> Finding | None:
        try:
            gm, inputs, outputs = build_piece(nodes, self.values, symbolic=self.symbolic)
        except Exception as e:  # torch cannot rebuild the piece: not the backend's fault; halves may do
            if len(nodes) == 1:
                if not self.symbolic:  # the static pass has said so already
                    self.skipped.append((nodes[0], _describe(e)))
                return None
            return Finding("rebuild failure", list(nodes), error=_describe(e))
        self.compiles += 1
        try:
            fn = self.backend.compile(gm, _fresh(inputs))
        except Exception as e:
            return Finding("compile failure", list(nodes), error=_describe(e), inputs=inputs, piece=gm)
        try:
            with torch.no_grad():
                got = _leaves(fn(*_fresh(inputs)))
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


#: ops whose output is memory left as it was (any value is right): not compared
_UNINITIALIZED = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}


def _fresh(inputs: Sequence[Any]) -> list[Any]:
    """A piece's inputs to hand a backend: tensors cloned (a backend may write into them), numbers as they are."""
    return [i.clone() if isinstance(i, torch.Tensor) else i for i in inputs]


def _random(node: Node) -> bool:
    """Outputs no backend must reproduce: random ops' (`nondeterministic_seeded`) and uninitialized memory."""
    target = node.args[0].target if node.target is operator.getitem else node.target
    if target in _UNINITIALIZED:
        return True
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
    """Why `backend` refuses the finding's piece by default (`refusal`: IREE's known wrong forms), else ""."""
    refusal = getattr(backend, "refusal", None)
    if not callable(refusal) or finding.piece is None:
        return ""
    return refusal(finding.piece)


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
    dynamic = finding is None and bool(todo) and has_symbolic_shapes(program.graph_module)
    if dynamic:  # right with the recorded sizes: the same search with the program's symbolic shapes
        search.symbolic = True
        finding = search.bisect(todo) if bisect else search.each(todo)
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
        dynamic=dynamic,
    )
