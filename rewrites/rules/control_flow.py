"""torch.cond: inline the branches so backends without control flow accept it.

`torch.cond(pred, true_fn, false_fn, (x,))` exports as
`cond = torch.ops.higher_order.cond(pred, true_graph_0, false_graph_0, (x,))`
read through `getitem(cond, i)`; the branches are `get_attr` nodes naming
GraphModules on the graph's module (no `meta["val"]`). It survives
`run_decompositions`, and importers without a lowering for it stop with
"NotImplementedError: Higher-order operation 'cond' not implemented in the
FxImporter".

Two rules:

- `cond_constant_predicate`: the predicate is a Python bool, a SymBool the
  shape environment decides (`s77 > 1` when s77 >= 2), or a constant 0-d
  tensor; the taken branch is inlined and the report says the cond was
  specialised (seed 002).
- `cond_to_where`: any other predicate, when both branches are free of side
  effects and give outputs of equal shapes and dtypes: both branches are
  inlined and each output is `aten.where.self(pred, t, f)`, with a SymBool
  predicate turned into a 0-d bool tensor by `aten.scalar_tensor`.

Nested conds need nothing special: inlining a branch copies its inner cond
into the outer graph, and the engine visits the new node.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_false, statically_known_true
from torch.utils import _pytree as pytree

from fx_rewrites.engine import Miss, Rewriter, values
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet
from fx_rewrites.subgraphs import graph_outputs, subgraph, walk

aten = torch.ops.aten
cond = torch.ops.higher_order.cond

ERROR_TEXT = "NotImplementedError: Higher-order operation 'cond' not implemented in the FxImporter"

#: ops whose schema says "mutates" but that change no value: harmless to run
#: in a branch that is not taken.
HARMLESS_IMPURE = frozenset({aten._assert_tensor_metadata.default, aten.detach_.default})

#: value-preserving ops a constant predicate may pass through.
_PASS_THROUGH = frozenset(
    {
        aten.lift_fresh_copy.default,
        aten.detach.default,
        aten.detach_.default,
        aten.clone.default,
        aten.alias.default,
    }
)


# -- subgraphs ------------------------------------------------------------------


def side_effects(gm: GraphModule) -> list[str]:
    """The ops of `gm` (nested bodies included) that mutate, assert or draw
    random numbers: running them when their branch is not taken is visible."""
    found = []
    for n in walk(gm):
        if n.op == "call_function" and n.target not in HARMLESS_IMPURE and n.is_impure():
            found.append(f"{n.name} ({getattr(n.target, '__name__', n.target)})")
    return found


def dtype_mismatch(node: Node, new: Sequence[Any]) -> Miss | None:
    """A Miss when inlined values differ in dtype from what `node` says it
    returns: the body ran under a mode (autocast) the graph does not record."""
    for i, (old, value) in enumerate(zip(pytree.tree_leaves(node.meta.get("val")), new)):
        got = value.meta.get("val") if isinstance(value, Node) else value
        if isinstance(old, torch.Tensor) and isinstance(got, torch.Tensor) and old.dtype != got.dtype:
            return Miss(
                f"inlined, output {i} is {got.dtype} but {node.name!r} gives {old.dtype}: "
                "the body ran under a mode the graph does not record (an enclosing autocast?)"
            )
    return None


# -- predicates -----------------------------------------------------------------


def _constant_tensor(node: Node) -> torch.Tensor | None:
    """The value of a constant tensor node: a lifted constant (its fake value
    keeps `.constant`) or a get_attr of a real tensor, reached through
    copies and detaches that nothing else mutates."""
    chain = [node]
    while node.op == "call_function" and node.target in _PASS_THROUGH and node.args and isinstance(node.args[0], Node):
        node = node.args[0]
        chain.append(node)
    for i, link in enumerate(chain):
        allowed = {chain[i - 1]} if i else set()
        for user in link.users:
            if user in allowed or user.op != "call_function" or user.target is cond:
                continue
            if user.target not in HARMLESS_IMPURE and user.is_impure():
                return None  # something may write to the constant
    value: Any = None
    if node.op == "get_attr":
        value = values.attr_of(node)
    else:
        value = getattr(node.meta.get("val"), "constant", None)
    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and value.numel() == 1:
        return value
    return None


def static_predicate(pred: Any) -> tuple[bool, str] | None:
    """(value, why) when the predicate's value is known before run time."""
    if isinstance(pred, (bool, int)):
        return bool(pred), "it is a Python constant"
    if not isinstance(pred, Node):
        return None
    val = pred.meta.get("val")
    if isinstance(val, bool):
        return val, "its value is a constant"
    if isinstance(val, torch.SymBool):
        if statically_known_true(val):
            return True, f"{val} holds for every allowed shape"
        if statically_known_false(val):
            return False, f"{val} fails for every allowed shape"
        return None
    if isinstance(val, torch.Tensor):
        const = _constant_tensor(pred)
        if const is not None:
            return bool(const.item()), f"it is the constant tensor {const.item()!r}"
    return None


def _cond_parts(node: Node) -> tuple[Any, GraphModule, GraphModule, tuple] | Miss:
    if len(node.args) != 4:
        return Miss(f"expected cond(pred, true_fn, false_fn, operands), got {len(node.args)} arguments")
    pred, t, f, operands = node.args
    true_gm, false_gm = subgraph(t), subgraph(f)
    if true_gm is None or false_gm is None:
        return Miss("a branch is not a get_attr of a GraphModule")
    if any(u.target is not operator.getitem for u in node.users):
        return Miss("the result is read other than through getitem")
    return pred, true_gm, false_gm, tuple(operands)


def _same_value_type(a: Any, b: Any) -> str | None:
    """None when branch outputs `a` and `b` (fake values) can be selected
    between with `where`; else what differs."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return f"an output is not a tensor ({type(a).__name__}, {type(b).__name__})"
    if a.dtype != b.dtype:
        return f"dtypes differ ({a.dtype} vs {b.dtype})"
    if a.dim() != b.dim() or not all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape)):
        return f"shapes differ ({tuple(a.shape)} vs {tuple(b.shape)})"
    return None


# -- rules ----------------------------------------------------------------------


def _is_static(node: Node) -> Any:
    """(cond's parts, the predicate's value, why it is known), or a Miss."""
    parts = _cond_parts(node)
    if isinstance(parts, Miss):
        return parts
    known = static_predicate(parts[0])
    return (parts, *known) if known is not None else Miss("the predicate is only known at run time")


@rule(
    roots=(cond,),
    priority=10,
    when=_is_static,
    doc=(
        "torch.cond whose predicate is known when the graph is built (a Python bool, a SymBool the "
        "shape ranges decide such as x.shape[0] > 1 with Dim(min=2), or a constant tensor): inlines the "
        "taken branch and notes that the cond was specialised. Fixes "
        f"'{ERROR_TEXT}'."
    ),
    tags=("control_flow", "cond"),
)
def cond_constant_predicate(node: Node, rw: Rewriter, *, found: Any) -> Any:
    (pred, true_gm, false_gm, operands), value, why = found
    outs = pytree.tree_leaves(rw.inline(true_gm if value else false_gm, operands))
    miss = dtype_mismatch(node, outs)
    if miss is not None:  # a Miss is falsy
        return miss
    rw.replace(node, outs)
    rw.note(
        f"cond {node.name!r} specialised to its {'true' if value else 'false'} branch: "
        f"the predicate {getattr(pred, 'name', pred)!r} is always {value} ({why}); "
        "the other branch is gone from the graph"
    )
    return None


def _selectable(node: Node) -> Any:
    """cond's parts when both branches can be computed and selected between, or a Miss."""
    parts = _cond_parts(node)
    if isinstance(parts, Miss):
        return parts
    pred, true_gm, false_gm, _ = parts
    pval = pred.meta.get("val") if isinstance(pred, Node) else pred
    if isinstance(pval, torch.Tensor):
        if pval.numel() != 1:
            return Miss(f"the predicate tensor has {pval.numel()} elements")
    elif not isinstance(pval, torch.SymBool):
        return Miss(f"the predicate is a {type(pval).__name__}, not a tensor or SymBool")
    for name, gm in (("true", true_gm), ("false", false_gm)):
        effects = side_effects(gm)
        if effects:
            return Miss(f"the {name} branch has side effects, so it cannot run when not taken: {effects[:3]}")
    t_out, f_out = graph_outputs(true_gm), graph_outputs(false_gm)
    if len(t_out) != len(f_out):
        return Miss(f"the branches return {len(t_out)} and {len(f_out)} values")
    for i, (t, f) in enumerate(zip(t_out, f_out)):
        tv = t.meta.get("val") if isinstance(t, Node) else t
        fv = f.meta.get("val") if isinstance(f, Node) else f
        if tv is None or fv is None:
            return Miss(f"output {i} of a branch has no meta['val'] to compare")
        why = _same_value_type(tv, fv)
        if why:
            return Miss(f"output {i}: {why}")
    return parts


def _predicate_tensor(rw: Rewriter, pred: Node) -> Node:
    """`pred` as a 0-d bool tensor."""
    val = pred.meta["val"]
    if isinstance(val, torch.SymBool):
        return rw.call(aten.scalar_tensor.default, pred, dtype=torch.bool)
    if val.dim() != 0:
        pred = rw.call(aten.view.default, pred, [])
    if val.dtype != torch.bool:
        pred = rw.call(aten.ne.Scalar, pred, 0)
    return pred


@rule(
    roots=(cond,),
    when=_selectable,
    doc=(
        "torch.cond on a tensor or symbolic predicate whose branches have no side effects and equal "
        "output shapes and dtypes: computes both branches and picks each output with "
        "aten.where.self(pred, true_out, false_out). Fixes "
        f"'{ERROR_TEXT}'."
    ),
    tags=("control_flow", "cond"),
)
def cond_to_where(node: Node, rw: Rewriter, *, found: Any) -> Any:
    pred, true_gm, false_gm, operands = found
    p = _predicate_tensor(rw, pred)
    t_out = pytree.tree_leaves(rw.inline(true_gm, operands))
    f_out = pytree.tree_leaves(rw.inline(false_gm, operands))
    miss = dtype_mismatch(node, t_out)
    if miss is None:
        miss = dtype_mismatch(node, f_out)
    if miss is not None:
        return miss
    rw.replace(node, [rw.call(aten.where.self, p, t, f) for t, f in zip(t_out, f_out)])
    return None


RULES = RuleSet([cond_constant_predicate, cond_to_where], name="control_flow")
