"""Targeted decomposition: replace one op by its decomposition, traced on the node's own values.

Unlike `ExportedProgram.run_decompositions`, only the nodes of the named
ops are touched: the decomposition (`fx_rewrites.decompositions`: torch's
table, the ones torch lacks, the op's CompositeImplicitAutograd kernel; or
the rule's own `table`) is traced with `make_fx` on the node's fake values,
functionalized, checked (same dtypes and ranks, no call of the op itself, no
size it fixes) and inlined in place of the node. The one decomposition path:
`Decompose` rules and the legality-driven phase (`kinds.legalize`, which
builds `Decompose` rules from a backend's list of ops it cannot lower) share it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import attrs
import torch
from torch._C import DispatchKey
from torch._dispatch.python import enable_python_dispatcher
from torch._ops import OpOverload
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from fx_rewrites import decompositions, schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds.base import RuleBase, as_tuple


def decomposition(op: Any) -> Callable[..., Any] | None:
    """`op`'s decomposition (`fx_rewrites.decompositions`: torch's table, the ones torch lacks, then the op's
    own CompositeImplicitAutograd kernel), None for anything but an OpOverload."""
    return decompositions.decomposition(op) if isinstance(op, OpOverload) else None


def _mutates(gm: GraphModule) -> list[str]:
    return [
        schema.op_name(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, OpOverload) and n.target._schema.is_mutable
    ]


def trace_decomposition(node: Node, fn: Callable[..., Any], fake_mode: Any) -> tuple[GraphModule, list[Node]] | Miss:
    """`fn` applied to `node`'s arguments, traced into a functional graph on their fake values; and the
    graph's inputs (the node's tensor-valued arguments). A Miss when it cannot be traced."""
    body, graph_values = schema.over_graph_values(node, fn)
    inputs = [n.meta.get("val") for n in graph_values]
    if any(v is None for v in inputs):
        return Miss("an argument has no meta['val']")
    op = schema.op_name(node.target)
    try:
        with fake_mode, enable_python_dispatcher():
            traced = make_fx(body, tracing_mode="real")(*inputs)
            if _mutates(traced):
                traced = make_fx(torch.func.functionalize(body, remove="mutations"), tracing_mode="real")(*inputs)
    except Exception as e:  # torch's decomposition rejects these arguments
        text = " ".join(str(e).split())[:200]
        return Miss(f"the decomposition of {op} raised {type(e).__name__}: {text}")
    out = traced.graph.output_node().args[0]
    if out is NotImplemented or (isinstance(out, (list, tuple)) and NotImplemented in out):
        return Miss(f"the decomposition of {op} declined these arguments")
    still = _mutates(traced)
    if still:
        return Miss(f"the decomposition of {op} writes to its inputs ({still[0]})")
    if any(n.op == "call_function" and n.target is node.target for n in traced.graph.nodes):
        return Miss(f"the decomposition of {op} calls {op} itself")
    returned: list[Node] = []
    map_arg(out, returned.append)
    mismatch = _mismatch(node.meta.get("val"), [n.meta.get("val") for n in returned])
    if mismatch:
        return Miss(f"the decomposition of {op} returns other values: {mismatch}")
    return traced, graph_values


def _mismatch(expected: Any, got: list[Any]) -> str:
    """How the decomposition's outputs differ in dtype or rank from the node's ("" when they do not)."""
    wanted = [v for v in pytree.tree_leaves(expected) if isinstance(v, torch.Tensor)]
    if not all(isinstance(v, torch.Tensor) for v in got):
        return ""  # a structure (torch.return_types): the engine checks the values it unpacks to
    if len(wanted) != len(got):
        return f"{len(got)} tensors for {len(wanted)}"
    for i, (w, g) in enumerate(zip(wanted, got)):
        if w.dtype != g.dtype or w.dim() != g.dim():
            return f"output {i} is {g.dtype} rank {g.dim()}, the op gives {w.dtype} rank {w.dim()}"
    return ""


def _unbacked(value: Any) -> bool:
    """Whether a value's sizes hold data-dependent (unbacked) symbols."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            for size in leaf.shape:
                if isinstance(size, torch.SymInt) and free_unbacked_symbols(size):
                    return True
    return False


def _inlinable(node: Node) -> Miss | None:
    """Why `node`'s decomposition cannot be inlined in its place, if it cannot."""
    returns = [r.type for r in node.target._schema.returns]
    if any(isinstance(t, torch.ListType) for t in returns) and len(returns) > 1:
        return Miss("it returns a tensor list inside a tuple, which a replacement cannot stand for")
    for arg in pytree.tree_leaves((node.args, dict(node.kwargs))):
        val = fake_value(arg)
        if isinstance(val, torch.Tensor) and val.layout != torch.strided:
            return Miss(f"a {val.layout} input (decompositions trace strided tensors only)")
    return None


def _dead_end(graph: GraphModule, illegal: frozenset[Any], lowered: frozenset[str]) -> str:
    """A call in `graph` the backend cannot take and nothing decomposes ("" when none): an illegal op without
    a decomposition, a torch primitive (prims.div) never seen lowering, a Python function other than the
    `operator` module's (torch.sym_float)."""
    for n in graph.graph.nodes:
        if n.op != "call_function":
            continue
        if not isinstance(n.target, OpOverload):
            module = getattr(n.target, "__module__", None) or ""
            if module != "_operator" and not module.startswith("torch.return_types") and not isinstance(n.target, type):
                return schema.op_name(n.target)
            continue
        if decomposition(n.target) is not None:
            continue
        if n.target in illegal or (n.target.namespace == "prims" and str(n.target) not in lowered):
            return schema.op_name(n.target)
    return ""


def _registered(op: OpOverload) -> bool:
    try:
        op.has_kernel_for_dispatch_key(DispatchKey.CompositeImplicitAutograd)
    except RuntimeError:
        return False
    return True


def _specialises(node: Node, graph: GraphModule) -> str:
    """How the traced decomposition fixes the node's symbolic sizes ("" when it does not seem to): a size
    query make_fx records as an op the dispatcher does not know (aten.size.default: torch.kron, torch.gradient
    and linalg.multi_dot with Dim sizes, whose sizes torch.export itself already fixed)."""
    for n in graph.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, OpOverload) and not _registered(n.target):
            return f"reads sizes through {schema.op_name(n.target)}"
    return ""


@attrs.frozen(kw_only=True)
class Decompose(RuleBase):
    """Inline the decomposition of each op in `ops`.

    - `table` maps ops to decomposition functions; by default
      `fx_rewrites.decompositions` (torch's table, the ones torch lacks, the
      op's CompositeImplicitAutograd kernel). Every op must have one.
    - `illegal` (ops) and `lowered` (op names): what the backend cannot take
      and the torch primitives it was seen lowering. Given `lowered`, a
      decomposition that needs an illegal op nothing decomposes, a primitive
      outside `lowered` or a Python function is declined (the op stays, and
      the backend's error names it); without it, nothing is judged.
    """

    ops: tuple[Any, ...] = attrs.field(converter=as_tuple)
    table: Mapping[Any, Callable[..., Any]] | None = attrs.field(default=None, eq=False, repr=False)
    illegal: frozenset[Any] = attrs.field(default=frozenset(), converter=frozenset, repr=False)
    lowered: frozenset[str] | None = attrs.field(
        default=None, converter=attrs.converters.optional(frozenset), repr=False
    )

    def _build(self) -> tuple[Hashable, ...]:
        ops = schema.resolve_ops(self.ops)
        missing = [schema.op_name(op) for op in ops if self._decomposition(op) is None]
        if missing:
            raise ValueError(f"no decomposition for {missing}; pass table={{op: fn}}")
        self._set("ops", ops)
        return ops

    def _decomposition(self, op: Any) -> Callable[..., Any] | None:
        """From `table`, else looked up when the rule runs (a decomposition registered later is found)."""
        return decomposition(op) if self.table is None else self.table.get(op)

    def _default_name(self) -> str:
        return f"decompose_{self.ops[0]._opname}"

    def rewrite(self, node: Node, match: Any, rw: Rewriter) -> Any:
        op = schema.op_name(node.target)
        why_not = _inlinable(node)
        if why_not is not None:
            return why_not
        fn = self._decomposition(node.target)
        if fn is None:
            return Miss(f"neither torch nor fx_rewrites.decompositions decomposes {op}")
        traced = trace_decomposition(node, fn, rw.fake_mode)
        if isinstance(traced, Miss):
            return traced
        graph, inputs = traced
        specialised = _specialises(node, graph)
        if specialised:
            return Miss(
                f"the decomposition of {op} {specialised}, which would turn the program's dynamic sizes static: "
                "the op is left as it is"
            )
        stuck = "" if self.lowered is None else _dead_end(graph, self.illegal, self.lowered)
        if stuck:
            return Miss(
                f"the decomposition of {op} needs {stuck}, which the backend cannot lower and nothing "
                "decomposes: the op is left as it is"
            )
        # data-dependent sizes (nonzero, argwhere): the decomposition's own unbacked symbols cannot be proven
        # equal to the node's, so the replacement is checked for dtype and rank only
        rw.replace(node, rw.inline(graph, inputs), same_shape=not _unbacked(node.meta.get("val")))
        return None
