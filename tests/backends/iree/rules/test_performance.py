"""IREE performance rules (rewrites/rules/performance.py): same numbers, another form.

Each rule on real exports (static and with a Dim batch), its graph after,
numerics against eager on two input sets, idempotence, and the default
llvm-cpu route end to end on IREE. Their speed is measured in
benchmarks/runtime.py, not here (no timings in unit tests).
(attention_as_matmul_softmax: tests/rules/test_attention.py.)
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules import performance
from fx_rewrites.backends.iree.rules.performance import (
    attention_by_head_groups,
    conv1d_as_matmul,
    patch_conv_as_matmul,
    softmax_as_exp_times_reciprocal,
    softmax_matmul_normalized_after,
)

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


class ScaledSoftmax(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x * 0.5, dim=-1) * 3.0


#: rows with -inf (a masked key; a row all -inf gives NaN in eager and here) and large values
SOFTMAX_ROWS = [(_randn(s, 2, 5, 7, 33) * 8,) for s in (0, 1)]
SOFTMAX_ROWS[1][0][0, 0, 0, :4] = float("-inf")
SOFTMAX_ROWS[1][0][0, 0, 1, :] = float("-inf")


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_softmax_as_exp_times_reciprocal(dynamic):
    result = _check(
        ScaledSoftmax(),
        SOFTMAX_ROWS,
        softmax_as_exp_times_reciprocal,
        dynamic=dynamic,
        present=[aten.amax.default, aten.exp.default, aten.reciprocal.default],
        absent=[aten._softmax.default, aten.softmax.int, aten.div.Tensor],
    )
    out = rt.graph_module(result)(*SOFTMAX_ROWS[1])[0]
    assert out[0, 0, 1].isnan().all() and not out[0, 0, 0].isnan().any()  # eager's NaN row, and only it


def test_softmax_as_exp_times_reciprocal_declines_other_dtypes_and_dims():
    for fn, x in (
        (lambda x: torch.softmax(x, 1), _randn(0, 2, 3, 4)),
        (lambda x: torch.softmax(x, -1), _randn(0, 2, 3).double()),
        (lambda x: torch.softmax(x, -1), _randn(0, 2, 3).bfloat16()),
        (lambda x: torch.softmax(x, -1, dtype=torch.float64), _randn(0, 2, 3)),
    ):
        result = rt.apply_rules(rt.export(fn, x), softmax_as_exp_times_reciprocal)
        rt.assert_not_fired(result, softmax_as_exp_times_reciprocal)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_softmax_of_an_empty_input_is_left_to_iree(dynamic):
    """x[:, :0].softmax(-1): the written-out form's amax over an empty dim failed the rule (RuleError, "reducing
    over zero-size dimension"); IREE's own softmax returns the empty result."""
    fn = lambda x: x[:, :0].softmax(-1) + 1
    inputs = [(_randn(0, 3, 5),), (_randn(1, 6 if dynamic else 3, 5),)]
    iree = backends.get("iree")
    ep = rt.export(fn, *inputs[0], dynamic_shapes=[{0: Dim("b")}] if dynamic else None)
    result = fx_rewrites.apply(ep, iree.rules)
    rt.assert_not_fired(result, softmax_as_exp_times_reciprocal)
    compiled = iree.compile(result.program, inputs[0])
    for args in inputs:
        got, want = compiled(*args), fn(*args)
        assert got.shape == want.shape == (args[0].shape[0], 0)


def test_softmax_as_exp_times_reciprocal_on_iree():
    """Through the default route, -inf keys and a row all -inf included (NaN there, as eager)."""
    iree = backends.get("iree")
    result = fx_rewrites.apply(rt.export(ScaledSoftmax(), *SOFTMAX_ROWS[0]), iree.rules)
    rt.assert_fired(result, softmax_as_exp_times_reciprocal)
    fn = iree.compile(result.program, SOFTMAX_ROWS[0])
    for (x,) in SOFTMAX_ROWS:
        torch.testing.assert_close(fn(x), ScaledSoftmax()(x), rtol=1e-5, atol=1e-6, equal_nan=True)


# ----------------------------------------------------------------------------- softmax, then a matmul


class SoftmaxThenMatmul(torch.nn.Module):
    def forward(self, s, v):
        return torch.softmax(s * 0.5, dim=-1) @ v


class RowsThenMatmul(torch.nn.Module):
    """softmax written out by hand (a model's eager attention): rows times the reciprocal of their sum."""

    def forward(self, s, v):
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return (e * torch.reciprocal(e.sum(-1, keepdim=True))) @ v


#: scores [2, 5, 7, 33] with -inf keys and a row all -inf (NaN in eager and here), values [2, 5, 33, 6]
SCORES_VALUES = [(x, _randn(s + 20, 2, 5, 33, 6)) for s, (x,) in enumerate(SOFTMAX_ROWS)]
NORMALIZED_AFTER = [aten.amax.default, aten.exp.default, aten.ones.default, aten.reciprocal.default]


@pytest.mark.parametrize("module", [SoftmaxThenMatmul(), RowsThenMatmul()], ids=["softmax", "written-out"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_softmax_matmul_normalized_after(module, dynamic):
    result = _check(
        module,
        SCORES_VALUES,
        softmax_matmul_normalized_after,
        dynamic=dynamic,
        n_inputs=2,
        present=NORMALIZED_AFTER,
        absent=[aten._softmax.default, aten.softmax.int, aten.sum.dim_IntList],
    )
    assert rt.targets(result).count(aten.matmul.default) == 2  # e @ values and e @ ones
    out = rt.graph_module(result)(*SCORES_VALUES[1])[0]
    assert out[0, 0, 1].isnan().all() and not out[0, 0, 0].isnan().any()  # eager's NaN row, and only it


def test_softmax_matmul_normalized_after_takes_the_softmax_rule_form():
    """Whichever of the two rules reaches the softmax first, the product is normalized after."""
    rules = (softmax_as_exp_times_reciprocal, softmax_matmul_normalized_after)
    ep = rt.export(SoftmaxThenMatmul(), *SCORES_VALUES[0])
    result = rt.apply_rules(rt.apply_rules(ep, rules[0]).program, rules[1])
    rt.assert_fired(result, softmax_matmul_normalized_after)
    rt.assert_ops(result, present=NORMALIZED_AFTER, absent=[aten.sum.dim_IntList])
    rt.assert_matches_eager(result, SoftmaxThenMatmul(), SCORES_VALUES)


def test_softmax_matmul_normalized_after_declines():
    s, v = SCORES_VALUES[0]
    cases = [
        (lambda s, v: (lambda p: (p @ v, p))(torch.softmax(s, -1)), (s, v)),  # the weights are returned too
        (lambda s, v: torch.softmax(s, -1) @ v, (s.double(), v.double())),
        (lambda s, v: torch.softmax(s, -2) @ v, (s[..., :7], v[..., :7, :])),
        (lambda s, v: torch.softmax(s, -1) @ v, (s, v[0, 0, :, 0])),  # a vector of values
        (lambda s, v: torch.softmax(s, -1) @ v, (s[..., :0], v[..., :0, :])),  # no keys: zeros, not NaN
        (lambda s, v: (s * torch.reciprocal(s.sum(-2, keepdim=True))) @ v, (s, v)),  # not its rows' sum
    ]
    for fn, inputs in cases:
        result = rt.apply_rules(rt.export(fn, *inputs), softmax_matmul_normalized_after)
        rt.assert_not_fired(result, softmax_matmul_normalized_after)


@pytest.mark.parametrize("length", [7, 31, 127, 500])
def test_softmax_matmul_normalized_after_on_iree(length):
    """The default route on attention, including the query lengths at which IREE's other data-tiling path
    computed a division-last form wrong (docs/iree-3.13-findings.md, sections 9 and 10)."""
    iree = backends.get("iree")
    inputs = [_qkv(s, 1, 2, length, length, 8) for s in (0, 10)]
    result = fx_rewrites.apply(rt.export(Attention(is_causal=True), *inputs[0]), iree.rules)
    rt.assert_fired(result, softmax_matmul_normalized_after)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), Attention(is_causal=True)(*args), rtol=1e-4, atol=1e-5)


def test_softmax_matmul_normalized_after_with_a_dim_key_length():
    """Keys of a Dim length: the ones are sized by the symbolic length; IREE matches eager at two lengths."""
    iree = backends.get("iree")
    keys = Dim("keys", min=2, max=64)
    inputs = [_qkv(s, 2, 2, 9, length, 8) for s, length in ((0, 13), (10, 20))]
    ep = rt.export(Attention(), *inputs[0], dynamic_shapes=(None, {2: keys}, {2: keys}))
    result = fx_rewrites.apply(ep, iree.rules)
    rt.assert_fired(result, softmax_matmul_normalized_after)
    rt.assert_matches_eager(result, Attention(), inputs, rtol=1e-5, atol=1e-6)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), Attention()(*args), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- attention by head groups


class Attention(torch.nn.Module):
    def __init__(self, is_causal: bool = False) -> None:
        super().__init__()
        self.is_causal = is_causal

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal) * 2.0


def _qkv(seed: int, batch: int, heads: int, rows: int, keys: int, size: int = 16) -> tuple[torch.Tensor, ...]:
    return (
        _randn(seed, batch, heads, rows, size),
        _randn(seed + 1, batch, heads, keys, size),
        _randn(seed + 2, batch, heads, keys, size),
    )


def _groups(result) -> list[list[int]]:
    sdpa = aten.scaled_dot_product_attention.default
    return [list(n.meta["val"].shape[:2]) for n in result.graph_module.graph.nodes if n.target is sdpa]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_attention_by_head_groups_per_head(is_causal):
    """2x4 heads of 400x400 scores (5 MB): 8 groups of one head (640 kB each), the same numbers."""
    inputs = [_qkv(s, 2, 4, 400, 400) for s in (0, 10)]
    result = _check(Attention(is_causal), inputs, attention_by_head_groups, dynamic=False, present=[aten.cat.default])
    assert _groups(result) == [[1, 1]] * 8


def test_attention_by_head_groups_per_batch():
    """2x4 heads of 200x200 scores (1.3 MB): a group a batch row, its 4 heads together (640 kB)."""
    inputs = [_qkv(s, 2, 4, 200, 200) for s in (0, 10)]
    result = _check(Attention(), inputs, attention_by_head_groups, dynamic=False)
    assert _groups(result) == [[1, 4]] * 2


def test_attention_by_head_groups_caps_the_number_of_groups():
    inputs = [_qkv(s, 4, 8, 300, 300, 4) for s in (0, 10)]  # 32 heads of 360 kB: 16 groups of 2 heads
    result = _check(Attention(), inputs, attention_by_head_groups, dynamic=False)
    assert _groups(result) == [[1, 2]] * performance.MAX_GROUPS


def test_attention_by_head_groups_declines():
    small, large = _qkv(0, 2, 4, 100, 100), _qkv(0, 2, 4, 400, 400)
    mask = torch.ones(400, 400, dtype=torch.bool).tril()
    gqa = (large[0], large[1][:, :2], large[2][:, :2])
    cases = [
        (Attention(), small, None),  # scores within the budget
        (Attention(), large, ({0: Dim("batch", min=2, max=8)},) * 3),  # symbolic sizes
        (lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask), large, None),
        (lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True), gqa, None),
    ]
    for module, inputs, dynamic_shapes in cases:
        result = rt.apply_rules(rt.export(module, *inputs, dynamic_shapes=dynamic_shapes), attention_by_head_groups)
        rt.assert_not_fired(result, attention_by_head_groups)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_attention_by_head_groups_on_iree(is_causal):
    """The default route less the unmasked flash dispatch (which takes the unmasked one first): 4 groups of 2 heads
    (255 x 300 scores), each written out; IREE matches eager."""
    iree = backends.get("iree")
    flash = [
        n
        for n in ("unmasked_attention_as_flash_dispatch_avx512", "unmasked_attention_as_flash_dispatch")
        if n in iree.rules
    ]
    iree = attrs.evolve(iree, rules=iree.rules.without(*flash))
    inputs = [_qkv(s, 2, 4, 255, 300, 64) for s in (0, 10)]
    result = fx_rewrites.apply(rt.export(Attention(is_causal), *inputs[0]), iree.rules)
    rt.assert_fired(result, attention_by_head_groups)
    rt.assert_fired(result, "attention_as_matmul_softmax", times=4)
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(fn(*args), Attention(is_causal)(*args), rtol=1e-4, atol=1e-5)


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
    present = [aten.linear.default, aten.cat.default]  # row slices side by side, channels last
    _check(module, inputs, conv1d_as_matmul, dynamic=dynamic, present=present, absent=[*CONVS, aten.stack.default])


def test_conv1d_declines_groups_and_long_kernels():
    for conv in (torch.nn.Conv1d(4, 8, 3, groups=2), torch.nn.Conv1d(4, 8, performance.MAX_TAPS + 1)):
        ep = rt.export(conv.eval(), _randn(0, 1, 4, 40))
        rt.assert_not_fired(rt.apply_rules(ep, conv1d_as_matmul), conv1d_as_matmul)


def test_conv1d_on_iree():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv1d(4, 6, 3, padding=1), torch.nn.GELU(), torch.nn.Conv1d(6, 6, 3, 2, 1))
    _on_iree(module.eval(), [(_randn(s, 2, 4, 20),) for s in (0, 1)], conv1d_as_matmul)


# ----------------------------------------------------------------------------- per target


def test_performance_rules_per_target():
    """llvm-cpu has the measured rules of each ISA (tests/backends/iree/test_cpu_isas.py); CUDA and ROCm none;
    Vulkan attention written out (it needs it)."""
    for isa in ("avx512", "avx2"):
        assert "attention_as_matmul_softmax" in performance.for_target("llvm-cpu", isa)
    for target in ("cuda", "rocm"):
        assert not len(performance.BY_TARGET[target])
    assert performance.BY_TARGET["vulkan-spirv"].names() == ["attention_as_matmul_softmax"]
    assert "attention_as_matmul_softmax" in backends.get("iree").rules
    assert "attention_as_matmul_softmax" not in backends.get("iree-cuda").rules
    assert "attention_fully_masked_rows_guard" in backends.get("iree-cuda").rules


def test_relu_conv_stays_on_iree():
    """A dilated 3x3 convolution is no rule's: it reaches IREE as a convolution and matches eager."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=2, padding=2, dilation=2), torch.nn.ReLU()).eval()
    iree = backends.get("iree")
    x = _randn(0, 2, 3, 9, 9)
    result = fx_rewrites.apply(rt.export(module, x), iree.rules)
    assert aten.conv2d.default in rt.targets(result)
    torch.testing.assert_close(iree.compile(result.program, (x,))(x), module(x), rtol=1e-4, atol=1e-4)
