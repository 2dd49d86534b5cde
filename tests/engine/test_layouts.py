"""A replacement laid out otherwise than the value it replaces (engine/layouts.py): the views downstream that
its strides no longer allow become reshapes, the others stay views, and the program runs on torch eager."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import rule
from fx_rewrites import testing as rt

aten = torch.ops.aten


@rule(roots=(aten.add.Tensor,), when=lambda node: not node.meta["val"].is_contiguous() or None)
def add_then_contiguous(node, rw):
    """The same sum, as a contiguous tensor (the layout a written-out op gives where eager's kept another)."""
    first, *rest = node.args
    rw.replace(
        node, rw.call(aten.add.Tensor, rw.call(aten.clone.default, first, memory_format=torch.contiguous_format), *rest)
    )


def f(x: torch.Tensor) -> torch.Tensor:
    y = x.t() + 1.0  # laid out as x: y.t() is contiguous, so its reshape is a view
    return y.t().reshape(-1) * 2.0, y.reshape(-1)


def _x(seed: int, rows: int = 3) -> torch.Tensor:
    return torch.randn(rows, 5, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_views_the_new_strides_do_not_allow_become_reshapes(dynamic):
    shapes = [{0: Dim("n", min=2, max=16)}] if dynamic else None
    ep = rt.export(f, _x(0), dynamic_shapes=shapes).run_decompositions({})
    views = [n for n in ep.graph.nodes if n.target in (aten.view.default, aten._unsafe_view.default)]
    # y.t()'s reshape a view; y's own a copy (clone + _unsafe_view)
    assert [v.target for v in views] == [aten.view.default, aten._unsafe_view.default], ep.graph
    result = rt.apply_rules(ep, add_then_contiguous)
    rt.assert_fired(result, add_then_contiguous, times=1)
    kept = {n.name: n for n in result.graph_module.graph.nodes}
    assert kept[views[0].name].target is aten.reshape.default  # failed on torch as a view of y.t()
    assert kept[views[0].name].meta["rewrites"][-1]["rule"] == "add_then_contiguous"
    assert kept[views[1].name].target is aten._unsafe_view.default  # of a clone: contiguous still
    rows = (3, 7) if dynamic else (3, 3)
    rt.assert_matches_eager(result, f, [(_x(1, rows[0]),), (_x(2, rows[1]),)])


def test_a_replacement_laid_out_as_before_leaves_the_views():
    ep = rt.export(lambda x: (x + 1.0).reshape(-1), _x(0)).run_decompositions({})
    result = rt.apply_rules(ep, add_then_contiguous)  # contiguous already: `when` declines
    rt.assert_not_fired(result, add_then_contiguous)
    assert aten.view.default in rt.targets(result)


def written_through_a_view(x: torch.Tensor) -> torch.Tensor:
    y = x.t() + 1.0
    y.t().view(-1).add_(1.0)  # writes y through the view
    return y * 2.0


def test_a_view_written_through_stays_a_view():
    """A graph that mutates (make_fx, not functionalized): as a reshape that copies, the write would miss y and
    the program would return y * 2 without the + 1, a wrong number; the view stays and torch names it instead."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = _x(0)
    gm = make_fx(written_through_a_view, tracing_mode="fake")(x)
    result = rt.apply_rules(gm, add_then_contiguous)
    rt.assert_fired(result, add_then_contiguous, times=1)
    assert aten.view.default in rt.targets(result) and aten.reshape.default not in rt.targets(result)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        result.graph_module(x)
