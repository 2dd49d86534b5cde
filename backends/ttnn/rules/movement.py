"""Data movement -> ttnn: view/reshape, permute, transpose, cat, slice, select, expand, casts, clone.

Each op is a `Movement`: a `check` (ttnn can take it, wherever its operand
is) and a `build`. Its lowering rule fires when an operand is already on the
device; `sink_data_movement` moves it there when a device op is its only
reader (`from_torch(view(x))` -> `ttnn.reshape(from_torch(x))`, up the chain
to where the data comes from). On host values read on the host it would only
add a bfloat16 round trip, so it stays.

Sinking also takes integer and bool sources (attention masks built from
`input_ids`, position ids): data movement commutes with the one conversion
to bfloat16 that `from_torch` makes (through float32, as the host cast did),
so the device values are the same.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch
from torch.fx import Node

from fx_rewrites.backends.ttnn.rules import ops, ops_extra
from fx_rewrites.backends.ttnn.rules.boundary import device_value, on_device
from fx_rewrites.backends.ttnn.rules.checks import (
    Bound,
    Build,
    bind,
    lowering,
    problem,
    static,
    static_problem,
    tensors_ok,
)
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import FunctionRule, rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: what a sunk chain may start from: data movement commutes with from_torch's conversion to bfloat16
SINK_SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.int64, torch.int32)


@attrs.frozen
class Movement:
    """A data-movement op's lowering: its rule fires when one of `operands` is on the device."""

    name: str
    ops: tuple[Any, ...]
    operands: tuple[str, ...]
    check: Callable[[Node, Bound], Any]  # (node, bound) -> bound | Miss, wherever the operands are
    build: Build
    doc: str

    def when(self, node: Node) -> Any:
        bound = bind(node)
        args = [a for n in self.operands for a in (bound[n] if isinstance(bound[n], (list, tuple)) else [bound[n]])]
        if not any(on_device(a) for a in args):
            return Miss("no operand is on the device and no device op reads it")
        return self.check(node, bound)

    def rule(self) -> FunctionRule:
        return lowering(self.name, self.ops, self.when, self.doc)(self.build)


def _tensor(*names: str, static: bool = False) -> Callable[[Node, Bound], Any]:
    return tensors_ok(*names, static=static)


# -- builds ------------------------------------------------------------------------------------------------


def build_reshape(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops.reshape, device_value(rw, args["self"]), static(node.meta["val"]))


def build_permute(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops.permute, device_value(rw, args["self"]), list(args["dims"]))


def build_transpose(node: Node, rw: Rewriter, *, args: Bound) -> Any:
    d0, d1 = (args["dim0"], args["dim1"]) if node.target is aten.transpose.int else (0, 1)
    if node.target is aten.t.default and node.meta["val"].dim() < 2:
        return Miss("t() of a 1-D tensor is the identity")
    return rw.call(ops.transpose, device_value(rw, args["self"]), int(d0), int(d1))


def build_numpy_t(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    rank = node.meta["val"].dim()
    return rw.call(ops.permute, device_value(rw, args["self"]), list(range(rank - 1, -1, -1)))


def build_concat(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops.concat, [device_value(rw, t) for t in args["tensors"]], int(args.get("dim", 0)))


def build_identity(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return device_value(rw, args["self"])  # clone / alias / contiguous / a cast: the device value itself


def _slice_bounds(bound: Bound) -> tuple[list[int], list[int], list[int]]:
    shape = static(bound["self"].meta["val"])
    dim = int(bound.get("dim", 0)) % len(shape)
    start, end, step = bound.get("start"), bound.get("end"), int(bound.get("step", 1))
    size = shape[dim]
    start = 0 if start is None else int(start) + (size if int(start) < 0 else 0)
    end = size if end is None else min(int(end) + (size if int(end) < 0 else 0), size)
    starts, ends, steps = [0] * len(shape), list(shape), [1] * len(shape)
    starts[dim], ends[dim], steps[dim] = max(0, min(start, size)), max(0, end), step
    return starts, ends, steps


def build_slice(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops.slice_, device_value(rw, args["self"]), *_slice_bounds(args))


def build_select(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    shape = static(args["self"].meta["val"])
    dim = int(args["dim"]) % len(shape)
    index = int(args["index"]) % shape[dim]
    starts, ends, steps = [0] * len(shape), list(shape), [1] * len(shape)
    starts[dim], ends[dim] = index, index + 1
    one = rw.call(ops.slice_, device_value(rw, args["self"]), starts, ends, steps)
    return rw.call(ops.reshape, one, static(node.meta["val"]))


def build_expand(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops.expand, device_value(rw, args["self"]), static(node.meta["val"]))


def build_stack(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    dim = int(args.get("dim", 0)) % node.meta["val"].dim()
    return rw.call(ops_extra.stack, [device_value(rw, t) for t in args["tensors"]], dim)


def build_repeat(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    return rw.call(ops_extra.repeat, device_value(rw, args["self"]), [int(r) for r in args["repeats"]])


def build_roll(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    rank = node.meta["val"].dim()
    dims = [int(d) % rank for d in args["dims"]]
    return rw.call(ops_extra.roll, device_value(rw, args["self"]), [int(s) for s in args["shifts"]], dims)


# -- checks beyond "a float tensor" ---------------------------------------------------------------------------


def _slice_check(node: Node, bound: Bound) -> Any:
    for arg in ("start", "end"):
        if isinstance(bound.get(arg), Node):
            return Miss(f"{arg} is a graph value; ttnn.slice takes constants")
    return tensors_ok("self", static=True)(node, bound)


def _cast_check(node: Node, bound: Bound) -> Any:
    if not same_place(node, bound):
        return Miss("a copy that changes device, layout or memory format")
    return tensors_ok(masks=("self",))(node, bound)  # bool -> float too: a device mask is already 1.0 / 0.0


def same_place(node: Node, bound: Bound) -> bool:
    """A cast (`_to_copy`, `to`) that keeps its input's device, strided layout and memory format."""
    source = bound.get("self")
    device = bound.get("device")
    here = source.meta["val"].device if isinstance(source, Node) and "val" in source.meta else None
    return (
        bound.get("memory_format") in (None, torch.preserve_format)
        and bound.get("layout") in (None, torch.strided)
        and (device is None or torch.device(device) == here)
    )


def _repeat_check(node: Node, bound: Bound) -> Any:
    if len(bound["repeats"]) != bound["self"].meta["val"].dim():
        return Miss("repeats add leading dimensions; ttnn.repeat is given one per dimension")
    return tensors_ok("self", static=True)(node, bound)


def _roll_check(node: Node, bound: Bound) -> Any:
    dims, shifts = list(bound.get("dims") or []), list(bound["shifts"])
    if not dims or len(dims) != len(shifts) or any(isinstance(v, Node) for v in (*dims, *shifts)):
        return Miss("a roll of the flattened tensor, or runtime shifts")
    return tensors_ok("self", static=True)(node, bound)


def _any(node: Node, bound: Bound) -> Any:
    return bound


RESHAPES = (
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.flatten.using_ints,
)
CASTS = (aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device)
IDENTITIES = (aten.clone.default, aten.alias.default, aten.contiguous.default)

MOVEMENTS = (
    Movement("ttnn_reshape", RESHAPES, ("self",), _tensor("self", static=True), build_reshape, "view/... -> reshape"),
    Movement("ttnn_permute", (aten.permute.default,), ("self",), _tensor("self"), build_permute, "permute"),
    Movement(
        "ttnn_transpose", (aten.transpose.int, aten.t.default), ("self",), _tensor("self"), build_transpose, "transpose"
    ),
    Movement("ttnn_numpy_t", (aten.numpy_T.default,), ("self",), _tensor("self"), build_numpy_t, "x.T -> permute"),
    Movement("ttnn_concat", (aten.cat.default,), ("tensors",), _tensor("tensors"), build_concat, "cat -> concat"),
    Movement("ttnn_slice", (aten.slice.Tensor,), ("self",), _slice_check, build_slice, "slice -> ttnn.slice"),
    Movement(
        "ttnn_select", (aten.select.int,), ("self",), _tensor("self", static=True), build_select, "select -> slice"
    ),
    Movement("ttnn_expand", (aten.expand.default,), ("self",), _tensor("self", static=True), build_expand, "expand"),
    Movement("ttnn_cast", CASTS, ("self",), _cast_check, build_identity, "a cast of a device value: read back"),
    Movement("ttnn_clone", IDENTITIES, ("self",), _any, build_identity, "clone / alias / contiguous: the value"),
    Movement("ttnn_stack", (aten.stack.default,), ("tensors",), _tensor("tensors"), build_stack, "stack"),
    Movement("ttnn_repeat", (aten.repeat.default,), ("self",), _repeat_check, build_repeat, "repeat"),
    Movement("ttnn_roll", (aten.roll.default,), ("self",), _roll_check, build_roll, "roll"),
)
#: op -> its Movement (what sink_data_movement moves)
BY_OP: dict[Any, Movement] = {op: m for m in MOVEMENTS for op in m.ops}


# -- split ---------------------------------------------------------------------------------------------------


def _split_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if not on_device(args["self"]):
        return Miss("no operand is on the device and no device op reads it")
    if not node.users or any(u.target is not operator.getitem for u in node.users):
        return Miss("the pieces are not each read through getitem")
    why = problem(args["self"], "self") or static_problem(node)
    return Miss(why) if why else args


@rule(roots=(aten.split.Tensor, aten.split_with_sizes.default), when=_split_when, tags=("ttnn",))
def lower_split(node: Node, rw: Rewriter, *, args: Bound) -> Any:
    """split / split_with_sizes of a device value -> one ttnn.slice per piece."""
    shape = static(args["self"].meta["val"])
    dim = int(args.get("dim", 0)) % len(shape)
    size = args.get("split_size", args.get("split_sizes"))
    sizes = list(size) if isinstance(size, (list, tuple)) else [int(size)] * -(-shape[dim] // int(size))
    x, start, pieces = device_value(rw, args["self"]), 0, []
    for piece, val in zip(sizes, node.meta["val"]):
        starts, ends = [0] * len(shape), list(shape)
        starts[dim], ends[dim] = start, min(start + int(piece), shape[dim])
        pieces.append(rw.call(ops.to_torch, rw.call(ops.slice_, x, starts, ends, [1] * len(shape)), val.dtype))
        start += int(piece)
    rw.replace(node, pieces)


# -- constant padding ---------------------------------------------------------------------------------------


def _pad_when(node: Node, *, args: Mapping[str, Any]) -> Any:
    if args.get("mode", "constant") != "constant":
        return Miss(f"mode={args['mode']!r}; ttnn.pad pads with a constant")
    if any(isinstance(p, Node) or int(p) < 0 for p in args["pad"]):
        return Miss("negative or runtime padding")
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() == 4 and len(args["pad"]) > 4:
        return Miss("padding a rank-4 tensor in 3 or more dimensions: ttnn.pad is used on rank <= 3 here")
    return tensors_ok("self", static=True)(node, args)


@lowering(
    "ttnn_pad",
    [aten.pad.default, aten.constant_pad_nd.default],
    _pad_when,
    "constant F.pad -> ttnn.pad(x, padding=[(before, after) per dim], value=).",
)
def lower_pad(node: Node, rw: Rewriter, *, args: Bound) -> Node:
    value, pad = args.get("value"), [int(p) for p in args["pad"]]
    return pad_tiles(rw, device_value(rw, args["self"]), pad, float(value or 0.0))


def pad_tiles(rw: Rewriter, x: Node, pad: list[int], value: float) -> Node:
    """ttnn.pad of a TILE device value; `pad` in torch's order (last dimension first, before and after).

    Front padding goes through row-major: "on device tile padding does not support front padding" (ttnn.pad).
    A rank-4 value is padded as rank 3 (its two leading dimensions merged): ttnn 0.81.1's pad of a rank-4
    tensor grows only its padded shape, not its logical shape (tools/ttnn_check replays it on the host)."""
    shape = [int(s) for s in x.meta["val"].shape]
    if len(shape) == 4:
        merged = rw.call(ops.reshape, x, [shape[0] * shape[1], *shape[2:]])
        out = [s + pad[2 * i] + pad[2 * i + 1] if i < len(pad) // 2 else s for i, s in enumerate(reversed(shape))]
        return rw.call(ops.reshape, pad_tiles(rw, merged, pad, value), list(reversed(out)))
    if not any(pad[0::2]):
        return rw.call(ops.pad, x, pad, value)
    y = rw.call(ops.pad, rw.call(ops.to_layout, x, ops.ROW_MAJOR), pad, value)
    return rw.call(ops.to_layout, y, ops.TILE)


# -- moving data movement onto the device when a device op reads it ------------------------------------------


def _sinkable(source: Node, bound: Bound) -> Any:
    """The movement's own check, with integer and bool sources allowed (see the module's docstring)."""
    movement = BY_OP[source.target]
    if source.target in CASTS:
        out = source.meta["val"]
        if not same_place(source, bound):
            return Miss("a copy that changes device, layout or memory format")
        if not out.is_floating_point():
            return Miss(f"a cast to {str(out.dtype).removeprefix('torch.')}; the device holds bfloat16")
        why = problem(bound["self"], "self", SINK_SOURCE_DTYPES, scalar_ok=True)
        why = why or problem(source, "the result", scalar_ok=True)
        return Miss(why) if why else bound
    names = list(movement.operands)
    scalar_ok = source.target in IDENTITIES  # a 0-d value goes to the device as shape [1], like a 0-d operand
    for name in names:
        values = bound[name] if isinstance(bound[name], (list, tuple)) else [bound[name]]
        for v in values:
            why = problem(v, name, SINK_SOURCE_DTYPES, scalar_ok=scalar_ok)
            if why:
                return Miss(why)
    why = problem(source, "the result", SINK_SOURCE_DTYPES, scalar_ok=scalar_ok) or (
        static_problem(source) if source.target in _STATIC else None
    )
    if why:
        return Miss(why)
    return movement.check(source, bound) if _all_float(source, names, bound) else _extra_checks(source, bound)


_STATIC = frozenset(
    (*RESHAPES, aten.slice.Tensor, aten.select.int, aten.expand.default, aten.repeat.default, aten.roll.default)
)


def _all_float(source: Node, names: Iterable[str], bound: Bound) -> bool:
    vals = [source.meta["val"]] + [
        v.meta["val"] for n in names for v in (bound[n] if isinstance(bound[n], (list, tuple)) else [bound[n]])
    ]
    return all(v.is_floating_point() for v in vals)


def _extra_checks(source: Node, bound: Bound) -> Any:
    """What a movement's check asks beyond float dtypes (constant slice bounds)."""
    if source.target is aten.slice.Tensor:
        for arg in ("start", "end"):
            if isinstance(bound.get(arg), Node):
                return Miss(f"{arg} is a graph value; ttnn.slice takes constants")
    return bound


def _sink_when(node: Node) -> Any:
    source = node.args[0]
    if not isinstance(source, Node) or source.target not in BY_OP:
        return Miss("its input is not a data-movement op (view, permute, slice, cat, cast, ...)")
    if tuple(node.args[1:]) != ("bfloat16", ops.TILE, True):
        return Miss("not a bfloat16 tile tensor on the device")
    if len(source.users) != 1:
        return Miss(f"{source.name} is read on the host too")
    ok = _sinkable(source, bind(source))
    return Miss(f"{source.name}: {ok.reason}") if isinstance(ok, Miss) else (source, ok)


@rule(roots=(ops.from_torch,), when=_sink_when, tags=("ttnn", "boundary"))
def sink_data_movement(node: Node, rw: Rewriter, *, found: tuple[Node, Bound]) -> Any:
    """from_torch(view(x)) -> ttnn.reshape(from_torch(x)), likewise permute, transpose, slice, cat and casts:
    data movement only a device op reads moves to the device, up the chain to where the data comes from."""
    source, bound = found
    out = BY_OP[source.target].build(source, rw, args=bound)
    if isinstance(out, Miss):
        return out
    rw.replace(node, out)
    return None


RULES = RuleSet([*(m.rule() for m in MOVEMENTS), lower_split, lower_pad, sink_data_movement], name="ttnn_movement")
