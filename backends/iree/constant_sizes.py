"""Sizes torch proved constant but kept as SymInts, made ints before IREE's importer types the graph.

Under a derived Dim (`L = 16 * chunks`), `x.reshape(b, -1, 16, h, d)` gets the value shape
`(b, chunks, 16, h, d)` whose `16` is a `SymInt` with the constant expression 16, not an int. IREE's
FX importer types every SymInt dim as dynamic (`?`), so the reshape becomes `[b,?,?,h,d]`: a view with
two dynamic dims, one of them inferred (`-1`), which IREE 3.13 lowers wrong. Its reads get a negative size
("invalid Read access range [0 to -8192]") or, inside a larger dispatch, it computes wrong numbers with no
error (Mamba2's chunked scan: its prefill logits 5.1 off). `concrete_sizes` gives each such value the
same shape with ints where the expression is a number: the importer then types `[b,?,16,h,d]`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Graph

_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _int(size: Any) -> Any:
    """`size` as an int where it is a SymInt whose expression is a number, else as it is."""
    if isinstance(size, torch.SymInt) and getattr(size.node.expr, "is_number", False):
        return int(size.node.expr)
    return size


def _has_constant_sym(sizes: Any) -> bool:
    return any(isinstance(s, torch.SymInt) and _int(s) is not s for s in sizes)


def _concrete(val: Any) -> Any:
    """A fake tensor like `val` with int sizes and strides where its SymInts are constants; None if none is."""
    if not isinstance(val, torch._subclasses.FakeTensor):
        return None
    if not (_has_constant_sym(val.shape) or _has_constant_sym(val.stride())):
        return None
    shape = [_int(s) for s in val.shape]
    stride = [_int(s) for s in val.stride()]
    with val.fake_mode:
        return torch.empty_strided(shape, stride, dtype=val.dtype, device=val.device)


def concrete_sizes(graph: Graph) -> int:
    """Give every node value (and tensor_meta) of `graph` with a constant SymInt size the int instead, in
    place (each node's `meta` is replaced key by key, so a copy of a graph leaves its original as it was).
    Returns how many values changed."""
    changed = 0
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, (list, tuple)):
            items = [_concrete(v) for v in val]
            if not any(item is not None for item in items):
                continue
            node.meta["val"] = type(val)(v if item is None else item for v, item in zip(val, items))
        else:
            new = _concrete(val)
            if new is None:
                continue
            node.meta["val"] = new
            meta = node.meta.get("tensor_meta")
            if meta is not None and hasattr(meta, "_replace"):
                node.meta["tensor_meta"] = meta._replace(shape=new.shape, stride=new.stride())
        changed += 1
    return changed
