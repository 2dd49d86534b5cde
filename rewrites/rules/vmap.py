"""`torch.vmap` in forward: export keeps the transform as Python calls.

`torch.export.export` (the training IR of torch 2.13) records a `torch.vmap`
it traces as calls to `torch._functorch.predispatch`:
`_vmap_increment_nesting(batch_size, randomness)`,
`_add_batch_dim(x, in_dim, level)`, the body on per-example values,
`_remove_batch_dim(y, level, batch_size, out_dim)` and
`_vmap_decrement_nesting()`, with `lazy_load_decompositions()` before each
level. Indexing inside the body comes through `higher_order.flat_apply` of
dynamo's `ModIndex`. transformers' mask code does this (`create_causal_mask`
vmaps the mask function over batch, head, query and key: GPT-2, Llama and
every model built on `masking_utils`).

None of these is an ATen op. IREE's importer stops at the first one:
"NotImplementedError: FIX ME: Unimplemented call_function:
target=<function lazy_load_decompositions ...>"; `run_decompositions`
removes them only by retracing the whole program.

`inline_vmap` retraces one vmap region (the outermost increment to its
matching decrement, nested levels included) with `make_fx` on the nodes'
fake values, so functorch's batching rules turn the body into plain ATen ops
on whole tensors, and inlines the result in place of the region.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._functorch import predispatch
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from fx_rewrites.engine import Miss, Rewriter, values
from fx_rewrites.kinds import Forward, rule
from fx_rewrites.ruleset import RuleSet

INCREMENT = predispatch._vmap_increment_nesting
DECREMENT = predispatch._vmap_decrement_nesting
ADD_BATCH_DIM = predispatch._add_batch_dim
REMOVE_BATCH_DIM = predispatch._remove_batch_dim

ERROR_TEXT = "NotImplementedError: FIX ME: Unimplemented call_function: target=<function lazy_load_decompositions"


def _region(start: Node) -> list[Node] | Miss:
    """The nodes from `start` (an increment) to its matching decrement, in graph order."""
    depth, nodes = 0, []
    node: Node | None = start
    while node is not None and node.op != "output":
        nodes.append(node)
        if node.target is INCREMENT:
            depth += 1
        elif node.target is DECREMENT:
            depth -= 1
            if depth == 0:
                return nodes
        node = node.next
    return Miss(f"{start.name} has no matching _vmap_decrement_nesting")


def _outermost(node: Node) -> bool | Miss:
    """`node` (an increment) is not inside another vmap level."""
    depth = 0
    prev = node.prev
    while prev.op != "root":
        if prev.target is DECREMENT:
            depth += 1
        elif prev.target is INCREMENT:
            if depth == 0:
                return Miss(f"inside the vmap level opened by {prev.name}; rewritten with it")
            depth -= 1
        prev = prev.prev
    return True


def _retrace(region: list[Node], inputs: list[Node], outputs: list[Node], module: Any) -> GraphModule:
    """Run the region under make_fx: the vmap levels run for real, so their
    batching rules leave ATen ops on whole tensors in the trace."""
    functorch = torch._C._functorch
    predispatch.lazy_load_decompositions()  # the batching rules some ops need (what the dropped calls did)

    def body(*vals: Any) -> list[Any]:
        env: dict[Node, Any] = dict(zip(inputs, vals))

        def read(n: Node) -> Any:
            if n not in env and n.op == "get_attr":
                env[n] = values.fetch_attr(module, str(n.target))
            return env[n]

        live: list[int] = []  # functorch levels open now, innermost last
        levels: dict[int, int] = {}  # the level export recorded -> the live one
        try:
            for n in region:
                if n.op == "get_attr":
                    read(n)
                    continue
                args = pytree.tree_map_only(Node, read, n.args)
                kwargs = pytree.tree_map_only(Node, read, n.kwargs)
                if n.target is INCREMENT:
                    live.append(functorch._vmap_increment_nesting(*args, **kwargs))
                    env[n] = live[-1]
                elif n.target is DECREMENT:
                    functorch._vmap_decrement_nesting()
                    live.pop()
                    env[n] = None
                elif n.target is ADD_BATCH_DIM:
                    x, dim, level = args
                    level = levels.setdefault(level, live[-1])
                    env[n] = functorch._add_batch_dim(x, dim + x.dim() if dim < 0 else dim, level)
                elif n.target is REMOVE_BATCH_DIM:
                    x, level, batch_size, out_dim = args
                    env[n] = functorch._remove_batch_dim(x, levels.get(level, live[-1]), batch_size, out_dim)
                else:
                    env[n] = n.target(*args, **kwargs)
        finally:
            for _ in live:  # a failed trace must not leave functorch levels open
                functorch._vmap_decrement_nesting()
        return [env[o] for o in outputs]

    return make_fx(body, tracing_mode="real")(*[n.meta["val"] for n in inputs])


@rule(
    roots=(INCREMENT,),
    when=_outermost,
    tags={"vmap"},
    doc=(
        "torch.vmap in forward (transformers' create_causal_mask) exports as torch._functorch.predispatch "
        "calls (_vmap_increment_nesting, _add_batch_dim, ..., lazy_load_decompositions), which are not ATen "
        "ops; the region is retraced with its batching rules into ATen ops on whole tensors. IREE: "
        f'"{ERROR_TEXT} ...>".'
    ),
)
def inline_vmap(node: Node, rw: Rewriter) -> Any:
    region = _region(node)
    if isinstance(region, Miss):
        return region
    inside = set(region)
    inputs: list[Node] = []
    attrs: list[Node] = []
    for n in region:
        for arg in n.all_input_nodes:
            if arg in inside:
                continue
            group = attrs if arg.op == "get_attr" else inputs
            if arg not in group:
                group.append(arg)
    missing = [n.name for n in inputs if not isinstance(n.meta.get("val"), (torch.Tensor, torch.SymInt))]
    if missing:
        return Miss(f"inputs {missing} carry no tensor or SymInt value")
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    with rw.fake_mode:
        traced = _retrace(region, inputs, outputs, rw.graph.owning_module)
    new = rw.inline(traced, inputs)
    for old, value in zip(outputs, new, strict=True):
        rw.replace(old, value)
    for n in reversed(region):
        rw.erase(n)
    for n in attrs:  # get_attrs outside the region that only it read (dynamo's ModIndex specs)
        if all(u in inside for u in n.users):
            rw.erase(n)
    return None


drop_lazy_load_decompositions = Forward(
    name="drop_lazy_load_decompositions",
    ops=predispatch.lazy_load_decompositions,
    tags={"vmap"},
    doc=(
        "lazy_load_decompositions() (before each vmap level) only registers batching rules in the "
        "tracing process; it returns nothing and the graph needs none of it. IREE: "
        f'"{ERROR_TEXT} ...>".'
    ),
)

RULES = RuleSet([inline_vmap, drop_lazy_load_decompositions], name="vmap")
