"""Guards on index lists (`Tensor?[]`: aten.index, index_put, _unsafe_index, ...) for IREE 3.13.

Part of `guards.RULES`; docs/iree-3.13-findings.md lists what was measured.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten


# -- int32 index tensors ------------------------------------------------------------------------


def _index_list_ops() -> dict[Any, tuple[str, ...]]:
    """Every functional aten op that takes a list of optional index tensors (`Tensor?[]`: aten.index,
    index_put, _unsafe_index, ...), read from torch's schemas -> the names of those arguments."""
    found = {}
    for op_schema in torch._C._jit_get_all_schemas():
        if not op_schema.name.startswith("aten::") or op_schema.is_mutable:
            continue
        names = tuple(a.name for a in op_schema.arguments if str(a.type) == "List[Optional[Tensor]]")
        packet = getattr(aten, op_schema.name.removeprefix("aten::"), None)
        overload = op_schema.overload_name or "default"
        if names and packet is not None and hasattr(packet, overload):
            found[getattr(packet, overload)] = names
    return found


_INDEX_LISTS = _index_list_ops()


def _int32_indices(node: Node) -> dict[str, list[Any]] | Miss:
    """The index lists of `node` (argument name -> list) when one of their tensors is int32."""
    named = schema.arguments(node)
    lists = {name: list(named[name]) for name in _INDEX_LISTS[node.target]}
    for indices in lists.values():
        for index in indices:
            val = fake_value(index)
            if isinstance(val, torch.Tensor) and val.dtype == torch.int32:
                return lists
    return Miss("no int32 index tensor")


@rule(
    roots=tuple(_INDEX_LISTS),
    when=_int32_indices,
    priority=20,  # before multi_index_to_flat_gather_for_iree: its linear index is then computed in int64
    tags={"iree", "guard"},
    doc=(
        "An int32 index tensor of aten.index / index_put / _unsafe_index (every op whose schema takes a "
        "`Tensor?[]` index list) is cast to int64; the values, and so the result, are the same. IREE 3.13 "
        "fails on any int32 index of aten.index, static sizes or not (torchvision's roi_align through "
        "torch.compile: y.int() / x.int() next to an int64 arange): \"'arith.cmpi' op requires all operands to "
        'have the same type"; index_put with int32 and int64 indices: "operand types should have the same '
        'type as the list contained type".'
    ),
)
def int32_index_to_int64_for_iree(
    node: Node, rw: Rewriter, *, args: Mapping[str, Any], found: dict[str, list[Any]]
) -> Any:
    named = dict(args)
    for name, indices in found.items():
        named[name] = [
            rw.call(aten._to_copy.default, index, dtype=torch.int64)
            if isinstance(index, Node) and index.meta["val"].dtype == torch.int32
            else index
            for index in indices
        ]
    call_args, kwargs = schema.unbind(node.target, named, explicit=False)
    rw.replace(node, rw.call(node.target, *call_args, **kwargs))


# -- negative indices of a put -----------------------------------------------------------------

#: the put ops among them: those whose schema writes `values` at the indices
_PUTS = tuple(op for op in _INDEX_LISTS if "values" in schema.arg_names(op))


def _is_wrapped(index: Node) -> bool:
    """`index` is where(i < 0, i + size, i), as `negative_put_index_for_iree` writes it."""
    if index.op != "call_function" or index.target is not aten.where.self:
        return False
    condition = index.args[0]
    return isinstance(condition, Node) and condition.target is aten.lt.Scalar and condition.args[1] == 0


def _unwrapped_put_indices(node: Node) -> list[int] | Miss:
    """Positions (= the dims of `self` they index) of the integer index tensors not yet wrapped."""
    named = schema.arguments(node)
    indices = list(named["indices"])
    vals = [fake_value(i) for i in indices]
    if any(i is not None and not isinstance(v, torch.Tensor) for i, v in zip(indices, vals)):
        return Miss("an index without a tensor value")
    if any(v is not None and v.dtype in (torch.bool, torch.uint8) for v in vals):
        return Miss("a mask index: the index list no longer lines up with self's dims")
    found = [k for k, (i, v) in enumerate(zip(indices, vals)) if v is not None and not _is_wrapped(i)]
    return found or Miss("no integer index tensor left to wrap")


@rule(
    roots=_PUTS,
    when=_unwrapped_put_indices,
    priority=10,  # after int32_index_to_int64_for_iree
    tags={"iree", "guard"},
    doc=(
        "Each integer index tensor of index_put / _unsafe_index_put / _index_put_impl (every op whose schema "
        "takes a `Tensor?[]` index list and `values`) becomes where(i < 0, i + size, i), the size of the dim "
        "it indexes (a sym_size node when symbolic). IREE 3.13 writes a negative index somewhere other than "
        "torch does (`x.index_put((rows, cols), v)` with rows [0, -1, 2]: wrong numbers, no error, static or "
        "Dim sizes, accumulate or not); a gather (aten.index) wraps them right."
    ),
)
def negative_put_index_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any], found: list[int]) -> Any:
    named = dict(args)
    x, indices = named["self"], list(named["indices"])
    for k in found:
        size = x.meta["val"].shape[k]
        if not isinstance(size, int):
            size = rw.call(aten.sym_size.int, x, k)
        index = indices[k]
        negative = rw.call(aten.lt.Scalar, index, 0)
        indices[k] = rw.call(aten.where.self, negative, rw.call(aten.add.Tensor, index, size), index)
    named["indices"] = indices
    call_args, kwargs = schema.unbind(node.target, named, explicit=False)
    rw.replace(node, rw.call(node.target, *call_args, **kwargs))
