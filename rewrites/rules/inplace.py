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
- later reads of `x`, of its bases and of every other view of them made
  before the write read the new values, written back as torch's
  functionalization does (`inplace_views.py`: `x.narrow(...).copy_(src)`
  becomes a `slice_scatter`; `select_scatter`, `diagonal_scatter`,
  `as_strided_scatter`, inverse views for `view`/`reshape`/`permute`, pieces
  of `split`/`unbind`), only as deep as a base read later or a program input;
- when `x` is a program input or buffer, the final value is returned as a
  USER_INPUT_MUTATION / BUFFER_MUTATION output, so `ep.module()` has the
  side effects eager has. A lifted constant written in place is state the
  module keeps outside its buffers (non-strict `torch.export` lifts the
  tensors a plain Python object holds, as transformers' `StaticCache` in
  `TorchExportableModuleWithStaticCache`): it becomes a non-persistent
  buffer with a BUFFER_MUTATION output (`program.rebuild_program`), the
  state eager keeps in that tensor.

Ops without a functional variant but with a CompositeImplicitAutograd kernel
(`dropout_`: in eval mode an identity; `alpha_dropout_`, `requires_grad_`)
are replaced by that kernel traced under torch's functionalization, whose
in-place writes back (`copy_`) this rule then takes in turn.

It declines (explain() says why) where a correct rewrite needs more: an
alias it cannot follow (a view op called with keywords, an in-place op left
in the graph whose output is read later), a view torch's functionalization
cannot invert, a mutated input of a plain GraphModule (no signature to
record it in), or an op with no functional variant (named).
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
from fx_rewrites.rules import inplace_views
from fx_rewrites.rules.functionalize import Composite, Variant, mutating_overloads, variant
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

#: every ATen overload whose schema writes to an argument: the rule's roots
MUTATING_OPS = mutating_overloads("aten")


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
    if spec.kind == InputKind.CONSTANT_TENSOR:  # state held outside the module's buffers (a non-strict export)
        return OutputKind.BUFFER_MUTATION, spec.target  # `rebuild_program` makes it a non-persistent buffer
    return Miss(f"mutates {spec.kind.name.lower()} {base.name}, which a program cannot return as mutated")


@attrs.frozen
class _Written:
    """One tensor the op writes: argument `arg` (element `item` of a list
    argument), the tensor, which of its aliases the write must update, and
    how a mutated program input (the memory's owner) is recorded."""

    arg: str
    item: int | None
    tensor: Node
    aliases: inplace_views.WriteBack
    root: Node
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
            root = inplace_views.view_chain(tensor)[-1]
            kind = _mutation_kind(root) if root.op == "placeholder" else None
            if isinstance(kind, Miss):
                return kind
            aliases = inplace_views.plan(tensor, node, record_root=kind is not None)
            if isinstance(aliases, Miss):
                return aliases
            written.append(_Written(arg, item, tensor, aliases, root, kind))
    shared = [w.root.name for w in written if w.aliases.targets]
    if len(shared) != len(set(shared)):
        return Miss(f"{node.target} writes two views of one tensor ({sorted(shared)}) that are read later")
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
    want = w.tensor.meta["val"].dtype
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


def _write_back(
    node: Node, rw: Rewriter, plan: _Plan, w: _Written, new: Node, outputs_added: int
) -> Miss | tuple[Node, int]:
    """Make later reads of the written tensor and of the aliases it shares
    memory with read the new values; record a mutated program input.
    Returns what later readers of the written tensor read, and the mutation
    outputs added."""
    tensor = w.tensor
    old, got = tensor.meta["val"], new.meta["val"]
    if torch.Tag.inplace_view in node.target.tags:  # t_, unsqueeze_, as_strided_: new sizes/strides, same data
        if w.kind is not None:
            return Miss(f"{node.target} changes the sizes or strides of graph input {tensor.name} for its caller")
        rw.replace_uses_after(tensor, new, after=node, reference=_reference(node, plan, w))
        return new, 0
    if compatible(old, got) is not None:  # resized (out=)
        reference = _reference(node, plan, w)
        if w.root is not tensor or w.aliases.targets or reference is None:
            return Miss(
                f"{node.target} changes the shape of {tensor.name} from {tuple(old.shape)} to {tuple(got.shape)}; "
                "only a tensor made inside the graph, not a view, input or buffer, can take that"
            )
        rw.replace_uses_after(tensor, new, after=node, reference=reference)
        return new, 0
    if not w.aliases.targets:  # nothing else reads this memory later
        rw.replace_uses_after(tensor, new, after=node)
        return new, 0
    values = inplace_views.trace(rw, w.aliases, new)
    if isinstance(values, Miss):
        return values
    for alias, value in values.items():
        if value is not alias:
            rw.replace_uses_after(alias, value, after=node)
    root = values.get(w.root, w.root)
    if w.kind is None or root is w.root:  # not a program input, or written nowhere (a reshape that copies)
        return values[tensor], 0
    added = new_mutations(node.graph)  # the caller's tensor: a mutation output
    rw.add_output(root, len(added) + outputs_added)
    rw.on_commit(lambda kind=w.kind: added.append(kind))
    return values[tensor], 1


def _functionalize(node: Node, rw: Rewriter, plan: _Plan) -> Miss | None:
    v = plan.variant
    outputs = _call_functional(node, rw, plan)
    new_values = {(w.arg, w.item): _written_value(rw, outputs, plan, w) for w in plan.written}
    read_later, added = {}, 0
    for w in plan.written:
        done = _write_back(node, rw, plan, w, new_values[(w.arg, w.item)], added)
        if isinstance(done, Miss):
            return done
        read_later[(w.arg, w.item)], outputs_added = done
        added += outputs_added
    results = []
    for i, alias in enumerate(v.returns):
        if alias is None:
            results.append(outputs[i])
        elif (alias, None) in read_later:
            results.append(read_later[(alias, None)])
        else:  # an optional mutated argument that was not given, or a list
            results.append(outputs[i])
    if node.users and results:
        rw.replace(node, results[0] if len(results) == 1 else results)
    rw.erase(node)
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
def functionalize_inplace(node: Node, rw: Rewriter, *, found: Any) -> Any:
    if isinstance(found, Composite):
        return _inline_composite(node, rw)
    return _functionalize(node, rw, found)


RULES = RuleSet([functionalize_inplace], name="inplace")
