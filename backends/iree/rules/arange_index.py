"""A gather by an `arange` over a whole dimension, written as that dimension itself (a view).

transformers' mask builder (`sdpa_mask`'s padding function) reads `attention_mask[batch_idx, kv_idx]` with
`kv_idx = arange(keys)` and `batch_idx = arange(batch)`, each unsqueezed to its axis of the [batch, heads, rows,
keys] mask. IREE 3.13 fuses that `aten.index` into the mask's dispatch as a `tensor.extract` at a computed index
inside the loop: it does not see that the index is the loop's own, and the loop is not vectorized. A static-cache
prefill (`compile_lm`) builds that mask over every cached key for every row: on a real AVX2 core 462 ms of the small
Qwen3-MoE's 4.8 s prefill, the mask alone 485 ms gathered against 7.1 ms read as the dimension
(docs/iree-3.13-findings.md, "A gather by an `arange` stays a gather"; benchmarks/causal_mask.py).

`index_by_arange_as_view` finds the index tensors that are `arange(0, n, 1)` over the whole size n of the dimension
they index (static or symbolic, through unsqueezes, full slices, an added 0, expands and views that only add ones),
and varying along one axis of the indices' broadcast shape no other index varies along. Entry j of such an index is
j, so the gather along that dimension is the dimension itself: it is moved to that axis (a permute), and only the
other index tensors, if any, are still gathered. The values are the same elements, no arithmetic.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten

_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


@attrs.frozen
class ArangeIndices:
    """`x[indices]` where the index at each position of `axes` (position -> its axis in the indices' broadcast
    shape, of rank `rank`) is an arange over x's whole dimension there."""

    x: Node
    indices: tuple[Any, ...]
    axes: dict[int, int]
    rank: int


def _is(value: Any, want: int) -> bool:
    """`value` (an int, a SymInt, or a node holding one) is statically `want`."""
    if isinstance(value, Node):
        value = value.meta.get("val")
    return isinstance(value, (int, torch.SymInt)) and statically_known_true(value == want)


def _one(size: Any) -> bool:
    """A static size of 1 (a Dim-sized one its range makes 1 is not squeezed: IREE 3.13 cannot collapse a `?` dim)."""
    return isinstance(size, int) and size == 1


def _ones_but_one(shape: Any) -> int | None:
    """The one axis of `shape` not statically 1 (the last axis where every one is 1), None where two are not."""
    axes = [i for i, s in enumerate(shape) if not _is(s, 1)]
    if len(axes) > 1 or not len(shape):
        return None
    return axes[0] if axes else len(shape) - 1


def _through(node: Node) -> tuple[Node, Any] | Miss:
    """(the input, a map from the input's arange axis to `node`'s) of a value-keeping view of one tensor."""
    target, val = node.target, fake_value(node)
    source = node.args[0] if node.args else None
    if not isinstance(source, Node) or not isinstance(fake_value(source), torch.Tensor):
        return Miss(f"{node.name}: not a function of one tensor")
    rank_in = fake_value(source).dim()
    if target is aten.unsqueeze.default:
        d = node.args[1] % val.dim()
        return source, lambda a: a if a < d else a + 1
    if target is aten.slice.Tensor:
        named = schema.arguments(node)
        dim, size = named.get("dim", 0) % rank_in, fake_value(source).shape[named.get("dim", 0) % rank_in]
        start, end, step = named.get("start"), named.get("end"), named.get("step", 1)
        end = end.meta.get("val") if isinstance(end, Node) else end
        full_end = end is None or (isinstance(end, (int, torch.SymInt)) and statically_known_true(end >= size))
        if start not in (None, 0) or not _is(step, 1) or not full_end:
            return Miss(f"{node.name}: a slice of part of dim {dim}")
        return source, lambda a: a
    if target in (aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar):
        if len(node.args) != 2 or node.kwargs or not (isinstance(node.args[1], int) and node.args[1] == 0):
            return Miss(f"{node.name}: adds something other than the constant 0")
        return source, lambda a: a
    if target in (aten.alias.default, aten.clone.default, aten.lift_fresh_copy.default):
        return source, lambda a: a
    if target in (aten._to_copy.default, aten.to.dtype) and val.dtype == torch.int64:  # the int32 index guard's cast
        if fake_value(source).dtype not in (torch.int32, torch.int64):
            return Miss(f"{node.name}: a cast of {fake_value(source).dtype}")
        return source, lambda a: a
    if target is aten.expand.default:
        shift = val.dim() - rank_in
        return source, lambda a: a + shift
    if target in _VIEWS:
        axis = _ones_but_one(val.shape)
        if axis is None or _ones_but_one(fake_value(source).shape) is None:
            return Miss(f"{node.name}: a view that moves more than one axis of size other than 1")
        return source, lambda a: axis
    return Miss(f"{node.name}: {schema.op_name(target) if callable(target) else target} is not a view of an arange")


def _arange_axis(index: Node, size: Any) -> int | Miss:
    """The axis of `index` along which it is `arange(0, size, 1)` (constant along the others)."""
    maps, node = [], index
    while node.target not in _ARANGES:
        if node.op != "call_function":
            return Miss(f"{index.name}: not computed from an arange")
        step = _through(node)
        if isinstance(step, Miss):
            return step
        node, axis_map = step
        maps.append(axis_map)
    named = schema.arguments(node)
    start, step = named.get("start", 0), named.get("step", 1)
    length = fake_value(node).shape[0]
    if not _is(start, 0):
        return Miss(f"{index.name}: an arange from {start}, not 0")
    if not _is(step, 1):
        return Miss(f"{index.name}: an arange by step {step}, not 1")
    if not statically_known_true(length == size):
        return Miss(f"{index.name}: an arange of {length}, not the whole dim of {size}")
    axis = 0
    for axis_map in reversed(maps):
        axis = axis_map(axis)
    return axis


def _arange_indices(node: Node) -> ArangeIndices | Miss:
    named = schema.arguments(node)
    x, indices = named["self"], tuple(named["indices"])
    vals = [fake_value(i) if i is not None else None for i in indices]
    if any(i is not None and not isinstance(v, torch.Tensor) for i, v in zip(indices, vals)):
        return Miss("an index without a tensor value")
    if any(v is not None and (v.dtype.is_floating_point or v.dtype in (torch.bool, torch.uint8)) for v in vals):
        return Miss("a mask (bool or uint8) index")
    rank = max(v.dim() for v in vals if v is not None)
    axes, misses = {}, []
    for k, (index, v) in enumerate(zip(indices, vals)):
        if v is None:
            continue
        axis = _arange_axis(index, fake_value(x).shape[k])
        if isinstance(axis, Miss):
            misses.append(f"position {k}: {axis.reason}")
        else:
            axes[k] = axis + rank - v.dim()
    if not axes:
        return Miss(f"no index is an arange over its whole dim ({'; '.join(misses)})")
    for k, q in list(axes.items()):  # another index varying along the same axis: a diagonal, not a broadcast
        for other, v in zip(range(len(indices)), vals):
            at = q - (rank - v.dim()) if v is not None else -1
            if other != k and v is not None and at >= 0 and not _one(v.shape[at]):
                return Miss(f"position {other}'s index varies along axis {q}, the arange's of position {k}")
    return ArangeIndices(x, indices, axes, rank)


def _permute(rw: Rewriter, x: Node, order: list[int]) -> Node:
    return x if order == sorted(order) else rw.call(aten.permute.default, x, order)


@rule(
    roots=(aten.index.Tensor,),
    when=_arange_indices,
    tags={"iree", "performance"},
    doc=(
        "x[..., i, ...] where the index tensor i is arange(0, n, 1) over the whole size n of the dim it indexes "
        "(static or symbolic; unsqueezed, expanded, offset by 0), broadcast against the other indices: that dim is "
        "moved to i's axis of the result (squeezes, unsqueezes, a permute where axes move) and only the other "
        "index tensors are still gathered. The same elements. IREE 3.13 compiles the gather as a tensor.extract in "
        "the loop, unvectorized: transformers' padding mask attention_mask[batch_idx, kv_idx] in a static-cache "
        "prefill, 485 ms against 7.1 ms read as the dim on a real AVX2 core."
    ),
)
def index_by_arange_as_view(node: Node, rw: Rewriter, *, found: ArangeIndices) -> Miss | None:
    positions = [k for k, i in enumerate(found.indices) if i is not None]
    x_rank = fake_value(found.x).dim()
    rest = [d for d in range(x_rank) if d not in positions]
    gathered = [k for k in positions if k not in found.axes]
    aranges = [k for k in positions if k in found.axes]
    if gathered:  # the other index tensors gather, adjacent at the front of x permuted
        y = _permute(rw, found.x, gathered + aranges + rest)
        y = rw.call(aten.index.Tensor, y, [found.indices[k] for k in gathered])
        rank = max(fake_value(found.indices[k]).dim() for k in gathered)
        # y's axes: their broadcast shape right-aligned in the indices' rank, the aranges' dims, the rest
        labels = [("b", i) for i in range(found.rank - rank, found.rank)]
        labels += [("a", k) for k in aranges] + [("r", d) for d in rest]
    else:  # x itself
        y, labels = found.x, [("a", d) if d in found.axes else ("r", d) for d in range(x_rank)]
    at_axis = {q: k for k, q in found.axes.items()}
    block = [("a", at_axis[i]) if i in at_axis else ("b", i) for i in range(found.rank)]
    if positions == list(range(positions[0], positions[-1] + 1)):  # adjacent indices: the block where they were
        final = [("r", d) for d in rest if d < positions[0]] + block + [("r", d) for d in rest if d > positions[0]]
    else:
        final = block + [("r", d) for d in rest]
    y = _arranged(rw, y, labels, final)
    return y if isinstance(y, Miss) else _expanded(rw, y, node, found)


def _arranged(rw: Rewriter, y: Node, labels: list[Any], final: list[Any]) -> Node | Miss:
    """`y` (axes `labels`) with axes `final`: its axes of size 1 squeezed (those not in `final` among them), the others
    permuted where their order differs (not for transformers' mask: a view then, which IREE folds into the read), and
    `final`'s other axes unsqueezed."""
    unit = [i for i, size in enumerate(fake_value(y).shape) if _one(size)]
    left = [label for i, label in enumerate(labels) if i not in unit]
    if any(label not in final for label in left):
        return Miss(f"axes {[label for label in left if label not in final]} of a size other than 1 are not kept")
    for i in reversed(unit):  # squeeze.dim one at a time: IREE 3.13 has no lowering of squeeze.dims (legality_data)
        y = rw.call(aten.squeeze.dim, y, i)
    order = [label for label in final if label in left]
    y = _permute(rw, y, [left.index(label) for label in order])
    for i, label in enumerate(final):
        if label not in order:
            y = rw.call(aten.unsqueeze.default, y, i)
    return y


def _expanded(rw: Rewriter, y: Node, node: Node, found: ArangeIndices) -> Miss | None:
    """Replace `node` by `y` expanded to its shape (an index tensor expanded along an axis it does not vary along
    leaves y of size 1 there); a symbolic size is read from an input that has it."""
    have, want = fake_value(y).shape, fake_value(node).shape
    if all(statically_known_true(a == b) for a, b in zip(have, want)):
        rw.replace(node, y)
        return None
    tensors = [found.x, *(i for i in found.indices if i is not None)]
    sizes: list[Any] = []
    for a, b in zip(have, want):
        if statically_known_true(a == b) or isinstance(b, int):
            sizes.append(-1 if statically_known_true(a == b) else b)
            continue
        source = next(
            ((t, d) for t in tensors for d, s in enumerate(t.meta["val"].shape) if statically_known_true(s == b)), None
        )
        if source is None:
            return Miss(f"no input has the result's size {b} to expand to")
        sizes.append(rw.size(*source))
    rw.replace(node, rw.call(aten.expand.default, y, sizes))
    return None
