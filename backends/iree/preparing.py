"""A graph made ready for IREE's FX importer (`importing`): a private copy the importer may edit, and its call plan.

Two inputs:

- an `ExportedProgram` (`prepare_program`): parameters, buffers and lifted
  constants are frozen into the module; mutated state (running means,
  counters, caches) becomes mutable module globals (`state.lift_state`): `main`
  reads them first and stores their new values last, so the state lives in
  the module between calls.
- a functional ATen `GraphModule` whose placeholders carry `meta["val"]`
  (`prepare_graph_module`): the forward graph an aot_autograd backend of
  `torch.compile` receives, or a `make_fx` graph. Every placeholder is an
  argument (dynamo lifts parameters to inputs), except SymInt placeholders
  that are the size of an input dim: those are recomputed inside the module
  (`aten.sym_size.int(tensor, dim)`) and the value the caller passes is
  dropped, so IREE never receives a SymInt and a call cannot pass a size
  that disagrees with the tensors. A Sym placeholder that is no input's size
  (an `item()` value dynamo made an input) is passed as a scalar
  (`!torch.int` / `!torch.float`), never where a tensor is expected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import GraphModule, Node
from torch.fx.graph import _PyTreeCodeGen
from torch.utils import _pytree as pytree

from fx_rewrites.backends.convention import Input, Output, Plan, leaf_paths, program_inputs, program_ranges
from fx_rewrites.backends.iree.a8int4_fold import fold_a8int4
from fx_rewrites.backends.iree.constant_sizes import concrete_sizes
from fx_rewrites.backends.iree.errors import IreeUnsupportedError
from fx_rewrites.backends.iree.int4_fold import fold_int4
from fx_rewrites.backends.iree.sharing import fresh_results, unwritten_arguments
from fx_rewrites.backends.iree.state import state_tensor
from fx_rewrites.backends.iree.weight_layout import fold_blocked_rows
from fx_rewrites.program import copy_graph_module, rebuild_program
from fx_rewrites.symbolic_sizes import sym_placeholder_sources

_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)

aten = torch.ops.aten


def copy_tree(gm: GraphModule) -> GraphModule:
    """`copy_graph_module` of `gm` and of every GraphModule under it (the importer edits graphs)."""
    new = copy_graph_module(gm)
    for name, child in gm.named_children():
        if isinstance(child, GraphModule):
            setattr(new, name, copy_tree(child))
    return new


def _value(node: Node) -> Any:
    return node.meta.get("val", node.meta.get("example_value"))


def _is_constant(node: Node) -> bool:
    """An input the tracer specialised (an int, None, ...): the graph does not read it."""
    return not node.users and not isinstance(_value(node), (torch.Tensor, *_SYM))


def _outputs(output: Node, leaves: list[Any], writes: list[int | torch.Tensor | None]) -> list[Output]:
    """The plan of each output leaf (`writes`: where a mutation goes); the output node is
    left returning the Node leaves only, the compiled function's results."""
    outputs, results = [], []
    for leaf, write in zip(leaves, writes, strict=True):
        if isinstance(leaf, Node):
            val = _value(leaf)
            dtype = val.dtype if isinstance(val, torch.Tensor) else None
            outputs.append(Output(len(results), dtype=dtype, write=write))
            results.append(leaf)
        else:
            outputs.append(Output(None, constant=leaf, write=write))
    output.args = (tuple(results),)
    return outputs


# ----------------------------------------------------------------------------- ExportedProgram

_STATE_IN = (InputKind.PARAMETER, InputKind.BUFFER)
_STATE_OUT = (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION)


def _check_signature(program: ExportedProgram) -> None:
    sig = program.graph_signature
    supported_in = {InputKind.USER_INPUT, InputKind.CONSTANT_TENSOR, *_STATE_IN}
    bad_in = [f"{s.arg.name} ({s.kind.name})" for s in sig.input_specs if s.kind not in supported_in]
    supported_out = {OutputKind.USER_OUTPUT, OutputKind.USER_INPUT_MUTATION, *_STATE_OUT}
    bad_out = [f"{getattr(s.arg, 'name', '')} ({s.kind.name})" for s in sig.output_specs if s.kind not in supported_out]
    if bad_in or bad_out:
        raise IreeUnsupportedError(
            f"the IREE backend does not support {'inputs ' + str(bad_in) if bad_in else ''}"
            f"{' and ' if bad_in and bad_out else ''}{'outputs ' + str(bad_out) if bad_out else ''} yet; "
            "run this program on the eager backend"
        )


def prepare_program(program: ExportedProgram, state: Collection[str] = ()) -> tuple[ExportedProgram, Plan]:
    """A private copy of `program` ready for the importer, and the call plan.

    Parameters, buffers and constants are frozen into the module, except
    mutated ones: those stay arguments, read from and written back to
    `program`'s state at each call (as `program.module()` does). Specialised
    non-tensor inputs and constant outputs (None, ints) have no IREE type:
    they are dropped from the copy and restored around the call. `state`:
    more buffer and parameter names to keep as arguments though this program
    only reads them (another function of the module writes them).
    """
    _check_signature(program)
    sig = program.graph_signature
    copy = fold_blocked_rows(rebuild_program(program, copy_tree(program.graph_module)))  # quantized weights
    copy = fold_int4(copy)  # int4 decode linears: their words packed
    copy = fold_a8int4(copy)  # int8 x int4 decode linears: their bytes packed
    mutated = {s.target for s in sig.output_specs if s.kind in _STATE_OUT} | set(state)
    # the importer freezes what the signature calls state; mutated state must stay an argument
    copy_specs = copy.graph_signature.input_specs
    for i, spec in enumerate(copy_specs):
        if spec.kind in _STATE_IN and spec.target in mutated:
            copy_specs[i] = dataclasses.replace(spec, kind=InputKind.USER_INPUT, target=None, persistent=None)
        elif spec.kind == InputKind.BUFFER and spec.persistent is False:
            # non-persistent buffers (BERT's position_ids) live in `constants`; the importer
            # freezes buffers from the state dict only ("Could not find state mapping for buffer")
            copy_specs[i] = dataclasses.replace(spec, persistent=True)
            copy._state_dict = {**copy.state_dict, spec.target: program.constants[spec.target]}

    user_names = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    sources: dict[str, int | torch.Tensor] = {name: i for i, name in enumerate(user_names)}
    for spec in sig.input_specs:
        if spec.kind in _STATE_IN and spec.target in mutated:
            sources[spec.arg.name] = state_tensor(program, spec.target)
    graph = copy.graph_module.graph
    args: list[int | torch.Tensor] = []
    arguments = []
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in sources]:
        if node.name in user_names and _is_constant(node):
            graph.erase_node(node)
        else:
            args.append(sources[node.name])
            arguments.append(node)

    writes: list[int | torch.Tensor | None] = []
    for spec in sig.output_specs:
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            writes.append(user_names.index(spec.target))
        else:
            writes.append(state_tensor(program, spec.target) if spec.kind in _STATE_OUT else None)
    output = graph.output_node()
    outputs = _outputs(output, pytree.tree_leaves(output.args[0]), writes)
    concrete_sizes(graph)
    graph.lint()
    copy.graph_module.recompile()
    in_spec = program.call_spec.in_spec
    plan = Plan(
        in_spec,
        program.call_spec.out_spec,
        tuple(args),
        tuple(outputs),
        program_inputs(program),
        program_ranges(program),
        unwritten_arguments(arguments),
        fresh_results(output.args[0]),
    )
    return copy, plan


# ----------------------------------------------------------------------------- GraphModule


def _check_graph_module(gm: GraphModule) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    bare = [n.name for n in placeholders if "val" not in n.meta]
    torch_level = [f"{n.name} ({n.op})" for n in gm.graph.nodes if n.op in ("call_module", "call_method")]
    if not bare and not torch_level:
        return
    why = (
        f"placeholders {bare[:5]} carry no meta['val'] (shapes and dtypes)"
        if bare
        else f"it holds torch-level calls {torch_level[:5]}, not ATen ops"
    )
    raise IreeUnsupportedError(
        "the IREE backend takes a torch.export.ExportedProgram, or a functional ATen GraphModule whose "
        f"placeholders carry meta['val'] (the forward graph of aot_autograd, make_fx); this one does not: {why} "
        "(torch.fx.symbolic_trace and plain dynamo graphs are like that). Export first, "
        "`ep = torch.export.export(model, args)`, then `backend.compile(fx_rewrites.apply(ep, backend.rules).program, "
        "args)`; or use `torch.compile(model, backend=backends.dynamo.fx_rewrites_iree)`"
    )


def _recompute_sizes(gm: GraphModule) -> set[str]:
    """Replace each Sym placeholder that is the size of a tensor input's dim by
    `aten.sym_size.int(tensor, dim)`; the names of the placeholders replaced."""
    graph = gm.graph
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    body = next(n for n in graph.nodes if n.op != "placeholder")  # the output node at the latest
    replaced = set()
    for name, source in sym_placeholder_sources(gm).items():
        if source is None:
            continue
        node = placeholders[name]
        if node.users:
            tensor, dim = source
            with graph.inserting_before(body):
                size = graph.call_function(aten.sym_size.int, (placeholders[tensor], dim))
            size.meta["val"] = _value(node)
            node.replace_all_uses_with(size)
        graph.erase_node(node)
        replaced.add(name)
    return replaced


def prepare_graph_module(gm: GraphModule) -> tuple[GraphModule, Plan]:
    """A private copy of `gm` ready for the importer, and the call plan.

    The compiled function takes the arguments `gm` takes and returns what
    it returns. Sym placeholders that are an input's size are recomputed in
    the module from that input (the caller's value is not passed to IREE);
    other Sym placeholders are passed as scalars. Unused specialised inputs
    and constant outputs are dropped and restored around the call. Tensor
    attributes (`get_attr`, frozen weights) stay in the copy; `import_mlir`
    imports them as constants, or as parameters where the hooks' `resolve_literal`
    binds them (`parameters.attribute_hooks`).
    """
    _check_graph_module(gm)
    copy = copy_tree(gm)
    graph = copy.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    codegen = graph._codegen
    if isinstance(codegen, _PyTreeCodeGen):
        in_spec, out_spec = codegen.pytree_info.in_spec, codegen.pytree_info.out_spec
        graph._codegen = torch.fx.graph.CodeGen()  # the importer sees flat inputs and outputs
    else:
        in_spec, out_spec = pytree.tree_flatten((tuple(placeholders), {}))[1], None
    replaced = _recompute_sizes(copy)
    args, arguments = [], []
    for i, node in enumerate(placeholders):
        if node.name in replaced:
            continue
        if _is_constant(node):
            graph.erase_node(node)
        else:
            args.append(i)
            arguments.append(node)

    output = graph.output_node()
    leaves, spec = pytree.tree_flatten(output.args[0])
    outputs = _outputs(output, leaves, [None] * len(leaves))
    concrete_sizes(graph)
    graph.lint()
    copy.recompile()
    unwritten, fresh = unwritten_arguments(arguments), fresh_results(output.args[0])
    inputs = _static_tensor_inputs(placeholders, in_spec) if len(args) == len(placeholders) else ()
    plan = Plan(in_spec, out_spec or spec, tuple(args), tuple(outputs), inputs, unwritten=unwritten, fresh=fresh)
    return copy, plan


def _static_tensor_inputs(placeholders: list[Node], in_spec: pytree.TreeSpec) -> tuple[Input, ...]:
    """Each placeholder as the call's input where all are tensors of static sizes, one a leaf of `in_spec` (what
    the call's fast paths check, `calling.input_checks`); () otherwise (the call takes `bind`'s path unchecked)."""
    paths = leaf_paths(in_spec)
    if len(paths) != len(placeholders):
        return ()
    inputs = []
    for node, path in zip(placeholders, paths, strict=True):
        val = _value(node)
        if not isinstance(val, torch.Tensor) or not all(isinstance(size, int) for size in val.shape):
            return ()
        inputs.append(Input(node.name, path, "tensor", dtype=val.dtype, shape=tuple(val.shape)))
    return tuple(inputs)
