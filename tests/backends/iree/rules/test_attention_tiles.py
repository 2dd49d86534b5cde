"""attention_padded_to_tiles (backends/iree/rules/attention_tiles.py): attention over a length that is not a multiple
of 8, written out padded to it.

Real torch 2.13 exports (static and with a Dim batch, ViT's 197 tokens and a Whisper-like 500 and 13), the graph
after (queries and keys padded to multiples of 8, the padded keys masked, the padded rows sliced off), numerics
against eager and float64 on two input sets, declines, and the AVX2 llvm-cpu route end to end on IREE. (Its speed:
docs/performance.md, not here.)
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim
from torch.nn.attention import SDPBackend, sdpa_kernel

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import CompileCache, IreeBackend
from fx_rewrites.backends.iree import targets as t
from fx_rewrites.backends.iree.rules.attention_tiles import TILE, attention_padded_to_tiles
from fx_rewrites.ruleset import Phases, RuleSet
from tests.backends.iree.rules.float32_error import assert_within_torch_error

aten = torch.ops.aten
sdpa = torch.nn.functional.scaled_dot_product_attention


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Attention(torch.nn.Module):
    def __init__(self, scale: float | None = None, gqa: bool = False) -> None:
        super().__init__()
        self.scale, self.gqa = scale, gqa

    def forward(self, q, k, v):
        return sdpa(q, k, v, scale=self.scale, enable_gqa=self.gqa)


def _inputs(batch: int, rows: int, keys: int, seed: int, heads: int = 2, kv_heads: int = 2, size: int = 16):
    return (
        _randn(seed, batch, heads, rows, size),
        _randn(seed + 1, batch, kv_heads, keys, size),
        3.0 * _randn(seed + 2, batch, kv_heads, keys, size),
    )


BATCH = Dim("batch", min=2, max=8)


def _math_kernel(module: torch.nn.Module):
    """`module` with torch's math SDPA kernel: written out as the rule writes it (matmul, softmax, matmul), the
    other of the two forms torch runs attention by on the CPU; torch's float32 error is the larger of the two."""

    def run(*args):
        with sdpa_kernel(SDPBackend.MATH):
            return module(*args)

    return run


def _check(module, inputs, dynamic: bool):
    shapes = ({0: BATCH},) * 3 if dynamic else None
    ep = rt.export(module, *inputs[0], dynamic_shapes=shapes)
    result = rt.apply_rules(ep, attention_padded_to_tiles)
    rt.assert_fired(result, attention_padded_to_tiles)
    rt.assert_ops(
        result,
        present=[aten.constant_pad_nd.default, aten._softmax.default],
        absent=[aten.scaled_dot_product_attention.default],
    )
    # both products, and the softmax between them, over lengths that are multiples of the tile
    for n in result.graph_module.graph.nodes:
        if n.target in (aten.matmul.default, aten._softmax.default):
            assert all(s % TILE == 0 for s in n.meta["val"].shape[-2:]), (n, n.meta["val"].shape)
    assert_within_torch_error(result.program.module(), module, inputs, torch_forms=[_math_kernel(module)])
    rt.assert_idempotent(result, attention_padded_to_tiles)
    return result


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize(("rows", "keys"), [(197, 197), (500, 500), (13, 13), (16, 197), (197, 16)])
def test_padded_to_tiles(rows, keys, dynamic):
    """ViT's 197 tokens, a Whisper-like 500, a short 13; queries or keys alone off the tile."""
    inputs = [_inputs(2, rows, keys, 0), _inputs(3 if dynamic else 2, rows, keys, 10)]
    result = _check(Attention(), inputs, dynamic)
    masked = [n for n in result.graph_module.graph.nodes if n.target is aten.masked_fill.Scalar]
    sliced = [n for n in result.graph_module.graph.nodes if n.target is aten.slice.Tensor]
    assert len(masked) == (keys % TILE != 0) and len(sliced) == (rows % TILE != 0)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_padded_with_a_scale_and_grouped_heads(dynamic):
    inputs = [
        _inputs(2, 197, 197, 0, heads=4, kv_heads=2),
        _inputs(4 if dynamic else 2, 197, 197, 20, heads=4, kv_heads=2),
    ]
    _check(Attention(scale=0.3, gqa=True), inputs, dynamic)


def test_scores_far_below_zero():
    """Every real score near -500 (the padded keys' 0 would be a row's max were they not masked, and every real
    exponential would underflow to 0): the padded form matches eager."""
    q, k, v = _inputs(2, 197, 197, 0)
    far = (torch.full_like(q, 10.0), -k.abs() - 10.0, v)
    assert (far[0] @ far[1].transpose(-2, -1) / 4.0).max() < -400.0
    _check(Attention(), [far, (q, k, v)], False)


def test_declines():
    q, k, v = _inputs(2, 197, 197, 0)
    aligned = _inputs(2, 128, 128, 0)
    cases = [
        (Attention(), aligned, None),  # multiples of 8 already
        (lambda q, k, v: sdpa(q, k, v, is_causal=True), (q, k, v), None),
        (lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), (q, k, v, torch.ones(197, 197, dtype=torch.bool)), None),
        (Attention(), (q[:, :, :1], k, v), None),  # one query row (a decode step)
        (Attention(), tuple(x.double() for x in (q, k, v)), None),
        (Attention(), (q, k, v), ({2: Dim("n", min=2, max=512)},) * 3),  # a symbolic length
    ]
    for module, inputs, shapes in cases:
        result = rt.apply_rules(rt.export(module, *inputs, dynamic_shapes=shapes), attention_padded_to_tiles)
        rt.assert_not_fired(result, attention_padded_to_tiles)


def test_in_all_and_on_for_no_isa():
    """Measured on real AVX2 at 1-2% on ViT and the Whisper encoder, inside the noise: a rule to add, not a default."""
    from fx_rewrites.backends.iree.rules import performance

    assert "attention_padded_to_tiles" in performance.ALL.names()
    for isa in ("avx2", "avx512"):
        assert "attention_padded_to_tiles" not in performance.for_target("llvm-cpu", isa).names()


def _with_padding(rules: RuleSet) -> RuleSet:
    """`rules` with `attention_padded_to_tiles` where ALL has it: before `attention_as_matmul_softmax`."""
    names = rules.names()
    at = names.index("attention_as_matmul_softmax")
    return RuleSet([*list(rules)[:at], attention_padded_to_tiles, *list(rules)[at:]], name="padded")


@pytest.mark.skipif(t.host_isa() == "", reason="AVX2 code runs on an x86-64 host with AVX2 and FMA only")
def test_on_iree_avx2_with_a_dim():
    """The AVX2 llvm-cpu route (head groups first, then the padded form of each group, the softmax normalized after
    the product) at two batch sizes of one module: IREE matches eager as the route without the rule does, and gives
    the unpadded route's numbers (measured: identical, the padded keys add exact zeros)."""
    from fx_rewrites.backends.iree.rules import performance

    backend = IreeBackend(target=t.llvm_cpu("avx2"), driver="local-sync", cache=CompileCache())
    perf = performance.for_target("llvm-cpu", "avx2")
    unpadded_rules = backend.rules  # AVX2's own: the rule is on for no ISA (test_in_all_and_on_for_no_isa)
    padded_rules = Phases(*(_with_padding(s) if s is perf else s for s in backend.rules.sets), name="padded")
    inputs = [
        _inputs(2, 197, 197, 0, heads=4, kv_heads=4, size=64),
        _inputs(3, 197, 197, 10, heads=4, kv_heads=4, size=64),
    ]
    ep = rt.export(Attention(), *inputs[0], dynamic_shapes=({0: BATCH},) * 3)
    result = fx_rewrites.apply(ep, padded_rules)
    rt.assert_fired(result, attention_padded_to_tiles)
    fn = backend.compile(result.program, inputs[0])
    before = fx_rewrites.apply(ep, unpadded_rules)
    rt.assert_not_fired(before, attention_padded_to_tiles)
    fn_before = backend.compile(before.program, inputs[0])
    for args in inputs:
        want = Attention()(*args)
        torch.testing.assert_close(fn(*args), want, rtol=1e-4, atol=1e-5)
        step = torch.finfo(torch.float32).eps * want.abs().max().item()
        assert (fn(*args) - fn_before(*args)).abs().max().item() <= step


class Heads(torch.nn.Module):
    """Multi-head attention as transformers writes it: split heads, SDPA, merge heads (a view after
    `run_decompositions`, which the padded form's strides must still allow on torch, engine/layouts.py)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (y.reshape(b, s, 4, 4).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        return sdpa(q, k, v).transpose(1, 2).reshape(b, s, 16) * 2.0


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_heads_merged_by_a_view_run_on_torch(dynamic):
    xs = [_randn(0, 2, 13, 16), _randn(1, 3 if dynamic else 2, 13, 16)]
    shapes = {"x": {0: BATCH}} if dynamic else None
    ep = torch.export.export(Heads().eval(), (xs[0],), dynamic_shapes=shapes).run_decompositions({})
    result = rt.apply_rules(ep, attention_padded_to_tiles)
    rt.assert_fired(result, attention_padded_to_tiles, times=1)
    heads = Heads().eval()
    double = Heads().eval().double()

    def eager(x: torch.Tensor) -> torch.Tensor:  # float64 inputs through float64 weights: the exact run
        return (double if x.dtype == torch.float64 else heads)(x)

    assert_within_torch_error(result.program.module(), eager, [(x,) for x in xs])
