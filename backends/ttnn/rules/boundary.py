"""Where device values meet host values: `from_torch`, `to_layout`, `to_torch`.

Every lowering replaces an aten node by `to_torch(ttnn_op(from_torch(x), ...))`,
so host users keep a host tensor of the node's own dtype. When the operand is
already a device value behind a `to_torch`, `device_value` takes that value
instead (converting its layout if needed), and `fuse_round_trip` removes the
`from_torch(to_torch(d))` pairs left when a producer was lowered after its
consumer. What remains is a conversion exactly where a host value enters the
device or leaves it.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from fx_rewrites.backends.ttnn.rules import ops
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule

#: ops whose result keeps its input's layout
_LAYOUT_PRESERVING = frozenset({ops.reshape, ops.permute, ops.transpose, ops.pad, ops.expand, ops.slice_})


def layout_of(node: Node) -> str:
    """The ttnn layout of a device value (TILE unless made otherwise)."""
    if node.target is ops.from_torch:
        return node.args[2]
    if node.target is ops.to_layout:
        return node.args[1]
    if node.target in ops.ROW_MAJOR_RESULTS:
        return ops.ROW_MAJOR  # ttnn.max_pool2d's and avg_pool2d's output_layout default
    if node.target in _LAYOUT_PRESERVING and isinstance(node.args[0], Node):
        return layout_of(node.args[0])
    return ops.TILE


def device_dtype(node: Node) -> str:
    """The ttnn dtype name of a device value."""
    if node.target is ops.from_torch:
        return node.args[1]
    val = node.meta.get("val")
    return "uint32" if isinstance(val, torch.Tensor) and not val.is_floating_point() else "bfloat16"


def on_device(arg: object) -> bool:
    """`arg` is a host tensor read back from a device value (`to_torch(d)`)."""
    return isinstance(arg, Node) and arg.target is ops.to_torch


def device_value(
    rw: Rewriter, arg: Node, *, dtype: str = "bfloat16", layout: str = ops.TILE, to_device: bool = True
) -> Node:
    """`arg` as a device value of `dtype` in `layout`.

    Reuses the device value behind a `to_torch`; otherwise inserts
    `from_torch` (with `to_device=False` the ttnn tensor stays on the host, as
    conv2d weights do)."""
    if to_device and on_device(arg):
        source = arg.args[0]
        if device_dtype(source) == dtype:
            return source if layout_of(source) == layout else rw.call(ops.to_layout, source, layout)
    for user in arg.users:  # one conversion per host value, shared by its device readers
        if user.target is ops.from_torch and tuple(user.args[1:]) == (dtype, layout, to_device) and user < rw.root:
            return user
    return rw.call(ops.from_torch, arg, dtype, layout, to_device)


def to_host(rw: Rewriter, value: Node, like: Node) -> Node:
    """`value` read back to a host tensor of `like`'s dtype."""
    return rw.call(ops.to_torch, value, like.meta["val"].dtype)


def _round_trip(node: Node) -> object:
    source = node.args[0]
    if not on_device(source):
        return Miss("its input is a host tensor, not read back from a device value")
    if not node.args[3]:
        return Miss("the ttnn tensor stays on the host (conv2d weights)")
    if device_dtype(source.args[0]) != node.args[1]:
        return Miss(f"the device value is {device_dtype(source.args[0])}, {node.args[1]} is asked for")
    return True


@rule(roots=(ops.from_torch,), when=_round_trip, tags=("ttnn", "boundary"))
def fuse_round_trip(node: Node, rw: Rewriter) -> None:
    """from_torch(to_torch(d)) -> d (or to_layout(d)): a device value read back to the host only
    to be sent to the device again stays on the device."""
    source = node.args[0].args[0]
    layout = node.args[2]
    rw.replace(node, source if layout_of(source) == layout else rw.call(ops.to_layout, source, layout))
