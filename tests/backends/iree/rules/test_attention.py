"""Attention on IREE (backends/iree/rules/attention.py): one form, the fully-masked-row guard, attention written out.

The guard's tests check both halves of the claim: IREE 3.13's own attention
lowering gives NaN for a row that masks every key (a test that fails once
IREE is fixed, so the guard can go), and with the guard IREE gives torch's
0, on the export route and through torch.compile.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.dynamo import dynamo_backend
from fx_rewrites.backends.iree import IreeBackend
from fx_rewrites.backends.iree.rules.attention import (
    GUARD,
    attention_as_matmul_softmax,
    attention_fully_masked_rows_guard,
    attention_mask_that_masks_nothing,
    bind,
    flash_attention_for_cpu_to_sdpa,
)
from fx_rewrites.ruleset import Phases

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


class Attend(torch.nn.Module):
    """SDPA with a mask argument (bool or float), as transformers calls it."""

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.kwargs)


def _qkv(seed: int, batch: int = 2, heads: int = 2, length: int = 5, keys: int = 7, kv_heads: int | None = None):
    g = torch.Generator().manual_seed(seed)
    kv_heads = kv_heads or heads
    return (
        torch.randn(batch, heads, length, 8, generator=g),
        torch.randn(batch, kv_heads, keys, 8, generator=g),
        torch.randn(batch, kv_heads, keys, 8, generator=g),
    )


def _bool_mask(seed: int, batch: int = 2, length: int = 5, keys: int = 7) -> torch.Tensor:
    """A random padding/window mask whose row 1 of batch 1 masks every key (seed picks more rows)."""
    g = torch.Generator().manual_seed(100 + seed)
    mask = torch.rand(batch, 1, length, keys, generator=g) > 0.4
    mask[:, :, :, 0] = True
    mask[-1, :, 1, :] = False
    mask[0, :, (seed + 2) % length, :] = False
    return mask


def _float_mask(seed: int, batch: int = 2, length: int = 5, keys: int = 7) -> torch.Tensor:
    return torch.zeros(batch, 1, length, keys).masked_fill(~_bool_mask(seed, batch, length, keys), float("-inf"))


def _inputs(mask_fn, **sizes):
    return [(*_qkv(seed, **sizes), mask_fn(seed)) for seed in (0, 1)]


def test_torch_gives_zero_for_a_fully_masked_row():
    """What the guard must reproduce (torch 2.13 CPU eager), for both mask kinds."""
    for mask_fn in (_bool_mask, _float_mask):
        out = Attend()(*_inputs(mask_fn)[0])
        assert torch.equal(out[-1, :, 1], torch.zeros_like(out[-1, :, 1]))
        assert out[0, :, 0].abs().sum() > 0


# ----------------------------------------------------------------------------- the guard


@pytest.mark.parametrize("mask_fn", [_bool_mask, _float_mask], ids=["bool", "float"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_guard_rewrites_and_keeps_numerics(mask_fn, dynamic):
    inputs = _inputs(mask_fn)
    shapes = None
    if dynamic:
        batch, length = Dim("batch", min=2, max=8), Dim("length", min=2, max=64)
        shapes = ({0: batch, 2: length}, {0: batch}, {0: batch}, {0: batch, 2: length})
    ep = rt.export(Attend(), *inputs[0], dynamic_shapes=shapes)
    result = rt.apply_rules(ep, attention_fully_masked_rows_guard)
    rt.assert_fired(result, GUARD, times=1)
    rt.assert_ops(result, present=[SDPA, aten.where.self])
    rt.assert_matches_eager(result, Attend(), inputs)
    rt.assert_idempotent(result, attention_fully_masked_rows_guard)


def test_guard_leaves_unmasked_attention_alone():
    ep = rt.export(Attend(is_causal=True), *_qkv(0))
    rt.assert_not_fired(rt.apply_rules(ep, attention_fully_masked_rows_guard), GUARD)


@pytest.fixture(scope="module")
def iree_own_attention() -> IreeBackend:
    """llvm-cpu with IREE's own attention lowering: the default rules less the performance phase (which writes
    attention out), without the performance flags (data tiling rejects IREE's attention lowering)."""
    default = IreeBackend()
    backend = IreeBackend(rules=Phases(*default.rules.sets[:-1]), perf_flags=())
    assert attention_as_matmul_softmax.name in default.rules and attention_as_matmul_softmax.name not in backend.rules
    return backend


@pytest.mark.parametrize("mask_fn", [_bool_mask, _float_mask], ids=["bool", "float"])
def test_iree_gives_nan_without_the_guard_and_zero_with_it(iree_own_attention, mask_fn):
    inputs = _inputs(mask_fn)
    ep = rt.export(Attend(), *inputs[0])
    unguarded = fx_rewrites.apply(ep, iree_own_attention.rules.without(GUARD)).program
    wrong = iree_own_attention.compile(unguarded, inputs[0])(*inputs[0])
    assert torch.isnan(wrong[-1, :, 1]).all(), "IREE no longer gives NaN here: the guard may be unneeded"
    guarded = fx_rewrites.apply(ep, iree_own_attention.rules)
    rt.assert_fired(guarded, GUARD, times=1)
    fn = iree_own_attention.compile(guarded.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), Attend()(*args), rtol=1e-4, atol=1e-5)


def _compile_route(backend: IreeBackend, rules, args):
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(Attend(), backend=dynamo_backend(backend, rules=rules, on_graph=graphs.append))
    with torch.no_grad():
        return compiled(*args), graphs


def test_torch_compile_route_guarded(iree_own_attention):
    """torch.compile hands over _scaled_dot_product_flash_attention_for_cpu with a float mask of 0 / -inf."""
    args = _inputs(_bool_mask)[0]
    wrong, graphs = _compile_route(iree_own_attention, iree_own_attention.rules.without(GUARD), args)
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in rt.targets(graphs[0].graph_module)
    assert torch.isnan(wrong[-1, :, 1]).all()
    right, graphs = _compile_route(iree_own_attention, iree_own_attention.rules, args)
    rt.assert_fired(graphs[0].result, flash_attention_for_cpu_to_sdpa, times=1)
    rt.assert_fired(graphs[0].result, GUARD, times=1)
    torch.testing.assert_close(right, Attend()(*args), rtol=1e-4, atol=1e-5)


def test_flash_for_cpu_becomes_sdpa():
    args = _inputs(_float_mask)[0]
    _, graphs = _compile_route(backends.get("eager"), backends.get("eager").rules, args)
    gm = graphs[0].graph_module
    result = rt.apply_rules(gm, flash_attention_for_cpu_to_sdpa)
    rt.assert_fired(result, flash_attention_for_cpu_to_sdpa, times=1)
    rt.assert_ops(result, present=[SDPA], absent=[aten._scaled_dot_product_flash_attention_for_cpu.default])
    rt.assert_matches_eager(result, gm, [args, _inputs(_float_mask)[1]])
    rt.assert_idempotent(result, flash_attention_for_cpu_to_sdpa)


# ----------------------------------------------------------------------------- written out

CASES = {
    "bool_mask": (Attend(), _bool_mask, {}),
    "float_mask": (Attend(scale=0.3), _float_mask, {}),
    "causal": (Attend(is_causal=True), None, {"keys": 5}),
    "no_mask": (Attend(), None, {}),
    "gqa": (Attend(enable_gqa=True), _bool_mask, {"heads": 4, "kv_heads": 2}),
}


def _case_inputs(name: str) -> list[tuple]:
    _, mask_fn, sizes = CASES[name]
    qkv = [_qkv(seed, **sizes) for seed in (0, 1)]
    keys = sizes.get("keys", 7)
    return [(*t, mask_fn(seed, keys=keys)) if mask_fn else t for seed, t in zip((0, 1), qkv)]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_attention_written_out(name, dynamic):
    module = CASES[name][0]
    inputs = _case_inputs(name)
    shapes = None
    if dynamic:
        batch = Dim("batch", min=2, max=8)
        shapes = tuple({0: batch} for _ in inputs[0])
    ep = rt.export(module, *inputs[0], dynamic_shapes=shapes)
    result = rt.apply_rules(ep, attention_as_matmul_softmax)
    rt.assert_fired(result, attention_as_matmul_softmax, times=1)
    rt.assert_ops(result, present=[aten.matmul.default, aten._softmax.default], absent=[SDPA])
    rt.assert_matches_eager(result, module, inputs, rtol=1e-5, atol=1e-6)
    rt.assert_idempotent(result, attention_as_matmul_softmax)


def test_written_out_causal_with_dynamic_length():
    module, length = Attend(is_causal=True), Dim("length", min=2, max=64)
    inputs = [_qkv(seed, keys=5) for seed in (0, 1)] + [_qkv(2, length=9, keys=9)]
    ep = rt.export(module, *inputs[0], dynamic_shapes=({2: length}, {2: length}, {2: length}))
    result = rt.apply_rules(ep, attention_as_matmul_softmax)
    rt.assert_fired(result, attention_as_matmul_softmax, times=1)
    rt.assert_matches_eager(result, module, inputs)


def test_written_out_declines_dropout_and_half_precision():
    ep = rt.export(Attend(dropout_p=0.1), *_qkv(0))
    rt.assert_not_fired(rt.apply_rules(ep, attention_as_matmul_softmax), attention_as_matmul_softmax)
    ep = rt.export(Attend(), *(t.bfloat16() for t in _qkv(0)))
    rt.assert_not_fired(rt.apply_rules(ep, attention_as_matmul_softmax), attention_as_matmul_softmax)


@pytest.mark.parametrize("name", ["bool_mask", "float_mask", "causal", "gqa"])
def test_written_out_on_iree_matches_eager(name):
    """The default llvm-cpu route: guard, then attention written out; fully masked rows give 0."""
    iree = backends.get("iree")
    module, inputs = CASES[name][0], _case_inputs(name)
    result = fx_rewrites.apply(rt.export(module, *inputs[0]), iree.rules)
    rt.assert_fired(result, attention_as_matmul_softmax, times=1)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), module(*args), rtol=1e-4, atol=1e-5)


def test_flash_for_cpu_with_grouped_query_heads_stays():
    """The CPU kernel serves 4 query heads from 2 key heads itself (a cached Llama); SDPA would refuse that."""
    module, args = Attend(enable_gqa=True), _qkv(0, heads=4, kv_heads=2)
    torch._dynamo.reset()
    graphs = []
    with torch.no_grad():
        got = torch.compile(module, backend=dynamo_backend("eager", on_graph=graphs.append))(*args)
    torch.testing.assert_close(got, module(*args))
    gm = graphs[0].graph_module
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in rt.targets(gm)
    rt.assert_not_fired(rt.apply_rules(gm, flash_attention_for_cpu_to_sdpa), flash_attention_for_cpu_to_sdpa)


# ----------------------------------------------------------------------------- a mask that masks nothing


class BuiltMask(torch.nn.Module):
    """SDPA with a mask built inside from sizes only, as transformers 5 builds ViT's (`arange(L) >= start`)."""

    def __init__(self, start: int = 0, as_float: bool = False, random: bool = False) -> None:
        super().__init__()
        self.start, self.as_float, self.random = start, as_float, random

    def forward(self, q, k, v):
        length = q.shape[-2]
        if self.random:
            keep = torch.rand(length) > -1.0  # always True, but random: one evaluation proves nothing
        else:
            keep = torch.arange(length) + 0 >= self.start
        mask = keep[None, None, :, None].expand(q.shape[0], -1, length, length)
        if self.as_float:
            mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)


def _square(seed: int, length: int = 7) -> tuple:
    return _qkv(seed, length=length, keys=length)


@pytest.mark.parametrize("as_float", [False, True], ids=["bool", "float"])
def test_a_mask_that_masks_nothing_is_dropped(as_float):
    module, inputs = BuiltMask(as_float=as_float), [_square(0), _square(1)]
    ep = rt.export(module, *inputs[0])
    assert any(n.target is SDPA and bind(n).mask is not None for n in ep.graph.nodes)
    result = rt.apply_rules(ep, attention_mask_that_masks_nothing)
    rt.assert_fired(result, attention_mask_that_masks_nothing, times=1)
    sdpa = [n for n in result.program.graph.nodes if n.target is SDPA]
    assert len(sdpa) == 1 and bind(sdpa[0]).mask is None
    rt.assert_ops(result, absent=[aten.arange.default, aten.ge.Scalar, aten.expand.default])
    rt.assert_matches_eager(result, module, inputs, rtol=0, atol=0)
    rt.assert_idempotent(result, attention_mask_that_masks_nothing)


@pytest.mark.parametrize(
    ("module", "shapes", "why"),
    [
        (BuiltMask(start=3), None, "masks some key"),
        (BuiltMask(random=True), None, "random"),
        (BuiltMask(), ({2: Dim("length", min=2, max=16)},) * 3, "symbolic size"),
        (Attend(), None, "depends on the inputs"),
    ],
    ids=["masks_keys", "random", "dim", "input_mask"],
)
def test_a_mask_that_may_mask_something_stays(module, shapes, why):
    args = _square(0) if isinstance(module, BuiltMask) else (*_square(0), _bool_mask(0, length=7))
    ep = rt.export(module, *args, dynamic_shapes=shapes)
    result = rt.apply_rules(ep, attention_mask_that_masks_nothing)
    rt.assert_not_fired(result, attention_mask_that_masks_nothing)
    (sdpa,) = [n for n in ep.graph.nodes if n.target is SDPA]
    assert why in str(attention_mask_that_masks_nothing.evaluate_when(sdpa))
    rt.assert_matches_eager(result, module, [args])


def test_a_mask_that_masks_nothing_on_iree():
    """The default IREE route drops it before the guard, so no row test and no select are compiled."""
    iree = backends.get("iree")
    module, inputs = BuiltMask(), [_square(0), _square(1)]
    result = fx_rewrites.apply(rt.export(module, *inputs[0]), iree.rules)
    rt.assert_fired(result, attention_mask_that_masks_nothing, times=1)
    rt.assert_not_fired(result, attention_fully_masked_rows_guard)
    rt.assert_ops(result, absent=[aten.where.self, aten.any.dim, aten.masked_fill.Scalar])
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), module(*args), rtol=1e-5, atol=1e-6)


class ThreeDimensionalLateDivision(torch.nn.Module):
    """Attention with softmax's division last and its max / exp / sum on the 4-D scores (not the rule's form)."""

    def forward(self, q, k, v):
        scores = (q * 0.125) @ k.transpose(-2, -1)
        exps = torch.exp(scores - scores.amax(-1, keepdim=True))
        return (exps @ v) / exps.sum(-1, keepdim=True)


@pytest.mark.parametrize("length", [7, 15, 31, 33])
def test_written_out_on_iree_at_lengths_iree_gets_wrong_in_4d(length):
    """The rule's form (softmax, then @ value) is right at query lengths 2^n - 1, where IREE 3.13 with
    `--iree-opt-data-tiling` gives inf for softmax's division moved after the matmul; the default flags' data
    tiling gets that form right too (docs/iree-3.13-findings.md, sections 9 and 10)."""
    iree = backends.get("iree")
    inputs = [_square(seed, length=length) for seed in (0, 1)]
    module = Attend(scale=0.125)
    result = fx_rewrites.apply(rt.export(module, *inputs[0]), iree.rules)
    rt.assert_fired(result, attention_as_matmul_softmax, times=1)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), module(*args), rtol=1e-5, atol=1e-6)
    if length == 7:  # the default flags compute it right; IREE's DispatchCreation data tiling does not
        plain = fx_rewrites.apply(rt.export(ThreeDimensionalLateDivision(), *inputs[0]), iree.rules)
        torch.testing.assert_close(iree.compile(plain.program, inputs[0])(*inputs[0]), module(*inputs[0]))
        other = attrs.evolve(iree, perf_flags=("--iree-opt-data-tiling", *iree.perf_flags[1:]))
        got = other.compile(plain.program, inputs[0])(*inputs[0])
        assert not torch.isfinite(got).all(), "IREE now computes the division-last form right on that path too"
