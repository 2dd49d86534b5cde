"""Boolean masks: data-dependent `x[mask]`, `masked_select`, and `x[mask] = v`.

`x[x > 0]` exports as `aten.index.Tensor(x, [mask])` in every route (R2 does
not decompose it), `torch.masked_select(x, m)` as `aten.masked_select`; both
return a tensor whose leading size is an unbacked symbol (u0), followed by
`sym_size.int` + `_assert_scalar` range checks. IREE cannot lower the bool
index: a rank-1 mask fails with "'arith.cmpi' op requires all operands to
have the same type", a rank-2 mask drives iree-compile out of memory. The
rules gather through explicit integer indices instead:
`index_select(x_flat, dim, nonzero(mask_flat).view(-1))`.

Masked assignment `x[mask] = v` has a static shape: its functional form
`aten.index_put(x, [mask], v)` (R2, R3) becomes `aten.where(mask, v, x)`.
The in-place `index_put_` (R1) is left to the in-place pack, which makes it
functional first.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


def _is_bool_tensor(arg: Any) -> bool:
    val = fake_value(arg)
    return isinstance(val, torch.Tensor) and val.dtype == torch.bool


def _mask_position(indices: Any) -> tuple[int, Node] | Miss:
    """(dim, mask) when `indices` is `[None] * dim + [mask] + [None] * t`."""
    if not isinstance(indices, (list, tuple)):
        return Miss("indices are not a list")
    given = [(i, idx) for i, idx in enumerate(indices) if idx is not None]
    if not any(_is_bool_tensor(idx) for _, idx in given):
        return Miss("no index is a bool tensor")
    if len(given) != 1:
        return Miss("a bool mask mixed with other tensor indices")
    dim, mask = given[0]
    if fake_value(mask).dim() == 0:
        return Miss("a 0-d bool index (x[True]) adds a dimension; not handled")
    return dim, mask


def _size(rw: Rewriter, node: Node, dim: int) -> Any:
    """`node.shape[dim]` as an int, or a `sym_size.int` node when symbolic."""
    size = fake_value(node).shape[dim]
    if isinstance(size, torch.SymInt):
        maybe = size.node.maybe_as_int()
        return maybe if maybe is not None else rw.call(aten.sym_size.int, node, dim)
    return int(size)


def _contiguous(val: torch.Tensor) -> bool:
    try:
        return bool(val.is_contiguous())
    except Exception:  # unbacked strides can make the question undecidable
        return False


def _flatten(rw: Rewriter, node: Node, start: int, end: int) -> Node:
    """`node` with dims start..end (inclusive) merged into one (core ATen:
    `view`, after a contiguous `clone` when the layout is not known to allow it)."""
    val = fake_value(node)
    if start == end and val.dim() > 0:
        return node
    shape = [_size(rw, node, d) for d in range(start)] + [-1] + [_size(rw, node, d) for d in range(end + 1, val.dim())]
    src = node
    if not _contiguous(val):
        src = rw.call(aten.clone.default, node, memory_format=torch.contiguous_format)
    return rw.call(aten.view.default, src, shape)


def _gather(rw: Rewriter, x: Node, mask: Node, dim: int, old_size: Any) -> Node:
    """`x[(slice(None),) * dim + (mask,)]` as an integer gather; its size
    along `dim` reuses the replaced node's unbacked symbol `old_size`."""
    k = fake_value(mask).dim()
    flat_x = _flatten(rw, x, dim, dim + k - 1)
    flat_mask = _flatten(rw, mask, 0, k - 1)
    nonzero = rw.call(aten.nonzero.default, flat_mask)  # [u, 1] int64
    _reuse_symbol(rw, nonzero, old_size)
    index = rw.call(aten.view.default, nonzero, [-1])
    return rw.call(aten.index_select.default, flat_x, dim, index)


def _reuse_symbol(rw: Rewriter, nonzero: Node, old_size: Any) -> None:
    """Rename the fresh unbacked symbol of `nonzero` (u3) to the one the
    replaced node bound (u0): they count the same True elements.

    Without this the rewritten program mentions a symbol its
    `range_constraints` lack, and `torch.export.load` fails with
    `KeyError: u3`. This is what torch itself does when a retrace makes a
    fresh symbol for a value it already has (`ShapeEnv._rename_unbacked_to`).
    """
    shape_env = getattr(rw.fake_mode, "shape_env", None)
    new_size = fake_value(nonzero).shape[0]
    if shape_env is None or not isinstance(old_size, torch.SymInt) or not isinstance(new_size, torch.SymInt):
        return
    old_s, new_s = old_size.node.expr, new_size.node._expr
    if new_size.node.expr == old_s:  # a memo hit: already the same symbol
        return
    if not isinstance(old_s, sympy.Symbol) or not free_unbacked_symbols(old_s) or new_s in shape_env.replacements:
        return

    def rename() -> None:  # only once the rewrite is committed
        shape_env._rename_unbacked_to(new_s, old_s)
        bindings = nonzero.meta.get("unbacked_bindings")
        if bindings and new_s in bindings:
            nonzero.meta["unbacked_bindings"] = {old_s: bindings[new_s]}

    rw.on_commit(rename)


@rule(
    roots=(aten.index.Tensor,),
    doc=(
        "x[mask] with a bool mask (aten.index.Tensor(x, [mask]), rank-1 or rank>=2 mask, also "
        "x[:, mask]) -> index_select(x flattened over the mask's dims, dim, nonzero(mask.flatten()).view(-1)). "
        "IREE: \"error: 'arith.cmpi' op requires all operands to have the same type\" for a rank-1 mask; "
        "a rank-2 mask runs iree-compile out of memory ('LLVM ERROR: out of memory')."
    ),
    tags={"masks", "dynamic"},
)
def mask_index_to_gather(node: Node, rw: Rewriter) -> Any:
    x, indices = node.args[0], node.args[1]
    found = _mask_position(indices)
    if isinstance(found, Miss):
        return found
    dim, mask = found
    xv, mv = fake_value(x), fake_value(mask)
    if xv is None or xv.dim() < dim + mv.dim():
        return Miss("the mask has more dims than x has after it")
    old_size = fake_value(node).shape[dim]
    rw.replace(node, _gather(rw, x, mask, dim, old_size), same_shape=False)
    return None


@rule(
    roots=(aten.masked_select.default,),
    doc=(
        "torch.masked_select(x, mask) (aten.masked_select.default) -> broadcast, flatten and "
        "index_select(x.flatten(), 0, nonzero(mask.flatten()).view(-1)); same IREE failures as x[mask]."
    ),
    tags={"masks", "dynamic"},
)
def masked_select_to_gather(node: Node, rw: Rewriter) -> Any:
    x, mask = node.args[0], node.args[1]
    xv, mv = fake_value(x), fake_value(mask)
    if not isinstance(xv, torch.Tensor) or not isinstance(mv, torch.Tensor):
        return Miss("x or mask has no tensor value")
    if mv.dtype != torch.bool:
        return Miss(f"mask dtype is {mv.dtype}")
    shape = torch.broadcast_shapes(xv.shape, mv.shape)
    if len(shape) == 0:
        shape = torch.Size([1])

    def expanded(n: Node) -> Node:
        v = fake_value(n)
        if v.dim() == len(shape) and all(statically_known_true(a == b) for a, b in zip(v.shape, shape)):
            return n
        sizes = [_broadcast_size(rw, (x, mask), d, len(shape)) for d in range(len(shape))]
        return rw.call(aten.expand.default, n, sizes)

    bx, bm = expanded(x), expanded(mask)
    flat_x = _flatten(rw, bx, 0, len(shape) - 1)
    flat_mask = _flatten(rw, bm, 0, len(shape) - 1)
    rw.replace(node, _gather(rw, flat_x, flat_mask, 0, fake_value(node).shape[0]), same_shape=False)
    return None


def _broadcast_size(rw: Rewriter, nodes: tuple[Node, ...], d: int, rank: int) -> Any:
    """Size of broadcast dim `d` (of `rank`), read from an input that has it."""
    fallback: Any = 1
    for n in nodes:
        v = fake_value(n)
        i = d - (rank - v.dim())
        if i < 0:
            continue
        size = v.shape[i]
        if isinstance(size, int) and size == 1:
            continue
        return _size(rw, n, i)
    return fallback


@rule(
    roots=(aten.index_put.default,),
    doc=(
        "x[mask] = v in functional form (aten.index_put(x, [mask], v) with a bool mask, R2/R3) -> "
        "aten.where(mask, v, x), broadcast over the dims after the mask (accumulate=True: "
        "where(mask, x + v, x)). The in-place index_put_ (R1) is the in-place pack's."
    ),
    tags={"masks"},
)
def mask_index_put_to_where(node: Node, rw: Rewriter) -> Any:
    x, indices, values = node.args[0], node.args[1], node.args[2]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    found = _mask_position(indices)
    if isinstance(found, Miss):
        return found
    dim, mask = found
    xv, mv, vv = fake_value(x), fake_value(mask), fake_value(values)
    if not isinstance(vv, torch.Tensor):
        return Miss("values have no tensor value")
    k = mv.dim()
    rest = xv.dim() - dim - k
    if rest < 0:
        return Miss("the mask has more dims than x has after it")
    # x[mask] = v broadcasts v to [*x.shape[:dim], nnz, *x.shape[dim+k:]]; where() can stand in
    # only if v does not vary along the selected-element dim (nor the dims before it).
    if vv.dim() > rest and not (vv.dim() == rest + 1 and dim == 0 and _is_one(vv.shape[0])):
        return Miss(f"values of shape {tuple(vv.shape)} vary per selected element")
    cond = mask
    for _ in range(rest):
        cond = rw.call(aten.unsqueeze.default, cond, -1)
    v = values
    if vv.dtype != xv.dtype:
        v = rw.call(aten._to_copy.default, values, dtype=xv.dtype)
    if accumulate:
        v = rw.call(aten.add.Tensor, x, v)
    rw.replace(node, rw.call(aten.where.self, cond, v, x))
    return None


def _is_one(size: Any) -> bool:
    return isinstance(size, int) and size == 1


RULES = RuleSet([mask_index_to_gather, masked_select_to_gather, mask_index_put_to_where], name="masks")
