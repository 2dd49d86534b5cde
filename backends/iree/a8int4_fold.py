"""torchao's int8-activation x int4 g32 linear as the rule leaves it (`fx_rewrites::a8int4_grouped_linear`), packed
at build time (issue 33).

`rules/a8int4_decode.py` replaces a decode's `linear(dequantize_affine(qx, [1, K], sx, zx, int8, -128, 127),
dequantize_affine(q, [1, 32], scale, zero, int8, -8, 7))` by `a8int4_grouped_linear(qx, sx, zx, q, scale, zero)`
(qx [rows, K] int8, sx [rows] float32, zx [rows] int32): one op over torchao's frozen weight tensors, since a rule sees
shapes, not values. `fold_a8int4` (run by `importing.prepare_program`) then writes it as `a8int4_matvec(qx, sx, zx,
bytes, groups, ...)`: the int4 values two a byte and each group's scale and sum of values (`a8int4_dispatch`) in
place of torchao's int8 values and scales. Where the zero points are not all 0 (the kernel has none) the op becomes
`linear` of torchao's dequantized x over the float32 dequantized weight, with a warning.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from fx_rewrites.backends.iree.a8int4_dispatch import A8INT4_MATVEC, pack_bytes, pack_groups
from fx_rewrites.backends.iree.int4_fold import _fake, _packed, _state, dequantized
from fx_rewrites.backends.iree.weight_layout import SUFFIX

#: output channels of the kernel's tile (4 x 8 lanes)
TILE = 4
#: channel tiles per workgroup
PER = 8
#: the packed parameters' key suffixes
BYTES, GROUPS = ".a8int4_bytes" + SUFFIX, ".a8int4_groups" + SUFFIX


def dequantized_x(qx: torch.Tensor, sx: torch.Tensor, zx: torch.Tensor) -> torch.Tensor:
    """torchao's `dequantize_affine` of x per row: (qx - zx) * sx in float32."""
    return (qx.to(torch.int32) - zx.to(torch.int32).unsqueeze(1)).to(torch.float32) * sx.unsqueeze(1)


@torch.library.custom_op("fx_rewrites::a8int4_grouped_linear", mutates_args=())
def a8int4_grouped_linear(
    qx: torch.Tensor,
    sx: torch.Tensor,
    zx: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
) -> torch.Tensor:
    """torchao's dequantized x [rows, K] @ its dequantized int4 g32 weight.T, before `fold_a8int4` packs it."""
    return dequantized_x(qx, sx, zx) @ dequantized(q, scale, zero).t()


@a8int4_grouped_linear.register_fake
def _(
    qx: torch.Tensor,
    sx: torch.Tensor,
    zx: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
) -> torch.Tensor:
    return qx.new_empty(qx.shape[0], q.shape[0], dtype=torch.float32)


A8INT4_GROUPED_LINEAR = torch.ops.fx_rewrites.a8int4_grouped_linear.default
aten = torch.ops.aten


def fold_a8int4(program: ExportedProgram) -> ExportedProgram:
    """`program` (a private copy: `prepare_program`'s) with each `a8int4_grouped_linear` over frozen weight tensors
    written as `a8int4_matvec` over the packed bytes and groups (or, where the zero points are not all 0, torchao's
    float32 form: a `linear` of the dequantized x over the dequantized weight)."""
    state, constants = dict(program.state_dict), dict(program.constants)
    tables, graph = (state, constants), program.graph
    specs = list(program.graph_signature.input_specs)
    done = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not A8INT4_GROUPED_LINEAR:
            continue
        qx, sx, zx, q, scale, zero = node.args
        found = [_state(program, tables, part) for part in (q, scale)]
        held = _state(program, tables, zero) if zero is not None else None
        if None in found or (zero is not None and held is None):
            continue  # not frozen: the backend's error names the op
        (qspec, qtable, qv), (sspec, stable, sv) = found
        zv = held[2] if held is not None else None
        n = qv.shape[0]
        if (zv is None or not bool(zv.any())) and int(qv.min()) >= -8 and int(qv.max()) <= 7:
            replaced = [
                (q, qspec, qtable, BYTES, _packed(qv, BYTES, lambda t: pack_bytes(t, TILE))),
                (scale, sspec, stable, GROUPS, _packed(sv, GROUPS, lambda t, qv=qv: pack_groups(qv, t, TILE))),
            ]
            with graph.inserting_before(node):
                new = graph.call_function(A8INT4_MATVEC, (qx, sx, zx, q, scale, n, TILE, PER))
        else:
            warnings.warn(
                f"{qspec.target}: int4 zero points not all 0 (an asymmetric mapping): the int8 x int4 dispatch has "
                "no zero point, so this linear reads a float32 copy of the dequantized weight (8x its bytes)",
                stacklevel=2,
            )
            replaced = [(q, qspec, qtable, ".int4_dequantized" + SUFFIX, dequantized(qv, sv, zv))]
            with graph.inserting_before(node):  # torchao's dequantize of x: (qx - zx) * sx, float32
                zu = graph.call_function(aten.unsqueeze.default, (zx, 1))
                d = graph.call_function(aten.sub.Tensor, (qx, zu))
                su = graph.call_function(aten.unsqueeze.default, (sx, 1))
                x = graph.call_function(aten.mul.Tensor, (d, su))
                new = graph.call_function(aten.linear.default, (x, q))
            for made in (zu, d, su, x):
                made.meta["val"] = _val(made)
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


def _val(node: torch.fx.Node) -> torch.Tensor:
    """The fake value of a node made here, from its arguments' (an aten op of fake tensors)."""
    args = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in node.args]
    with next(a for a in args if isinstance(a, torch.Tensor)).fake_mode:
        return node.target(*args)
