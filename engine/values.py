"""Fake values (`node.meta["val"]`): finding the graph's fake mode, computing
values for new nodes, and comparing a replacement with what it replaces."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Hashable
from typing import Any

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import (
    compute_unbacked_bindings,
    statically_known_true,
)
from torch.utils import _pytree as pytree


def find_fake_mode(graph: Graph) -> Any:
    """The FakeTensorMode the graph's values were made in, or None."""
    vals = [n.meta["val"] for n in graph.nodes if n.op == "placeholder" and "val" in n.meta]
    return detect_fake_mode(vals)


def adopt_constants(graph: Graph, fake_mode: Any) -> None:
    """Give tensor get_attr nodes a value in `fake_mode`.

    aot_autograd graphs carry `_tensor_constant0` get_attrs whose value was
    made in another fake mode; new ops on them would mix modes.
    """
    if fake_mode is None or graph.owning_module is None:
        return
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        val = node.meta.get("val")
        if val is not None and getattr(val, "fake_mode", fake_mode) is fake_mode:
            continue
        obj = attr_of(node)
        if isinstance(obj, torch.Tensor):
            node.meta["val"] = fake_mode.from_tensor(obj, static_shapes=True)


def missing_values(graph: Graph) -> list[str]:
    """Names of nodes that should carry `meta["val"]` and do not."""
    wanted = ("placeholder", "call_function")
    return [n.name for n in graph.nodes if n.op in wanted and "val" not in n.meta and not _returns_nothing(n)]


def _returns_nothing(node: Node) -> bool:
    """Ops such as `aten._assert_scalar`: aot_autograd gives them no value."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and not schema.returns


class MissingValue(Exception):
    """Internal: a value could not be computed (wrapped into RuleError)."""


def fetch_attr(module: Any, target: str) -> Any:
    """`module.a.b` for a get_attr target "a.b"."""
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def attr_of(node: Any) -> Any:
    """The object a get_attr node names (None for other nodes, or if gone)."""
    if not isinstance(node, Node) or node.op != "get_attr" or node.graph.owning_module is None:
        return None
    try:
        return fetch_attr(node.graph.owning_module, str(node.target))
    except AttributeError:
        return None


def fake_value(arg: Any) -> Any:
    """The value recorded for a graph node (its `meta["val"]`: a FakeTensor, a SymInt, ...); None for an argument
    that is not a node, or a node without one."""
    return arg.meta.get("val") if isinstance(arg, Node) else None


def fake_tensor(arg: Any) -> torch.Tensor | None:
    """`fake_value(arg)` where it is a tensor, else None."""
    value = fake_value(arg)
    return value if isinstance(value, torch.Tensor) else None


def node_value(arg: Any) -> Any:
    """Replace every Node inside `arg` by its fake value. A get_attr of a
    subgraph (the body of a higher-order op) stands for the module itself."""

    def one(n: Node) -> Any:
        if "val" in n.meta:
            return n.meta["val"]
        if isinstance(obj := attr_of(n), torch.nn.Module):
            return obj
        raise MissingValue(f"input node {n.name!r} has no meta['val']")

    return pytree.tree_map_only(Node, one, arg)


def evaluate(fake_mode: Any, target: Any, args: tuple, kwargs: dict) -> Any:
    """Run `target` on the fake values of its arguments.

    Functional ATen ops are memoised per fake mode: a second call with the
    same op and the same argument metadata (symbolic sizes by their sympy
    expressions) returns a new fake value of the first call's metadata (a
    distinct object: make_fx and torch.export tell inputs apart by identity,
    and two nodes sharing one fake tensor were traced as one). Values
    are metadata; the memo holds only ops whose outputs alias no input and
    evaluations that made no unbacked symbol, and the guards the first call
    added are already in the shared shape environment. Fake-tensor dispatch
    costs 0.3 ms (static) to 20 ms (symbolic pooling) per op, which
    dominated rewrites of deep graphs whose layers repeat the same shapes.
    """
    memo = key = None
    if fake_mode is not None and _memoisable(target):
        memo = _MEMOS.get(fake_mode)
        if memo is None:
            memo = _MEMOS[fake_mode] = _Memo()
        key = memo.key(target, args, kwargs)
        if key is not None and (hit := memo.values.get(key)) is not None:
            return _fresh(fake_mode, hit)
    fargs, fkwargs = node_value(args), node_value(kwargs)
    ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is None:
        with ctx:
            val = target(*fargs, **fkwargs)
    else:
        # symbolic sizes: CompositeImplicitAutograd ops (aten.pad) run their C++ kernels, which read
        # sizes as ints and specialise the program's dynamic sizes, unless the Python dispatcher routes
        # them to torch's symbolic-aware Python kernels, as torch.export does while tracing
        known = len(shape_env.replacements)
        with ctx, enable_python_dispatcher(), _scalar_outputs(shape_env, target):
            val = target(*fargs, **fkwargs)
        if len(shape_env.replacements) != known:
            _check_no_specialisation(shape_env, known, target)
    if key is not None and _storable(fake_mode, val):
        memo.values[key] = val  # type: ignore[union-attr]
    return val


#: ops whose value is a number the program reads at run time (an unbacked symbol)
_SCALAR_OUTPUTS = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)


@contextlib.contextmanager
def _scalar_outputs(shape_env: Any, target: Any) -> Any:
    """A rule's `item` evaluated as an unbacked symbol, as torch.export's shape environment does, where the
    program's own environment was made without (torch.compile's graphs: dynamo's `capture_scalar_outputs` is
    off, and `item` raised DataDependentOutputException); restored after, so nothing else sees it."""
    if target not in _SCALAR_OUTPUTS or shape_env.allow_scalar_outputs:
        yield
        return
    settings = shape_env.settings  # a frozen dataclass
    shape_env.settings = dataclasses.replace(settings, allow_scalar_outputs=True)
    try:
        yield
    finally:
        shape_env.settings = settings


class Specialised(MissingValue):
    """Evaluating a new node fixed a dynamic size of the program to a number."""


def _check_no_specialisation(shape_env: Any, known: int, target: Any) -> None:
    """Raise when the evaluation just done replaced a size symbol by a constant
    (the program would silently become static for that size)."""
    fixed = [(a, b) for a, b in list(shape_env.replacements.items())[known:] if getattr(b, "is_number", False)]
    if fixed:
        sizes = ", ".join(f"{a} = {b}" for a, b in fixed)
        raise Specialised(
            f"computing the value of {getattr(target, '__name__', target)} on symbolic sizes specialised them "
            f"({sizes}): the program's dynamic sizes would become static; the shape environment keeps that "
            "guard, so re-export the program before rewriting it again"
        )


class _Memo:
    """One fake mode's memo: values by (op, argument metadata), and the
    metadata of each argument value seen (by id; the value is kept alive
    with it, so the id cannot be reused while the entry exists)."""

    __slots__ = ("meta", "values")

    def __init__(self) -> None:
        self.values: dict[tuple, Any] = {}
        self.meta: dict[int, tuple[Any, Hashable]] = {}

    def key(self, target: Any, args: tuple, kwargs: dict) -> tuple | None:
        """(op, metadata of every argument), or None when an argument has
        no metadata to key on."""
        parts: list[Any] = [id(target)]  # ops live as long as torch.ops; OpOverload.__hash__ is slow Python
        for a in (*args, *kwargs.items()):
            if not self._part(a, parts):
                return None
        return tuple(parts)

    def _part(self, a: Any, parts: list[Any]) -> bool:
        if isinstance(a, Node):
            val = a.meta.get("val")
            seen = self.meta.get(id(val))
            if seen is None:
                seen = self.meta[id(val)] = (val, _value_key(val))
            if seen[1] is None:
                return False
            parts.append(seen[1])
            return True
        if isinstance(a, _PLAIN):
            parts.append((type(a), a))  # 1, 1.0 and True hash alike
            return True
        if isinstance(a, (tuple, list)):
            parts.append((type(a), len(a)))
            return all(self._part(x, parts) for x in a)
        return False


def _value_key(val: Any) -> Hashable | None:
    """What a memo key holds of an argument's fake value (None: not keyable).
    A fake tensor carrying a constant (fake mode propagates small constants'
    data) is not keyable: outputs could depend on the data."""
    if isinstance(val, torch.Tensor):
        if getattr(val, "constant", None) is not None:
            return None
        if val._has_symbolic_sizes_strides:
            shape, stride, offset = (_sym_key(v) for v in (val.shape, val.stride(), (val.storage_offset(),)))
        else:
            shape, stride, offset = val.shape, val.stride(), val.storage_offset()
        return (shape, stride, offset, val.dtype, val.device, val.requires_grad)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (type(val), val.node.expr)
    return None


#: fake mode -> its memo; see `evaluate`.
_MEMOS: weakref.WeakKeyDictionary[Any, _Memo] = weakref.WeakKeyDictionary()
_UNCACHED_TAGS = frozenset({torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.inplace_view})
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_memoisable_ops: dict[int, bool] = {}  # by id: ops live as long as torch.ops


def _memoisable(target: Any) -> bool:
    """A functional ATen op whose outputs alias no input and whose output
    sizes follow from its inputs' metadata alone."""
    known = _memoisable_ops.get(id(target))
    if known is None:
        schema = getattr(target, "_schema", None)
        known = (
            isinstance(target, torch._ops.OpOverload)
            and schema is not None
            and not schema.is_mutable
            and bool(schema.returns)
            and not any(r.alias_info is not None for r in schema.returns)
            and not _UNCACHED_TAGS.intersection(target.tags)
        )
        _memoisable_ops[id(target)] = known
    return known


def _sym_key(sizes: Any) -> tuple:
    """Sizes with each SymInt replaced by its sympy expression (hashable;
    equal expressions in one shape environment are equal sizes)."""
    return tuple(s if type(s) is int else s.node.expr for s in sizes)


def _fresh(fake_mode: Any, hit: Any) -> Any:
    """A memo hit as new fake tensors of the same metadata (a tuple stays a tuple).
    Measured (loaded 2-core machine): ~65 us a tensor, against ~260 us for a static add's
    dispatch and up to 20 ms for symbolic pooling, which the memo still saves."""
    with fake_mode:
        if isinstance(hit, torch.Tensor):
            return torch.empty_strided(
                hit.shape, hit.stride(), dtype=hit.dtype, device=hit.device, requires_grad=hit.requires_grad
            )
        return type(hit)([_fresh(fake_mode, t) for t in hit])


def _at_offset_zero(t: torch.Tensor) -> bool:
    offset = t.storage_offset()
    return type(offset) is int and offset == 0  # a symbolic offset is not compared (that would add a guard)


def _storable(fake_mode: Any, val: Any) -> bool:
    """A tensor (or tuple of tensors) at offset 0 of its storage (what `_fresh`
    rebuilds) whose evaluation made no new unbacked symbol (a memo hit must not
    share one symbol between two nodes)."""
    tensors = val if isinstance(val, (tuple, list)) else (val,)
    if not all(
        isinstance(t, torch.Tensor) and getattr(t, "constant", None) is None and _at_offset_zero(t) for t in tensors
    ):
        return False
    shape_env = getattr(fake_mode, "shape_env", None)
    return shape_env is None or not shape_env.pending_fresh_unbacked_symbols


def unbacked_bindings(fake_mode: Any, val: Any) -> Any:
    """Bindings for unbacked symbols a new value introduced (e.g. nonzero)."""
    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is None:
        return None
    return compute_unbacked_bindings(shape_env, val)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) or isinstance(
        b, (torch.SymInt, torch.SymFloat, torch.SymBool)
    ):
        return bool(statically_known_true(a == b))
    return a == b


def describe(val: Any) -> str:
    """Short text for a fake value, for error messages."""
    if isinstance(val, torch.Tensor):
        return f"{val.dtype} tensor of shape {tuple(val.shape)}"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(describe(v) for v in val) + ")"
    return f"{type(val).__name__} {val!r}"


def _form(val: Any) -> Any:
    """Sizes as written (an int and a symbolic size equal to it differ)."""
    if isinstance(val, torch.Tensor):
        return tuple(s if type(s) is int else ("sym", s.node.expr) for s in val.shape)
    if isinstance(val, (list, tuple)):
        return tuple(_form(v) for v in val)
    return None


def users_view(seen: Any, new: Any) -> Any:
    """The value a replacement should carry: `seen` (what the replaced value's
    users were typed against) when `new` is the same value with its sizes
    written otherwise (`1` for `(s53//6)`, or another expression provably
    equal), else `new`. Backends type each node from its own value: a
    producer typed [?, ?, 1, 1] feeding users typed [?, ?, ?, ?] fails to
    import in IREE."""
    if seen is None or seen is new or _form(seen) == _form(new) or compatible(seen, new) is not None:
        return new
    return seen


def compatible(old: Any, new: Any, *, check_shape: bool = True) -> str | None:
    """None when `new` can stand in for `old`; else what differs."""
    if isinstance(old, torch.Tensor):
        if old is new:
            return None
        if not isinstance(new, torch.Tensor):
            return f"expected {describe(old)}, got {describe(new)}"
        if old.dtype != new.dtype:
            return f"dtype changed from {old.dtype} to {new.dtype}"
        if old.dim() != new.dim():
            return f"rank changed from {old.dim()} to {new.dim()} ({describe(old)} -> {describe(new)})"
        static = not (old._has_symbolic_sizes_strides or new._has_symbolic_sizes_strides)
        if static and old.shape == new.shape:
            return None
        if not static and _sym_key(old.shape) == _sym_key(new.shape):  # written alike: equal, no sympy asked
            return None
        if check_shape and not all(_same(a, b) for a, b in zip(old.shape, new.shape)):
            return f"shape changed from {tuple(old.shape)} to {tuple(new.shape)}"
        return None
    if isinstance(old, (list, tuple)):
        if not isinstance(new, (list, tuple)) or len(old) != len(new):
            return f"expected {describe(old)}, got {describe(new)}"
        for i, (a, b) in enumerate(zip(old, new)):
            why = compatible(a, b, check_shape=check_shape)
            if why:
                return f"output {i}: {why}"
        return None
    return None
