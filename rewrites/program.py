"""Copying graph modules and keeping an ExportedProgram's signature true."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Iterator

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx import Graph, GraphModule, Node
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from fx_rewrites.engine import RewriteError
from fx_rewrites.engine.fxgraph import copy_nodes


@contextlib.contextmanager
def quiet_torch_pytree() -> Iterator[None]:
    """Silence torch 2.13's FutureWarning about its own pytree code (`isinstance(treespec, LeafSpec)` is
    deprecated), which copying or exporting a program raises: inside this block only, so a user's own
    warning filters are left alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        yield


class ProgramError(RewriteError):
    """The rewritten graph does not make a valid ExportedProgram."""


#: `gm.meta` keys `apply` sets while it rewrites an ExportedProgram, so that
#: rules can read the signature and record mutations they make explicit.
INPUT_SPECS = "fx_rewrites_input_specs"  # placeholder name -> InputSpec
NEW_MUTATIONS = "fx_rewrites_new_mutations"  # [(OutputKind, target)], outputs 0..k-1
#: the outputs that write a program's own state
_STATE_WRITES = (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION)


def expose_signature(ep: ExportedProgram, gm: GraphModule) -> None:
    gm.meta[INPUT_SPECS] = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    gm.meta[NEW_MUTATIONS] = []


def input_spec(node: Node) -> InputSpec | None:
    """The signature entry of a placeholder, when the graph is a program's."""
    owner = node.graph.owning_module
    specs = getattr(owner, "meta", {}).get(INPUT_SPECS)
    return None if specs is None else specs.get(node.name)


def new_mutations(graph: Graph) -> list | None:
    """The mutation outputs rules added so far (None outside a program)."""
    return getattr(graph.owning_module, "meta", {}).get(NEW_MUTATIONS)


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A new GraphModule with a copied graph (node meta copied shallowly);
    attributes and submodules are shared with `gm`, not copied."""
    graph = Graph(tracer_cls=gm.graph._tracer_cls)
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    env, old_output = copy_nodes(gm.graph, graph)
    out = map_arg(old_output.args[0], env.__getitem__)
    new_output = graph.output(out, type_expr=old_output.type)
    new_output.meta = copy.copy(old_output.meta)
    # lazy: the copy is recompiled when first called, not three times per apply()
    with _use_lazy_graph_module(True):
        new = _make_graph_module(gm, graph, class_name=type(gm).__name__)
    new.meta = copy.copy(getattr(gm, "meta", {}))
    return new


def drop_dead_subgraphs(gm: GraphModule) -> None:
    """Remove child GraphModules (higher-order op bodies) no node reads any
    more. Importers that walk every child (IREE's) would meet them.
    `delete_all_unused_submodules` misses a body registered under two names
    (named_modules() yields each module once under one name), hence this."""
    used = {str(n.target).split(".")[0] for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    for name, child in list(gm._modules.items()):  # not named_children(): it skips repeats
        if name not in used and isinstance(child, GraphModule):
            delattr(gm, name)


def _outputs(gm: GraphModule) -> list:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return pytree.tree_leaves(output.args[0])


def rebuild_program(ep: ExportedProgram, gm: GraphModule) -> ExportedProgram:
    """`ep` with its graph replaced by the rewritten `gm`.

    Output specs are renamed after the nodes now returned (rewrites replace
    nodes, so names change); input specs of placeholders a rule removed are
    dropped. Everything else (state, constants, ranges) carries over.
    """
    renamed: dict[str, str] = {}
    gm.meta.pop(INPUT_SPECS, None)
    added = gm.meta.pop(NEW_MUTATIONS, [])
    outputs = _outputs(gm)
    output_specs = [
        OutputSpec(kind=kind, arg=TensorArgument(name=out.name), target=target)
        for (kind, target), out in zip(added, outputs)
    ]
    for spec, out in zip(ep.graph_signature.output_specs, outputs[len(added) :], strict=True):
        old = getattr(spec.arg, "name", None)
        if isinstance(out, Node) and old is not None and old != out.name:
            renamed[old] = out.name
            spec = dataclasses.replace(spec, arg=dataclasses.replace(spec.arg, name=out.name))
        output_specs.append(spec)
    placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    input_specs = [s for s in ep.graph_signature.input_specs if getattr(s.arg, "name", None) in placeholders]
    input_specs = _written_constants_as_buffers(input_specs, added)
    signature = ExportGraphSignature(input_specs=input_specs, output_specs=output_specs)
    with quiet_torch_pytree():  # deepcopy of the TreeSpecs in the call graph
        call_graph = copy.deepcopy(ep.module_call_graph)
    for entry in call_graph:
        if entry.fqn == "" and entry.signature is not None:
            for arg in entry.signature.outputs:
                if getattr(arg, "name", None) in renamed:
                    arg.name = renamed[arg.name]
    try:
        return _program(ep, gm, signature, call_graph)
    except Exception as e:  # torch's verifier raises several kinds
        raise ProgramError(_blame(gm, e)) from e


def _written_constants_as_buffers(specs: list[InputSpec], added: list) -> list[InputSpec]:
    """Lifted constants a rule now writes (a BUFFER_MUTATION output names them) as non-persistent buffers:
    state held outside the module's buffers, which `ExportedProgram.constants` keeps as it keeps those."""
    written = {target for kind, target in added if kind == OutputKind.BUFFER_MUTATION}
    return [
        InputSpec(InputKind.BUFFER, s.arg, s.target, persistent=False)
        if s.kind == InputKind.CONSTANT_TENSOR and s.target in written
        else s
        for s in specs
    ]


def _blame(gm: GraphModule, error: Exception) -> str:
    """The verifier's complaint, with the rules that made the nodes it names."""
    text = str(error).strip().splitlines()[0]
    culprits = [
        f"{n.name} ({n.target}) from rule {n.meta['rewrites'][-1]['rule']!r}"
        for n in gm.graph.nodes
        if "rewrites" in n.meta and n.op == "call_function" and str(n.target) in text
    ]
    made = f"; made by: {', '.join(culprits[:5])}" if culprits else ""
    return (
        f"the rewritten graph is not a valid ExportedProgram: {type(error).__name__}: {text}{made}. "
        "A rule produced an op this program's dialect does not allow; fix that rule, or leave it out "
        "of the RuleSet."
    )


def _program(
    ep: ExportedProgram, gm: GraphModule, signature: ExportGraphSignature, call_graph: list
) -> ExportedProgram:
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict=ep.state_dict,
        range_constraints=copy.deepcopy(ep.range_constraints),
        module_call_graph=call_graph,
        example_inputs=ep.example_inputs,
        constants=ep.constants,
        verifiers=ep.verifiers,
    )


def with_own_state(ep: ExportedProgram) -> ExportedProgram:
    """`ep` with a copy of each buffer or parameter its graph writes (the rest shared): a backend compiling
    it, or its `module()`, keeps its own running means and counters instead of sharing `ep`'s, so calling
    one never moves the other's. A shallow copy; `ep` itself is left as it was."""
    written = {s.target for s in ep.graph_signature.output_specs if s.kind in _STATE_WRITES}
    if not written:
        return ep

    def own(value: torch.Tensor) -> torch.Tensor:
        copied = value.detach().clone()
        return torch.nn.Parameter(copied, value.requires_grad) if isinstance(value, torch.nn.Parameter) else copied

    copied = copy.copy(ep)
    copied._state_dict = {k: own(v) if k in written else v for k, v in ep.state_dict.items()}
    copied._constants = {
        k: own(v) if k in written and isinstance(v, torch.Tensor) else v for k, v in ep.constants.items()
    }
    return copied


def _is_subclass(value: object) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value)


def has_tensor_subclasses(ep: ExportedProgram) -> bool:
    """Whether `ep` holds tensor-subclass state (torchao's quantized weights, `Int8Tensor`) or reads a
    subclass's inner tensors (`export.access_subclass_inner_tensor`): what `torch.export` leaves before
    `run_decompositions`."""
    if any(_is_subclass(v) for v in (*ep.state_dict.values(), *ep.constants.values())):
        return True
    access = getattr(getattr(torch.ops, "export", None), "access_subclass_inner_tensor", None)
    return access is not None and any(
        n.op == "call_function" and getattr(n.target, "overloadpacket", None) is access for n in ep.graph.nodes
    )


def unwrap_tensor_subclasses(ep: ExportedProgram) -> ExportedProgram:
    """`ep` with its tensor subclasses flattened into plain tensors, or `ep` itself when it holds none.

    A weight quantized with torchao (`quantize_(model, Int8WeightOnlyConfig())`) exports as a subclass
    whose ops run in Python; `run_decompositions({})` (no decomposition table: the ops stay as they are)
    replaces each by its inner tensors (int8 data, float scales) as parameters and traces the subclass's
    ops into the graph (the dequantize), which backends then see as ordinary aten ops."""
    if not has_tensor_subclasses(ep):
        return ep
    try:
        with quiet_torch_pytree():
            return ep.run_decompositions({})
    except Exception as e:
        raise ProgramError(
            f"the program holds tensor subclasses (e.g. torchao quantized weights) and torch could not "
            f"flatten them into plain tensors: {type(e).__name__}: {' '.join(str(e).split())[:400]}. Fix: "
            "call program.run_decompositions() yourself to see the failure, or export the model before "
            "quantizing it"
        ) from e
