"""IREE performance rules (rewrites/rules/iree_perf.py): same numbers, another form.

Each rule on real exports (static and with a Dim batch), its graph after,
numerics against eager on two input sets, idempotence, and the default
llvm-cpu route end to end on IREE. Their speed is measured in
benchmarks/runtime.py, not here (no timings in unit tests).
(attention_as_matmul_softmax: tests/rules/test_attention.py.)
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.rules import iree_perf
from fx_rewrites.rules.iree_perf import conv1d_as_matmul, patch_conv_as_matmul, softmax_rows_as_2d

aten = torch.ops.aten
CONVS = (aten.conv1d.default, aten.conv2d.default, aten.convolution.default)


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _batch_dim(n_inputs: int = 1):
    batch = Dim("batch", min=2, max=16)
    return tuple({0: batch} for _ in range(n_inputs))


def _check(module, inputs, rule, *, dynamic: bool, present=(), absent=(), n_inputs: int = 1):
    ep = rt.export(module, *inputs[0], dynamic_shapes=_batch_dim(n_inputs) if dynamic else None)
    result = rt.apply_rules(ep, rule)
    rt.assert_fired(result, rule)
    rt.assert_ops(result, present=present, absent=absent)
    rt.assert_matches_eager(result, module, inputs, rtol=1e-5, atol=1e-5)
    rt.assert_idempotent(result, rule)
    return result


def _on_iree(module, inputs, rule):
    """The default `iree` backend (llvm-cpu, its performance phase on): `rule` fires and IREE matches eager."""
    iree = backends.get("iree")
    result = fx_rewrites.apply(rt.export(module, *inputs[0]), iree.rules)
    rt.assert_fired(result, rule)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), module(*args), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- softmax


class Scores(torch.nn.Module):
    def forward(self, q, k):
        return torch.softmax(q @ k.transpose(-2, -1), dim=-1)


SOFTMAX_INPUTS = [(_randn(s, 2, 3, 300, 8), _randn(s + 7, 2, 3, 6, 8)) for s in (0, 1)]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_softmax_rows_as_2d(dynamic):
    result = _check(Scores(), SOFTMAX_INPUTS, softmax_rows_as_2d, dynamic=dynamic, n_inputs=2)
    softmaxes = [n for n in result.graph_module.graph.nodes if n.target in (aten._softmax.default, aten.softmax.int)]
    assert [n.meta["val"].dim() for n in softmaxes] == [2]


def test_softmax_rows_declines_other_dims_2d_few_rows_and_powers_of_two():
    ep = rt.export(lambda x: (torch.softmax(x, 1), torch.softmax(x[0], -1)), _randn(0, 2, 300, 4))
    rt.assert_not_fired(rt.apply_rules(ep, softmax_rows_as_2d), softmax_rows_as_2d)
    for rows in (iree_perf.MIN_ROWS - 1, 512):
        ep = rt.export(lambda x: torch.softmax(x, -1), _randn(0, 2, rows, 4))
        rt.assert_not_fired(rt.apply_rules(ep, softmax_rows_as_2d), softmax_rows_as_2d)


def test_softmax_rows_on_iree():
    _on_iree(Scores(), SOFTMAX_INPUTS, softmax_rows_as_2d)


# ----------------------------------------------------------------------------- patch convolution


class Patches(torch.nn.Module):
    """ViT's patch embedding, flattened to tokens as ViT does."""

    def __init__(self, patch: int = 4) -> None:
        super().__init__()
        self.proj = torch.nn.Conv2d(3, 8, kernel_size=patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


@pytest.mark.parametrize("size", [(16, 16), (18, 13)], ids=["whole", "cropped"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_patch_conv_as_matmul(size, dynamic):
    torch.manual_seed(0)
    module = Patches().eval()
    inputs = [(_randn(s, 2, 3, *size),) for s in (0, 1)]
    _check(module, inputs, patch_conv_as_matmul, dynamic=dynamic, present=[aten.linear.default], absent=CONVS)


def test_patch_conv_declines_overlapping_padded_and_pointwise():
    convs = (
        torch.nn.Conv2d(3, 8, 4, stride=2),
        torch.nn.Conv2d(3, 8, 4, stride=4, padding=1),
        torch.nn.Conv2d(3, 8, 1),
    )
    for conv in convs:
        ep = rt.export(conv.eval(), _randn(0, 1, 3, 16, 16))
        rt.assert_not_fired(rt.apply_rules(ep, patch_conv_as_matmul), patch_conv_as_matmul)


def test_patch_conv_on_aot_autograd_graph():
    """torch.compile's graphs hold aten.convolution, not aten.conv2d."""
    torch.manual_seed(0)
    module, graphs = Patches().eval(), []
    torch._dynamo.reset()
    from fx_rewrites.backends.dynamo import dynamo_backend

    with torch.no_grad():
        torch.compile(module, backend=dynamo_backend("eager", on_graph=graphs.append))(_randn(0, 2, 3, 16, 16))
    gm = graphs[0].graph_module
    assert aten.convolution.default in rt.targets(gm)
    result = rt.apply_rules(gm, patch_conv_as_matmul)
    rt.assert_fired(result, patch_conv_as_matmul, times=1)
    # the graph takes the lifted parameters, then the image (its example inputs are fake tensors)
    inputs = [(module.proj.weight.detach(), module.proj.bias.detach(), _randn(s, 2, 3, 16, 16)) for s in (0, 1)]
    assert [tuple(a.shape) for a in inputs[0]] == [tuple(a.shape) for a in graphs[0].example_inputs]
    rt.assert_matches_eager(result, gm, inputs, rtol=1e-5, atol=1e-5)


def test_patch_conv_on_iree():
    torch.manual_seed(0)
    _on_iree(Patches().eval(), [(_randn(s, 2, 3, 16, 16),) for s in (0, 1)], patch_conv_as_matmul)


# ----------------------------------------------------------------------------- 1-D convolution

CONV1D = {
    "whisper_stem": dict(kernel_size=3, padding=1),
    "strided": dict(kernel_size=3, stride=2, padding=1),
    "dilated": dict(kernel_size=3, dilation=2),
    "no_bias": dict(kernel_size=5, bias=False),
}


@pytest.mark.parametrize("name", list(CONV1D))
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_conv1d_as_matmul(name, dynamic):
    torch.manual_seed(0)
    module = torch.nn.Conv1d(4, 6, **CONV1D[name]).eval()
    inputs = [(_randn(s, 2, 4, 20),) for s in (0, 1)]
    _check(module, inputs, conv1d_as_matmul, dynamic=dynamic, present=[aten.linear.default], absent=CONVS)


def test_conv1d_declines_groups_and_long_kernels():
    for conv in (torch.nn.Conv1d(4, 8, 3, groups=2), torch.nn.Conv1d(4, 8, iree_perf.MAX_TAPS + 1)):
        ep = rt.export(conv.eval(), _randn(0, 1, 4, 40))
        rt.assert_not_fired(rt.apply_rules(ep, conv1d_as_matmul), conv1d_as_matmul)


def test_conv1d_on_iree():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv1d(4, 6, 3, padding=1), torch.nn.GELU(), torch.nn.Conv1d(6, 6, 3, 2, 1))
    _on_iree(module.eval(), [(_randn(s, 2, 4, 20),) for s in (0, 1)], conv1d_as_matmul)


# ----------------------------------------------------------------------------- per target


def test_performance_rules_per_target():
    """llvm-cpu has every measured rule; CUDA and ROCm none; Vulkan attention written out (it needs it)."""
    assert set(iree_perf.BY_TARGET["llvm-cpu"].names()) == set(iree_perf.ALL.names())
    for target in ("cuda", "rocm"):
        assert not len(iree_perf.BY_TARGET[target])
    assert iree_perf.BY_TARGET["vulkan-spirv"].names() == ["attention_as_matmul_softmax"]
    assert "attention_as_matmul_softmax" in backends.get("iree").rules
    assert "attention_as_matmul_softmax" not in backends.get("iree-cuda").rules
    assert "attention_fully_masked_rows_guard" in backends.get("iree-cuda").rules


def test_relu_conv_stays_on_iree():
    """A 3x3 convolution is no rule's: it reaches IREE as a convolution and matches eager."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.nn.ReLU()).eval()
    iree = backends.get("iree")
    x = _randn(0, 2, 3, 9, 9)
    result = fx_rewrites.apply(rt.export(module, x), iree.rules)
    assert aten.conv2d.default in rt.targets(result)
    torch.testing.assert_close(iree.compile(result.program, (x,))(x), module(x), rtol=1e-4, atol=1e-4)
