"""`addmm_as_f32_dispatch[_avx512]` (backends/iree/rules/f32_matmul.py): transformers' `Conv1D` (GPT-2's linears:
addmm(b, x, W) with W [K, N]) through the float32 matmul dispatch.

Real torch 2.13 exports of `transformers.pytorch_utils.Conv1D` over rows of rank 3; the graph after (no addmm: the
weight's [K, N] rows laid out [N/S, K, S] by a reshape and permute, one `f32_linear` taking the bias); numerics as near
float64 as torch's own float32 on two input sets, static and with a Dim (which the rule declines: the kernel is static
in its rows); what it declines (beta or alpha off 1, a weight passed in, few rows, N off the strip); the ISA's route end
to end on IREE where the host runs its code.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim
from transformers.pytorch_utils import Conv1D

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeBackend, targets
from fx_rewrites.backends.iree.f32_dispatch import F32_LINEAR, pack
from fx_rewrites.backends.iree.rules.f32_matmul import addmm_as_f32_dispatch, addmm_as_f32_dispatch_avx512
from tests.backends.iree.rules.float32_error import assert_within_torch_error, in_float64

aten = torch.ops.aten
#: the rule -> its strip and ISA
RULES = {addmm_as_f32_dispatch: (16, "avx2"), addmm_as_f32_dispatch_avx512: (32, "avx512")}


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _conv1d(k: int, n: int) -> torch.nn.Module:
    torch.manual_seed(0)
    module = Conv1D(n, k).eval()
    with torch.no_grad():  # Conv1D's bias starts at zero: one that is not, to see it added
        module.bias.uniform_(-1.0, 1.0)
    return module


@pytest.mark.parametrize("which", list(RULES), ids=lambda r: r.name)
@pytest.mark.parametrize("n", [96, 48])
def test_conv1d_becomes_the_f32_dispatch(n, which):
    strip, _ = RULES[which]
    module, k = _conv1d(64, n), 64
    inputs = [(_randn(0, 2, 40, k),), (3.0 * _randn(1, 2, 40, k),)]
    result = rt.apply_rules(rt.export(module, *inputs[0]), which)
    if n % strip:
        rt.assert_not_fired(result, which)
        return
    rt.assert_fired(result, which, times=1)
    rt.assert_ops(result, absent=[aten.addmm.default, aten.mm.default], present=[F32_LINEAR])
    (call,) = [node for node in rt.graph_module(result).graph.nodes if node.target is F32_LINEAR]
    x, packed, bias, *rest = call.args
    assert tuple(x.meta["val"].shape) == (80, k) and rest == [n, strip // 8, 4]
    assert tuple(bias.meta["val"].shape) == (n,)
    permute = packed.args[0]
    assert permute.target is aten.permute.default and permute.args[1] == [1, 0, 2]
    assert tuple(permute.args[0].meta["val"].shape) == (k, n // strip, strip), "W's [K, N] rows cut into strips"
    # the layout is linear_as_f32_dispatch's of W.T: [N/S, K, S]
    weight = module.weight.detach()
    laid = weight.reshape(k, n // strip, strip).permute(1, 0, 2).reshape(-1)
    assert torch.equal(laid, pack(weight.t().contiguous(), strip))
    assert_within_torch_error(result.program.module(), in_float64(module), inputs)
    rt.assert_idempotent(result, which)


@pytest.mark.parametrize("which", list(RULES), ids=lambda r: r.name)
def test_a_dim_of_rows_is_declined_and_computes_as_eager(which):
    module = _conv1d(64, 96)
    inputs = [(_randn(0, 2, 40, 64),), (3.0 * _randn(1, 5, 40, 64),)]
    ep = rt.export(module, *inputs[0], dynamic_shapes=({0: Dim("batch", min=2, max=16)},))
    result = rt.apply_rules(ep, which)
    rt.assert_not_fired(result, which)
    assert_within_torch_error(result.program.module(), in_float64(module), inputs)


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.b = torch.nn.Parameter(_randn(0, 64, 96)), torch.nn.Parameter(_randn(1, 96))

    def forward(self, x):
        return torch.addmm(self.b, x, self.w, beta=0.5)


class WeightIn(torch.nn.Module):
    def forward(self, x, w, b):
        return torch.addmm(b, x, w)


def test_what_it_declines():
    """beta off 1, a weight passed in, few rows, K off 4."""
    x = _randn(0, 80, 64)
    cases = [
        (Scaled(), (x,)),
        (WeightIn(), (x, _randn(1, 64, 96), _randn(2, 96))),
        (_conv1d(64, 96), (_randn(0, 8, 64),)),
        (_conv1d(62, 96), (_randn(0, 80, 62),)),
    ]
    for which in RULES:
        for module, args in cases:
            rt.assert_not_fired(rt.apply_rules(rt.export(module, *args), which), which)


def test_each_isa_takes_its_own_block():
    assert addmm_as_f32_dispatch.name in targets.CPU_ISAS["avx2"].perf_rules
    assert addmm_as_f32_dispatch_avx512.name in targets.CPU_ISAS["avx512"].perf_rules
    assert addmm_as_f32_dispatch.name not in targets.CPU_ISAS["avx512"].perf_rules
    assert addmm_as_f32_dispatch_avx512.name not in targets.CPU_ISAS["avx2"].perf_rules


@pytest.mark.parametrize("which", list(RULES), ids=lambda r: r.name)
def test_conv1d_through_the_isa_route(which):
    """The ISA's route where the host runs its code: the rule fires among the ISA's rules, the dispatch is spliced
    and run, and on two inputs (70 rows: blocks and a remainder on both ISAs) the result is as near float64 as torch's
    float32."""
    _, isa = RULES[which]
    if isa not in {"avx512": ["avx512", "avx2"], "avx2": ["avx2"]}.get(targets.host_isa(), []):
        pytest.skip(f"llvm-cpu code for {isa} runs on an x86-64 host with {isa}")
    module = _conv1d(64, 96)
    inputs = [(_randn(0, 70, 64),), (3.0 * _randn(1, 70, 64),)]
    iree = IreeBackend(target=targets.llvm_cpu(isa))
    result = fx_rewrites.apply(rt.export(module, *inputs[0]), iree.rules)
    rt.assert_fired(result, which, times=1)
    fn = iree.compile(result.program, inputs[0])
    assert_within_torch_error(fn, in_float64(module), inputs)


class Transposed(torch.nn.Module):
    """A linear as aot_autograd gives it to the torch.compile route: addmm(b, x, W.t()), or mm(x, W.t()) without a
    bias, W [N, K] the module's own."""

    def __init__(self, k: int, n: int, bias: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(_randn(2, n, k) / k**0.5)
        self.b = torch.nn.Parameter(_randn(3, n)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.w.t()) if self.b is None else torch.addmm(self.b, x, self.w.t())


@pytest.mark.parametrize("which", list(RULES), ids=lambda r: r.name)
@pytest.mark.parametrize("bias", [True, False], ids=["addmm", "mm"])
def test_a_transposed_held_weight_becomes_the_f32_dispatch(which, bias):
    strip, _ = RULES[which]
    module = Transposed(64, 96, bias).eval()
    inputs = [(_randn(0, 80, 64),), (3.0 * _randn(1, 80, 64),)]
    ep = rt.export(module, *inputs[0])
    assert ep.graph.find_nodes(op="call_function", target=aten.addmm.default if bias else aten.mm.default)
    result = rt.apply_rules(ep, which)
    rt.assert_fired(result, which, times=1)
    rt.assert_ops(result, absent=[aten.addmm.default, aten.mm.default])
    (call,) = [n for n in rt.graph_module(result).graph.nodes if str(n.target).startswith("fx_rewrites.f32_")]
    strips = call.args[1].args[0].args[0]  # reshape(permute(reshape(W, [N/S, S, K]), [0, 2, 1]))
    assert strips.target is aten.reshape.default and tuple(strips.meta["val"].shape) == (96 // strip, strip, 64)
    assert_within_torch_error(result.program.module(), in_float64(module), inputs)
    rt.assert_idempotent(result, which)


def test_the_torch_compile_route_takes_the_dispatch_over_frozen_weights():
    """torch.compile's route freezes the weights before the rules run: a linear's addmm(b, x, t(W)) takes the float32
    dispatch there as the export route's linear does; with freezing off (the weights run-time inputs) it does not."""
    from fx_rewrites.backends.dynamo import CompiledGraph, dynamo_backend

    rules = {addmm_as_f32_dispatch.name, addmm_as_f32_dispatch_avx512.name}
    module = torch.nn.Linear(64, 96).eval()
    x = _randn(0, 80, 64)
    for freeze, fires in ((True, 1), (False, 0)):
        graphs: list[CompiledGraph] = []
        torch._dynamo.reset()
        try:
            backend = dynamo_backend("iree", strict=True, freeze=freeze, on_graph=graphs.append)
            with torch.no_grad():
                got = torch.compile(module, backend=backend)(x)
        finally:
            torch._dynamo.reset()
        (graph,) = graphs
        fired = sum(graph.result.report.rewrites.get(name, 0) for name in rules)
        if targets.host_isa() in ("avx2", "avx512"):
            assert fired == fires, (freeze, dict(graph.result.report.rewrites))
        assert_within_torch_error(lambda t, got=got: got, in_float64(module), [(x,)])


class HeldKMajor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(_randn(4, 64, 96) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.w)


@pytest.mark.parametrize("which", list(RULES), ids=lambda r: r.name)
def test_mm_by_a_held_k_major_weight_becomes_the_f32_dispatch(which):
    module = HeldKMajor().eval()
    inputs = [(_randn(0, 80, 64),), (3.0 * _randn(1, 80, 64),)]
    result = rt.apply_rules(rt.export(module, *inputs[0]), which)
    rt.assert_fired(result, which, times=1)
    rt.assert_ops(result, absent=[aten.mm.default])
    assert_within_torch_error(result.program.module(), in_float64(module), inputs)
