"""mlp_rows_padded_to_tiles (backends/iree/rules/mlp_tiles.py): an MLP over rows that are not a multiple of 8,
padded to them.

Real torch 2.13 exports (ViT's 4 x 197 rows, GELU exact and tanh, ReLU and two activations in a row, a residual
and layer norm around the MLP as ViT has them), the graph after (the rows padded before the first linear, the
activation and both linears over a multiple of 8, the padded rows sliced off), numerics against eager and float64
on two input sets, declines (a Dim, rows already aligned, a shared intermediate, float64), and the AVX2 llvm-cpu
route end to end on IREE. (Its speed: docs/performance.md, not here.)
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import CompileCache, IreeBackend
from fx_rewrites.backends.iree import targets as t
from fx_rewrites.backends.iree.rules.mlp_tiles import TILE, mlp_rows_padded_to_tiles
from fx_rewrites.ruleset import Phases, RuleSet
from tests.backends.iree.rules.float32_error import assert_within_torch_error

aten = torch.ops.aten


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Block(torch.nn.Module):
    """ViT's MLP half-block: x + fc2(act(fc1(layer_norm(x))))."""

    def __init__(self, act: str = "gelu", width: int = 32, hidden: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(width)
        self.fc1, self.fc2 = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)
        self.act = act

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        F = torch.nn.functional
        if self.act == "gelu":
            return F.gelu(h)
        if self.act == "tanh-gelu":
            return F.gelu(h, approximate="tanh")
        if self.act == "relu":
            return torch.relu(h)
        return torch.tanh(F.silu(h))  # two in a row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.activation(self.fc1(self.norm(x))))


def _eager(module: torch.nn.Module):
    double = Block(module.act, module.fc1.in_features, module.fc1.out_features).double().eval()
    double.load_state_dict({k: v.double() for k, v in module.state_dict().items()})

    def run(x: torch.Tensor) -> torch.Tensor:  # float64 inputs through float64 weights: the exact run
        return (double if x.dtype == torch.float64 else module)(x)

    return run


def _check(module: Block, inputs: list[tuple[torch.Tensor]]) -> rt.Result:
    ep = rt.export(module, *inputs[0])
    result = rt.apply_rules(ep, mlp_rows_padded_to_tiles)
    rt.assert_fired(result, mlp_rows_padded_to_tiles, times=1)
    rt.assert_ops(result, present=[aten.constant_pad_nd.default, aten.slice.Tensor])
    rows = inputs[0][0].shape[:-1].numel()
    padded = -(-rows // TILE) * TILE
    acts = [n for n in result.graph_module.graph.nodes if n.target in (aten.gelu.default, aten.relu.default)]
    acts += [n for n in result.graph_module.graph.nodes if n.target in (aten.silu.default, aten.tanh.default)]
    linears = [n for n in result.graph_module.graph.nodes if n.target is aten.linear.default]
    assert acts and len(linears) == 2
    for n in (*acts, *linears):  # both linears and the activations between them over the padded rows
        assert n.meta["val"].shape[0] == padded, (n, n.meta["val"].shape)
    sliced = [n for n in result.graph_module.graph.nodes if n.target is aten.slice.Tensor]
    assert [n.meta["val"].shape[0] for n in sliced] == [rows]
    assert_within_torch_error(result.program.module(), _eager(module), inputs)
    rt.assert_idempotent(result, mlp_rows_padded_to_tiles)
    return result


@pytest.mark.parametrize("act", ["gelu", "tanh-gelu", "relu", "silu-tanh"])
def test_vit_rows_padded(act):
    """4 images x 197 tokens (ViT-B/16 at 224x224): 788 rows padded to 792."""
    module = Block(act).eval()
    _check(module, [(_randn(0, 4, 197, 32),), (3.0 * _randn(1, 4, 197, 32),)])


def test_rows_of_a_matrix_and_of_rank_four():
    module = Block().eval()
    _check(module, [(_randn(0, 13, 32),), (_randn(1, 13, 32),)])
    _check(module, [(_randn(0, 2, 3, 5, 32),), (_randn(1, 2, 3, 5, 32),)])


class Shared(torch.nn.Module):
    """fc1's result used twice: padding the MLP would leave the other use over the unpadded rows."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(torch.relu(h)), h


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_declines(dynamic):
    """Rows a multiple of 8, fewer than 8, a shared intermediate, float64; with a Dim batch (static: the same
    modules at a static 197): the rows are symbolic, whether they fit the tile is not known, nothing is padded."""
    x = _randn(0, 4, 197, 32)
    cases = [
        (Block().eval(), _randn(0, 4, 128, 32)),
        (Block().eval(), _randn(0, 1, 5, 32)),
        (Shared().eval(), x),
        (Block().double().eval(), x.double()),
    ]
    if dynamic:
        cases = [(Block().eval(), x), (Block("relu").eval(), x)]
    for module, inputs in cases:
        shapes = ({0: Dim("batch", min=2, max=8)},) if dynamic else None
        result = rt.apply_rules(rt.export(module, inputs, dynamic_shapes=shapes), mlp_rows_padded_to_tiles)
        rt.assert_not_fired(result, mlp_rows_padded_to_tiles)
        if dynamic:  # the route without the rule, at two batch sizes
            assert_within_torch_error(result.program.module(), _eager(module), [(x,), (_randn(1, 3, 197, 32),)])


def test_in_all_and_on_for_avx2():
    """Measured on real AVX2 (ViT 0.88x of the route with it); AVX-512's 16-row tiles were not measured."""
    from fx_rewrites.backends.iree.rules import performance

    assert "mlp_rows_padded_to_tiles" in performance.ALL.names()
    assert "mlp_rows_padded_to_tiles" in performance.for_target("llvm-cpu", "avx2").names()
    assert "mlp_rows_padded_to_tiles" not in performance.for_target("llvm-cpu", "avx512").names()


def _with_rule(rules: RuleSet) -> RuleSet:
    return RuleSet([*rules, mlp_rows_padded_to_tiles], name=rules.name)


@pytest.mark.skipif(t.host_isa() == "", reason="AVX2 code runs on an x86-64 host with AVX2 and FMA only")
def test_on_iree_avx2():
    """The AVX2 llvm-cpu route (whose list has the rule) against the route without it, on
    ViT's MLP at 788 rows: IREE matches eager and gives the unpadded route's numbers within a float32 step."""
    from fx_rewrites.backends.iree.rules import performance

    backend = IreeBackend(target=t.llvm_cpu("avx2"), driver="local-sync", cache=CompileCache())
    perf = performance.for_target("llvm-cpu", "avx2")
    # without `linear_as_f32_dispatch` too: it takes the linears (static rows) before this rule, IREE's product is
    # what this rule pads for
    dropped = ("mlp_rows_padded_to_tiles", "linear_as_f32_dispatch")
    plain = RuleSet([r for r in perf if r.name not in dropped], name=perf.name)
    without = Phases(*(plain if s is perf else s for s in backend.rules.sets), name="without")
    with_rule = Phases(*(_with_rule(plain) if s is perf else s for s in backend.rules.sets), name="with")
    module = Block(width=64, hidden=256).eval()
    inputs = [(_randn(0, 4, 197, 64),), (3.0 * _randn(1, 4, 197, 64),)]
    ep = rt.export(module, *inputs[0])
    result = fx_rewrites.apply(ep, with_rule)
    rt.assert_fired(result, mlp_rows_padded_to_tiles, times=1)
    before = fx_rewrites.apply(ep, without)
    rt.assert_not_fired(before, mlp_rows_padded_to_tiles)
    fn, fn_before = backend.compile(result.program, inputs[0]), backend.compile(before.program, inputs[0])
    for (x,) in inputs:
        want = module(x)
        torch.testing.assert_close(fn(x), want, rtol=1e-4, atol=1e-5)
        step = torch.finfo(torch.float32).eps * want.abs().max().item()
        assert (fn(x) - fn_before(x)).abs().max().item() <= step
