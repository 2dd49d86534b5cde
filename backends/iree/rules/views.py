"""Guards against IREE 3.13 writing a tensor into itself (silent wrong results).

`aten.slice_scatter(t, src, ...)` and `aten.index_put(t, indices, values)`
whose source reads `t` (MBart's `shift_tokens_right`: `y = x.clone();
y[:, 1:] = y[:, :-1].clone()`): IREE folds the clones, ties the result to
`t`'s buffer and copies the source out of that same buffer while it writes
it. An overlapping shift then reads elements it already overwrote (every
position gets the first token) or, for a contiguous range, fails at run
time ("source and target ranges must not overlap within the same buffer").

The guards rewrite such a scatter into a form whose result is a fresh
tensor: a `cat` of the untouched pieces and the source, or a scatter into
zeros picked by a mask with `where`. They fire whenever the source's
values depend on the written tensor (IREE folds clones, views and `x * 1`,
so which chains it sees through cannot be listed), and whenever something
else reads the written tensor: IREE also scatters in place into a tensor
still to be read when the result is padded (section 14; the other scatters:
`backends/iree/rules/live_scatters.py`). The rewritten forms compute the same values
exactly. docs/iree-3.13-findings.md section 8 has the measurements.

Also here: `diagonal_as_gather_for_iree`. With a diagonal of `y` read by a
broadcast `where`, IREE 3.13 returns `y` itself wrong (silently); a gather
of the same elements is right. Slices with a step: `backends/iree/rules/steps.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: aten.slice's "to the end" as torch.export writes it
_TO_END = 9223372036854775807


def _tensor_inputs(node: Node) -> list[Node]:
    return [n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]


def _buffer(dest: Node) -> set[Node]:
    """`dest` and what IREE may give the same buffer: back through ops with one tensor operand
    (views, clones, copies, and unary math IREE folds to the identity, such as `x * 1`)."""
    chain = {dest}
    node = dest
    while node.op == "call_function" and len(inputs := _tensor_inputs(node)) == 1:
        node = inputs[0]
        chain.add(node)
    return chain


#: the operand of these ops whose values they read; their other tensor operands give only a shape, dtype or
#: device (aten.copy's destination), so a read of those cannot alias a write (torch's schemas do not say it)
_DATA_OPERAND = {aten.copy.default: 1}
#: ops that read only sizes
_SIZES_ONLY = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int}


def _data_inputs(node: Node) -> list[Node]:
    if node.op != "call_function" or node.target in _SIZES_ONLY:
        return []
    if node.target in _DATA_OPERAND:
        operand = node.args[_DATA_OPERAND[node.target]]
        return [operand] if isinstance(operand, Node) else []
    return node.all_input_nodes


def _reads(src: Any, buffer: set[Node]) -> bool:
    """Whether the values of `src` depend on the values of a node of `buffer`."""
    if not isinstance(src, Node):
        return False
    seen: set[Node] = set()
    todo = [src]
    while todo:
        node = todo.pop()
        if node in buffer:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(n for n in _data_inputs(node) if n not in seen)
    return False


def full_from_sizes(rw: Rewriter, like: Node, fill: Any, dtype: torch.dtype) -> Node:
    """`fill` in `like`'s shape, built from its sizes (not from `like`: no data dependence on it)."""
    val = like.meta["val"]
    sizes = [rw.size(like, d) for d in range(val.dim())]
    return rw.call(aten.full.default, sizes, fill, dtype=dtype, device=val.device)


def added_over(rw: Rewriter, x: Node, scatter: Callable[[Node], Node]) -> Node:
    """x + scatter(-0.0 in x's shape): an accumulating scatter into `x` that writes a fresh tensor instead.
    -0.0 + v == v for every float v (0.0 + -0.0 would be +0.0), so untouched elements stay bit-exact; 0 for
    integers. Exact where each index occurs once."""
    dtype = x.meta["val"].dtype
    fill = -0.0 if dtype.is_floating_point or dtype.is_complex else 0
    return rw.call(aten.add.Tensor, x, scatter(full_from_sizes(rw, x, fill, dtype)))


def placed_over(rw: Rewriter, x: Node, scatter: Callable[[Node], Node], mark: Callable[[Node], Node]) -> Node:
    """where(mark(False in x's shape), scatter(zeros in x's shape), x): a scatter into `x` that writes fresh
    tensors instead, `mark` scattering True where `scatter` writes."""
    dtype = x.meta["val"].dtype
    scattered = scatter(full_from_sizes(rw, x, False if dtype is torch.bool else 0, dtype))
    mask = mark(full_from_sizes(rw, x, False, torch.bool))
    return rw.call(aten.where.self, mask, scattered, x)


def reads_destination(dest: Node, source: Any) -> bool:
    """Whether a scatter's `source` reads the tensor `dest` it is written into (through what IREE folds)."""
    return _reads(source, _buffer(dest))


def read_elsewhere(scatter: Node, dest: Node) -> bool:
    """Whether anything but `scatter` reads the values of the tensor it writes into (another op, directly or
    through views; the program's outputs). IREE 3.13 may write such a tensor in place while it is still to
    be read (docs/iree-3.13-findings.md section 14)."""
    chain = _buffer(dest)
    skip = chain | {scatter}

    def read(node: Node) -> bool:
        for user in node.users:
            if user in skip or (user.op != "output" and node not in _data_inputs(user)):
                continue  # aten.copy's destination only gives a shape
            if isinstance(user.target, torch._ops.OpOverload) and user.target.is_view:
                if read(user):
                    return True
                continue
            return True
        return False

    return any(read(node) for node in chain)


def scatter_hazard(node: Node, dest: Node, source: Any) -> bool | Miss:
    """Why a scatter of `source` into `dest` by `node` needs a fresh result on IREE, or a Miss."""
    if reads_destination(dest, source) or read_elsewhere(node, dest):
        return True
    return Miss("the source does not read the tensor written into, and nothing else reads that tensor")


# -- slice_scatter ---------------------------------------------------------------------------------------


def slice_bound(value: Any, size: Any, default: Any) -> Any:
    """`value` as slice_scatter reads it (negative from the end, clamped), or None when unknown here."""
    if value is None:
        return default
    if not isinstance(value, int):
        return None  # a SymInt node: the where-form handles it
    if value >= _TO_END:
        return size
    at = size + value if value < 0 else value
    if statically_known_true(at >= 0) and statically_known_true(at <= size):
        return at
    if value >= 0 and statically_known_true(at >= size):
        return size
    return None


def writes_whole_tensor(node: Node) -> bool:
    """Whether a slice_scatter writes every element (step 1 over the whole dim: functionalization's write-back
    through a view, `slice_scatter(t, f(slice(t, d, 0, end)), d, 0, end)`); the guard then returns the source."""
    named = schema.arguments(node)
    val = named["self"].meta["val"]
    size = val.shape[named.get("dim", 0) % val.dim()]
    lo, hi = slice_bound(named.get("start"), size, 0), slice_bound(named.get("end"), size, size)
    return named.get("step", 1) == 1 and lo is not None and hi is not None and statically_known_true(hi - lo == size)


def _slice_scatter(node: Node, *, args: Mapping[str, Any]) -> dict[str, Any] | Miss:
    hazard = scatter_hazard(node, args["self"], args["src"])
    return args if hazard is True else hazard


@rule(
    roots=(aten.slice_scatter.default,),
    when=_slice_scatter,
    tags={"iree", "guard"},
    doc=(
        "aten.slice_scatter(t, src, ...) whose src reads t (MBart's shift_tokens_right: `y = x.clone(); "
        "y[:, 1:] = y[:, :-1].clone()`), or whose t something else reads, becomes cat(t[..start], src, "
        "t[end..]) (step 1), or a slice_scatter into zeros picked by a mask with where (a step, symbolic "
        "bounds). IREE 3.13 folds the clones and copies src out of t's buffer while writing it: every shifted "
        'position gets the first element (silently), or, for a contiguous range, "source and target ranges '
        'must not overlap within the same buffer" at run time. And it writes t in place while t is still '
        "read when the result is padded (`a, pad(slice_scatter(a, z, 0, 0, 1))`: `a` comes back with z in it)."
    ),
)
def slice_scatter_of_itself_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    x, src = found["self"], found["src"]
    dim, start, end, step = found.get("dim", 0), found.get("start"), found.get("end"), found.get("step", 1)
    dim = dim % x.meta["val"].dim()
    size = x.meta["val"].shape[dim]
    lo, hi = slice_bound(start, size, 0), slice_bound(end, size, size)
    if step == 1 and lo is not None and hi is not None and statically_known_true(lo <= hi):
        pieces = []
        if not statically_known_true(lo == 0):
            pieces.append(rw.call(aten.slice.Tensor, x, dim, 0, start))
        # a constant src (a lifted tensor) is imported as a literal, which IREE's importer cannot list with values
        pieces.append(src if src.op == "call_function" else rw.call(aten.clone.default, src))
        if not statically_known_true(hi == size):
            pieces.append(rw.call(aten.slice.Tensor, x, dim, end, _TO_END))
        rw.replace(node, rw.call(aten.cat.default, pieces, dim) if len(pieces) > 1 else src)
        return
    scattered = rw.call(
        aten.slice_scatter.default, full_from_sizes(rw, x, 0, src.meta["val"].dtype), src, dim, start, end, step
    )
    # built from src's sizes: ones_like asks for src's memory format, which guards a symbolic size of 1
    ones = full_from_sizes(rw, src, True, torch.bool)
    mask = rw.call(aten.slice_scatter.default, full_from_sizes(rw, x, False, torch.bool), ones, dim, start, end, step)
    rw.replace(node, rw.call(aten.where.self, mask, scattered, x))


# -- index_put ---------------------------------------------------------------------------------------------


def _index_put(node: Node, *, args: Mapping[str, Any]) -> dict[str, Any] | Miss:
    hazard = scatter_hazard(node, args["self"], args["values"])
    return args if hazard is True else hazard


@rule(
    roots=(aten.index_put.default, aten._unsafe_index_put.default),
    when=_index_put,
    tags={"iree", "guard"},
    doc=(
        "aten.index_put(t, indices, values) whose values read t (`torch.index_put(x, (i,), x[:-1])`, "
        "`y[:, idx] = y[:, :-2:2]`) scatters into a fresh tensor: into zeros picked by a mask with where, or, "
        "with accumulate=True, into -0.0 (0 for integers) then added to t (exact where each index occurs "
        "once). Also when something else reads t. IREE 3.13 scatters in place into t's buffer while reading "
        "values from it, or while t is still to be read (the result padded): silently wrong."
    ),
)
def index_put_of_itself_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    x, indices, values = found["self"], found["indices"], found["values"]
    if found.get("accumulate", False):
        rw.replace(node, added_over(rw, x, lambda base: rw.call(node.target, base, indices, values, True)))
        return
    ones = full_from_sizes(rw, values, True, torch.bool)
    placed = placed_over(
        rw,
        x,
        lambda base: rw.call(node.target, base, indices, values),
        lambda base: rw.call(node.target, base, indices, ones),
    )
    rw.replace(node, placed)


# -- diagonal ------------------------------------------------------------------------------------------------


#: ops that read their input's storage (sizes, strides and offset against the base), not its values
_STORAGE_READERS = frozenset(
    op
    for name, overload in (
        ("as_strided", "default"),
        ("as_strided_", "default"),
        ("as_strided_copy", "default"),
        ("as_strided_scatter", "default"),
        ("_reshape_alias", "default"),
    )
    if (op := getattr(getattr(aten, name, None), overload, None)) is not None
)


def _reads_storage(view: Node) -> Node | None:
    """A user of `view`, or of a view of it, that reads the base's storage rather than the view's values."""
    seen, todo = {view}, [view]
    while todo:
        for user in todo.pop().users:
            if user.op != "call_function" or user in seen:
                continue
            if user.target in _STORAGE_READERS:
                return user
            returns = getattr(getattr(user.target, "_schema", None), "returns", ())
            if any(r.alias_info is not None and not r.alias_info.is_write for r in returns):  # a view: follow it
                seen.add(user)
                todo.append(user)
    return None


def _diagonal(node: Node, *, args: Mapping[str, Any]) -> dict[str, Any] | Miss:
    val, out = args["self"].meta.get("val"), node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor) or type(out.shape[-1]) is not int:
        return Miss("the diagonal's length is not static")
    if any(u.op == "call_function" and u.target._schema.is_mutable for u in node.users):
        return Miss("written through in place: the view must stay a view")
    reader = _reads_storage(node)
    if reader is not None:
        return Miss(f"read by {reader.target} ({reader.name!r}), which reads the base's storage: it stays a view")
    n = val.dim()
    return {"self": args["self"], "offset": args.get("offset", 0), "dims": (args.get("dim1", 0) % n,
            args.get("dim2", 1) % n), "length": out.shape[-1], "rank": n}  # fmt: skip


@rule(
    roots=(aten.diagonal.default,),
    when=_diagonal,
    tags={"iree", "guard"},
    doc=(
        "aten.diagonal(y, offset, d1, d2) becomes a gather of the same elements (y with d1, d2 moved first, "
        "indexed by arange rows and columns, the diagonal moved last): the same values, selected. IREE 3.13 "
        "returns y itself wrong, silently, when a diagonal of y is read by a broadcast where "
        "(`y, where(eye, y.diagonal().unsqueeze(-1), 0.)` on [2, 2, 2, 4]: y off by up to 2.5; on [3, 3, 2, 4] "
        "and [4, 4, 8] too), the form the in-place pack gives a write through a diagonal. Not when the diagonal, "
        "or a view of it, is read by as_strided: that reads the base's storage, which a gather does not have."
    ),
)
def diagonal_as_gather_for_iree(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> None:
    (d1, d2), offset, n = found["dims"], found["offset"], found["rank"]
    index = rw.call(aten.arange.default, found["length"], device=node.meta["val"].device)
    rows = rw.call(aten.add.Tensor, index, max(-offset, 0)) if offset < 0 else index
    cols = rw.call(aten.add.Tensor, index, offset) if offset > 0 else index
    moved = rw.call(aten.permute.default, found["self"], [d1, d2, *(d for d in range(n) if d not in (d1, d2))])
    picked = rw.call(aten.index.Tensor, moved, [rows, cols])  # [length, the other dims in order]
    rw.replace(node, rw.call(aten.permute.default, picked, [*range(1, n - 1), 0]))


RULES = RuleSet(
    [slice_scatter_of_itself_for_iree, index_put_of_itself_for_iree, diagonal_as_gather_for_iree], name="iree-views"
)
