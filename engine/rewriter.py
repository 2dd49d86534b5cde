"""The Rewriter: how a rule changes a graph, as one transaction.

A rule never edits the graph directly. It asks the Rewriter to insert nodes
(`call`, `getitem`, `inline`, `attr`) and to `replace` or `erase` nodes. New
nodes go in just before the root node, get `meta["val"]` by running their op
under the graph's fake mode, and carry provenance in `meta["rewrites"]`.
Replacements and erasures are only recorded; `commit` checks them and then
applies them. `rollback` removes everything the rule inserted, leaving the
graph as it was.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from fx_rewrites.engine import fxgraph, layouts, values

#: meta keys a new node inherits from the node it replaces (source locations
#: and module paths, so backend errors still point at the user's code).
INHERITED_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn")


def _substitute(arg: Any, env: dict[Node, Any]) -> Any:
    """`arg` with every node replaced by `env[node]` (fx's map_arg is C++;
    pytree's tree_map was a tenth of a rewrite in profiles of large graphs)."""
    return map_arg(arg, env.__getitem__)


def _plan(graph: Graph) -> tuple[list[Node], list[Node], Node | None]:
    """What `inline` needs of a graph it copies: the placeholders, the other
    nodes in order, and the node a `modify=` target can become in place (the
    single output, a call read by nothing else), if any."""
    nodes = list(graph.nodes)
    out = graph.output_node().args[0] if nodes and nodes[-1].op == "output" else None
    reusable = out if isinstance(out, Node) and out.op == "call_function" and len(out.users) == 1 else None
    return [n for n in nodes if n.op == "placeholder"], [n for n in nodes if n.op != "placeholder"], reusable


def _nested_nodes(arg: Any) -> list[Node]:
    """Every node inside `arg` (tuples, lists, dicts)."""
    found: list[Node] = []
    map_arg(arg, found.append)
    return found


_pure_targets: dict[int, bool] = {}


def _impure(node: Node) -> bool:
    """`node.is_impure()`, remembered per ATen op (it inspects the op's
    schema and effects each time: a tenth of a rewrite in profiles). Other
    targets (higher-order ops: purity depends on arguments) are asked anew."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return node.is_impure()
    known = _pure_targets.get(id(node.target))  # ops live as long as torch.ops
    if known is None:
        known = _pure_targets[id(node.target)] = not node.is_impure()
    return not known


class CheckFailed(Exception):
    """A recorded rewrite failed the structural check (internal)."""


@attrs.frozen
class _Replacement:
    """`new` stands in for `old` for all its users, or those after `after`."""

    old: Node
    new: Any
    same_shape: bool = True
    after: Node | None = None
    #: the value `old`'s users (those after `after`) saw, when not old's own
    #: (an op that resizes its out= argument or changes a tensor's shape in place)
    reference: Any = None

    def users(self) -> list[Node]:
        users = list(self.old.users)
        return users if self.after is None else [u for u in users if self.after < u]


@attrs.frozen
class _Modification:
    """`node` takes `args` and `kwargs` in place; `val` is its new value
    (`bindings`: the unbacked symbols it introduced, if any)."""

    node: Node
    args: tuple
    kwargs: dict
    val: Any
    bindings: Any = None


class Rewriter:
    """One transaction of one rule on one root node."""

    def __init__(
        self,
        graph: Graph,
        root: Node,
        rule: str,
        fake_mode: Any,
        *,
        check_shapes: bool = True,
    ) -> None:
        self.graph = graph
        self.root = root
        self.rule = rule
        self.fake_mode = fake_mode
        self.check_shapes = check_shapes
        self.created: list[Node] = []
        self.replacements: list[_Replacement] = []
        self.modifications: list[_Modification] = []
        self.erasures: list[Node] = []
        self.attrs: list[str] = []
        self.notes: list[str] = []
        self.outputs: list[tuple[int, Node]] = []
        self.callbacks: list[Callable[[], None]] = []
        self._provenance = tuple(root.meta.get("rewrites", ())) + ({"rule": rule, "source": root.name},)

    # -- building ---------------------------------------------------------------

    def call(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        """Insert `target(*args, **kwargs)` before the root; returns the node."""
        try:
            val = values.evaluate(self.fake_mode, target, args, kwargs)
        except values.MissingValue as e:
            raise CheckFailed(str(e)) from None
        # export-style names ("relu", not "relu_default") keep graphs readable.
        name = getattr(target, "_opname", None)
        with self.graph.inserting_before(self.root):
            node = fxgraph.insert_node(self.graph, "call_function", target, args, kwargs, name)
        self._adopt(node, val)
        return node

    def getitem(self, value: Node, index: int) -> Node:
        """Insert `value[index]` (for ops that return several tensors)."""
        return self.call(operator.getitem, value, index)

    def size(self, node: Node, dim: int) -> Any:
        """`node`'s size along `dim`: an int where its fake value's size is one, else an inserted
        `aten.sym_size.int(node, dim)` (a symbolic size stays symbolic in the replacement)."""
        size = node.meta["val"].shape[dim]
        return size if isinstance(size, int) else self.call(torch.ops.aten.sym_size.int, node, dim)

    def attr(self, obj: Any, hint: str = "_rewrites_attr") -> Node:
        """Register `obj` on the graph's module and insert a get_attr for it."""
        owner = self.graph.owning_module
        if owner is None:
            raise CheckFailed("the graph has no owning module to hold attributes")
        name, i = hint, 0
        while hasattr(owner, name):
            i += 1
            name = f"{hint}_{i}"
        if isinstance(obj, torch.nn.Module):
            owner.add_module(name, obj)
        else:
            setattr(owner, name, obj)
        self.attrs.append(name)
        with self.graph.inserting_before(self.root):
            node = self.graph.get_attr(name)
        node.meta["rewrites"] = self._provenance
        if isinstance(obj, torch.Tensor) and self.fake_mode is not None:
            node.meta["val"] = self.fake_mode.from_tensor(obj, static_shapes=True)
        self.created.append(node)
        return node

    def inline(self, sub: GraphModule | Graph, args: Sequence[Any], *, modify: Node | None = None) -> Any:
        """Copy the body of `sub` in before the root, its placeholders bound
        to `args`; returns its outputs (same structure, nodes of this graph).

        With `modify=node`: when `sub` returns one call of `node`'s op, that
        call is not copied; `node` takes its arguments in place (`modify`)
        and is returned."""
        graph = sub.graph if isinstance(sub, GraphModule) else sub
        module = sub if isinstance(sub, GraphModule) else graph.owning_module
        placeholders, body, reusable = _plan(graph)
        if len(placeholders) != len(args):
            raise CheckFailed(f"inlined graph takes {len(placeholders)} inputs, got {len(args)}")
        env: dict[Node, Any] = dict(zip(placeholders, args))
        reused = reusable if modify is not None and reusable is not None and reusable.target == modify.target else None
        for n in body:
            if n.op == "output":
                return _substitute(n.args[0], env)
            if n.op == "call_function":
                a, k = _substitute(n.args, env), _substitute(n.kwargs, env)
                if n is reused:
                    self.modify(modify, a, k)  # type: ignore[arg-type]
                    env[n] = modify
                elif isinstance(n.target, type) and issubclass(n.target, tuple):
                    env[n] = tuple(a)  # a namedtuple built by a decomposition
                else:
                    env[n] = self.call(n.target, *a, **k)
            elif n.op == "get_attr":
                env[n] = self.attr(values.fetch_attr(module, n.target), hint=str(n.target).replace(".", "_"))
            else:
                raise CheckFailed(f"cannot inline a {n.op} node ({n.format_node()})")
        raise CheckFailed("inlined graph has no output node")

    # -- recording --------------------------------------------------------------

    def replace(self, old: Node, new: Any, *, same_shape: bool = True) -> None:
        """Make every user of `old` use `new` instead (at commit).

        `new` is a node or, for an `old` that returns several values and is
        only read through `getitem`, a sequence with one node per value.
        `same_shape=False` relaxes the check to dtype and rank, for values
        whose sizes are data-dependent (unbacked symbols that cannot be
        proven equal).
        """
        self.replacements.append(_Replacement(old, new, same_shape))

    def modify(self, node: Node, args: Sequence[Any] | None = None, kwargs: dict[str, Any] | None = None) -> None:
        """Give `node` new arguments in place (at commit), keeping its op,
        name and users: what MLIR calls modifying an op in place. Cheaper
        than building a new node and replacing the old one, e.g. when a
        pattern's replacement ends in the op its match ended in. The node's
        value is recomputed and must match the old one, as for `replace`."""
        args = node.args if args is None else tuple(args)
        kwargs = dict(node.kwargs) if kwargs is None else kwargs
        try:
            val = values.evaluate(self.fake_mode, node.target, args, kwargs)
        except values.MissingValue as e:
            raise CheckFailed(str(e)) from None
        bindings = values.unbacked_bindings(self.fake_mode, val)
        self.modifications.append(_Modification(node, args, kwargs, val, bindings))

    def replace_uses_after(self, old: Node, new: Node, after: Node, *, reference: Any = None) -> None:
        """Users of `old` that come after `after` read `new` instead: what
        an in-place op made functional needs (later reads see the update).

        `new` is checked against `old`'s value, or against `reference`: the
        value those users saw when the op that mutated `old` also changed its
        shape (`out=` arguments are resized; `unsqueeze_` changes the view),
        usually that op's own `meta["val"]`."""
        self.replacements.append(_Replacement(old, new, True, after, reference))

    def add_output(self, value: Node, index: int) -> None:
        """Insert `value` into the graph's output tuple at `index` (at commit)."""
        self.outputs.append((index, value))

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Call `fn` when the rewrite commits (bookkeeping outside the graph
        that must not happen if the rewrite is rolled back): after its checks
        passed, before the graph changes, in the order given. One that raises
        fails the rewrite like a rule that raises: it is rolled back and the
        graph is as before (what earlier callbacks of it did outside the graph
        stays: keep each to one step that cannot fail halfway)."""
        self.callbacks.append(fn)

    def erase(self, node: Node) -> None:
        """Remove `node` at commit (it must have no users by then)."""
        self.erasures.append(node)

    def note(self, text: str) -> None:
        """A message for the report (e.g. "cond specialised to true branch")."""
        self.notes.append(text)

    # -- transaction ------------------------------------------------------------

    def commit(self) -> list[Node]:
        """Check, then apply the recorded changes. Returns the nodes whose
        neighbourhood changed (to be re-queued by the engine)."""
        self._check()
        for fn in self.callbacks:  # inside the transaction: one that raises leaves the graph untouched
            fn()
        touched: list[Node] = []
        dead: list[Node] = []
        for m in self.modifications:
            before = m.node.all_input_nodes
            if m.args != m.node.args:
                m.node.args = m.args
            if m.kwargs != m.node.kwargs:
                m.node.kwargs = m.kwargs
            m.node.meta["val"] = values.users_view(m.node.meta.get("val"), m.val)
            if m.bindings:
                m.node.meta["unbacked_bindings"] = m.bindings
            else:
                m.node.meta.pop("unbacked_bindings", None)
            m.node.meta["rewrites"] = (*m.node.meta.get("rewrites", ()), self._provenance[-1])
            touched += [m.node, *m.node.users]
            dead += before
        created = {id(n) for n in self.created}
        relaid: dict[Node, Any] = {}  # replacements laid out otherwise than the values their users saw
        for r in self.replacements:
            seen = r.old.meta.get("val") if r.reference is None else r.reference
            if r.same_shape and isinstance(r.new, Node) and layouts.changed(seen, r.new.meta.get("val")):
                relaid[r.new] = r.new.meta.get("val")
            if r.same_shape and isinstance(r.new, Node) and id(r.new) in created:
                r.new.meta["val"] = values.users_view(seen, r.new.meta.get("val"))
            users = r.users()
            touched.extend(users)
            if isinstance(r.new, Node) or not isinstance(r.new, Sequence):
                for user in users:
                    user.replace_input_with(r.old, r.new)
            else:
                for user in users:
                    user.replace_all_uses_with(r.new[user.args[1]])
                    self.graph.erase_node(user)
        touched += layouts.follow(self.fake_mode, relaid, self._provenance[-1])
        if self.outputs:
            output = next(n for n in reversed(self.graph.nodes) if n.op == "output")
            values_out = list(output.args[0])
            for index, value in self.outputs:
                values_out.insert(index, value)
            output.args = (tuple(values_out),)
        dead += [r.old for r in self.replacements if r.after is None] + self.erasures
        dead += [n for n in self.created if not n.users]
        touched += self._sweep(dead)
        return [n for n in self.created if not n._erased] + touched

    def rollback(self) -> None:
        """Remove every node and attribute this transaction inserted."""
        for node in reversed(self.created):
            if not node._erased:
                self.graph.erase_node(node)
        owner = self.graph.owning_module
        for name in self.attrs:
            if owner is not None and hasattr(owner, name):
                delattr(owner, name)
        self.created.clear()

    # -- internals --------------------------------------------------------------

    def _adopt(self, node: Node, val: Any) -> None:
        node.meta["val"] = val
        bindings = values.unbacked_bindings(self.fake_mode, val)
        if bindings:
            node.meta["unbacked_bindings"] = bindings
        for key in INHERITED_META:
            if key in self.root.meta:
                node.meta[key] = self.root.meta[key]
        node.meta["rewrites"] = self._provenance
        self.created.append(node)

    def _check(self) -> None:
        for node in self.created:
            self._check_inputs(node, node.all_input_nodes, "new node")
        for m in self.modifications:
            if m.node._erased:
                raise CheckFailed(f"cannot modify {m.node.name!r}: it is not in the graph")
            self._check_inputs(m.node, _nested_nodes((m.args, m.kwargs)), "modified node")
            why = values.compatible(m.node.meta.get("val"), m.val, check_shape=self.check_shapes)
            if why:
                raise CheckFailed(f"modified {m.node.name!r} does not match what it was: {why}")
        if self.outputs:
            output = next(n for n in reversed(self.graph.nodes) if n.op == "output")
            if not isinstance(output.args[0], (tuple, list)):
                raise CheckFailed("add_output needs a graph that returns a tuple of values")
        for r in self.replacements:
            self._check_replacement(r)
        replaced = {id(r.old) for r in self.replacements if r.after is None}
        erased = {id(n) for n in self.erasures}
        for node in self.erasures:
            users = [u.name for u in node.users if id(u) not in erased and id(u) not in replaced]
            if users and id(node) not in replaced:
                raise CheckFailed(f"cannot erase {node.name!r}: it is still used by {users}")

    def _check_inputs(self, node: Node, inputs: Sequence[Node], what: str) -> None:
        for inp in inputs:
            if inp._erased or inp.graph is not self.graph:
                raise CheckFailed(f"{what} {node.name!r} uses {inp.name!r}, which is not in the graph")
            if not inp < node:
                raise CheckFailed(f"{what} {node.name!r} uses {inp.name!r}, which comes after it")

    def _check_replacement(self, r: _Replacement) -> None:
        old, new = r.old, r.new
        users = r.users()
        if isinstance(new, Node):
            if "val" not in new.meta and "val" in old.meta:
                raise CheckFailed(f"replacement {new.name!r} has no meta['val']")
            new_val = new.meta.get("val")
        elif isinstance(new, Sequence):
            for user in users:
                if user.target is not operator.getitem or not isinstance(user.args[1], int):
                    raise CheckFailed(
                        f"{old.name!r} is replaced by {len(new)} values but its user {user.name!r} is not a getitem"
                    )
                if user.args[1] >= len(new):
                    raise CheckFailed(f"{user.name!r} reads output {user.args[1]}, only {len(new)} given")
            new_val = [n.meta.get("val") if isinstance(n, Node) else n for n in new]
        else:
            new_val = new
        for n in new if isinstance(new, Sequence) else (new,):
            late = [u.name for u in users if isinstance(n, Node) and not n < u]
            if late:
                raise CheckFailed(f"replacement {n.name!r} comes after users {late} of {old.name!r}")
        expected = old.meta.get("val") if r.reference is None else r.reference
        why = values.compatible(expected, new_val, check_shape=self.check_shapes and r.same_shape)
        if why:
            raise CheckFailed(f"replacement for {old.name!r} does not match it: {why}")

    def _sweep(self, candidates: list[Node]) -> list[Node]:
        """Erase dead nodes among `candidates` and, transitively, their
        operands. Explicitly erased and replaced nodes go even if impure."""
        forced = {id(n) for n in self.erasures} | {id(r.old) for r in self.replacements if r.after is None}
        touched: list[Node] = []
        stack = list(candidates)
        while stack:
            node = stack.pop()
            if node._erased or node.users or node.op in ("placeholder", "output"):
                continue
            if id(node) not in forced and _impure(node):
                continue
            inputs = node.all_input_nodes
            self.graph.erase_node(node)
            touched.extend(inputs)
            stack.extend(inputs)
        return [n for n in touched if not n._erased]
