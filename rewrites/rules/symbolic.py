"""SymInt / SymFloat / SymBool values where a Tensor is expected.

With dynamic shapes, `x * x.shape[0]` exports as
`aten.mul.Tensor(x, sym_size_int)`: the schema says `Tensor other`, the
argument is a SymInt (from `aten.sym_size.int`, `operator.*` on sizes,
`item()` / `_local_scalar_dense`, or in aot_autograd graphs of
`torch.compile(dynamic=True)` the SymInt placeholder itself). Eager torch
wraps the number into a tensor on the fly; importers that type arguments by
the schema do not. The same happens for `add`/`sub`/`div.Tensor`,
`floor_divide`, `div.Tensor_mode` and, in R2 only, `sub.Tensor(n, x)` with
the SymInt in slot 0.

`sym_scalar_in_tensor_slot` finds such arguments through the schema
(`op._schema.arguments[i].type` is a Tensor type, the argument's
`meta["val"]` a Sym value) and switches to the overload that takes a
`Scalar` there (`mul.Tensor` -> `mul.Scalar`), or else wraps the value in
`aten.scalar_tensor` of a dtype that keeps the result's dtype.

`pow_sym_exponent_sign_safe` is the other SymInt family:
`aten.pow.Tensor_Scalar(x, n)` with a SymInt `n` is legal by schema, but
IREE lowers a non-constant exponent through exp(n * log(x)), which is NaN
for every negative x.

`sym_arithmetic_constant` folds arithmetic on sizes that the exporter
proved constant: `(16 - L % 16) % 16` with `L = 16 * chunks` (Mamba2's chunk
padding under a derived Dim) exports as `operator.mod` nodes whose value is
the int 0; a backend that imports them needs a lowering for each (IREE has
none for `aten.fmod.int`).

`sym_in_tensor_slots(graph)` lists what is left, for backends to check.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._ops import OpOverload
from torch.fx import Node
from torch.fx.node import map_arg

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine import values as fake_values
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet
from fx_rewrites.symbolic_sizes import SYM_TYPES, is_scalar_type, is_scalar_value, is_tensor_type

aten = torch.ops.aten

#: op packets whose Tensor arguments can receive a number in eager code
#: (`x * n`, `torch.where(m, x, n)`, ...). Every functional overload with a
#: Tensor argument is a root; which argument holds a Sym value is found
#: through the schema.
PACKETS = (
    "add", "sub", "rsub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "pow",
    "eq", "ne", "lt", "le", "gt", "ge",
    "maximum", "minimum", "fmax", "fmin", "atan2", "hypot", "copysign", "xlogy",
    "bitwise_and", "bitwise_or", "bitwise_xor", "logical_and", "logical_or", "logical_xor",
    "where", "clamp", "clamp_min", "clamp_max", "lerp", "masked_fill", "fill", "addcmul", "addcdiv",
)  # fmt: skip


def _slot_ops() -> tuple[OpOverload, ...]:
    ops: list[OpOverload] = []
    for name in PACKETS:
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            s = op._schema
            if s.is_mutable or any(a.is_out for a in s.arguments):
                continue
            if any(is_tensor_type(a.type) for a in s.arguments):
                ops.append(op)
    return tuple(ops)


SYM_SLOT_OPS = _slot_ops()


# -- sym_scalar_in_tensor_slot ------------------------------------------------------


def _sym_slots(op: OpOverload, bound: dict[str, Any]) -> list[str]:
    return [a.name for a in op._schema.arguments if is_tensor_type(a.type) and is_scalar_value(bound.get(a.name))]


def _scalar_overload(op: OpOverload, slots: list[str], bound: dict[str, Any]) -> OpOverload | None:
    """The overload of `op`'s packet that is `op` with `Scalar` in `slots`
    and every other argument the same (`mul.Tensor` -> `mul.Scalar`,
    `pow.Tensor_Tensor` -> `pow.Tensor_Scalar`, `where.self` ->
    `where.ScalarOther`, `clamp.Tensor` -> `clamp.default` when the other
    bound is absent)."""
    mine = op._schema
    for name in op.overloadpacket.overloads():
        cand = getattr(op.overloadpacket, name)
        if cand is op:
            continue
        theirs = cand._schema
        if theirs.is_mutable != mine.is_mutable or len(theirs.arguments) != len(mine.arguments):
            continue
        if [str(r.type) for r in theirs.returns] != [str(r.type) for r in mine.returns]:
            continue
        ok = True
        for a, b in zip(mine.arguments, theirs.arguments):
            if a.name != b.name:  # bound by name, so kwarg-only may differ (add.Scalar's alpha)
                ok = False
            elif a.name in slots:
                ok = is_scalar_type(b.type)
            elif str(a.type) != str(b.type):
                # an unused optional Tensor may become an unused optional Scalar
                ok = bound.get(a.name) is None and isinstance(b.type, torch.OptionalType)
            if not ok:
                break
        if ok:
            return cand
    return None


def _natural_dtype(val: Any) -> torch.dtype:
    if isinstance(val, (torch.SymBool, bool)):
        return torch.bool
    if isinstance(val, (torch.SymInt, int)):
        return torch.int64
    return torch.get_default_dtype()


def _wrap(rw: Rewriter, node: Node, bound: dict[str, Any], slot: str) -> Node:
    """`aten.scalar_tensor(value)` for `bound[slot]`: int64 / default float /
    bool, unless that changes the op's result dtype (a 0-d operand of the
    same kind, e.g. float16 `x.sum() * n / 2`), then the result's dtype,
    which is what the number is converted to in eager."""
    value = bound[slot]
    out = node.meta.get("val")
    device = out.device if isinstance(out, torch.Tensor) else torch.device("cpu")
    candidates = [_natural_dtype(value.meta["val"])]
    if isinstance(out, torch.Tensor) and out.dtype not in candidates:
        candidates.append(out.dtype)
    wrapped = None
    for dtype in candidates:
        wrapped = rw.call(aten.scalar_tensor.default, value, dtype=dtype, device=device)
        trial = {**bound, slot: wrapped}
        args, kwargs = schema.unbind(node.target, trial, explicit=False)
        got = fake_values.evaluate(rw.fake_mode, node.target, args, kwargs)
        if not isinstance(out, torch.Tensor) or getattr(got, "dtype", None) == out.dtype:
            return wrapped
    return wrapped  # the engine's dtype check reports the mismatch


@rule(
    roots=SYM_SLOT_OPS,
    doc=(
        "A SymInt/SymFloat/SymBool (aten.sym_size.int, operator.* on sizes, item(), or a SymInt "
        "placeholder of torch.compile(dynamic=True)) passed where the schema says Tensor: "
        "aten.mul.Tensor(x, sym_size_int), add/sub/div.Tensor, floor_divide, div.Tensor_mode, "
        "sub.Tensor(n, x). Uses the .Scalar overload (mul.Tensor -> mul.Scalar) or wraps the value "
        "in aten.scalar_tensor. IREE: \"'torch.aten.sub.Tensor' op operand #0 must be Any Torch tensor "
        "type, but got '!torch.int'\" (R2 sub.Tensor(n, x), div.Tensor_mode); backends that re-dispatch "
        "with SymInts: \"Expected a value of type 'Tensor' ... but instead found type 'SymInt'\"."
    ),
    tags={"symbolic", "dynamic"},
)
def sym_scalar_in_tensor_slot(node: Node, rw: Rewriter) -> Any:
    op: OpOverload = node.target  # type: ignore[assignment]
    bound = schema.bind(op, node.args, dict(node.kwargs))
    slots = _sym_slots(op, bound)
    if not slots:
        return Miss("no Sym value in a Tensor argument")
    scalar_op = _scalar_overload(op, slots, bound)
    if scalar_op is not None:
        args, kwargs = schema.unbind(scalar_op, bound, explicit=False)
        new = rw.call(scalar_op, *args, **kwargs)
    else:
        for slot in slots:
            bound[slot] = _wrap(rw, node, bound, slot)
        args, kwargs = schema.unbind(op, bound, explicit=False)
        new = rw.call(op, *args, **kwargs)
    rw.replace(node, new)
    return None


# -- pow_sym_exponent_sign_safe -----------------------------------------------------


def _pow_match(node: Node) -> Any:
    base, exponent = node.args[0], node.args[1]
    val = fake_value(exponent)
    if not isinstance(val, torch.SymInt):
        return Miss("the exponent is not a SymInt (a constant exponent lowers fine)")
    bval = fake_value(base)
    if not isinstance(bval, torch.Tensor) or not bval.dtype.is_floating_point:
        return Miss("the base is not a floating-point tensor")
    if base.target is aten.abs.default:
        return Miss("the base is abs(...): already sign-safe")
    return True


@rule(
    roots=(aten.pow.Tensor_Scalar,),
    when=_pow_match,
    doc=(
        "aten.pow.Tensor_Scalar(x, n) with a SymInt exponent (torch.pow(x, x.shape[0]), x ** k.item()): "
        "IREE lowers a non-constant exponent as exp(n*log(x)) and returns NaN for every negative x "
        "(even n too). Rewritten as where(n == 0, 1, where(x < 0 & n odd, -|x|**n, |x|**n))."
    ),
    tags={"symbolic", "dynamic", "numerics"},
)
def pow_sym_exponent_sign_safe(node: Node, rw: Rewriter) -> Any:
    x, n = node.args[0], node.args[1]
    xval = x.meta["val"]
    magnitude = rw.call(aten.pow.Tensor_Scalar, rw.call(aten.abs.default, x), n)
    n_t = rw.call(aten.scalar_tensor.default, n, dtype=torch.int64, device=xval.device)
    odd = rw.call(aten.ne.Scalar, rw.call(aten.remainder.Scalar, n_t, 2), 0)
    flip = rw.call(aten.logical_and.default, rw.call(aten.lt.Scalar, x, 0), odd)
    signed = rw.call(aten.where.self, flip, rw.call(aten.neg.default, magnitude), magnitude)
    # exp(0 * log|0|) is NaN: x ** 0 is 1 for every x
    one = rw.call(aten.scalar_tensor.default, 1, dtype=xval.dtype, device=xval.device)
    rw.replace(node, rw.call(aten.where.self, rw.call(aten.eq.Scalar, n_t, 0), one, signed))
    return None


# -- sym_arithmetic_constant --------------------------------------------------------

#: Python arithmetic and comparisons on SymInt/SymFloat/SymBool values, as torch.export records them
SYM_ARITHMETIC = (
    operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod, operator.pow,
    operator.neg, operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
    torch.sym_max, torch.sym_min, torch.sym_float, torch.sym_int, torch.sym_not,
)  # fmt: skip


def _constant(val: Any) -> int | float | bool | None:
    """`val` as a Python number where it is one: a plain number, or a Sym value whose expression is a number
    (`16*s % 16` is `0`: sympy folds it), else None."""
    if isinstance(val, SYM_TYPES):
        expr = val.node.expr
        if not getattr(expr, "is_number", False):
            return None
        kind = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(val)]
        return kind(expr)
    return val if isinstance(val, (int, float, bool)) else None


def _constant_match(node: Node) -> tuple[int | float | bool] | Miss:
    """(the constant,): a 1-tuple, so that a constant 0 or False is still a match."""
    value = _constant(node.meta.get("val"))
    if value is None:
        return Miss("the value is symbolic (or unknown): it depends on the input's sizes")
    if any(user.op != "call_function" for user in node.users):
        return Miss("the value is a graph output")
    return (value,)


@rule(
    roots=SYM_ARITHMETIC,
    when=_constant_match,
    doc=(
        "Arithmetic on sizes that torch.export proved constant (`operator.mod(16 * s, 16)` is the int 0, "
        "Mamba2's chunk padding under a Dim that is a multiple of the chunk): its users read the constant. "
        "IREE: \"failed to legalize operation 'torch.operator'\" on `aten.fmod.int`."
    ),
    tags={"symbolic", "dynamic"},
)
def sym_arithmetic_constant(node: Node, rw: Rewriter, *, found: tuple[int | float | bool]) -> Any:
    (value,) = found
    for user in list(node.users):
        args = map_arg(user.args, lambda n: value if n is node else n)
        kwargs = map_arg(user.kwargs, lambda n: value if n is node else n)
        rw.modify(user, args, kwargs)  # `node`, then unused, is swept at commit
    return None


RULES = RuleSet([sym_scalar_in_tensor_slot, pow_sym_exponent_sign_safe, sym_arithmetic_constant], name="symbolic")
