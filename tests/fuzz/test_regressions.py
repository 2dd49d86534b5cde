"""Failures the fuzzers found, kept as plain tests (the fuzz example database replays them too)."""

from __future__ import annotations

import torch

import fx_rewrites
from fx_rewrites import testing as rt
from tests.fuzz.graphs import GraphSpec, build, check_graph

aten = torch.ops.aten


def test_graph_module_with_a_data_dependent_size_gets_values():
    # found by test_default_rules_keep_results_of_hand_built_graphs: apply(gm, example_inputs=...) computed
    # meta['val'] under a FakeTensorMode without a ShapeEnv, so x[x > 0] raised DynamicOutputShapeException
    spec = GraphSpec(shape=(2, 3, 4, 8), steps=(("mask_index_sum", 0.0), ("relu", None)), seed=1)
    gm = build(spec)
    (x,) = spec.inputs()[0]
    result = fx_rewrites.apply(gm, example_inputs=(x,))
    rt.assert_fired(result, "mask_index_to_gather", times=1)
    rt.assert_ops(result, absent=[aten.index.Tensor])
    expected = torch.relu(x + x[x > 0].sum())
    torch.testing.assert_close(result.graph_module(x.clone())[0], expected)
    check_graph(spec)


def test_chained_writes_through_a_copying_reshape_with_its_source_read_after():
    # WRONG before (view-write fuzzer, seed 13): r missed the add_ (tests/rules/test_inplace_views.py)
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = x * 1
        n = m.narrow(1, 0, 1)
        r = n.reshape(-1)  # n is not contiguous: reshape copies, so the writes below never reach m or n
        w = r.narrow(0, 0, 1).mul_(2.0).add_(-1.0)
        return m * 1, n * 1, r * 1, w * 1

    x = torch.randn(2, 2, 2, 4, generator=torch.Generator().manual_seed(0))
    result = fx_rewrites.apply(rt.export(fn, x))
    expected = fn(x.clone())
    for got, want in zip(result.program.module()(x.clone()), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
