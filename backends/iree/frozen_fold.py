"""Build-time folds of an op over frozen weight tensors: the bookkeeping `int4_fold` and `a8int4_fold` share.

A rule sees shapes, not values, so it leaves one op over torchao's frozen tensors (int values, scales, zero points);
`preparing.prepare_program` then calls a fold, which rewrites each such op with the values known. `fold_frozen` finds
the ops whose weight tensors are frozen placeholders read once, hands each to the fold's `rewrite`, and keeps the
program's signature true: a replaced placeholder's state key gains the new tensor's suffix (the old key goes where no
other input reads it), and a scale or zero point the new op no longer reads leaves the graph and the signature.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec
from torch.fx import Graph, Node

from fx_rewrites.backends.iree.weight_layout import _same_memory

_STATE = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)

#: (source tensor, what) -> (its version, the packed tensor): one packed object per weight for every function of a
#: module (compile_lm's prefill and decode share parameters by identity, as `weight_layout._BLOCKS` does)
_PACKED: weakref.WeakKeyDictionary[torch.Tensor, dict[str, tuple[int, torch.Tensor]]] = weakref.WeakKeyDictionary()


def packed(tensor: torch.Tensor, what: str, pack: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`pack(tensor)`, made once per tensor (and `what`) while the tensor is unchanged."""
    held = _PACKED.get(tensor)
    if held is None:  # torchao's flattened tensors are new objects per exported program, over the same memory
        held = next((v for k, v in list(_PACKED.items()) if _same_memory(k, tensor)), {})
        _PACKED[tensor] = held
    if what not in held or held[what][0] != tensor._version:
        with torch.no_grad():
            held[what] = (tensor._version, pack(tensor.detach()))
    return held[what][1]


@dataclasses.dataclass(frozen=True)
class FrozenWeight:
    """An op's quantized weight: the placeholders of its int values, scales and zero points, and their values."""

    q: Node
    scale: Node
    zero: Node | None
    qv: torch.Tensor
    sv: torch.Tensor
    zv: torch.Tensor | None
    #: the int values' state key (a warning names the weight by it)
    name: str

    def symmetric_int4(self) -> bool:
        """Zero points all 0 (or none) and values in int4's range: what the int4 kernels take."""
        zero = self.zv is None or not bool(self.zv.any())
        return zero and int(self.qv.min()) >= -8 and int(self.qv.max()) <= 7


#: (placeholder, key suffix, new value): a weight placeholder that now holds another tensor
Replaced = tuple[Node, str, torch.Tensor]
#: `rewrite(graph, node, weight)`, called with the graph inserting before `node`: the node that replaces it (its
#: value `node`'s) and the placeholders it re-filled
Rewrite = Callable[[Graph, Node, FrozenWeight], tuple[Node, Sequence[Replaced]]]


def _state(program: ExportedProgram, tables: tuple[dict, dict], node: object) -> tuple | None:
    """(spec, table, value) of a placeholder that is a frozen tensor of `program` read once, else None."""
    if not isinstance(node, Node) or node.op != "placeholder" or len(node.users) != 1:
        return None
    spec = next((s for s in program.graph_signature.input_specs if getattr(s.arg, "name", None) == node.name), None)
    if spec is None or spec.kind not in _STATE:
        return None
    table = tables[spec.kind == InputKind.CONSTANT_TENSOR]
    return (spec, table, table[spec.target]) if spec.target in table else None


def fake_of(like: Node, value: torch.Tensor) -> torch.Tensor:
    """A fake tensor of `value` in `like`'s fake mode (a placeholder's new `val`)."""
    return like.meta["val"].fake_mode.from_tensor(value, static_shapes=True)


def fold_frozen(program: ExportedProgram, target: object, weight: slice, rewrite: Rewrite) -> ExportedProgram:
    """`program` (a private copy: `prepare_program`'s) with each call of `target` whose arguments at `weight` (int
    values, scales, zero points or None) are frozen tensors read once replaced by `rewrite`'s node; an op over
    tensors that are not frozen stays (the backend's error names it)."""
    state, constants = dict(program.state_dict), dict(program.constants)
    tables, graph = (state, constants), program.graph
    specs: list[InputSpec] = list(program.graph_signature.input_specs)
    done = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not target:
            continue
        q, scale, zero = node.args[weight]
        held = {part: _state(program, tables, part) for part in (q, scale, zero) if part is not None}
        if None in held.values():
            continue
        zv = held[zero][2] if zero is not None else None
        frozen = FrozenWeight(q, scale, zero, held[q][2], held[scale][2], zv, held[q][0].target)
        with graph.inserting_before(node):
            new, replaced = rewrite(graph, node, frozen)
        new.meta = {**node.meta, "val": node.meta["val"]}
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for placeholder, suffix, value in replaced:
            spec, table, _ = held[placeholder]
            key = spec.target + suffix
            table[key] = value
            if not any(s.target == spec.target for s in specs if s is not spec):
                table.pop(spec.target)
            specs[specs.index(spec)] = dataclasses.replace(spec, target=key)
            placeholder.meta["val"] = fake_of(placeholder, value)
        for part in (scale, zero):  # read by the new op no more
            if part is None or part.users:
                continue
            spec = next(s for s in specs if getattr(s.arg, "name", None) == part.name)
            specs.remove(spec)
            graph.erase_node(part)
            if not any(s.target == spec.target for s in specs):
                tables[spec.kind == InputKind.CONSTANT_TENSOR].pop(spec.target, None)
        done = True
    if done:
        program.graph_signature.input_specs[:] = specs
        program._state_dict, program._constants = state, constants
        program.graph_module.recompile()
    return program
