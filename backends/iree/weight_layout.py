"""Quantized weights re-laid once, at compile time, in the blocks IREE's fused matvec reads.

A decode step multiplies one row by every weight, so it is bound by reading the weights. IREE 3.13 compiles
`x @ dequantize(w_int8)` into two dispatches: a float32 copy of the whole weight per call (4x the int8 bytes
written, then read again), and a float matmul. With the dequantize fused into a reduction over a weight laid
out as [N/16, K, 16] (16 output channels side by side, each row of K in 16-byte strips) the int8 bytes are
read once and converted in registers: measured on a 2816x1024 int8 weight, one row, one thread, 0.144 ms
against 0.49 ms for the float32 matmul and 1.2 ms for the two dispatches (benchmarks/quantized.py).

The rules (`rules/quantized_matmul.py`) write `fx_rewrites::blocked_rows(w, block)` on a weight that is
program state; `fold_blocked_rows` (run by `preparing.prepare_program`) replaces each such call on a frozen
parameter or buffer by a parameter holding the re-laid bytes, so the module's `.irpa` holds int8 blocks and
no layout op runs per call. Where a grouped weight's zero points are all 0 (torchao's symmetric default), the
share the rule takes off for them is dropped here, where the values are known. The fusion needs
`--iree-dispatch-creation-enable-aggressive-fusion`, which `extra_flags` adds to a module that reads such a
parameter (and to no other).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node

#: the suffix of a re-laid parameter's key: how `extra_flags` knows a module reads one
SUFFIX = ".blocked_rows"
#: what IREE needs to fuse the int8 -> float conversion into the reduction that reads it
FUSION_FLAGS = ("--iree-dispatch-creation-enable-aggressive-fusion",)


@torch.library.custom_op("fx_rewrites::blocked_rows", mutates_args=())
def blocked_rows(weight: torch.Tensor, block: int, group: int = 0, tile: int = 1) -> torch.Tensor:
    """`weight` [N, K] as [N / block, K, block]: out[b, k, j] = weight[b * block + j, k] (a copy). With a `group`,
    K's groups of `group` taken `tile` at a time and interleaved: [N / block, K / (group tile), group, tile,
    block], out[b, h, i, t, j] = weight[b * block + j, (h * tile + t) * group + i], so a kernel that reduces
    `tile` groups side by side reads one contiguous run of bytes (`rules/quantized_matmul.py`)."""
    rows, cols = weight.shape
    out = weight.reshape(rows // block, block, cols).permute(0, 2, 1)
    if group:
        out = out.reshape(rows // block, cols // (group * tile), tile, group, block).transpose(2, 3)
    return out.contiguous()


@blocked_rows.register_fake
def _(weight: torch.Tensor, block: int, group: int = 0, tile: int = 1) -> torch.Tensor:
    rows, cols = weight.shape
    if group:
        return weight.new_empty((rows // block, cols // (group * tile), group, tile, block))
    return weight.new_empty((rows // block, cols, block))


BLOCKED_ROWS = torch.ops.fx_rewrites.blocked_rows.default
aten = torch.ops.aten

#: source tensor -> (its version, its layout's (block, group, tile), its blocks): a weight re-laid once per
#: content, and the same blocks object for every function of a module that reads it (parameters are shared by
#: identity; torchao's flattened weights are a new tensor object per exported program, over the same memory). A
#: tensor written in place since (its `_version` moved) is re-laid again; entries go with their source tensor.
_BLOCKS: weakref.WeakKeyDictionary[torch.Tensor, tuple[int, tuple[int, ...], torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` and `b` read the same bytes the same way (`a` alive, so its memory cannot have been reused)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a._version == b._version
    )


def _blocks(tensor: torch.Tensor, layout: tuple[int, ...]) -> torch.Tensor:
    held = _BLOCKS.get(tensor)
    if held is None or held[1] != layout:
        held = next((v for k, v in list(_BLOCKS.items()) if v[1] == layout and _same_memory(k, tensor)), None)
    if held is not None and held[0] == tensor._version and held[1] == layout:
        _BLOCKS[tensor] = held
        return held[2]
    with torch.no_grad():
        out = blocked_rows(tensor.detach(), *layout)
    _BLOCKS[tensor] = (tensor._version, layout, out)
    return out


def _zero_point_share(blocks: Node) -> Node | None:
    """The `sub(partial, mul(view(_to_copy(blocks)), sums))` that takes a group's zero point's share off, as
    `rules/quantized_matmul.py` writes it over `blocks` (a `blocked_rows` of zero points), or the
    `sub(values, view(_to_copy(blocks)))` of its prefill form (the zero points taken off the weight's values), else
    None."""
    node, chain = blocks, (aten._to_copy.default, aten.view.default, aten.mul.Tensor)
    for target in chain:
        if len(node.users) != 1:
            return None
        user = next(iter(node.users))
        if target is aten.mul.Tensor and user.target is aten.sub.Tensor and len(user.args) == 2:
            return user if user.args[1] is node else None
        node = user
        if node.target is not target:
            return None
    share = next(iter(node.users)) if len(node.users) == 1 else None
    if share is None or share.target is not aten.sub.Tensor or share.args[1] is not node or len(share.args) != 2:
        return None
    return share


def _erase_unused(graph: torch.fx.Graph, nodes: list[Node]) -> None:
    """Erase `nodes` and, upward, the calls that only they read (aten ops of the rules: no side effects)."""
    while nodes:
        node = nodes.pop()
        if node.op != "call_function" or node.users:
            continue
        inputs = [n for n in node.all_input_nodes if n.op == "call_function"]
        graph.erase_node(node)
        nodes.extend(inputs)


def _drop_zero_zero_points(program: ExportedProgram, tables: tuple[dict, dict]) -> bool:
    """Take out each grouped product's zero point's share where the zero points are a frozen tensor of zeros
    (torchao's default, symmetric `IntxWeightOnlyConfig`): `partial - 0 * sums` is `partial`, and the kernel
    no longer reads the zero points nor sums x per group. Only here are the values known; a rule sees shapes.
    The zero points' placeholder, now unread, is removed with its input spec (and its tensor, when no other
    spec names it). True when anything was dropped."""
    specs = {s.arg.name: s for s in program.graph_signature.input_specs if hasattr(s.arg, "name")}
    graph, dropped = program.graph, []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not BLOCKED_ROWS or len(node.args) != 2:
            continue
        source = node.args[0]
        spec = specs.get(source.name) if isinstance(source, Node) else None
        if spec is None or spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            continue
        value = tables[spec.kind == InputKind.CONSTANT_TENSOR].get(spec.target)
        if value is None or value.is_floating_point() or value.is_complex() or bool(value.any()):
            continue
        share = _zero_point_share(node)
        if share is None:
            continue
        share.replace_all_uses_with(share.args[0])
        _erase_unused(graph, [share])
        if not source.users:
            dropped.append(spec)
            graph.erase_node(source)
    if dropped:
        kept = [s for s in program.graph_signature.input_specs if s not in dropped]
        program.graph_signature.input_specs[:] = kept
        for spec in dropped:
            if not any(s.target == spec.target for s in kept):
                tables[spec.kind == InputKind.CONSTANT_TENSOR].pop(spec.target, None)
    return bool(dropped)


def fold_blocked_rows(program: ExportedProgram) -> ExportedProgram:
    """`program` (a private copy: `prepare_program`'s) with each `blocked_rows` of a frozen parameter,
    buffer or constant replaced by a state tensor of its own holding the blocks; its graph is edited in
    place, its state dicts are new dicts. A call on anything else is left (the backend's error names it).
    Zero points that are all zero are dropped first, with the share they take off (`_drop_zero_zero_points`)."""
    state, constants = dict(program.state_dict), dict(program.constants)
    folded = _drop_zero_zero_points(program, (state, constants))
    specs = {s.arg.name: s for s in program.graph_signature.input_specs if hasattr(s.arg, "name")}
    input_specs = list(program.graph_signature.input_specs)
    for node in list(program.graph.nodes):
        if node.op != "call_function" or node.target is not BLOCKED_ROWS:
            continue
        source, *layout = node.args
        spec = specs.get(source.name) if isinstance(source, Node) else None
        if spec is None or spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            continue
        if len(source.users) != 1:  # the original is still read elsewhere: keep it, and the layout op
            continue
        table = constants if spec.kind == InputKind.CONSTANT_TENSOR else state
        if spec.target not in table:
            continue
        key = spec.target + SUFFIX
        table[key] = _blocks(table[spec.target], tuple(layout))
        if not any(s.target == spec.target for s in input_specs if s is not spec):
            table.pop(spec.target)
        input_specs[input_specs.index(spec)] = dataclasses.replace(spec, target=key)
        source.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(source)
        program.graph.erase_node(node)
        folded = True
    if folded:
        program.graph_signature.input_specs[:] = input_specs
        program._state_dict, program._constants = state, constants
        program.graph_module.recompile()
    return program


def extra_flags(mlir: str) -> tuple[str, ...]:
    """The compile flags a module needs for the weights it reads re-laid (`FUSION_FLAGS`), else none."""
    return FUSION_FLAGS if SUFFIX + '">' in mlir or SUFFIX + '"' in mlir else ()
