"""Views with a strided innermost dim that IREE 3.13 cannot compile where they are read, rewritten to the
same elements.

IREE 3.13 fails to compile ops that read a slice with a step along its
innermost dim at computed positions ("LLVM Translation failed for
operation: builtin.unrealized_conversion_cast"): a `flip` of it
(`flip_of_stepped_slice_for_iree` slices the flipped tensor instead), a
gather or a diagonal of it (`stepped_slice_read_by_gather_for_iree` gathers
its elements from the sliced tensor). So does such a read of one element of
a longer innermost dim (`select(-1, i)`, `narrow(-1, i, 1)`, an `unbind(-1)`
item), whose new innermost dim is strided:
`one_innermost_element_read_by_gather_for_iree` and
`unbind_innermost_read_by_gather_for_iree`. A write through a slice whose
step picks one element (a step along a dim of size 1) fails too ("expected
result type ... rank-reduced"): `single_element_step_for_iree` drops the
step. Found by the view-write fuzzer (docs/reliability.md).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fx_rewrites import schema
from fx_rewrites.backends.iree.rules.views import slice_bound
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


def _stepped_innermost(sliced: Any) -> dict[str, Any] | Miss:
    """A slice with a step along its input's innermost dim, non-empty, with a static start and count: its
    input, dim, step, start, count and the dim's size."""
    if not (isinstance(sliced, Node) and sliced.target == aten.slice.Tensor):
        return Miss("not a slice")
    named = schema.arguments(sliced)
    base, out = named["self"].meta.get("val"), sliced.meta.get("val")
    if not isinstance(base, torch.Tensor) or not isinstance(out, torch.Tensor):
        return Miss("no tensor values")
    dim, step = named.get("dim", 0) % base.dim(), named.get("step", 1)
    if step == 1 or dim != base.dim() - 1:
        return Miss("no step along the innermost dim")
    size, count = base.shape[dim], out.shape[dim]
    start = slice_bound(named.get("start"), size, 0)
    if not all(type(v) is int for v in (size, count, start)) or count == 0:
        return Miss("symbolic or empty along the sliced dim")
    return {"self": named["self"], "dim": dim, "step": step, "start": start, "count": count, "size": size}


# -- flip of a stepped slice --------------------------------------------------------------------------------


def _flip_of_stepped_slice(node: Node, args: Mapping[str, Any]) -> dict[str, Any] | Miss:
    dims = args["dims"]
    m = _stepped_innermost(node.args[0])
    if isinstance(m, Miss):
        return Miss(lambda: f"the flipped tensor: {m.reason} (those flips compile)")
    return {**m, "dims": [d % m["self"].meta["val"].dim() for d in dims]}


@rule(
    roots=(aten.flip.default,),
    when=_flip_of_stepped_slice,
    tags={"iree", "lowering"},
    doc=(
        "flip(x[..., start::step], dims) with a step > 1 along the innermost dim becomes a slice of flip(x, "
        "dims) that picks the same elements (the slice's start mirrored when its dim is flipped): the same "
        'values. IREE 3.13 fails to compile the flip of such a slice ("LLVM Translation failed for operation: '
        'builtin.unrealized_conversion_cast"), whichever dims are flipped; a flip followed by the slice compiles.'
    ),
)
def flip_of_stepped_slice_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    last = found["start"] + found["step"] * (found["count"] - 1)  # the slice's last index in the base
    start = found["size"] - 1 - last if found["dim"] in found["dims"] else found["start"]
    flipped = rw.call(aten.flip.default, found["self"], found["dims"])
    end = start + found["step"] * (found["count"] - 1) + 1
    rw.replace(node, rw.call(aten.slice.Tensor, flipped, found["dim"], start, end, found["step"]))


# -- a stepped slice read by a gather ------------------------------------------------------------------------

#: ops that read their input at computed positions (IREE lowers them to `tensor.extract` gathers). Found by
#: the view-write fuzzer and reduced: each fails to compile on a slice with a step along the innermost dim
#: (`x[..., ::2][i, i]`, `.index_select(0, i)`, `.gather(0, idx)`, `[..., i]`, a diagonal as a gather),
#: read directly or through views. `flip` is one too: read directly, it has its own cheaper rule above.
_GATHERS = frozenset({aten.index.Tensor, aten.index_select.default, aten.gather.default, aten.embedding.default})


def _read_by_gather(node: Node, direct_flip: bool = False) -> bool | Miss:
    """Whether a gather or a diagonal reads `node`, directly or through views (a flip through views, or
    directly with `direct_flip`); a Miss when a view of it is written. A diagonal counts both as the view
    it is (kept with Dim sizes) and as the gather `diagonal_as_gather_for_iree` makes of it: neither
    compiles, and the gather, made after this node's visit, would not bring it back to this rule."""
    todo, seen = [node], {node}
    found = False
    while todo:
        tensor = todo.pop()
        for user in tensor.users:
            if user.target is operator.getitem and user not in seen:  # an item of a split or unbind
                seen.add(user)
                todo.append(user)
            if user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload):
                continue
            if user.target._schema.is_mutable:
                return Miss(f"{user.name} ({user.target}) writes it in place: the view must stay a view")
            flip = user.target == aten.flip.default and (direct_flip or tensor is not node)
            found = found or user.target in _GATHERS or flip or user.target == aten.diagonal.default
            if user.target.is_view and user not in seen:
                seen.add(user)
                todo.append(user)
    return found


def _stepped_innermost_slice(node: Node) -> dict[str, Any] | Miss:
    m = _stepped_innermost(node)
    if isinstance(m, Miss):
        return m
    read = _read_by_gather(node)
    if isinstance(read, Miss):
        return read
    return m if read else Miss("no gather reads it (those compile)")


@rule(
    roots=(aten.slice.Tensor,),
    when=_stepped_innermost_slice,
    tags={"iree", "lowering"},
    doc=(
        "x[..., start::step] (a step > 1 along the innermost dim) read by a gather (index, index_select, gather, "
        "embedding; directly or through views; a flip through views) becomes index_select(x, -1, arange(start, "
        '..., step)): the same elements. IREE 3.13 fails to compile a gather of such a slice ("LLVM Translation '
        'failed for operation: builtin.unrealized_conversion_cast"); a gather of a gather compiles.'
    ),
)
def stepped_slice_read_by_gather_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    end = found["start"] + found["step"] * (found["count"] - 1) + 1
    device = node.meta["val"].device
    index = rw.call(aten.arange.start_step, found["start"], end, found["step"], device=device)
    rw.replace(node, rw.call(aten.index_select.default, found["self"], found["dim"], index))


# -- one element of the innermost dim read by a gather, flip or diagonal --------------------------------------


def _one_innermost_element(node: Node) -> dict[str, Any] | Miss:
    """`select` of the innermost dim, or a step-1 slice of one element of it (`narrow(-1, i, 1)`), of a
    longer static dim, read by a gather, a flip or a diagonal: its input, dim, index and whether the dim is
    dropped."""
    named = schema.arguments(node)
    base = named["self"].meta.get("val")
    if not isinstance(base, torch.Tensor) or not isinstance(node.meta.get("val"), torch.Tensor):
        return Miss("no tensor values")
    dim = named.get("dim", 0) % base.dim()
    size = base.shape[dim]
    if dim != base.dim() - 1 or type(size) is not int or size < 2:
        return Miss("not the innermost dim, or a dim of one or of a symbolic size")
    if node.target == aten.select.int:
        index, drops = named["index"], True
    elif node.target == aten.narrow.default and statically_known_true(named["length"] == 1):
        index, drops = named["start"], False
    elif (
        node.target == aten.slice.Tensor
        and named.get("step", 1) == 1
        and statically_known_true(node.meta["val"].shape[dim] == 1)  # no guard on a size read from the data
    ):
        index, drops = slice_bound(named.get("start"), size, 0), False
    else:
        return Miss("not one element of the dim with step 1 (a step has its own rule)")
    if type(index) is not int:
        return Miss("a symbolic index")
    read = _read_by_gather(node, direct_flip=True)
    if isinstance(read, Miss):
        return read
    if not read:
        return Miss("no gather, flip or diagonal reads it (those compile)")
    return {"self": named["self"], "dim": dim, "index": index % size, "drops": drops}


@rule(
    roots=(aten.select.int, aten.narrow.default, aten.slice.Tensor),
    when=_one_innermost_element,
    tags={"iree", "lowering"},
    doc=(
        "x.select(-1, i) or x[..., i:i+1] (one element of a longer innermost dim) read by a gather (index, "
        "index_select, gather, embedding), a flip or a diagonal, directly or through views, becomes "
        "index_select(x, -1, arange(i, i + 1)) (squeezed for select): the same elements. IREE 3.13 fails to "
        "compile such a read (`x.select(3, -1).flip(-1)`, `x.select(3, -1)[i]`, `x.narrow(3, 0, 1).diagonal(0, "
        '1, 2)`: "LLVM Translation failed for operation: builtin.unrealized_conversion_cast"); it compiles '
        "the gather of a gather."
    ),
)
def one_innermost_element_read_by_gather_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    index = rw.call(aten.arange.start, found["index"], found["index"] + 1, device=node.meta["val"].device)
    picked = rw.call(aten.index_select.default, found["self"], found["dim"], index)
    rw.replace(node, rw.call(aten.squeeze.dim, picked, found["dim"]) if found["drops"] else picked)


def _unbind_innermost(node: Node, args: Mapping[str, Any]) -> dict[str, Any] | Miss:
    base = args["self"].meta.get("val")
    if not isinstance(base, torch.Tensor) or base.dim() == 0:
        return Miss("no tensor value")
    dim = args.get("dim", 0) % base.dim()
    if dim != base.dim() - 1 or type(base.shape[dim]) is not int:
        return Miss("not along the innermost dim, or along a symbolic one")
    items = list(node.users)
    if not all(u.target is operator.getitem for u in items):
        return Miss("a user takes the list whole")
    reads = [_read_by_gather(u, direct_flip=True) for u in items]
    written = next((r for r in reads if isinstance(r, Miss)), None)
    if written is not None:
        return written
    if not any(reads):
        return Miss("no gather, flip or diagonal reads an element (those compile)")
    return {"self": args["self"], "dim": dim, "items": items}


@rule(
    roots=(aten.unbind.int,),
    when=_unbind_innermost,
    tags={"iree", "lowering"},
    doc=(
        "x.unbind(-1) with an element read by a gather, flip or diagonal becomes one select per element "
        "taken, the same views, so that one_innermost_element_read_by_gather_for_iree sees them (fuzz seed 21: "
        "`y.unbind(3)[0].diagonal(0, 0, 1).mul_(3)` failed to compile on IREE 3.13 as the select did)."
    ),
)
def unbind_innermost_read_by_gather_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    for item in found["items"]:
        rw.replace(item, rw.call(aten.select.int, found["self"], found["dim"], item.args[1]))


# -- a step that picks one element ----------------------------------------------------------------------------


def _single_element_step(node: Node, args: Mapping[str, Any]) -> dict[str, Any] | Miss:
    base = args["self"].meta.get("val")
    piece = (args["src"] if node.target == aten.slice_scatter.default else node).meta.get("val")
    if not isinstance(base, torch.Tensor) or not isinstance(piece, torch.Tensor):
        return Miss("no tensor values")
    dim, step = args.get("dim", 0) % base.dim(), args.get("step", 1)
    start = slice_bound(args.get("start"), base.shape[dim], 0)
    if step == 1 or piece.shape[dim] != 1 or type(start) is not int:
        return Miss("not a step picking one element at a static start")
    operands = (args["self"], args["src"]) if node.target == aten.slice_scatter.default else (args["self"],)
    return {"operands": operands, "dim": dim, "start": start}


@rule(
    roots=(aten.slice.Tensor, aten.slice_scatter.default),
    when=_single_element_step,
    tags={"iree", "lowering"},
    doc=(
        "A slice (or slice_scatter) whose step picks one element along its dim (`y[:, ::2]` where that dim "
        "has size 1 or 2) takes that element with step 1: the same element. IREE 3.13 fails to compile a "
        'write through such a slice ("expected result type ... or a rank-reduced version").'
    ),
)
def single_element_step_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    rw.replace(node, rw.call(node.target, *found["operands"], found["dim"], found["start"], found["start"] + 1, 1))


RULES = RuleSet(
    [
        flip_of_stepped_slice_for_iree,
        stepped_slice_read_by_gather_for_iree,
        one_innermost_element_read_by_gather_for_iree,
        unbind_innermost_read_by_gather_for_iree,
        single_element_step_for_iree,
    ],
    name="iree-steps",
)
