"""The call convention of a compiled program: what a call takes and gives back, checked before a backend runs.

A `Plan` says, for the compiled function, where each of its arguments comes
from (a flat user input, or a mutated state tensor), what each user input
must be (`Input`: a tensor of this dtype and shape, a number, or a constant
torch.export specialised), and where each result goes (`Output`). `bind`
turns a call's `(args, kwargs)` into the flat inputs, filling keyword
arguments that were constants at compile time and saying, for anything
that does not fit, which input, what was expected, what came, and the fix;
IREE's own checks (`buffer_diagnostics.c: tensor shape dimension 0
mismatch`) never reach the caller.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Literal

import attrs
import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ConstantArgument, InputKind
from torch.utils import _pytree as pytree

from fx_rewrites.engine import RewriteError

#: how a user input reaches the compiled function
Passing = Literal["tensor", "scalar", "constant", "unused"]


class InputMismatch(RewriteError, ValueError):
    """A call's input does not fit what the program was compiled for (shape, dtype, a constant's value)."""


@attrs.frozen(eq=False)
class Input:
    """One flat user input.

    `kind`: "tensor" (`dtype`, `shape`: an int per static dim, the symbol's
    name per dynamic one), "scalar" (a number passed through), "constant"
    (torch.export specialised it to `value`; the graph does not read it) or
    "unused" (not passed on: a size read off a tensor instead).
    """

    name: str
    path: str
    kind: Passing
    dtype: torch.dtype | None = None
    shape: tuple[int | str, ...] = ()
    value: Any = None


@attrs.frozen(eq=False)
class Output:
    """One output: where its value comes from and where it goes."""

    #: index among the compiled function's results; None for a constant output
    result: int | None
    constant: Any = None
    dtype: torch.dtype | None = None
    #: a mutation's destination: a flat user-input index or a state tensor; None for a user output
    write: int | torch.Tensor | None = None


@attrs.frozen(eq=False)
class Plan:
    """How a call maps onto the compiled function and back."""

    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    #: per argument of the compiled function: a flat input index, or a (mutated) state tensor
    args: tuple[int | torch.Tensor, ...]
    outputs: tuple[Output, ...]
    #: per flat user input, in the order of `in_spec`'s leaves (empty: not checked)
    inputs: tuple[Input, ...] = ()
    #: a dynamic dim's symbol -> (least, greatest or None) size the program was exported for
    ranges: Mapping[str, tuple[int, int | None]] = attrs.field(factory=dict)
    #: per argument of the compiled function: True where the program never writes it, so a call may hand over
    #: the caller's memory instead of a copy (the IREE backend's `sharing.unwritten_arguments`; empty: copy all)
    unwritten: tuple[bool, ...] = ()
    #: per result of the compiled function: True where it is a buffer of the call's own, which the caller may keep
    #: uncopied (`sharing.fresh_results`; empty: copy all)
    fresh: tuple[bool, ...] = ()


def leaf_paths(spec: pytree.TreeSpec) -> list[str]:
    """Where each leaf of an `(args, kwargs)` spec sits: "args[0]", "kwargs['mask']", "args[1][0]"."""
    tree = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    paths = []
    for keys, _ in pytree.tree_flatten_with_path(tree)[0]:
        head = ""
        if _is_call_spec(spec) and keys:
            head = "args" if keys[0] == pytree.SequenceKey(0) else "kwargs"
            keys = keys[1:]
        paths.append(head + "".join(str(k) for k in keys))
    return paths


def _dim(d: Any) -> int | str:
    """A static size, or a dynamic one's symbol ("s0"; an expression such as "2*s0" for a derived dim)."""
    return d if isinstance(d, int) else str(d.node.expr)


def program_inputs(program: ExportedProgram) -> tuple[Input, ...]:
    """Per flat user input (the leaves of the call spec): what a call must pass there."""
    paths = leaf_paths(program.call_spec.in_spec)
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    specs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if len(specs) != len(paths):
        return ()  # not a layout this check knows: leave the call unchecked rather than refuse it
    inputs = []
    for spec, path in zip(specs, paths, strict=True):
        name = getattr(spec.arg, "name", "")
        if isinstance(spec.arg, ConstantArgument):
            inputs.append(Input(name, path, "constant", value=spec.arg.value))
            continue
        val = placeholders[name].meta.get("val") if name in placeholders else None
        if isinstance(val, torch.Tensor):
            inputs.append(Input(name, path, "tensor", dtype=val.dtype, shape=tuple(_dim(d) for d in val.shape)))
        elif isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            inputs.append(Input(name, path, "scalar"))
        else:
            inputs.append(Input(name, path, "unused"))
    return tuple(inputs)


def program_ranges(program: ExportedProgram) -> dict[str, tuple[int, int | None]]:
    """Each dynamic dim's symbol -> the (least, greatest or None) size torch.export allowed."""
    out = {}
    for symbol, bounds in program.range_constraints.items():
        out[str(symbol)] = (max(_finite(bounds.lower) or 0, 0), _finite(bounds.upper))
    return out


def _finite(bound: Any) -> int | None:
    """A range bound as an int; None for an infinite one (sympy's oo, torch's int_oo)."""
    try:
        return int(bound) if bool(bound.is_integer) and bool(bound.is_finite) else None
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


def _is_call_spec(spec: pytree.TreeSpec) -> bool:
    return spec.type is tuple and spec.num_children == 2 and spec.child(1).type is dict


def positional_leaves(spec: pytree.TreeSpec) -> int | None:
    """How many arguments a call spec `((a, b, ...), {})` takes when they are all positional leaves (its flat
    inputs are then the call's arguments as they are); None for any other spec."""
    if not _is_call_spec(spec) or spec.child(1).num_children:
        return None
    args = spec.child(0)
    if args.type is not tuple or any(not args.child(i).is_leaf() for i in range(args.num_children)):
        return None
    return args.num_children


def _kwarg_leaves(spec: pytree.TreeSpec) -> dict[str, range]:
    """kwarg name -> the flat indices of its leaves."""
    start = spec.child(0).num_leaves
    out = {}
    kwargs = spec.child(1)
    for i, key in enumerate(kwargs.context or []):
        count = kwargs.child(i).num_leaves
        out[key] = range(start, start + count)
        start += count
    return out


def _shape(shape: tuple[int | str, ...]) -> str:
    """(2, 4), (4,), (s0, 4): a shape as Python prints a tuple, symbols unquoted."""
    return f"({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''})"


def _describe(item: Input) -> str:
    if item.kind == "tensor":
        return f"a {str(item.dtype).removeprefix('torch.')} tensor of shape {_shape(item.shape)}"
    if item.kind == "constant":
        return f"the constant {item.value!r}"
    return "a number"


def _fill_kwargs(plan: Plan, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` in the compiled order, with the constant ones the call left out filled in."""
    spec = plan.in_spec
    if not _is_call_spec(spec):
        return kwargs
    wanted = list(spec.child(1).context or [])
    if not plan.inputs or set(kwargs) - set(wanted):
        return kwargs
    leaves = _kwarg_leaves(spec)
    filled = dict(kwargs)
    for i, key in enumerate(wanted):
        if key in filled:
            continue
        items = [plan.inputs[j] for j in leaves[key]]
        if items and all(item.kind == "constant" for item in items):
            filled[key] = pytree.tree_unflatten([item.value for item in items], spec.child(1).child(i))
    return {k: filled[k] for k in wanted if k in filled} if set(filled) == set(wanted) else filled


def _structure_error(plan: Plan, args: tuple[Any, ...], kwargs: dict[str, Any], got: pytree.TreeSpec) -> TypeError:
    spec = plan.in_spec
    shape = f"(args, kwargs) shaped {pytree.treespec_pprint(spec)}, got {pytree.treespec_pprint(got)}"
    if not _is_call_spec(spec):
        return TypeError(f"the compiled program takes {shape}")
    positional = spec.child(0).num_children
    wanted = list(spec.child(1).context or [])
    problems = []
    if len(args) != positional:
        problems.append(f"{positional} positional argument{'s' if positional != 1 else ''}, got {len(args)}")
    leaves = _kwarg_leaves(spec)
    for key in wanted:
        if key not in kwargs:
            what = ", ".join(_describe(plan.inputs[j]) for j in leaves[key]) if plan.inputs else "an input"
            problems.append(f"keyword argument {key!r} ({what}) is missing")
    extra = [k for k in kwargs if k not in wanted]
    if extra:
        problems.append(f"unexpected keyword argument{'s' if len(extra) > 1 else ''} {extra}")
    if not problems:
        problems.append("an argument's structure (a list, tuple or dict inside it) differs")
    return TypeError(
        f"the compiled program takes {shape}: {'; '.join(problems)}. Fix: call it as the model was called when "
        "it was compiled (keyword arguments that were non-tensor constants then may be left out)."
    )


def bind(plan: Plan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The flat user inputs of a call, checked against the plan (TypeError, InputMismatch)."""
    kwargs = _fill_kwargs(plan, kwargs)
    flat, spec = pytree.tree_flatten((tuple(args), kwargs))
    if spec != plan.in_spec:
        raise _structure_error(plan, args, kwargs, spec)
    if plan.inputs:
        _check_values(plan, flat)
    return flat


_FIX_SHAPE = (
    "Fix: pass inputs of the compiled shape, or compile with that dim dynamic: fx_rewrites.compile(model, args"
    "{kwargs}, dynamic_shapes={shapes}) (or torch.export.export(..., dynamic_shapes=...))"
)


def _dynamic_shapes(plan: Plan, item: Input, dim: int, dim_name: str) -> str:
    """The `dynamic_shapes=` dict that makes `item`'s dim dynamic: an entry per argument of the call (torch.export
    wants one for each, `None` for the static ones and the keyword constants), else the input's alone."""
    dynamic = f"{{{dim}: torch.export.Dim('{dim_name}')}}"
    alone = f"{{{item.name or 'x'!r}: {dynamic}}}"
    spec = plan.in_spec
    if not _is_call_spec(spec) or not plan.inputs:
        return alone
    entries: list[tuple[str, bool]] = []  # (argument name, is it item's)
    start = 0
    for i in range(spec.child(0).num_children):
        count = spec.child(0).child(i).num_leaves
        name = plan.inputs[start].name if count == 1 else ""
        if not name:
            return alone  # a positional argument holding a structure: its name is not in the program
        entries.append((name, plan.inputs[start] is item))
        start += count
    for key, leaves in _kwarg_leaves(spec).items():
        entries.append((key, len(leaves) == 1 and plan.inputs[leaves[0]] is item))
    if not any(mine for _, mine in entries):
        return alone  # the input sits inside a structure
    return "{" + ", ".join(f"{name!r}: {dynamic if mine else None}" for name, mine in entries) + "}"


def _check_values(plan: Plan, flat: list[Any]) -> None:
    sizes: dict[str, tuple[int, str]] = {}  # symbol -> (its value, where it was first seen)
    for item, value in zip(plan.inputs, flat, strict=True):
        where = f"input {item.name!r} ({item.path})" if item.name else f"input {item.path}"
        if item.kind == "constant":
            if not _same_constant(value, item.value):
                raise InputMismatch(
                    f"{where} is {value!r}; the program was compiled with {item.value!r} (torch.export specialises "
                    f"non-tensor inputs). Fix: pass {item.value!r} (or leave a keyword argument out), or compile "
                    f"again with {value!r}."
                )
        elif item.kind == "tensor":
            _check_tensor(plan, item, where, value, sizes)
        elif item.kind == "scalar" and not isinstance(value, (int, float, bool, torch.SymInt, torch.SymFloat)):
            raise InputMismatch(
                f"{where} is not a number (got {type(value).__name__}); the compiled program takes one."
            )


def _same_constant(got: Any, want: Any) -> bool:
    try:
        return type(got) is type(want) and bool(got == want)
    except Exception:
        return got is want


def _check_tensor(plan: Plan, item: Input, where: str, value: Any, sizes: dict[str, tuple[int, str]]) -> None:
    if not isinstance(value, torch.Tensor):
        raise InputMismatch(
            f"{where} is not a tensor (got {type(value).__name__}); the compiled program takes {_describe(item)}."
        )
    want = str(item.dtype).removeprefix("torch.")
    if value.dtype != item.dtype:
        got = str(value.dtype).removeprefix("torch.")
        raise InputMismatch(
            f"{where} is a {got} tensor; the compiled program takes {want}. Fix: pass `{item.name or 'x'}.to("
            f"torch.{want})`, or compile with example inputs of dtype {got}."
        )
    shape = tuple(value.shape)
    compiled = _shape(item.shape)
    if len(shape) != len(item.shape):
        raise InputMismatch(
            f"{where} has shape {_shape(shape)} ({len(shape)} dims); the compiled program takes {compiled} "
            f"({len(item.shape)} dims)."
        )
    for dim, (got, expected) in enumerate(zip(shape, item.shape)):
        if isinstance(expected, int):
            if got != expected:
                shapes = _dynamic_shapes(plan, item, dim, "batch" if dim == 0 else f"d{dim}")
                kwargs = ", kwargs" if _is_call_spec(plan.in_spec) and plan.in_spec.child(1).num_children else ""
                fix = _FIX_SHAPE.format(kwargs=kwargs, shapes=shapes)
                raise InputMismatch(
                    f"{where} has shape {_shape(shape)}; the compiled program takes {compiled}: dim {dim} is {got}, "
                    f"compiled for {expected} (a static size: torch.export fixed it to the example input's). {fix}."
                )
            continue
        low, high = plan.ranges.get(expected, (0, None))
        if got < low or (high is not None and got > high):
            bounds = f"[{low}, {'inf' if high is None else high}]"
            raise InputMismatch(
                f"{where} has shape {_shape(shape)}; dim {dim} ({expected}) is {got}, outside the range {bounds} "
                f"the program was exported for. Fix: pass a size in {bounds}, or export with a wider "
                "torch.export.Dim(min=, max=)."
            )
        key, scale, offset = size_form(expected)
        if (got - offset) % scale:
            raise InputMismatch(
                f"{where} has shape {_shape(shape)}; dim {dim} ({expected}) is {got}, not of that form (a multiple "
                f"of {scale}{f' plus {offset}' if offset else ''}). The compiled module assumes it is (IREE's "
                "util.assume.int), so the call is refused rather than computed wrong. Fix: pad the input to such "
                "a size, or export with a plain torch.export.Dim."
            )
        value = (got - offset) // scale
        if key in sizes and sizes[key][0] != value:
            first, seen = sizes[key]
            raise InputMismatch(
                f"{where} has shape {_shape(shape)}; dim {dim} ({expected}) is {got}, but {seen} gives {key} = "
                f"{first}, and the program was exported with the two equal in {key}. Fix: pass inputs whose sizes "
                "agree."
            )
        sizes.setdefault(key, (value, f"dim {dim} of {where} ({got})"))


@functools.lru_cache(maxsize=1024)
def size_form(expected: str) -> tuple[str, int, int]:
    """A dynamic dim's expression `expected` as (key, scale, offset): a size is `scale * v + offset` for an
    integer v, the value of the symbol `key` (one symbol: "8*s0" -> ("s0", 8, 0), "s1" -> ("s1", 1, 0)); for an
    expression of several symbols the key is the expression itself, scale the divisor of its coefficients. What a
    call must meet beyond the ranges: IREE assumes the divisors (`util.assume.int` udiv) and ties the sizes of one
    symbol together."""
    try:
        expr = sympy.sympify(expected)
        poly = sympy.Poly(expr, *sorted(expr.free_symbols, key=str))
    except (sympy.SympifyError, sympy.PolynomialError, TypeError, ValueError):
        return expected, 1, 0
    if not expr.free_symbols or not all(c.is_Integer for c in poly.coeffs()):
        return expected, 1, 0
    if len(poly.gens) == 1 and poly.degree() == 1:
        scale, offset = (int(c) for c in poly.all_coeffs())
        if scale > 0:
            return str(poly.gens[0]), scale, offset
    return expected, max(int(sympy.gcd_list(poly.coeffs())), 1), 0
