"""Fuzz step: in-place writes through chains of views, then reads of the base and of other views.

The forms `rewrites/rules/inplace_views.py` writes back as torch's functionalization does: a write
through `narrow`/`slice` (strided too)/`select`/`diagonal`/`transpose`/`permute`/`unsqueeze`/`view`,
through a piece of `split`/`unbind`, through a `reshape`/`flatten`/`contiguous` that may copy (then
the write reaches nobody, as in eager), with every view made before the writes and read after them
(views of views included: they must not keep stale values), on a fresh tensor or on the step's input
itself (the program's input when it is the first step: the caller's tensor is compared too).

A step's parameter is data, `(base, writes, read_views)`: `base` is "fresh" (`x * 1`) or "input"
(`x` itself), `writes` one or two `(chain, op)` pairs, `chain` a tuple of `(view, k)` links. Dims are
picked at run time from `k` modulo the view's rank and a link the rank cannot take is left out, so
every drawn chain runs on every shape (sizes of 1, dims lost to `select`/`unbind`, Dim sizes) and
makes no empty view.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

Link = tuple[str, int]


def _pieces(t: torch.Tensor, d: int, how: str) -> list[torch.Tensor]:
    """`t.split([1, n - 1], d)` or `t.unbind(d)`; on a tensor that requires grad (after a layer with
    parameters), where autograd refuses writes to pieces of a multi-output view, the same pieces
    by `narrow` / `select`."""
    n = t.shape[d]
    if how == "split":
        return [t.narrow(d, 0, 1), t.narrow(d, 1, n - 1)] if t.requires_grad else list(t.split([1, n - 1], d))
    return [t.select(d, i) for i in range(n)] if t.requires_grad else list(t.unbind(d))


def _link(t: torch.Tensor, view: str, k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`t` viewed by one link, and the sibling views it made (other pieces of a split/unbind); `t` itself
    when its rank cannot take the view."""
    rank = t.dim()
    if rank == 0:
        return t, []
    d = k % rank
    if view in ("narrow_tail", "split") and t.shape[d] < 2:
        return t, []  # no empty views: iree-compile crashes on some (a size-0 write read back), torch does not
    if view == "narrow_head":
        return t.narrow(d, 0, 1), []
    if view == "narrow_tail":
        return t.narrow(d, 1, t.shape[d] - 1), []
    if view == "slice_step":
        index = [slice(None)] * d + [slice(None, None, 2)]
        return t[tuple(index)], []
    if view == "select":
        return t.select(d, -1 if k % 2 else 0), []
    if view in ("split", "unbind"):
        pieces = _pieces(t, d, view)
        chosen = (-1 if k % 2 else 0) % len(pieces)
        return pieces[chosen], [p for i, p in enumerate(pieces) if i != chosen]
    if view == "unsqueeze":
        return t.unsqueeze(d), []
    if view == "view_flat":  # a view when t is contiguous; otherwise eager raises, so reshape instead
        return (t.view(-1) if t.is_contiguous() else t.reshape(-1)), []
    if view == "reshape":  # copies when t's strides do not allow a view: the write then reaches nobody
        return t.reshape(-1), []
    if view == "contiguous":
        return t.contiguous(), []
    if rank < 2:
        return t, []
    e = (d + 1) % rank
    if view == "transpose":
        return t.transpose(d, e), []
    if view == "diagonal":
        return t.diagonal(k % 2 if t.shape[e] >= 2 else 0, d, e), []
    if view == "permute":
        return t.permute(*reversed(range(rank))), []
    if view == "flatten":
        return t.flatten(min(d, e), max(d, e)), []
    raise ValueError(f"unknown view {view!r}")


VIEWS = (
    "narrow_head",
    "narrow_tail",
    "slice_step",
    "select",
    "split",
    "unbind",
    "unsqueeze",
    "view_flat",
    "reshape",
    "contiguous",
    "transpose",
    "diagonal",
    "permute",
    "flatten",
)


def _write(v: torch.Tensor, op: str) -> None:
    """One in-place op on `v`."""
    if op == "mul_":
        v.mul_(-1.5)
    elif op == "add_":
        v.add_(0.5)
    elif op == "zero_":
        v.zero_()
    elif op == "fill_":
        v.fill_(3.0)
    elif op == "clamp_":
        v.clamp_(-0.5, 0.5)
    elif op == "copy_":  # from values of the view itself, reordered
        v.copy_(torch.tanh(v.flip(-1) if v.dim() else v) * 2)
    elif op == "setitem":
        if v.dim():
            v[..., :1] = 2.0
        else:
            v.fill_(2.0)
    elif op == "masked_fill_":
        v.masked_fill_(v > 0, 0.25)
    elif op == "mul_add_":
        v.mul_(2.0).add_(-1.0)
    else:
        raise ValueError(f"unknown in-place op {op!r}")


OPS = ("mul_", "add_", "zero_", "fill_", "clamp_", "copy_", "setitem", "masked_fill_", "mul_add_")


def _probe(v: torch.Tensor) -> torch.Tensor:
    """A number that changes when any element of `v` does (a position-weighted mean)."""
    n = v.numel() + 1
    weights = torch.arange(1, n, dtype=v.dtype).view(v.shape)
    return (v * weights).sum() / (n * n)  # not n ** 2: IREE's FX importer has no pow of SymInts


def write_through_views(net: torch.nn.Module, i: int, x: torch.Tensor, p: Any) -> torch.Tensor:
    """The step: make every view, then write through the last view of each chain, then read."""
    base, writes, read_views = p
    y = x if base == "input" else x * 1
    made: list[torch.Tensor] = []
    written: list[tuple[torch.Tensor, str]] = []
    for chain, op in writes:
        v = y
        for view, k in chain:
            v, siblings = _link(v, view, k)
            made += [v, *siblings]
        written.append((v, op))
    for v, op in written:
        _write(v, op)
    out = y * 1
    if read_views:
        for v in made:
            out = out + _probe(v)
    return out


def write_params(views: tuple[str, ...] = VIEWS) -> st.SearchStrategy:
    """Parameters of the step: chains of 1 to 3 of `views`, one or two writes."""
    chains = st.lists(st.tuples(st.sampled_from(views), st.integers(0, 3)), min_size=1, max_size=3).map(tuple)
    return st.tuples(
        st.sampled_from(["fresh", "input"]),
        st.lists(st.tuples(chains, st.sampled_from(OPS)), min_size=1, max_size=2).map(tuple),
        st.booleans(),
    )


WRITE_PARAMS = write_params()
