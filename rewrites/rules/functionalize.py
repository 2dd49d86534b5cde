"""Which ops mutate an argument, and what their functional variant is, read
from torch's own schema data (the in-place pack's mechanism).

- Mutating ops: every registered overload whose schema writes to an argument
  (`Tensor(a!)`): `x_` methods (`add_`, `hardswish_`, `uniform_`), `out=`
  overloads (`arange.start_out`), `_impl_` ops (`_index_put_impl_`) and
  "mutable" ops (`_fused_moving_avg_obs_fq_helper`).
- The functional variant: torchgen (shipped inside the torch wheel) groups an
  op with its in-place, out= and mutable forms by `FunctionSchema.signature()`
  (overload name, out arguments, trailing `_` and alias annotations removed);
  the functionalization kernels torch generates call the functional member of
  that group. The same grouping is done here, lazily, for one op at a time: a
  functional variant shares the op's base name, so only that packet's
  overloads are parsed (parsing all 3,700 ATen schemas costs 0.2 to 0.8 s).
- The functional variant returns the op's own non-aliased returns, then one
  new value per mutated argument that the op does not return (torchgen's
  order: self, out arguments, other positional arguments); an aliased return
  (`-> Tensor(a!)`) is the new value of the argument it aliases.
- Ops without such a variant but with a CompositeImplicitAutograd kernel
  (`dropout_`, `alpha_dropout_`, `requires_grad_`) are traced through that
  kernel under torch's functionalization instead (`op.decompose`); the rest
  (`polygamma_`, whose functional form takes `n` first) have none.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import attrs
import torch
from torch._ops import OpOverload

if TYPE_CHECKING:
    from torchgen.model import FunctionSchema

#: argument names of TensorOptions, which torchgen's signature() drops because
#: out= variants of factory functions take them from the out tensor
TENSOR_OPTIONS = ("dtype", "layout", "device", "pin_memory")


@attrs.frozen
class Variant:
    """How to call `functional` in place of the mutating `op`.

    `returns[i]`: the mutated argument the op's output i aliases, or None for
    a fresh output (taken from the functional's output i). `extra`: mutated
    arguments the op does not return; their new values follow the op's own
    outputs in the functional's returns. `options_from`: the out argument
    whose dtype and device fill the functional's unset TensorOptions.
    """

    op: OpOverload
    functional: OpOverload
    mutated: tuple[str, ...]
    returns: tuple[str | None, ...]
    extra: tuple[str, ...]
    options_from: str | None = None


@attrs.frozen
class Composite:
    """`op` has no functional variant but a CompositeImplicitAutograd kernel."""

    op: OpOverload
    mutated: tuple[str, ...]


def mutated_arguments(op: OpOverload) -> tuple[str, ...]:
    """Names of the arguments `op`'s schema writes to (`Tensor(a!)`)."""
    return tuple(a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write)


def _registered(namespace: str) -> Iterator[OpOverload]:
    """Every overload in `namespace` that the dispatcher has a schema for."""
    prefix = namespace + "::"
    ns = getattr(torch.ops, namespace)
    for s in torch._C._jit_get_all_schemas():
        if not s.name.startswith(prefix):
            continue
        try:
            yield getattr(getattr(ns, s.name[len(prefix) :]), s.overload_name or "default")
        except (AttributeError, RuntimeError):  # TorchScript builtins without a dispatcher entry
            continue


def mutating_overloads(namespace: str = "aten") -> tuple[OpOverload, ...]:
    """Every registered overload in `namespace` whose schema mutates an argument."""
    return tuple(op for op in _registered(namespace) if op._schema.is_mutable)


def _parse(op: OpOverload) -> FunctionSchema:
    from torchgen.model import FunctionSchema

    return FunctionSchema.parse(str(op._schema).split("::", 1)[1])


@functools.cache
def variant(op: OpOverload) -> Variant | Composite | str:
    """The functional variant of mutating `op` (or a CompositeImplicitAutograd
    fallback); a sentence saying why there is none otherwise."""
    mutated = mutated_arguments(op)
    if not mutated:
        return f"{op} mutates no argument"
    try:
        parsed = _parse(op)
    except Exception as e:  # torchgen's parser raises AssertionError / RuntimeError on TorchScript-only types
        return f"{op}: torchgen cannot read its schema ({type(e).__name__}: {e})"
    found = _functional_twin(op, parsed)
    if found is not None:
        return _describe(op, parsed, found)
    if _has_composite_kernel(op):
        return Composite(op, mutated)
    return (
        f"{op} has no functional variant (no overload in its schema group, as torchgen pairs them) "
        "and no CompositeImplicitAutograd decomposition"
    )


def _has_composite_kernel(op: OpOverload) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), torch._C.DispatchKey.CompositeImplicitAutograd)
    except RuntimeError:  # a TorchScript-only overload: no dispatcher entry
        return False


def _functional_twin(op: OpOverload, parsed: FunctionSchema) -> OpOverload | None:
    from torchgen.model import SchemaKind

    signature = parsed.signature()
    namespace = getattr(torch.ops, op.namespace)
    packet = getattr(namespace, str(signature.name.name), None)
    if packet is None:
        return None
    for name in packet.overloads():
        candidate = getattr(packet, name)
        try:
            other = _parse(candidate)
        except Exception:
            continue
        if other.kind() is SchemaKind.functional and other.signature() == signature:
            return candidate
    return None


def _describe(op: OpOverload, parsed: FunctionSchema, functional: OpOverload) -> Variant:
    args = parsed.arguments
    writes = {a.name: a.annotation for a in args.flat_all if a.annotation is not None and a.annotation.is_write}
    returns: list[str | None] = []
    for r in parsed.returns:
        alias = next((name for name, ann in writes.items() if r.annotation is not None and ann == r.annotation), None)
        returns.append(alias)
    ordered = ([args.self_arg.argument] if args.self_arg is not None else []) + list(args.out)
    ordered += list(args.post_self_positional)
    extra = tuple(a.name for a in ordered if a.name in writes and a.name not in returns)
    options_from = None
    functional_names = {a.name for a in functional._schema.arguments}
    own_names = {a.name for a in op._schema.arguments}
    if args.out and any(n in functional_names and n not in own_names for n in TENSOR_OPTIONS):
        options_from = args.out[0].name
    return Variant(op, functional, tuple(writes), tuple(returns), extra, options_from)
