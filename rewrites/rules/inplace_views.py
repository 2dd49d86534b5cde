"""Writes through views, written back as torch's functionalization does.

A tensor an in-place op writes may be a view (`narrow`, `select`,
`diagonal`, `as_strided`, `view`, `reshape`, `permute`, a piece of `split` or
`unbind`, ...) of a base that other views share. After the write, every
alias of that memory read later must read the new values. This module finds
them from the graph (view ops by their schema, `Tensor(a)` returns, and
`getitem` of multi-output views) and asks torch for the new values: the view
chain is replayed on the base's fake value under `torch.func.functionalize`,
the written view is overwritten with its new value, and what torch's
functionalization gives for the base and each alias read later is inlined.
Its view inverses (`at::functionalization::FunctionalInverses`: slice_scatter,
select_scatter, diagonal_scatter, as_strided_scatter, the inverse view of
`view`/`unsqueeze`/`transpose`, ...) are used as torch defines them, and a
`reshape` or `contiguous` that copies a non-contiguous base writes nothing
back, as in eager (decided from the fake value's strides). `torch._C.
_functionalization` exposes only the forward replay (`ViewMeta`), not the
inverses, hence the trace. A trace costs ~10 ms: a write through one view
that has a `<view>_scatter` twin (same arguments after `self, src`) takes it
directly, as the trace would, and traces are memoised per fake mode.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import weakref
from collections.abc import Iterator
from typing import Any

import attrs
import torch
from torch._ops import OpOverload
from torch._prims_common import is_contiguous_or_false
from torch.fx import GraphModule, Node
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import _sym_key, compatible

aten = torch.ops.aten


@attrs.frozen
class Link:
    """`view = op(base, *args)`, or its element `item` for a multi-output view (`split`, `unbind`)."""

    op: OpOverload
    base: Node
    args: tuple
    item: int | None = None


def _aliased_argument(op: OpOverload) -> int | None:
    """Position of the argument a view op's output aliases (its schema's `Tensor(a)` argument)."""
    for i, a in enumerate(op._schema.arguments):
        if a.alias_info is not None and not a.alias_info.is_write:
            return i
    return None


def _view_call(node: Node) -> Link | None:
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload) or not target.is_view or node.kwargs:
        return None
    if _aliased_argument(target) != 0 or not node.args or not isinstance(node.args[0], Node):
        return None
    return Link(target, node.args[0], tuple(node.args[1:]))


def view_link(node: Node) -> Link | None:
    """How `node` aliases another tensor of the graph, or None."""
    if node.op == "call_function" and node.target is operator.getitem:
        source, item = node.args
        link = _view_call(source) if isinstance(source, Node) else None
        return None if link is None or not isinstance(item, int) else attrs.evolve(link, item=item)
    if isinstance(node.meta.get("val"), (list, tuple)):  # a multi-output view itself: only its items alias
        return None
    return _view_call(node)


def view_chain(x: Node) -> list[Node]:
    """[x, the tensor x views, the tensor that views, ...]: the last one owns the memory."""
    chain = [x]
    while (link := view_link(chain[-1])) is not None:
        chain.append(link.base)
    return chain


def _aliases_argument(user: Node, tensor: Node) -> bool:
    """Whether `user`'s output may alias `tensor`: passed where its schema says `Tensor(a)` or
    `Tensor(a!)`, with a return that says so too."""
    op = user.target
    if not isinstance(op, OpOverload) or not any(r.alias_info is not None for r in op._schema.returns):
        return False
    named = schema.bind(op, user.args, user.kwargs)
    return any(a.alias_info is not None and named.get(a.name) is tensor for a in op._schema.arguments)


def _aliases(root: Node, mutation: Node) -> list[Node] | Miss:
    """Every tensor sharing `root`'s memory through views (root included), or why that is not known: an
    alias this module cannot follow (a view op called with keywords, an in-place op left in the graph
    before `mutation`) that is read."""
    found, todo = [root], [root]
    while todo:
        tensor = todo.pop()
        for user in tensor.users:
            if user is mutation or user in found:
                continue
            link = _view_call(user)
            if link is not None and link.base is tensor and isinstance(user.meta.get("val"), (list, tuple)):
                items = [i for i in user.users if i.target is operator.getitem and view_link(i) is not None]
                found.extend(items)
                todo.extend(items)
            elif link is not None and link.base is tensor:
                found.append(user)
                todo.append(user)
            elif _aliases_argument(user, tensor) and (
                (user.target.is_view and user.users) or (user < mutation and any(mutation < u for u in user.users))
            ):
                return Miss(f"{user.name} ({user.target}) aliases {tensor.name} in a way this rule does not follow")
    return found


@attrs.frozen
class WriteBack:
    """How a write to `written` reaches the tensors that alias it: traced from `base` (a tensor of the
    written view chain), the aliases `targets` read after the mutation get new values. Empty targets: the
    write reaches nobody else (the written tensor's later readers just read its new value)."""

    written: Node
    base: Node
    targets: tuple[Node, ...]


def plan(x: Node, mutation: Node, *, record_root: bool) -> WriteBack | Miss:
    """Which aliases of `x` a write by `mutation` must update: those made before it and read after it,
    and the root itself when `record_root` (a program input whose caller sees the write)."""
    chain = view_chain(x)
    root = chain[-1]
    aliases = _aliases(root, mutation)
    if isinstance(aliases, Miss):
        return aliases
    live = [a for a in aliases if a is not x and a < mutation and any(mutation < u for u in a.users)]
    if record_root and root not in live:
        live.append(root)
    if not live:
        return WriteBack(x, x, ())
    position = {n: i for i, n in enumerate(chain)}
    depth = 0
    for alias in live:  # where the alias's own chain meets x's: the base to trace from is the deepest one
        depth = max(depth, next(position[n] for n in view_chain(alias) if n in position))
    targets = [chain[depth], *(a for a in live if a is not chain[depth])]
    if x is not chain[depth]:
        targets.append(x)
    return WriteBack(x, chain[depth], tuple(targets))


#: traced write-backs per fake mode, by what the trace depends on (`_key`): deep models write through the
#: same views of same-sized tensors in every layer, and one make_fx trace costs ~10 ms
_TRACES: weakref.WeakKeyDictionary[Any, dict[tuple, GraphModule | str]] = weakref.WeakKeyDictionary()


def _value_key(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        offset = _sym_key([value.storage_offset()])
        return (value.dtype, value.device, _sym_key(value.shape), _sym_key(value.stride()), offset)
    if isinstance(value, torch.SymInt):
        return ("sym", value.node.expr)
    return ("const", value)


def _key(wb: WriteBack, links: dict[Node, Link], leaves: list, spec: Any, inputs: list[Node]) -> tuple:
    """The views replayed (ops, constant arguments, which is the base of which), which are returned and
    written, and the metadata of every input: all the trace depends on."""
    order = {n: i for i, n in enumerate([wb.base, *links])}
    position = {n: i for i, n in enumerate(inputs)}
    views = tuple((str(link.op), link.item, order[link.base]) for link in links.values())
    args = tuple(("input", position[a]) if isinstance(a, Node) else a for a in leaves)
    returned = tuple(order[t] for t in wb.targets)
    base, new, *values = (_value_key(n.meta.get("val")) for n in inputs)
    metadata = (base, new[:4], *values)  # the new value is only copied: its storage offset does not matter
    return views, args, repr(spec), returned, order[wb.written], metadata


def trace(rw: Rewriter, wb: WriteBack, new: Node) -> dict[Node, Node] | Miss:
    """The value each target of `wb` has after `wb.written` becomes `new`, inlined before the root."""
    links: dict[Node, Link] = {}
    for target in wb.targets:
        node = target
        while node is not wb.base:
            link = view_link(node)
            if link is None:
                return Miss(f"{target.name} is not a view of {wb.base.name}")
            links.setdefault(node, link)
            node = link.base
    if wb.targets == (wb.written,):  # the written tensor itself (a program input): its new value, no trace
        return {wb.written: new}
    one_view = len(links) == 1 and wb.targets == (wb.base, wb.written)  # written = view(base, *args)
    if one_view and (scatter := _scatter_twin(links[wb.written])) is not None:
        args = links[wb.written].args  # what the trace would give, without its ~10 ms
        updated = rw.call(scatter, wb.base, new, *args)
        return {wb.base: updated, wb.written: rw.call(links[wb.written].op, updated, *args)}
    leaves, spec = pytree.tree_flatten([link.args for link in links.values()])
    graph_values = [leaf for leaf in leaves if isinstance(leaf, Node)]
    inputs = [wb.base, new, *graph_values]
    memo = _TRACES.setdefault(rw.fake_mode, {})
    key = _key(wb, links, leaves, spec, inputs)
    try:
        traced = memo.get(key)
    except TypeError:  # an argument that cannot be a key: traced each time
        key, traced = None, None
    if traced is None:
        traced = _traced(rw, wb, links, leaves, spec, inputs)
        if key is not None:
            memo[key] = traced
    if isinstance(traced, str):
        return Miss(f"writing {wb.written.name} back to {wb.base.name}: {traced}")
    outs = rw.inline(traced, inputs)
    return dict(zip(wb.targets, outs))


@functools.cache
def _scatter_op(view: OpOverload) -> OpOverload | None:
    """torch's `<view>_scatter` op that writes `src` where `view` reads (slice_scatter, select_scatter,
    diagonal_scatter, as_strided_scatter), when its arguments after (self, src) are the view's own."""
    packet = getattr(aten, f"{view._schema.name.split('::')[-1]}_scatter", None)
    scatter = getattr(packet, "default", None)
    if scatter is None:
        return None
    ours = [a.name for a in view._schema.arguments[1:]]
    theirs = [a.name for a in scatter._schema.arguments]
    return scatter if theirs[:2] == ["self", "src"] and theirs[2:] == ours else None


def _scatter_twin(link: Link) -> OpOverload | None:
    return _scatter_op(link.op) if link.item is None else None


def _traced(
    rw: Rewriter, wb: WriteBack, links: dict[Node, Link], leaves: list, spec: Any, inputs: list[Node]
) -> GraphModule | str:
    """make_fx of the view chain replayed, the written view overwritten and the targets returned, under
    torch's functionalization, on the inputs' fake values, tidied (`_tidy`); or why that failed."""
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Node)]

    def body(base: torch.Tensor, value: torch.Tensor, *vals: Any) -> tuple[torch.Tensor, ...]:
        filled = list(leaves)
        for i, v in zip(where, vals):
            filled[i] = v
        args_of = dict(zip(links, pytree.tree_unflatten(filled, spec)))
        replayed: dict[Node, torch.Tensor] = {wb.base: base}

        def replay(node: Node) -> torch.Tensor:
            if node not in replayed:
                link = links[node]
                out = link.op(replay(link.base), *args_of[node])
                replayed[node] = out if link.item is None else out[link.item]
            return replayed[node]

        views = [replay(t) for t in wb.targets]  # every view made before the write, as in the program
        written = replay(wb.written)
        # copy_'s meta kernel asks whether the view overlaps itself, which on symbolic sizes guards them
        # ('batch - 1 < 2'): a view of the program, which eager wrote through, does not; value has its sizes
        with _no_guards(rw):
            written.copy_(value)
        return tuple(views)

    shape_env = rw.fake_mode.shape_env
    known = dict(shape_env.replacements) if shape_env is not None else {}
    try:
        # symbolic: a size argument (narrow's length `batch - 1`) stays a graph value, not its example;
        # no_grad: a parameter written under no_grad (RWKV) is a leaf needing grad
        with rw.fake_mode, torch.no_grad(), _no_contiguity_guards():
            traced = make_fx(torch.func.functionalize(body, remove="mutations"), tracing_mode="symbolic")(
                *[n.meta["val"] for n in inputs]
            )
    except RuntimeError as e:  # a view torch's functionalization cannot invert
        first = str(e).strip().splitlines()[0]
        return f"torch's functionalization fails: {first}"
    fixed = [
        f"{a} = {b}"
        for a, b in (shape_env.replacements.items() if shape_env is not None else ())
        if a not in known and getattr(b, "is_number", False)
    ]
    if fixed:
        return f"replaying the views fixed symbolic sizes to their examples ({', '.join(fixed)}); re-export"
    return _tidy(traced) or traced


@contextlib.contextmanager
def _no_guards(rw: Rewriter) -> Iterator[None]:
    shape_env = rw.fake_mode.shape_env
    with shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _no_contiguity_guards() -> Iterator[None]:
    """make_fx records each traced value's `tensor_meta`, whose memory-format query asks `size == 1` of
    every dim: on a symbolic size whose example is 1 (`narrow(0, 1, batch - 1)` at batch 2) that guards
    the program's Dim to one size (a specialised program: 'Guard failed: -1 + x.size()[0] == 1'). The
    scratch trace's `tensor_meta` is never read (inlining recomputes values), and torch has no switch
    for it, so it is extracted without the contiguity query here."""
    extract = proxy_tensor._extract_tensor_metadata
    proxy_tensor._extract_tensor_metadata = functools.partial(extract, include_contiguity=False)
    try:
        yield
    finally:
        proxy_tensor._extract_tensor_metadata = extract


def _same_layout(a: Any, b: Any) -> bool:
    """Whether two tensors have the same sizes and strides (symbolic ones written alike)."""
    return compatible(a, b) is None and _sym_key(a.stride()) == _sym_key(b.stride())


def _contiguous(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and is_contiguous_or_false(value)  # no guard on symbolic sizes


def _tidy(traced: GraphModule) -> str | None:
    """Drop what the rule does itself from the scratch trace: functionalize's copy back into the traced
    base (`copy_` into a placeholder) and `aten.copy` of the new value onto a view of its own dtype,
    sizes and strides (the value itself). A copy onto other strides stays: it gives the written memory
    its layout back, as eager keeps it, and the base's new value its strides (a `reshape` of it read
    later views or copies as in eager: without it, a write through `permute` left the base strided so
    that a later `base.reshape(...).mul_()` was taken for a copy and its write was lost). Returns what
    is left that mutates, if anything."""
    graph = traced.graph
    for node in list(graph.nodes):
        if node.target is aten._unsafe_view.default and _contiguous(node.args[0].meta.get("val")):
            # functionalization writes a reshape that copies as clone + _unsafe_view and replays it after a
            # write as _unsafe_view of the new base: a view its schema does not declare, so a later write
            # through one replayed view missed the others (fuzz seed 13). On a contiguous input it is `view`.
            node.target = aten.view.default
        elif node.target is aten.copy_.default and node.args[0].op == "placeholder" and not node.users:
            graph.erase_node(node)
        elif node.target is aten.copy.default:
            dst, src = node.args[:2]
            if isinstance(src, Node) and _same_layout(dst.meta.get("val"), src.meta.get("val")):
                node.replace_all_uses_with(src)
                graph.erase_node(node)
    graph.eliminate_dead_code()
    left = [str(n.target) for n in graph.nodes if isinstance(n.target, OpOverload) and n.target._schema.is_mutable]
    return f"the traced write-back still mutates ({left})" if left else None
