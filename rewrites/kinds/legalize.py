"""Legality-driven decomposition: an op the backend cannot lower is replaced by torch's own decomposition.

One mechanism instead of a rule per op. The backend says which ops it
cannot lower (IREE: measured, `fx_rewrites.backends.iree.legality`); every
such op that has a decomposition (`fx_rewrites.decompositions`: torch's table,
then the ones torch lacks, then the op's CompositeImplicitAutograd kernel)
becomes a root of one rule, which
inlines that op's decomposition alone, traced on the node's own fake values
and functionalized. What the decomposition emits is offered to the rule
again, so the fixpoint decomposes until every op left is legal or has no
decomposition (the backend's compile error then names it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch._decomp
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
from fx_rewrites.kinds import FunctionRule

#: ops torch's table decomposes into themselves or that must stay whole (no op is listed today)
_KEEP: frozenset[str] = frozenset()


def decomposition(op: Any) -> Callable[..., Any] | None:
    """`op`'s decomposition (`fx_rewrites.decompositions`: torch's, else one torch lacks), unless kept whole."""
    if not isinstance(op, OpOverload) or str(op) in _KEEP:
        return None
    return decompositions.decomposition(op)


def resolve(names: Iterable[str]) -> list[OpOverload]:
    """The OpOverloads of `names` ("aten.xlogy.Tensor") that exist in this torch."""
    ops = []
    for name in names:
        try:
            ops.extend(op for op in schema.resolve_op(name) if isinstance(op, OpOverload))
        except schema.SchemaError:
            continue  # an op of another torch version
    return ops


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
        val = arg.meta.get("val") if isinstance(arg, Node) else None
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


def _inline(
    node: Node, rw: Rewriter, illegal: frozenset[Any] = frozenset(), lowered: frozenset[str] = frozenset()
) -> Any:
    fn = decomposition(node.target)
    if fn is None:
        return Miss(f"neither torch nor fx_rewrites.decompositions decomposes {schema.op_name(node.target)}")
    why_not = _inlinable(node)
    if why_not is not None:
        return why_not
    traced = trace_decomposition(node, fn, rw.fake_mode)
    if isinstance(traced, Miss):
        return traced
    graph, inputs = traced
    specialised = _specialises(node, graph)
    if specialised:
        return Miss(
            f"the decomposition of {schema.op_name(node.target)} {specialised}, which would turn the "
            "program's dynamic sizes static: the op is left as it is"
        )
    stuck = _dead_end(graph, illegal, lowered)
    if stuck:
        return Miss(
            f"the decomposition of {schema.op_name(node.target)} needs {stuck}, which the backend "
            "cannot lower and nothing decomposes: the op is left as it is"
        )
    # data-dependent sizes (nonzero, argwhere): the decomposition's own unbacked symbols cannot be proven
    # equal to the node's, so the replacement is checked for dtype and rank only
    rw.replace(node, rw.inline(graph, inputs), same_shape=not _unbacked(node.meta.get("val")))
    return None


def legalize(
    illegal: Iterable[str], *, name: str, backend: str, lowered: Iterable[str] = (), tags: Iterable[str] = ()
) -> FunctionRule:
    """One rule decomposing every op of `illegal` (op names, "aten.xlogy.Tensor") that torch can decompose.

    `lowered` names ops seen lowering: a torch primitive (prims.*) outside it is taken for one the backend
    cannot take, and a decomposition that needs it is declined.

    `backend` names the backend in the rule's doc ("IREE 3.13"). Ops of
    `illegal` without a decomposition are not roots: they stay, and the
    backend's error names them.
    """
    known = frozenset(resolve(illegal))
    roots = [op for op in known if decomposition(op) is not None]
    return FunctionRule(
        fn=functools.partial(_inline, illegal=known, lowered=frozenset(lowered)),
        ops=tuple(roots),
        name=name,
        when=None,
        doc=(
            f"Ops {backend} cannot lower (measured), each replaced by torch's own decomposition of that op "
            "alone (torch._decomp, else fx_rewrites.decompositions.MISSING, else its CompositeImplicitAutograd "
            "kernel), repeatedly until what is left "
            f"lowers: {len(roots)} ops, e.g. aten.multiply/subtract (aliases), aten.im2col (nn.Unfold), "
            'aten.xlogy, aten.nll_loss_nd. The error they meet otherwise: "failed to legalize operation '
            "'torch.operator' that was explicitly marked illegal\" or \"failed to legalize operation "
            "'torch.aten.xlogy.Tensor'\"."
        ),
        tags=frozenset({"legalize", *tags}),
    )


def legalize_form(
    ops: Iterable[OpOverload],
    *,
    when: Callable[[Node], Any],
    name: str,
    doc: str,
    illegal: Iterable[str] = (),
    lowered: Iterable[str] = (),
    tags: Iterable[str] = (),
) -> FunctionRule:
    """A rule decomposing `ops` (torch's own decomposition, as `legalize` does) only in the forms `when`
    accepts: for ops the backend lowers in some forms and fails in others."""
    return FunctionRule(
        fn=functools.partial(_inline, illegal=frozenset(resolve(illegal)), lowered=frozenset(lowered)),
        ops=tuple(ops),
        name=name,
        when=when,
        doc=doc,
        tags=frozenset({"legalize", *tags}),
    )
