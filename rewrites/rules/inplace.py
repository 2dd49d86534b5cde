"""In-place ops and mutation (seed 003; issue 12).

`torch.export.export` in torch 2.13 returns training IR that keeps ops that
write into an argument (`add_`, `hardswish_`, `uniform_`, `index_put_`,
`_index_put_impl_`, `copy_`, buffer `add_`, `out=` overloads such as
`arange.start_out`) and whose signature has no mutation outputs. IREE
rejects them: "'torch.aten.add_.Tensor' op operand #0 must be
Multi-dimensional array modeling Torch's Tensor type, but got
'!torch.vtensor<...>'", or has no lowering for the op at all.

`functionalize_inplace` is rooted at every ATen overload whose schema
mutates an argument and calls the functional variant torch pairs with it
(`functionalize.py`: torchgen's schema groups) instead. Then, for each
mutated tensor `x`:

- the new value keeps `x`'s dtype (`a += b` with float32 `a` and float64 `b`
  stays float32, as eager and torch's functionalization do);
- later reads of `x`, and of the tensors `x` is a slice/select/alias of,
  read the new value (written back with `slice_scatter` / `select_scatter`);
- when `x` is a program input or buffer, the final value is returned as a
  USER_INPUT_MUTATION / BUFFER_MUTATION output, so `ep.module()` has the
  side effects eager has.

Ops without a functional variant but with a CompositeImplicitAutograd kernel
(`dropout_`: in eval mode an identity; `alpha_dropout_`, `requires_grad_`)
are replaced by that kernel traced under torch's functionalization, whose
in-place writes back (`copy_`) this rule then takes in turn.

It declines (explain() says why) where a correct rewrite needs full
functionalization: a view created before the mutation and read after it, a
view op it cannot invert, a mutated input of a plain GraphModule (no
signature to record it in), or an op with no functional variant (named).
`ExportedProgram.run_decompositions()` handles those.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch._ops import OpOverload
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import Node
from torch.fx.experimental.proxy_tensor import make_fx

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import compatible
from fx_rewrites.kinds import rule
from fx_rewrites.program import input_spec, new_mutations
from fx_rewrites.rules.functionalize import Composite, Variant, mutating_overloads, variant
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: every ATen overload whose schema writes to an argument: the rule's roots
MUTATING_OPS = mutating_overloads("aten")

#: view ops whose effect on the base can be written back functionally
_SCATTER = {
    aten.slice.Tensor: lambda rw, base, new, args: rw.call(aten.slice_scatter.default, base, new, *args),
    aten.select.int: lambda rw, base, new, args: rw.call(aten.select_scatter.default, base, new, *args),
    aten.alias.default: lambda rw, base, new, args: new,
    aten.detach.default: lambda rw, base, new, args: new,
}


#: meta key on a functional stand-in for a view: (view op, base, view args),
#: so a second mutation through it is written back to the base as well.
ALIAS_OF = "fx_rewrites_alias_of"


def _is_view(node: Node) -> bool:
    return isinstance(node.target, OpOverload) and node.target.is_view


def _view_link(node: Node) -> tuple[Any, Node, tuple] | Miss | None:
    """(view op, base, view args) when `node` aliases another tensor."""
    if ALIAS_OF in node.meta:
        return node.meta[ALIAS_OF]
    if not _is_view(node):
        return None
    return node.target, node.args[0], tuple(node.args[1:])


def _view_chain(x: Node) -> tuple[list[Node], list[tuple[Any, tuple]]]:
    """[x, base of x, base of that, ...] and the (view op, args) between them."""
    chain, links = [x], []
    while (link := _view_link(chain[-1])) is not None:
        target, base, args = link
        chain.append(base)
        links.append((target, args))
    return chain, links


def _written_through(chain: list[Node], links: list[tuple[Any, tuple]], mutation: Node) -> int | Miss:
    """How many view links the write must go back through: down to the
    deepest base read after `mutation` (all of them when the base is a
    program input, whose caller sees the write). A base nobody reads later
    needs no new value: Funnel's `positional_attn *= cls_mask` writes
    through `aten.reshape` views of a product read nowhere else."""
    depth = len(links) if chain[-1].op == "placeholder" else 0
    for i, base in enumerate(chain[1:], start=1):
        if any(mutation < user for user in base.users):
            depth = max(depth, i)
    for (target, _), view in zip(links[:depth], chain):
        if target not in _SCATTER:
            return Miss(
                f"{mutation.name} writes {chain[0].name}, whose base {chain[depth].name} is read after it, through "
                f"{view.name} (a {target} view): this rule cannot write back through {target}"
            )
    return depth


def _aliased_reads(chain: list[Node], mutation: Node) -> str | None:
    """A view of a mutated tensor made before `mutation` and read after it."""
    for tensor in chain:
        for user in tensor.users:
            if user in chain or not _is_view(user) or not user < mutation:
                continue
            late = [u.name for u in user.users if mutation < u]
            if late:
                return f"{user.name} views {tensor.name} before the mutation and is read after it by {late}"
    return None


def _mutation_kind(base: Node) -> tuple[OutputKind, str] | Miss:
    spec = input_spec(base)
    if spec is None or new_mutations(base.graph) is None:
        return Miss(f"mutates graph input {base.name}; only an ExportedProgram can record that")
    if spec.kind == InputKind.BUFFER:
        return OutputKind.BUFFER_MUTATION, spec.target
    if spec.kind == InputKind.USER_INPUT:
        return OutputKind.USER_INPUT_MUTATION, base.name
    if spec.kind == InputKind.PARAMETER:  # RWKV rescales its weights in place, under no_grad
        return OutputKind.PARAMETER_MUTATION, spec.target
    return Miss(f"mutates {spec.kind.name.lower()} {base.name}, which a program cannot return as mutated")


@attrs.frozen
class _Written:
    """One tensor the op writes: argument `arg` (element `item` of a list
    argument), its view chain down to the deepest base read later, and how a mutated program
    input is recorded."""

    arg: str
    item: int | None
    chain: list[Node]
    links: list[tuple[Any, tuple]]
    kind: tuple[OutputKind, str] | None


@attrs.frozen
class _Plan:
    variant: Variant
    named: dict[str, Any]
    written: tuple[_Written, ...]


def _full_arguments(op: OpOverload, node: Node) -> dict[str, Any]:
    """The node's arguments by name, defaults of `op`'s schema filled in (a
    functional variant may have other defaults: `bernoulli_.float` has p=0.5,
    `bernoulli.p` none)."""
    named = schema.bind(op, node.args, node.kwargs)
    for a in op._schema.arguments:
        if a.name not in named and a.has_default_value():
            named[a.name] = schema.default(a)
    return named


def _writes(node: Node, found: Variant, named: dict[str, Any]) -> tuple[_Written, ...] | Miss:
    written: list[_Written] = []
    seen: set[Node] = set()
    for arg in found.mutated:
        value = named.get(arg)
        if value is None:  # an optional mutated argument not given (`Tensor(a!)? running_mean`)
            continue
        items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
        for item, tensor in items:
            if not isinstance(tensor, Node):
                return Miss(f"mutated argument {arg!r} is not a graph value")
            if tensor in seen:
                return Miss(f"{tensor.name} is written twice by one {node.target}")
            seen.add(tensor)
            chain, links = _view_chain(tensor)
            why = _aliased_reads(chain, node)
            if why:
                return Miss(why)
            depth = _written_through(chain, links, node)
            if isinstance(depth, Miss):
                return depth
            base = chain[-1]
            kind = _mutation_kind(base) if base.op == "placeholder" else None
            if isinstance(kind, Miss):
                return kind
            written.append(_Written(arg, item, chain[: depth + 1], links[:depth], kind))
    return tuple(written)


def _plan(node: Node) -> _Plan | Composite | Miss:
    found = variant(node.target)
    if isinstance(found, str):
        return Miss(found)
    if isinstance(found, Composite):
        return found
    named = _full_arguments(node.target, node)
    written = _writes(node, found, named)
    if isinstance(written, Miss):
        return written
    return _Plan(found, named, written)


def _call_functional(node: Node, rw: Rewriter, plan: _Plan) -> list[Node]:
    """Insert the functional variant; its outputs, one node each."""
    v = plan.variant
    names = {a.name for a in v.functional._schema.arguments}
    named = {k: x for k, x in plan.named.items() if k in names}
    if v.options_from is not None:  # factory out= ops: the out tensor's options, as torchgen's kernels pass them
        out = plan.named[v.options_from].meta["val"]
        for key, value in (("dtype", out.dtype), ("device", out.device), ("layout", out.layout)):
            if key in names and named.get(key) is None:
                named[key] = value
    args, kwargs = schema.unbind(v.functional, named, explicit=False)
    call = rw.call(v.functional, *args, **kwargs)
    count = len(v.functional._schema.returns)
    return [call] if count == 1 else [rw.getitem(call, i) for i in range(count)]


def _written_value(rw: Rewriter, outputs: list[Node], plan: _Plan, w: _Written) -> Node:
    """The new value of one written tensor, in that tensor's dtype (in-place
    type promotion: the result is cast back, as eager's `a += b` does)."""
    v = plan.variant
    index = v.returns.index(w.arg) if w.arg in v.returns else len(v.returns) + v.extra.index(w.arg)
    new = outputs[index] if w.item is None else rw.getitem(outputs[index], w.item)
    want = w.chain[0].meta["val"].dtype
    if new.meta["val"].dtype != want:
        new = rw.call(aten._to_copy.default, new, dtype=want)
    return new


def _reference(node: Node, plan: _Plan, w: _Written) -> Any:
    """What readers of `w`'s tensor after the op saw: the op's own output
    that aliases it (None when the op does not return it)."""
    if w.arg not in plan.variant.returns or w.item is not None:
        return None
    val = node.meta.get("val")
    return val[plan.variant.returns.index(w.arg)] if isinstance(val, (tuple, list)) else val


def _write_back(node: Node, rw: Rewriter, plan: _Plan, w: _Written, new: Node, outputs_added: int) -> Miss | int:
    """Make later reads of the written tensor (and of its bases) read `new`;
    record a mutated program input. Returns the mutation outputs added."""
    tensor = w.chain[0]
    old, got = tensor.meta["val"], new.meta["val"]
    if torch.Tag.inplace_view in node.target.tags:  # t_, unsqueeze_, as_strided_: new sizes/strides, same data
        if w.kind is not None:
            return Miss(f"{node.target} changes the sizes or strides of graph input {tensor.name} for its caller")
        rw.replace_uses_after(tensor, new, after=node, reference=_reference(node, plan, w))
        return 0
    if compatible(old, got) is not None:  # resized (out=)
        reference = _reference(node, plan, w)
        if len(w.chain) > 1 or w.kind is not None or reference is None:
            return Miss(
                f"{node.target} changes the shape of {tensor.name} from {tuple(old.shape)} to {tuple(got.shape)}; "
                "only a tensor made inside the graph, not a view, input or buffer, can take that"
            )
        rw.replace_uses_after(tensor, new, after=node, reference=reference)
        return 0
    rw.replace_uses_after(tensor, new, after=node)
    for (target, args), base in zip(w.links, w.chain[1:]):
        updated = _SCATTER[target](rw, base, new, args)
        if updated is not new:  # alias/detach: base and view are one value now (a self-link would never end)
            new.meta[ALIAS_OF] = (target, updated, args)
        rw.replace_uses_after(base, updated, after=node)
        new = updated
    if w.kind is None:
        return 0
    added = new_mutations(node.graph)
    rw.add_output(new, len(added) + outputs_added)
    rw.on_commit(lambda kind=w.kind: added.append(kind))
    return 1


def _functionalize(node: Node, rw: Rewriter, plan: _Plan) -> Miss | None:
    v = plan.variant
    outputs = _call_functional(node, rw, plan)
    new_values = {(w.arg, w.item): _written_value(rw, outputs, plan, w) for w in plan.written}
    results = []
    for i, alias in enumerate(v.returns):
        if alias is None:
            results.append(outputs[i])
        elif (alias, None) in new_values:
            results.append(new_values[(alias, None)])
        else:  # an optional mutated argument that was not given, or a list
            results.append(outputs[i])
    if node.users and results:
        rw.replace(node, results[0] if len(results) == 1 else results)
    rw.erase(node)
    added = 0
    for w in plan.written:
        done = _write_back(node, rw, plan, w, new_values[(w.arg, w.item)], added)
        if isinstance(done, Miss):
            return done
        added += done
    return None


def _inline_composite(node: Node, rw: Rewriter) -> Miss | None:
    """Replace `node` by its op's CompositeImplicitAutograd kernel, traced
    under torch's functionalization (writes to inputs come back as `copy_`)."""
    op = node.target
    composite, inputs = schema.over_graph_values(node, op.decompose)
    if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in inputs):
        return Miss(f"{op} has no functional variant and takes a non-tensor graph value: its kernel is not traced")

    try:
        with rw.fake_mode:
            traced = make_fx(torch.func.functionalize(composite, remove="mutations"), tracing_mode="real")(
                *[n.meta["val"] for n in inputs]
            )
    except RuntimeError as e:  # C++ kernels that read a symbolic size as an int (train-mode dropout_: numel())
        first = str(e).strip().splitlines()[0]
        return Miss(f"{op} has no functional variant and its CompositeImplicitAutograd kernel fails to trace: {first}")
    out = rw.inline(traced, inputs)
    if node.users:
        rw.replace(node, out)
    rw.erase(node)
    return None


@rule(
    roots=MUTATING_OPS,
    name="functionalize_inplace",
    when=_plan,
    tags={"mutation"},
    doc=(
        "Ops that write into an argument (every ATen overload whose schema says Tensor(a!): add_, hardswish_, "
        "uniform_, bernoulli_, index_put_, _index_put_impl_, copy_, out= overloads such as arange.start_out, "
        "buffer updates such as num_batches_tracked.add_(1)) become the functional variant torch pairs with "
        "them; the result keeps the written tensor's dtype, later reads see the new value and mutated "
        "inputs/buffers become USER_INPUT_MUTATION / BUFFER_MUTATION outputs; eval-mode dropout_ is an "
        "identity. IREE: \"'torch.aten.add_.Tensor' op operand #0 must be Multi-dimensional array modeling "
        "Torch's Tensor type, but got '!torch.vtensor<...>'\"."
    ),
)
def functionalize_inplace(node: Node, rw: Rewriter, plan: Any) -> Any:
    if isinstance(plan, Composite):
        return _inline_composite(node, rw)
    return _functionalize(node, rw, plan)


RULES = RuleSet([functionalize_inplace], name="inplace")
