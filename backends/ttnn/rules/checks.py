"""What ttnn can take, and the shape every lowering rule has.

A lowering rule's `when` says whether ttnn can take the node (or
`Miss("why")`); the rule's body, `build(node, rw, *, args)` as any rule body
(`args`: the node's arguments by schema name; `found`: what `when` returned,
where it computed more), returns the device value that computes the node,
which the rule reads back to the host (`to_torch`). The reasons are what the coverage report
shows: non-float tensors (ttnn computes in bfloat16 here), rank above 4,
symbolic sizes where ttnn takes constants, a number where a tensor is
expected, arguments the ttnn op lacks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.backends.ttnn.rules import ops
from fx_rewrites.backends.ttnn.rules.boundary import to_host
from fx_rewrites.backends.ttnn.rules.constants import constant_reason
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import FunctionRule

aten = torch.ops.aten

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32)
MASK_DTYPES = (torch.bool, *FLOAT_DTYPES)
#: ttnn tensors here have rank 1 to 4 (4-D is the tile library's native form)
MAX_RANK = 4

Bound = dict[str, Any]
Build = Callable[..., Any]  # build(node, rw, *, args, found) -> device value | Miss


def bind(node: Node) -> Bound:
    """The node's arguments by schema name."""
    return schema.arguments(node)


def problem(arg: Any, what: str, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES, scalar_ok: bool = False) -> str | None:
    """Why `arg` cannot be a ttnn tensor, or None (`scalar_ok`: a 0-d tensor may go in as shape [1])."""
    val = arg.meta.get("val") if isinstance(arg, Node) else arg
    if not isinstance(val, torch.Tensor):
        return f"{what} is {type(val).__name__} {val!r}, not a tensor"
    if val.dtype not in dtypes:
        kinds = "float" if dtypes == FLOAT_DTYPES else "/".join(str(d).removeprefix("torch.") for d in dtypes)
        kinds = "bool or float" if dtypes == MASK_DTYPES else kinds
        return f"{what} is {str(val.dtype).removeprefix('torch.')}; the ttnn lowering takes {kinds} tensors"
    if not (0 if scalar_ok else 1) <= val.dim() <= MAX_RANK:
        return f"{what} has rank {val.dim()}; ttnn tensors here have rank 1 to {MAX_RANK}"
    if any(isinstance(s, int) and s == 0 for s in val.shape):  # no guard on unbacked sizes
        return f"{what} is empty"
    return None


def static_problem(node: Node) -> str | None:
    """Why the node's shape cannot be written into a ttnn call as constants (reshape, conv2d, pooling)."""
    vals = [a.meta.get("val") for a in (node, *node.all_input_nodes)]
    sym = [tuple(v.shape) for v in vals if isinstance(v, torch.Tensor) and not all(isinstance(s, int) for s in v.shape)]
    return f"symbolic sizes {sym[0]}: this ttnn call takes its sizes as constants" if sym else None


def tensors_ok(
    *names: str,
    indices: Iterable[str] = (),
    static: bool = False,
    masks: Iterable[str] = (),
    result: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    scalars: Iterable[str] = (),
) -> Callable[..., Any]:
    """A `when` predicate: the named arguments (float; `indices`: integer; `masks`: bool or float) and the
    node's result (`result` dtypes) can be ttnn tensors (`static`: of static shapes). It returns the binding
    (or a Miss); `when(node, args)` reuses a binding the caller (or the engine) made. `scalars`: operands that
    may be 0-d (elementwise ops broadcast them; they go to the device as shape [1])."""
    index_names, mask_names, scalar_names = tuple(indices), tuple(masks), frozenset(scalars)

    def when(node: Node, args: Bound | None = None) -> Any:
        bound = bind(node) if args is None else args
        for name in names + index_names + mask_names:
            values = bound.get(name)
            dtypes = INDEX_DTYPES if name in index_names else MASK_DTYPES if name in mask_names else FLOAT_DTYPES
            for i, v in enumerate(values if isinstance(values, (list, tuple)) else [values]):
                if v is None:
                    continue
                what = f"{name}[{i}]" if isinstance(values, (list, tuple)) else name
                why = problem(v, what, dtypes, scalar_ok=name in scalar_names)
                if why:
                    return Miss(why)
        why = problem(node, "the result", result) or (static_problem(node) if static else None)
        return Miss(why) if why else bound

    return when


@attrs.frozen(kw_only=True)
class Lowering(FunctionRule):
    """A function rule whose body, `build(node, rw, *, args, found)`, returns the device value that computes
    the node (or a Miss); the rule reads it back to the host (`to_torch`) in the node's place. A node computed
    from the program's constants only is declined before `when`: it stays on the host, computed once in float32
    (`constants.py`)."""

    def _when(self, node: Node) -> Any:
        why = constant_reason(node)
        return Miss(f"when: {why}") if why else super()._when(node)

    def rewrite(self, node: Node, match: Any, rw: Rewriter) -> Any:
        out = super().rewrite(node, match, rw)
        if isinstance(out, Miss):
            return out
        rw.replace(node, out if out.target is ops.to_torch else to_host(rw, out, node))
        return None


def lowering(name: str, roots: Iterable[Any], when: Callable[..., Any], doc: str) -> Callable[[Build], Lowering]:
    """Decorator: `build(node, rw, *, args, found) -> device value | Miss` (each keyword declared only when
    used, as any rule body) becomes a `Lowering` rule."""

    def wrap(build: Build) -> Lowering:
        return Lowering(fn=build, ops=tuple(roots), name=name, when=when, doc=doc, tags=frozenset({"ttnn"}))

    return wrap


def static(val: Any) -> list[int]:
    """A tensor value's shape as ints (the caller checked it is static)."""
    return [int(s) for s in val.shape]


def pair(value: Any) -> list[int]:
    """A 2-D size, stride or padding as a list of two ints."""
    items = [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return items * 2 if len(items) == 1 else items
