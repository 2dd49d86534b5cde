"""Hand-written lowerings for ops torch cannot decompose (backends/iree/rules/lowerings.py), on IREE."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import CompileCache, IreeBackend, IreeCompileTimeout
from fx_rewrites.backends.iree.rules.lowerings import (
    histc_to_one_hot_sum_for_iree,
    kthvalue_to_topk_for_iree,
    real_fft_to_matmul_for_iree,
)
from fx_rewrites.engine import RewriteError

aten = torch.ops.aten


@pytest.fixture(scope="module")
def iree():
    return backends.get("iree")


def _fails_then_matches(iree, before, after, module, inputs, error):
    with pytest.raises(RewriteError, match=error):
        iree.compile(before, inputs[0])
    fn = iree.compile(after, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), module(*args), rtol=1e-4, atol=1e-4)


# -- histc ---------------------------------------------------------------------------------


class ExpertCounts(torch.nn.Module):
    """MoE routing: tokens per expert from the top-k expert indices (transformers 5's histc)."""

    experts = 8

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        top = torch.topk(logits, 2, dim=-1).indices
        return torch.histc(top.float(), bins=self.experts, min=0, max=self.experts - 1)


class Histograms(torch.nn.Module):
    """Values outside the range, the last edge, and the data's own range (min == max == 0)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.histc(x, bins=5, min=-1.0, max=1.5), torch.histc(x, bins=7)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_histc_expert_counts(iree, dynamic):
    shapes = ({0: Dim("tokens", min=2)},) if dynamic else None
    inputs = [(torch.randn(6, 8),), (torch.randn(11 if dynamic else 6, 8),)]
    ep = rt.export(ExpertCounts(), *inputs[0], dynamic_shapes=shapes)
    rt.assert_ops(ep, present=[aten.histc.default])
    result = rt.apply_rules(ep, histc_to_one_hot_sum_for_iree)
    rt.assert_fired(result, histc_to_one_hot_sum_for_iree, times=1)
    rt.assert_ops(result, absent=[aten.histc.default])
    rt.assert_matches_eager(result, ExpertCounts(), inputs)
    rt.assert_idempotent(result, histc_to_one_hot_sum_for_iree)
    _fails_then_matches(iree, ep, result.program, ExpertCounts(), inputs, "histc")


def test_histc_edges_and_data_range(iree):
    x = torch.tensor([-2.0, -1.0, 0.0, 0.49, 0.5, 1.5, 1.6, 1.0, 0.25, 1.25])
    inputs = [(x,), (torch.randn(10),), (torch.full((10,), 3.0),)]
    ep = rt.export(Histograms(), x)
    result = rt.apply_rules(ep, histc_to_one_hot_sum_for_iree)
    rt.assert_fired(result, histc_to_one_hot_sum_for_iree, times=2)
    rt.assert_matches_eager(result, Histograms(), inputs)
    _fails_then_matches(iree, ep, result.program, Histograms(), inputs, "histc")


# -- the real part of an FFT (FNet) ----------------------------------------------------------


class FourierMixing(torch.nn.Module):
    """FNet's token mixing: the real part of a 2-D DFT over the sequence and hidden dims."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fftn(x, dim=(1, 2)).real


class FourierVariants(torch.nn.Module):
    """Chained 1-D FFTs (FNet's other spelling), fft2 with norm="ortho", and a real input kept."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chained = torch.fft.fft(torch.fft.fft(x, dim=-1), dim=-2).real
        return chained, torch.fft.fft2(x, norm="ortho").real + x


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_fnet_fourier_mixing(iree, dynamic):
    shapes = ({0: Dim("batch")},) if dynamic else None
    inputs = [(torch.randn(2, 6, 8),), (torch.randn(3 if dynamic else 2, 6, 8),)]
    ep = rt.export(FourierMixing(), *inputs[0], dynamic_shapes=shapes)
    rt.assert_ops(ep, present=[aten.fft_fftn.default])
    result = rt.apply_rules(ep, real_fft_to_matmul_for_iree)
    rt.assert_fired(result, real_fft_to_matmul_for_iree, times=1)
    rt.assert_ops(result, absent=[aten.fft_fftn.default, aten.real.default])
    rt.assert_matches_eager(result, FourierMixing(), inputs, rtol=1e-4, atol=1e-4)
    rt.assert_idempotent(result, real_fft_to_matmul_for_iree)
    _fails_then_matches(iree, ep, result.program, FourierMixing(), inputs, "fft|complex")


def test_fft_variants_and_the_aot_form(iree):
    x = torch.randn(2, 4, 6)
    inputs = [(x,), (torch.randn(2, 4, 6),)]
    for ep in (rt.export(FourierVariants(), x), rt.export(FourierVariants(), x).run_decompositions()):
        result = rt.apply_rules(ep, real_fft_to_matmul_for_iree)
        rt.assert_fired(result, real_fft_to_matmul_for_iree, times=2)
        rt.assert_ops(result, absent=[aten._fft_c2c.default, aten.fft_fft.default, aten.view_as_real.default])
        rt.assert_matches_eager(result, FourierVariants(), inputs, rtol=1e-4, atol=1e-4)
        _fails_then_matches(iree, ep, result.program, FourierVariants(), inputs, "fft|complex")


def test_imaginary_part_and_inverse_fft_left_alone():
    ep = rt.export(lambda x: (torch.fft.fft(x).imag, torch.fft.ifft(x).real), torch.randn(4, 6))
    result = rt.apply_rules(ep, real_fft_to_matmul_for_iree)
    rt.assert_not_fired(result, real_fft_to_matmul_for_iree)


# -- kthvalue ---------------------------------------------------------------------------------


class KthSmallest(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values, indices = torch.kthvalue(x, 3, dim=1)
        return values, indices, torch.kthvalue(x, 2, dim=-1, keepdim=True).values


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_kthvalue_as_topk(iree, dynamic):
    shapes = ({0: Dim("rows")},) if dynamic else None
    inputs = [(torch.randn(4, 7),), (torch.randn(6 if dynamic else 4, 7),)]
    ep = rt.export(KthSmallest(), *inputs[0], dynamic_shapes=shapes)
    result = rt.apply_rules(ep, kthvalue_to_topk_for_iree)
    rt.assert_fired(result, kthvalue_to_topk_for_iree, times=2)
    rt.assert_ops(result, present=[aten.topk.default], absent=[aten.kthvalue.default])
    rt.assert_matches_eager(result, KthSmallest(), inputs)
    rt.assert_idempotent(result, kthvalue_to_topk_for_iree)
    # the two topks of one input share IREE 3.13's sorted iota (rules/topk.py): compiled after every rule
    _fails_then_matches(iree, ep, rt.apply_rules(ep, iree.rules).program, KthSmallest(), inputs, "topk")


# -- logcumsumexp -------------------------------------------------------------------------------


class LogCumSumExp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.logcumsumexp(x * 40, dim=1), torch.logcumsumexp(x, dim=-1)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_logcumsumexp_stable_on_iree(iree, dynamic):
    from fx_rewrites.backends.iree.rules.lowerings import logcumsumexp_to_masked_logsumexp_for_iree as lowering

    shapes = ({0: Dim("rows")},) if dynamic else None
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(4, 6, 5, generator=g),), (torch.randn(7 if dynamic else 4, 6, 5, generator=g),)]
    inputs[0][0][:, 2, :] = 3.0  # exp(120) overflows float32: eager stays finite, IREE's lowering does not
    ep = rt.export(LogCumSumExp(), *inputs[0], dynamic_shapes=shapes)
    result = rt.apply_rules(ep, lowering)
    rt.assert_fired(result, lowering, times=2)
    rt.assert_ops(result, absent=[aten.logcumsumexp.default])
    rt.assert_matches_eager(result, LogCumSumExp(), inputs, rtol=1e-5, atol=1e-4)
    rt.assert_idempotent(result, lowering)
    x = inputs[0][0]
    raw = attrs.evolve(iree, refuse_wrong_forms=False)  # IREE itself: the backend refuses the form
    wrong = raw.compile(ep, inputs[0])(x)[0]  # IREE 3.13: inf where eager is finite
    assert torch.isfinite(LogCumSumExp()(x)[0]).all() and not torch.isfinite(wrong).all()
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), LogCumSumExp()(*args), rtol=1e-4, atol=1e-4)


# -- split_with_sizes of symbolic sizes ---------------------------------------------------------


class SplitPieces(torch.nn.Module):
    """Pieces of `split([1, n - 1])` along a dim, and a write through one read later (the fuzz step
    view_write)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * 1
        head, tail = y.split([1, y.shape[2] - 1], 2)
        tail.mul_(2)
        return head + 1, tail * 3, y


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_symbolic_split_to_slices(iree, dynamic):
    inputs = [(torch.randn(2, 3, 4, 5),), (torch.randn(2, 3, 7 if dynamic else 4, 5),)]
    ep = rt.export(SplitPieces(), *inputs[0], dynamic_shapes=({2: Dim("h", min=3)},) if dynamic else None)
    rules = backends.get("iree").rules
    result = rt.apply_rules(ep, rules)
    rt.assert_fired(result, "symbolic_split_to_slices_for_iree", times=1 if dynamic else 0)
    rt.assert_ops(result, **({"absent": [aten.split_with_sizes.default]} if dynamic else {}))
    rt.assert_matches_eager(result, SplitPieces(), inputs)
    if dynamic:
        before = rt.apply_rules(ep, rules.without("symbolic_split_to_slices_for_iree")).program
        _fails_then_matches(iree, before, result.program, SplitPieces(), inputs, "torch.constant.int")
    else:
        fn = iree.compile(result.program, inputs[0])  # static sizes: IREE lowers the split itself
        torch.testing.assert_close(fn(*inputs[0]), SplitPieces()(*inputs[0]))


# -- softmax of a 0-d tensor ------------------------------------------------------------------

ZERO_DIM_SOFTMAXES = {
    "softmax": lambda x: torch.softmax(x, 0) * 2,
    "log_softmax": lambda x: torch.log_softmax(x, -1) * 2,
    "_softmax": lambda x: torch.ops.aten._softmax(x, 0, False) * 2,
}


class Fn(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


@pytest.mark.parametrize("name", list(ZERO_DIM_SOFTMAXES))
def test_zero_dim_softmax_as_one_element(iree, name):
    """1 (softmax) or 0 (log_softmax) for a finite value, NaN for inf and NaN, as eager; on IREE too."""
    module = Fn(ZERO_DIM_SOFTMAXES[name])
    inputs = [(torch.tensor(v),) for v in (0.3, -7.5, float("inf"), float("nan"))]
    result = rt.apply_rules(rt.export(module, *inputs[0]), backends.get("iree").rules)
    rt.assert_fired(result, "zero_dim_softmax_as_one_element_for_iree", times=1)
    zero_d = [n for n in rt.graph_module(result).graph.nodes if n.op == "call_function" and n.meta["val"].dim() == 0]
    assert {n.target for n in zero_d} <= {aten.reshape.default, aten.mul.Tensor}, zero_d
    rt.assert_matches_eager(result, module, inputs)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), module(*args), equal_nan=True)


def test_zero_dim_softmax_never_returns_from_iree_compile_as_exported():
    """iree-compile spins on the 0-d form; the backend's time limit stops it (pinned: this fails once IREE compiles
    it, and the rule can go). Timeouts themselves: tests/backends/iree/test_invoke.py."""
    x = torch.tensor(0.3)
    backend = IreeBackend(cache=CompileCache(), compile_timeout_s=20)
    with pytest.raises(IreeCompileTimeout, match="ran past its limit of 20 s"):
        backend.compile(rt.export(Fn(ZERO_DIM_SOFTMAXES["softmax"]), x), (x,))
