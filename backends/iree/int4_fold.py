"""torchao's int4 g32 linear as the rule leaves it (`fx_rewrites::int4_grouped_linear`), packed at build time.

`rules/int4_decode.py` replaces a decode's `linear(x, dequantize_affine(q, [1, 32], scale, zero, int8, -8, 7))` by
`int4_grouped_linear(x, q, scale, zero)`: one op over the frozen tensors as torchao stores them (eager: torchao's
dequantize, float32, and a matmul), since a rule sees shapes, not values. `fold_int4` (run by
`importing.prepare_program`, where the values are known) then writes it as `int4_matvec(x, words, scales, ...)`,
the words (`int4_dispatch.pack_words`: eight values an int32) and scales a parameter each, in place of torchao's
int8 values and scales: the module holds half int8's bytes, and no packing runs per call. The words are only
packed where the zero points are all 0 (torchao's symmetric default: the kernel has no zero point); otherwise the
op becomes `linear` over the dequantized float32 weight (a parameter: correct, 8x the bytes), with a warning.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node

from fx_rewrites.backends.iree.int4_dispatch import GROUP, INT4_MATVEC, pack_scales, pack_words
from fx_rewrites.backends.iree.weight_layout import SUFFIX, _same_memory

#: output channels of the kernel's tile (4 x 8 lanes: AVX2's ymm; 8 x 8 spills, section 49)
TILE = 4
#: channel tiles per workgroup (section 49's measured split)
PER = 8
#: the packed parameters' key suffixes (ending in `weight_layout.SUFFIX`: the archive is written as it is)
WORDS, SCALES = ".int4_words" + SUFFIX, ".int4_scales" + SUFFIX
_STATE = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def dequantized(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """torchao's `dequantize_affine(q, [1, 32], scale, zero)` to float32: (q - zero) * scale per group."""
    n, k = q.shape
    values = q.view(n, k // GROUP, GROUP).to(torch.int32)
    if zero is not None:
        values = values - zero.to(torch.int32).unsqueeze(-1)
    return (values.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)).view(n, k)


@torch.library.custom_op("fx_rewrites::int4_grouped_linear", mutates_args=())
def int4_grouped_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, K] @ dequantized(q, scale, zero).T: torchao's int4 g32 linear, before `fold_int4` packs it."""
    return x @ dequantized(q, scale, zero).t()


@int4_grouped_linear.register_fake
def _(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0])


INT4_GROUPED_LINEAR = torch.ops.fx_rewrites.int4_grouped_linear.default


#: (source tensor, what) -> (its version, the packed tensor): one packed object per weight for every function of a
#: module (compile_lm's prefill and decode share parameters by identity, as `weight_layout._BLOCKS` does)
_PACKED: weakref.WeakKeyDictionary[torch.Tensor, dict[str, tuple[int, torch.Tensor]]] = weakref.WeakKeyDictionary()


def _packed(tensor: torch.Tensor, what: str, pack: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    held = _PACKED.get(tensor)
    if held is None:  # torchao's flattened tensors are new objects per exported program, over the same memory
        held = next((v for k, v in list(_PACKED.items()) if _same_memory(k, tensor)), {})
        _PACKED[tensor] = held
    if what not in held or held[what][0] != tensor._version:
        with torch.no_grad():
            held[what] = (tensor._version, pack(tensor.detach()))
    return held[what][1]


def _state(program: ExportedProgram, tables: tuple[dict, dict], node: object) -> tuple | None:
    """(spec, table, value) of a placeholder that is a frozen tensor of `program` read once, else None."""
    if not isinstance(node, Node) or node.op != "placeholder" or len(node.users) != 1:
        return None
    spec = next((s for s in program.graph_signature.input_specs if getattr(s.arg, "name", None) == node.name), None)
    if spec is None or spec.kind not in _STATE:
        return None
    table = tables[spec.kind == InputKind.CONSTANT_TENSOR]
    return (spec, table, table[spec.target]) if spec.target in table else None


def _fake(like: Node, value: torch.Tensor) -> torch.Tensor:
    return like.meta["val"].fake_mode.from_tensor(value, static_shapes=True)


def fold_int4(program: ExportedProgram) -> ExportedProgram:
    """`program` (a private copy: `prepare_program`'s) with each `int4_grouped_linear` over frozen tensors written
    as `int4_matvec` over packed words and scales (or, where the zero points are not all 0, a float32 `linear`);
    the placeholders become the packed parameters (their keys end in `WORDS`, `SCALES`), the zero points' go."""
    state, constants = dict(program.state_dict), dict(program.constants)
    tables, graph = (state, constants), program.graph
    specs = list(program.graph_signature.input_specs)
    done = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not INT4_GROUPED_LINEAR:
            continue
        x, q, scale, zero = node.args
        found = [_state(program, tables, part) for part in (q, scale)]
        held = _state(program, tables, zero) if zero is not None else None
        if None in found or (zero is not None and held is None):
            continue  # not frozen: the backend's error names the op
        (qspec, qtable, qv), (sspec, stable, sv) = found
        zv = held[2] if held is not None else None
        symmetric = zv is None or not bool(zv.any())
        n = qv.shape[0]
        if symmetric and int(qv.min()) >= -8 and int(qv.max()) <= 7:
            replaced = [
                (q, qspec, qtable, WORDS, _packed(qv, WORDS, lambda t: pack_words(t, TILE))),
                (scale, sspec, stable, SCALES, _packed(sv, SCALES, lambda t: pack_scales(t, TILE))),
            ]
            with graph.inserting_before(node):
                new = graph.call_function(INT4_MATVEC, (x, q, scale, n, TILE, PER))
        else:
            warnings.warn(
                f"{qspec.target}: int4 zero points not all 0 (an asymmetric mapping): the int4 dispatch has no "
                "zero point, so this linear reads a float32 copy of the dequantized weight (8x its bytes)",
                stacklevel=2,
            )
            replaced = [(q, qspec, qtable, ".int4_dequantized" + SUFFIX, dequantized(qv, sv, zv))]
            with graph.inserting_before(node):
                new = graph.call_function(torch.ops.aten.linear.default, (x, q))
        new.meta = {**node.meta, "val": node.meta["val"]}
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for placeholder, spec, table, suffix, value in replaced:
            key = spec.target + suffix
            table[key] = value
            if not any(s.target == spec.target for s in specs if s is not spec):
                table.pop(spec.target)
            specs[specs.index(spec)] = dataclasses.replace(spec, target=key)
            placeholder.meta["val"] = _fake(placeholder, value)
        for part in (scale, zero) if len(replaced) == 1 else (zero,):
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
