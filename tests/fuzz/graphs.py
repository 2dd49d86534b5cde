"""Random FX graphs of ATen ops, built node by node (no torch.export), holding the bad forms.

Cheaper than exporting a module (no tracing), so a local run reaches tens of
thousands of graphs: `GraphSpec` is a chain of (op, parameter) steps on a 4-d
float input; `build(spec)` makes the GraphModule (`meta["val"]` left to
`fx_rewrites.apply(..., example_inputs=...)`), and `check_graph(spec)` compares it
with the rewritten graph, checks idempotence and lint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from hypothesis import strategies as st
from torch.fx import Graph, GraphModule, Node

import fx_rewrites
from tests.fuzz.generate import ATOL, RTOL

aten = torch.ops.aten


@attrs.frozen
class GraphSpec:
    shape: tuple[int, int, int, int]
    steps: tuple[tuple[str, Any], ...]
    seed: int = 0

    def inputs(self) -> list[tuple[torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed)
        return [(torch.randn(self.shape, generator=gen),), (torch.randn(self.shape, generator=gen) * 3,)]


class _Builder:
    def __init__(self, root: torch.nn.Module) -> None:
        self.graph, self.root, self.consts = Graph(), root, 0

    def call(self, op: Any, *args: Any, **kwargs: Any) -> Node:
        return self.graph.call_function(op, args, kwargs)

    def const(self, value: torch.Tensor) -> Node:
        name = f"_tensor_constant{self.consts}"
        self.consts += 1
        self.root.register_buffer(name, value)
        return self.graph.get_attr(name)


# each: fn(builder, x, param) -> x ; RESHAPE: how it changes (H, W)
OPS: dict[str, Callable[[_Builder, Node, Any], Node]] = {
    "relu": lambda b, x, p: b.call(aten.relu.default, x),
    "neg": lambda b, x, p: b.call(aten.neg.default, x),
    "tanh": lambda b, x, p: b.call(aten.tanh.default, x),
    "add_scalar": lambda b, x, p: b.call(aten.add.Tensor, x, p),
    "mul_scalar": lambda b, x, p: b.call(aten.mul.Tensor, x, p),
    "pow2": lambda b, x, p: b.call(aten.pow.Tensor_Scalar, x, 2),
    "hardswish": lambda b, x, p: b.call(aten.hardswish.default, x),
    "sum_keepdim": lambda b, x, p: b.call(aten.sub.Tensor, x, b.call(aten.sum.dim_IntList, x, [p], True)),
    "max_pool_no_stride": lambda b, x, p: b.call(aten.max_pool2d.default, x, [2, 2]),
    "max_pool_empty_stride": lambda b, x, p: b.call(aten.max_pool2d.default, x, [2, 2], []),
    "avg_pool_no_stride": lambda b, x, p: b.call(aten.avg_pool2d.default, x, [2, 2]),
    "lift_fresh_copy": lambda b, x, p: b.call(
        aten.add.Tensor, x, b.call(aten.lift_fresh_copy.default, b.const(torch.tensor(p)))
    ),
    "detach_": lambda b, x, p: b.call(aten.detach_.default, b.call(aten.mul.Tensor, x, 1)),
    "dropout_eval": lambda b, x, p: b.call(aten.dropout.default, x, p, False),
    "clone_add_": lambda b, x, p: b.call(aten.add_.Tensor, b.call(aten.clone.default, x), p),
    "mask_index_sum": lambda b, x, p: b.call(
        aten.add.Tensor,
        x,
        b.call(aten.sum.default, b.call(aten.index.Tensor, x, [b.call(aten.gt.Scalar, x, p)])),
    ),
    "masked_select_sum": lambda b, x, p: b.call(
        aten.sub.Tensor,
        x,
        b.call(aten.sum.default, b.call(aten.masked_select.default, x, b.call(aten.gt.Scalar, x, p))),
    ),
}
HALVES = {"max_pool_no_stride", "max_pool_empty_stride", "avg_pool_no_stride"}
_SCALAR = st.sampled_from([-1.5, -0.5, 0.5, 2.0])
PARAMS: dict[str, st.SearchStrategy] = {
    "add_scalar": _SCALAR,
    "mul_scalar": _SCALAR,
    "sum_keepdim": st.integers(1, 3),
    "lift_fresh_copy": _SCALAR,
    "dropout_eval": st.sampled_from([0.1, 0.5]),
    "clone_add_": _SCALAR,
    "mask_index_sum": st.sampled_from([-0.5, 0.0, 0.5]),
    "masked_select_sum": st.sampled_from([-0.5, 0.0, 0.5]),
}


def build(spec: GraphSpec) -> GraphModule:
    root = torch.nn.Module()
    b = _Builder(root)
    x = b.graph.placeholder("x")
    for kind, param in spec.steps:
        x = OPS[kind](b, x, param)
    b.graph.output((x,))
    return GraphModule(root, b.graph)


@st.composite
def graph_specs(draw: st.DrawFn, max_steps: int = 6) -> GraphSpec:
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([4, 8])), 8)
    h, w, steps = shape[2], shape[3], []
    for _ in range(draw(st.integers(1, max_steps))):
        kinds = sorted(k for k in OPS if k not in HALVES or (h >= 2 and w >= 2))
        kind = draw(st.sampled_from(kinds))
        steps.append((kind, draw(PARAMS[kind]) if kind in PARAMS else None))
        if kind in HALVES:
            h, w = h // 2, w // 2
    return GraphSpec(shape=shape, steps=tuple(steps), seed=draw(st.integers(0, 2**16)))


def check_graph(spec: GraphSpec) -> fx_rewrites.Result:
    gm = build(spec)
    inputs = spec.inputs()
    result = fx_rewrites.apply(gm, example_inputs=inputs[0])
    assert result.report.converged and not result.report.skips, result.report.summary()
    result.graph_module.graph.lint()
    for n, args in enumerate(inputs):
        expected = build(spec)(*(a.clone() for a in args))
        got = result.graph_module(*(a.clone() for a in args))
        torch.testing.assert_close(
            got, expected, rtol=RTOL, atol=ATOL, equal_nan=True, msg=lambda m, n=n: f"graph, input set {n}: {m}"
        )
    again = fx_rewrites.apply(result.graph_module)
    assert again.report.total_rewrites == 0, f"second apply rewrote again: {dict(again.report.rewrites)}"
    return result
