"""Training-IR wrappers: grad-mode and autocast regions, metadata asserts.

`torch.export.export` (training IR) wraps `with torch.no_grad():` and
`with torch.autocast(...):` blocks in higher-order ops whose body is a
GraphModule on the graph's module (get_attr node name != target):

    wrap_with_set_grad_enabled(enabled, body, *operands)
    wrap_with_autocast(device_type, dtype, enabled, cache_enabled, body, *operands)

Both return a tuple read through `getitem`. Importers stop with
"NotImplementedError: Higher-order operation 'wrap_with_set_grad_enabled'
not implemented in the FxImporter" (or 'wrap_with_autocast').
`run_decompositions` inlines them, but leaves `aten._assert_tensor_metadata`
behind. `make_fx(..., pre_dispatch=True)` has no HOPs but raw
`torch._C._set_grad_enabled` and `_enter_autocast` / `_exit_autocast` calls;
`torch.export` keeps those raw autocast calls too when the block holds a
`torch.cond`.

- `inline_set_grad_enabled`: splice the body in. Grad mode changes no value
  in an inference graph; an in-place op of the body (seed 003: `y.add_(1)`
  under no_grad) lands on the outer value, in order, and the in-place pack
  makes it functional afterwards.
- `inline_autocast`: the body holds no casts (autocast applies them when the
  body runs), so it is re-traced with `make_fx` under
  `torch.autocast(device_type, dtype)` and the traced graph, casts included,
  is spliced in.
- `autocast_region`: the raw form; the nodes between `_enter_autocast` and
  its `_exit_autocast` are re-traced the same way (nested regions and
  grad-mode calls inside run while tracing; a cond inside is re-traced with
  casts in its branches, for the control-flow pack to inline).
- `drop_assert_tensor_metadata`, `drop_set_grad_enabled`: remove the nodes.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import Forward, rule
from fx_rewrites.ruleset import RuleSet
from fx_rewrites.subgraphs import graph_outputs, subgraph

aten = torch.ops.aten
wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled
wrap_with_autocast = torch.ops.higher_order.wrap_with_autocast
enter_autocast = torch.amp.autocast_mode._enter_autocast
exit_autocast = torch.amp.autocast_mode._exit_autocast
set_grad_enabled = torch._C._set_grad_enabled


def _error(hop: str) -> str:
    return f"NotImplementedError: Higher-order operation '{hop}' not implemented in the FxImporter"


def _body_at(node: Node, index: int) -> Any:
    if len(node.args) <= index:
        return Miss(f"expected the body at argument {index}, got {len(node.args)} arguments")
    body = subgraph(node.args[index])
    if body is None:
        return Miss(f"argument {index} is not a get_attr of a GraphModule")
    return body


def _has_body(node: Node, index: int) -> Any:
    body = _body_at(node, index)
    if isinstance(body, Miss):
        return body
    if any(u.target is not operator.getitem for u in node.users):
        return Miss("the result is read other than through getitem")
    return True


def _replace_outputs(rw: Rewriter, node: Node, outs: Any) -> None:
    rw.replace(node, list(pytree.tree_leaves(outs)))


def _retrace_under_autocast(rw: Rewriter, fn: Any, inputs: list[Node], autocast_args: tuple) -> GraphModule:
    """`fn(*inputs)` traced by make_fx under `torch.autocast(*autocast_args)`
    (device_type, dtype, enabled, cache_enabled), on the inputs' fake values:
    the casts autocast inserts become `_to_copy` nodes."""

    def under_autocast(*args: Any) -> Any:
        with torch.autocast(*autocast_args):
            return fn(*args)

    vals = [n.meta["val"] for n in inputs]
    with rw.fake_mode:
        return make_fx(under_autocast, tracing_mode="real")(*vals)


def _dtype_mismatch(traced: GraphModule, expected: list[Any]) -> Miss | None:
    """A Miss when the re-traced outputs' dtypes are not the graph's (e.g.
    autocast for a device type these tensors are not on)."""
    got = [n.meta.get("val") if isinstance(n, Node) else n for n in graph_outputs(traced)]
    for i, (g, e) in enumerate(zip(got, expected)):
        if isinstance(g, torch.Tensor) and isinstance(e, torch.Tensor) and g.dtype != e.dtype:
            return Miss(f"re-traced under autocast, output {i} is {g.dtype} but the graph says {e.dtype}")
    return None


# -- wrap_with_set_grad_enabled --------------------------------------------------


@rule(
    roots=(wrap_with_set_grad_enabled,),
    when=lambda node: _has_body(node, 1),
    doc=(
        "torch.no_grad() / torch.enable_grad() / torch._C._set_grad_enabled blocks in torch.export "
        "training IR become wrap_with_set_grad_enabled(enabled, body, *operands); splices the body in "
        "(grad mode changes no value in inference). In-place ops of the body stay in place on the outer "
        f"values. Fixes '{_error('wrap_with_set_grad_enabled')}'."
    ),
    tags=("wrappers", "training_ir"),
)
def inline_set_grad_enabled(node: Node, rw: Rewriter) -> Any:
    body = subgraph(node.args[1])
    # the body's values are computed in its grad mode: under no_grad it may write into a parameter
    # (RWKV's `_rescale_layers`: weight.div_(...)), which raises "a leaf Variable that requires grad is
    # being used in an in-place operation" with grad enabled
    with torch.set_grad_enabled(bool(node.args[0])):
        outputs = rw.inline(body, node.args[2:])
    _replace_outputs(rw, node, outputs)
    return None


# -- wrap_with_autocast -----------------------------------------------------------


def _autocast_ok(node: Node) -> Any:
    has_body = _has_body(node, 4)
    if isinstance(has_body, Miss):
        return has_body
    operands = node.args[5:]
    if not all(isinstance(o, Node) and "val" in o.meta for o in operands):
        return Miss("an operand is not a graph value with meta['val']")
    return True


@rule(
    roots=(wrap_with_autocast,),
    when=_autocast_ok,
    doc=(
        "torch.autocast blocks in torch.export training IR become wrap_with_autocast(device_type, dtype, "
        "enabled, cache_enabled, body, *operands), whose body has no casts. Re-traces the body with make_fx "
        "under torch.autocast so the _to_copy casts appear, and splices that in (plain inlining would "
        f"compute in float32 what autocast computes in bfloat16). Fixes '{_error('wrap_with_autocast')}'."
    ),
    tags=("wrappers", "training_ir", "autocast"),
)
def inline_autocast(node: Node, rw: Rewriter) -> Any:
    body = subgraph(node.args[4])
    operands = list(node.args[5:])
    traced = _retrace_under_autocast(rw, body, operands, tuple(node.args[:4]))
    miss = _dtype_mismatch(traced, list(pytree.tree_leaves(node.meta.get("val"))))
    if miss is not None:  # a Miss is falsy
        return miss
    _replace_outputs(rw, node, rw.inline(traced, operands))
    return None


# -- pre-dispatch make_fx: _enter_autocast ... _exit_autocast ----------------------


def _region(exit_node: Node) -> tuple[Node, list[Node]] | Miss:
    """The `_enter_autocast` node an exit closes and the nodes between them."""
    enter = exit_node.args[0] if exit_node.args else None
    if not isinstance(enter, Node) or enter.target is not enter_autocast:
        return Miss("the argument of _exit_autocast is not an _enter_autocast node")
    if len(enter.args) < 2:
        return Miss(f"_enter_autocast has {len(enter.args)} arguments, expected (device_type, dtype, ...)")
    open_regions = 0
    for n in enter.graph.nodes:  # is this region inside another one?
        if n is enter:
            break
        if n.target is enter_autocast:
            open_regions += 1
        elif n.target is exit_autocast:
            open_regions -= 1
    if open_regions:
        return Miss("nested in an outer autocast region, which is re-traced as a whole")
    inside: list[Node] = []
    n = enter.next
    while n is not exit_node:
        if n.op == "output":
            return Miss("_exit_autocast comes before its _enter_autocast")
        inside.append(n)
        n = n.next
    return enter, inside


#: calls without a value that a region may hold: they run while re-tracing.
_NO_VALUE_OK = frozenset({enter_autocast, exit_autocast, set_grad_enabled, aten._assert_tensor_metadata.default})


def _region_ok(node: Node) -> Any:
    """(the enter node, the nodes inside) of an autocast region whose nodes can be retraced."""
    found = _region(node)
    if isinstance(found, Miss):
        return found
    _, inside = found
    for n in inside:
        if n.op not in ("call_function", "get_attr"):
            return Miss(f"the region holds a {n.op} node ({n.name})")
        if n.op == "call_function" and "val" not in n.meta and n.target not in _NO_VALUE_OK:
            return Miss(f"{n.name} has no meta['val']")
    return found


@rule(
    roots=(exit_autocast,),
    when=_region_ok,
    doc=(
        "make_fx(..., pre_dispatch=True), and torch.export around a torch.cond, record torch.autocast as raw "
        "_enter_autocast / _exit_autocast calls around ops that carry no casts; importers reject the calls "
        "('NotImplementedError: FIX ME: Unimplemented call_function: target=<function _enter_autocast ...>') "
        "and dropping them changes dtypes. Re-traces the region under torch.autocast so the _to_copy casts "
        "appear, and splices it in."
    ),
    tags=("wrappers", "pre_dispatch", "autocast"),
)
def autocast_region(node: Node, rw: Rewriter, *, found: tuple[Node, list[Node]]) -> Any:
    enter, inside = found
    members = {n for n in inside if n.op == "call_function"} | {enter, node}
    # what the region reads: values from before it (or get_attrs inside it),
    # and the subgraphs of HOPs it holds (a cond under autocast)
    inputs: list[Node] = []
    bodies: dict[Node, GraphModule] = {}
    for n in inside:
        for a in [n] if n.op == "get_attr" else n.all_input_nodes:
            if a in members or a in inputs or a in bodies:
                continue
            body = subgraph(a)
            if body is not None:
                bodies[a] = body
            else:
                inputs.append(a)
    outputs = [n for n in inside if n.op == "call_function" and any(u not in members for u in n.users)]
    if any("val" not in a.meta for a in inputs):
        return Miss("a value the region reads has no meta['val']")

    root = torch.nn.Module()
    graph = Graph()
    env: dict[Node, Node] = {a: graph.placeholder(a.name) for a in inputs}
    for i, (a, body) in enumerate(bodies.items()):
        root.add_module(f"body_{i}", body)
        env[a] = graph.get_attr(f"body_{i}")
    for n in inside:
        if n.op == "call_function":
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    region = GraphModule(root, graph)

    traced = _retrace_under_autocast(rw, region, inputs, tuple(enter.args))
    miss = _dtype_mismatch(traced, [o.meta["val"] for o in outputs])
    if miss is not None:  # a Miss is falsy
        return miss
    new = pytree.tree_leaves(rw.inline(traced, inputs))
    for old, value in zip(outputs, new):
        rw.replace(old, value)
    for n in members:
        if n not in outputs:
            rw.erase(n)
    return None


# -- nodes that only assert or set state ------------------------------------------------

drop_assert_tensor_metadata = Forward(
    name="drop_assert_tensor_metadata",
    ops=(aten._assert_tensor_metadata.default,),
    doc=(
        "aten._assert_tensor_metadata (from x.to(dtype) and autocast in torch.export training IR; it "
        "survives run_decompositions) returns nothing and checks dtype/device/layout the graph's values "
        "already fix. Removed: it breaks graphs re-run or rewritten with other dtypes ('RuntimeError: Tensor "
        "dtype mismatch! Expected: BFloat16, Got: float', pytorch#151001) and backends without a lowering "
        "for it."
    ),
    tags=("wrappers", "training_ir"),
)

drop_set_grad_enabled = Forward(
    name="drop_set_grad_enabled",
    ops=(set_grad_enabled,),
    doc=(
        "make_fx(..., pre_dispatch=True) records torch.no_grad() as raw torch._C._set_grad_enabled(False) "
        "/ (True) calls; grad mode changes no value in inference, so they are removed ('NotImplementedError: "
        "FIX ME: Unimplemented call_function: target=<built-in function _set_grad_enabled>')."
    ),
    tags=("wrappers", "pre_dispatch"),
)


RULES = RuleSet(
    [inline_set_grad_enabled, inline_autocast, autocast_region, drop_assert_tensor_metadata, drop_set_grad_enabled],
    name="wrappers",
)
