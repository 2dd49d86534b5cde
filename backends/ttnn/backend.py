"""`TtnnBackend`: its rules lower (DEFAULT, then the ttnn pack); compile partitions into device and host
regions; calling runs them on ttnn.

backend = backends.get("ttnn")
fn = backend.compile(fx_rewrites.apply(program, backend.rules).program, args)   # works without ttnn
fn.partitioning.summary()                          # regions and device share
fn(*args)                                          # needs ttnn (or backends.ttnn.runtime.use(double))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import GraphModule, Interpreter
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from fx_rewrites.api import apply
from fx_rewrites.backends.partition import Partitioning, partition, split
from fx_rewrites.backends.ttnn import dispatch, runtime
from fx_rewrites.backends.ttnn.constants import ConstantCache, region_plans
from fx_rewrites.backends.ttnn.coverage import coverage
from fx_rewrites.backends.ttnn.rules import PHASES, is_device_node
from fx_rewrites.backends.ttnn.rules.ops import is_standin
from fx_rewrites.ruleset import Phases
from fx_rewrites.symbolic_sizes import sym_in_tensor_slots

#: what `fx_rewrites.apply(program, backend.rules)` runs for ttnn (`rules.PHASES`): DEFAULT, the folds, the lowering
TTNN_PHASES = PHASES


class TtnnLoweringError(RuntimeError):
    """The lowered graph breaks a promise the ttnn backend makes (e.g. a SymInt in a tensor slot)."""


def lower(program: ExportedProgram | GraphModule) -> ExportedProgram | GraphModule:
    """The ttnn backend's rules applied: DEFAULT, the folds, then the ttnn pack (`TTNN_PHASES`)."""
    result = apply(program, TTNN_PHASES)
    lowered = result.program if result.program is not None else result.graph_module
    _check_lowered(result.graph_module)
    return lowered


def _check_lowered(gm: GraphModule) -> None:
    left = sym_in_tensor_slots(gm)
    if left:
        raise TtnnLoweringError(
            "a SymInt is in a tensor slot, so ttnn would get a number where it needs a tensor: "
            f"{left[:5]}. Fix: apply the backend's rules first (`fx_rewrites.apply(program, backend.rules)`); "
            "if it stays after them, a rule in rewrites/rules/symbolic.py for this op."
        )


class _CachingRegion(Interpreter):
    """A region's graph run node by node; its constant nodes come from `cached` (filled on the first call)."""

    def __init__(self, module: GraphModule, constant: frozenset[str], cached: dict[str, Any]) -> None:
        super().__init__(module)
        self.constant, self.cached = constant, cached

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.name not in self.constant:
            return super().run_node(n)
        if n.name not in self.cached:
            self.cached[n.name] = super().run_node(n)
        return self.cached[n.name]


class _DeviceRegion(_CachingRegion):
    """A device region's graph, each stand-in run as its ttnn call."""

    def __init__(
        self, module: GraphModule, ttnn: Any, device: Any, constant: frozenset[str], cached: dict[str, Any]
    ) -> None:
        super().__init__(module, constant, cached)
        self.ttnn, self.device = ttnn, device

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if is_standin(target) and self.ttnn is not None:  # None: emulated, each stand-in's own torch body
            return dispatch.call(self.ttnn, self.device, target, args, kwargs)
        return super().call_function(target, args, kwargs)


class _Regions(Interpreter):
    """The split top-level module: device regions on ttnn, host regions on torch."""

    def __init__(self, compiled: TtnnCompiled, ttnn: Any, device: Any) -> None:
        super().__init__(compiled.graph_module)
        self.compiled, self.ttnn, self.device = compiled, ttnn, device

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        sub = self.fetch_attr(target)
        placeholders, constant = self.compiled._constants[target]
        if target in self.compiled._host and not constant:
            return sub(*args, **kwargs)
        inputs = [args[i] for i in sorted(placeholders)]
        cached = self.compiled._cache.region(target, inputs, self.ttnn, self.device)
        if target in self.compiled._host:  # values computed from constants only (folded weights): once
            return _CachingRegion(sub, constant, cached).run(*args)
        return _DeviceRegion(sub, self.ttnn, self.device, constant, cached).run(*args)


@attrs.frozen
class TtnnCompiled:
    """The partitioned program; calling it runs device regions on ttnn.

    Takes what `program.module()` takes (an ExportedProgram's user inputs) or,
    for a GraphModule, its placeholders. Buffer mutations are not written back.
    """

    graph_module: GraphModule  # the top-level module calling one submodule per region
    partitioning: Partitioning
    program: ExportedProgram | None = None
    #: run device regions on the host with each stand-in's torch body (bfloat16 results), without ttnn
    emulate: bool = False
    #: per region: its placeholders fed by constants, and its nodes computed from constants only
    _constants: dict[str, tuple[frozenset[int], frozenset[str]]] = attrs.field(init=False, repr=False)
    _host: frozenset[str] = attrs.field(init=False, repr=False)
    _cache: ConstantCache = attrs.field(init=False, repr=False, factory=ConstantCache)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_constants", region_plans(self.graph_module, self.program))
        object.__setattr__(self, "_host", frozenset(r.name for r in self.partitioning.host_regions))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ttnn = None if self.emulate else runtime.ttnn_module()
        device = None if ttnn is None else runtime.device(ttnn)
        flat = self._inputs(args, kwargs)
        with torch.no_grad():
            out = _Regions(self, ttnn, device).run(*flat)
        return self._outputs(out)

    def _inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        if self.program is None:
            return list(args)
        ep = self.program
        user = iter(fx_pytree.tree_flatten_spec((args, kwargs), ep.call_spec.in_spec))
        flat = []
        for spec in ep.graph_signature.input_specs:
            if spec.kind == InputKind.USER_INPUT:
                flat.append(next(user))
            elif spec.target in ep.state_dict:
                flat.append(ep.state_dict[spec.target])
            else:
                flat.append(ep.constants[spec.target])
        return flat

    def _outputs(self, out: Any) -> Any:
        if self.program is None:
            return out
        specs = self.program.graph_signature.output_specs
        user = [v for v, s in zip(out, specs) if s.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT)]
        return pytree.tree_unflatten(user, self.program.call_spec.out_spec)


@attrs.frozen
class TtnnBackend:
    """Tenstorrent TT-NN: aten lowered to ttnn calls as rules, the rest on the host."""

    name: str = "ttnn"
    rules: Phases = TTNN_PHASES
    #: device regions emulated on the host (the stand-ins' torch bodies, bfloat16) instead of run on ttnn
    emulate: bool = False
    #: agreement with eager to expect: bfloat16 on the device keeps about 2 significant digits per op
    rtol: float = 3e-2
    atol: float = 3e-2

    def describe(self, program: ExportedProgram | GraphModule, label: str = "model") -> str:
        """The coverage report (per aten op: nodes on the device, on the host and why), for `fx-rewrites check`."""
        return coverage(program, label, self.rules).text()

    def for_demo(self) -> TtnnBackend:
        """This backend, or where ttnn cannot be imported its host emulation, named so (`fx-rewrites demo`)."""
        try:
            runtime.ttnn_module()
        except runtime.TtnnUnavailable:
            return attrs.evolve(self, name="ttnn (not installed: device regions emulated on the host)", emulate=True)
        return self

    def compile(self, program: ExportedProgram | GraphModule, example_args: Sequence[Any]) -> TtnnCompiled:
        """Partition a program the rules have lowered; needs no ttnn until called. It rewrites nothing:
        nodes the rules did not lower to ttnn stand-ins run on the host."""
        if not isinstance(program, (ExportedProgram, GraphModule)):
            raise TypeError(
                "the ttnn backend compiles a torch.export.ExportedProgram or a torch.fx.GraphModule, "
                f"got {type(program).__name__}"
            )
        gm = program.graph_module if isinstance(program, ExportedProgram) else program
        _check_lowered(gm)
        partitioning = partition(gm.graph, is_device_node)
        return TtnnCompiled(
            split(gm, partitioning),
            partitioning,
            program if isinstance(program, ExportedProgram) else None,
            emulate=self.emulate,
        )
