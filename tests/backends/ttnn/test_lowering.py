"""The ttnn pack's rules on real exports: what each lowers to, and why it declines."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fx_rewrites import testing as rt
from fx_rewrites.backends.ttnn.rules import RULES, ops, ops_extra
from fx_rewrites.rules import DEFAULT
from tests.backends.ttnn.conftest import assert_close_bf16

aten = torch.ops.aten


def _lower(module, *args, **options):
    ep = rt.export(module, *args)
    first = rt.apply_rules(ep, DEFAULT)
    return rt.apply_rules(first.program, RULES, **options)


def _reasons(result, node_name):
    return [a.reason for a in result.report.explain() if a.node == node_name and not a.fired]


def _targets(result):
    return [n.target for n in result.graph_module.graph.nodes if n.op == "call_function"]


def test_linear_keeps_torch_weight_layout_with_transpose_b():
    model = torch.nn.Linear(8, 4).eval()
    result = _lower(model, torch.randn(3, 8))
    rt.assert_fired(result, "ttnn_linear", times=1)
    rt.assert_ops(result, present=[ops.linear, ops.from_torch, ops.to_torch], absent=[aten.linear.default])
    (linear,) = [n for n in result.graph_module.graph.nodes if n.target is ops.linear]
    assert linear.args[3] is True  # transpose_b: W stays [out, in]
    assert linear.args[1].args[0].name == "p_weight"
    bias = linear.args[2]  # ttnn.linear's bias is a row vector [1, N]
    assert bias.target is ops.reshape and bias.args[1] == [1, 4] and bias.args[0].args[0].name == "p_bias"
    x = torch.randn(3, 8)
    assert_close_bf16(result.program.module()(x), model(x))
    rt.assert_idempotent(result, RULES)


def test_a_chain_stays_on_the_device_between_one_from_torch_and_one_to_torch():
    result = _lower(lambda x: torch.softmax(torch.relu(x) * 2.0 + 1.0, -1), torch.randn(4, 40))
    targets = _targets(result)
    assert targets.count(ops.from_torch) == 1 and targets.count(ops.to_torch) == 1, result.graph_module.graph
    assert [t for t in targets if t not in ops.BOUNDARY] == [
        ops.OPS["relu"],
        ops.OPS["multiply_scalar"],
        ops.OPS["add_scalar"],
        ops.softmax,
    ]


def test_round_trip_left_by_a_late_producer_is_fused():
    """A consumer lowered before its producer leaves from_torch(to_torch(d)); fuse_round_trip removes it."""
    ep = rt.export(lambda x: torch.relu(x) + 1.0, torch.randn(4, 40))
    first = rt.apply_rules(ep, DEFAULT)
    add_only = rt.apply_rules(first.program, RULES["ttnn_binary"])
    relu_too = rt.apply_rules(add_only.program, RULES)
    rt.assert_fired(relu_too, "ttnn_unary", times=1)
    rt.assert_fired(relu_too, "fuse_round_trip", times=1)
    assert _targets(relu_too).count(ops.from_torch) == 1


def test_data_movement_read_only_on_the_device_sinks_there():
    result = _lower(lambda x, w: x.view(4, 10).t() @ w, torch.randn(40), torch.randn(4, 8))
    rt.assert_fired(result, "sink_data_movement")
    rt.assert_ops(result, present=[ops.reshape, ops.transpose], absent=[aten.view.default, aten.t.default])


def test_data_movement_of_host_values_read_on_the_host_stays():
    result = _lower(lambda x: torch.special.i0(x.view(4, 10)), torch.randn(40), explain=True)
    rt.assert_ops(result, present=[aten.view.default], absent=[ops.from_torch])
    assert _reasons(result, "view") == ["when: no operand is on the device and no device op reads it"]


@pytest.mark.parametrize(
    ("fn", "args", "node", "reason"),
    [
        (lambda x: x + 1, (torch.arange(6),), "add", "self is int64; the ttnn lowering takes float tensors"),
        (
            lambda x: x * 2.0,
            (torch.randn(1, 2, 2, 2, 2),),
            "mul",
            "self has rank 5; ttnn tensors here have rank 1 to 4",
        ),
        (lambda x: F.gelu(x, approximate="tanh"), (torch.randn(4),), "gelu", "only the exact (erf) gelu"),
        (lambda x, y: torch.add(x, y, alpha=2), (torch.randn(4), torch.randn(4)), "add", "alpha=2"),
        (lambda x: x.sum(), (torch.randn(4),), "sum_1", "no ttnn lowering"),
        (lambda x: torch.matmul(x, x), (torch.randn(4),), "matmul", "1-D operand"),
        (lambda x: F.layer_norm(x, (3, 4)), (torch.randn(2, 3, 4),), "layer_norm", "normalized_shape [3, 4]"),
    ],
    ids=["int", "rank5", "gelu_tanh", "alpha", "sum_all", "matmul_1d", "layer_norm_2d"],
)
def test_declines_say_why(fn, args, node, reason):
    result = _lower(fn, *args, explain=True)
    reasons = _reasons(result, node) or ["no ttnn lowering (no rule for the op)"]
    assert any(reason in r for r in reasons), reasons
    assert not any(ops.is_standin(t) for t in _targets(result) if t not in ops.BOUNDARY)


def test_conv2d_goes_through_nhwc_and_back():
    conv = torch.nn.Conv2d(3, 5, 3, stride=(2, 1), padding=1).eval()
    x = torch.randn(2, 3, 9, 13)
    result = _lower(conv, x)
    (node,) = [n for n in result.graph_module.graph.nodes if n.target is ops.conv2d]
    assert node.args[0].target is ops.permute and node.args[0].args[1] == [0, 2, 3, 1]
    assert node.args[3:9] == (3, 5, 2, 9, 13, [3, 3])  # in, out, batch, height, width, kernel
    assert node.args[1].args[3] is False  # weights stay host tensors
    assert_close_bf16(result.program.module()(x), conv(x))


def test_symbolic_batch_lowers_shape_generic_ops_only():
    from torch.export import Dim

    ep = rt.export(lambda x: torch.relu(x).view(-1, 2, 4), torch.randn(4, 8), dynamic_shapes=[{0: Dim("b")}])
    result = rt.apply_rules(rt.apply_rules(ep, DEFAULT).program, RULES, explain=True)
    rt.assert_ops(result, present=[ops.OPS["relu"], aten.view.default])
    assert any("symbolic sizes" in r for r in _reasons(result, "view"))


class IntegerMask(torch.nn.Module):
    """transformers' extended attention mask: int64 input -> slice/unsqueeze/expand -> float cast -> (1 - m) * min."""

    def forward(self, scores, attention_mask):
        m = attention_mask[:, None, None, :].expand(2, 1, 4, 6).to(torch.float32)
        return torch.softmax(scores + (1.0 - m) * -1e4, dim=-1)


def test_a_mask_built_from_integers_moves_to_the_device():
    scores, mask = torch.randn(2, 1, 4, 6), torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    result = _lower(IntegerMask(), scores, mask)
    rt.assert_fired(result, "sink_data_movement")
    host = [t for t in _targets(result) if not ops.is_standin(t)]
    assert host == [], host  # the int64 input goes to the device once, as bfloat16 0.0 / 1.0
    (upload,) = [
        n for n in result.graph_module.graph.nodes if n.target is ops.from_torch and n.args[0].name == "attention_mask"
    ]
    assert upload.args[1:] == ("bfloat16", ops.TILE, True)
    for s, m in ((scores, mask), (scores * 3.0, mask.flip(-1))):  # (a fully masked row is uniform in bfloat16)
        assert_close_bf16(result.program.module()(s, m), IntegerMask()(s, m))


class IntegerCast(torch.nn.Module):
    def forward(self, x, ids):
        return x * ids.to(torch.int32).to(torch.float32)  # an int -> int cast first: wraps, so it stays


def test_integer_to_integer_casts_stay_on_the_host():
    result = _lower(IntegerCast(), torch.randn(3), torch.tensor([1, 2, 3]), explain=True)
    assert aten._to_copy.default in _targets(result) or aten.to.dtype in _targets(result)
    assert any("the device holds bfloat16" in r for n in ("to", "_to_copy") for r in _reasons(result, n)) or any(
        "the device holds bfloat16" in a.reason for a in result.report.explain() if not a.fired
    )


class Split(torch.nn.Module):
    def forward(self, x):
        a, b, c = (x * 2.0).split(4, dim=-1)  # gpt2's qkv split of a linear's output
        return a + 1.0, b.transpose(0, 1), c.sum(-1)


class MaskedFill(torch.nn.Module):
    def forward(self, x, m):
        keep = (1.0 - m.to(torch.float32)).to(torch.bool)  # transformers' new-style mask, with a 0-d constant
        return torch.softmax((x * torch.tensor(2.0)).masked_fill(keep, torch.finfo(torch.float32).min), -1)


class BoolMaskAttention(torch.nn.Module):
    def forward(self, q, mask):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


@pytest.mark.parametrize(
    ("module", "make", "fired", "present"),
    [
        (Split(), lambda: (torch.randn(3, 12),), "lower_split", [ops.slice_]),
        (
            MaskedFill(),
            lambda: (torch.randn(2, 6), torch.tensor([[1, 1, 0, 1, 0, 1]] * 2)),
            "ttnn_masked_fill",
            [ops.where_scalar],
        ),
        (
            BoolMaskAttention(),
            lambda: (torch.randn(1, 2, 5, 8), torch.ones(5, 5, dtype=torch.bool).tril()),
            "ttnn_sdpa",
            [ops.sdpa],
        ),
        (torch.nn.Hardswish(), lambda: (torch.randn(4, 8) * 4,), "ttnn_unary", [ops.OPS["hardswish"]]),
        (
            lambda x: torch.log1p(x.abs()) + torch.atan(x),
            lambda: (torch.randn(4, 8),),
            "ttnn_unary",
            [ops.OPS["log1p"]],
        ),
    ],
    ids=["split", "masked_fill_0d_to_bool", "bool_attention_mask", "hardswish", "log1p_atan"],
)
def test_more_of_what_torch_ttnn_lowers(module, make, fired, present):
    args = make()
    result = _lower(module, *args)
    rt.assert_fired(result, fired)
    rt.assert_ops(result, present=present)
    host = [t for t in _targets(result) if not ops.is_standin(t)]
    assert host == [], host
    again = tuple(a * 0.5 if a.is_floating_point() else a for a in args)
    for inputs in (args, again):
        assert_close_bf16(result.program.module()(*inputs), module(*inputs))


def test_step_functions_stay_on_the_host_and_say_why():
    result = _lower(lambda x: torch.floor(x * 3.0), torch.randn(4, 8), explain=True)
    rt.assert_ops(result, present=[aten.floor.default])
    assert any("off by a whole unit" in r for r in _reasons(result, "floor"))


@pytest.mark.parametrize(
    ("module", "shape", "fired"),
    [
        (torch.nn.GroupNorm(2, 6), (2, 6, 5, 7), "ttnn_group_norm"),
        (torch.nn.AvgPool2d(3, 1, 1, count_include_pad=False), (2, 4, 6, 8), "ttnn_avg_pool2d"),
    ],
    ids=["group_norm", "avg_pool2d"],
)
def test_poolformer_ops(module, shape, fired):
    torch.manual_seed(0)
    if isinstance(module, torch.nn.GroupNorm):
        torch.nn.init.uniform_(module.weight, 0.5, 1.5), torch.nn.init.uniform_(module.bias, -0.5, 0.5)
    x = torch.randn(shape)
    result = _lower(module.eval(), x)
    rt.assert_fired(result, fired)
    assert [t for t in _targets(result) if not ops.is_standin(t)] == []
    for inputs in (x, x * 3.0 + 1.0):
        assert_close_bf16(result.program.module()(inputs), module(inputs))


def test_factories_of_small_integers_only():
    result = _lower(lambda x: x * torch.arange(8) + torch.ones(8), torch.randn(3, 8))
    rt.assert_ops(result, present=[ops.arange, ops.full], absent=[aten.arange.default, aten.ones.default])
    x = torch.randn(3, 8)
    assert_close_bf16(result.program.module()(x), x * torch.arange(8) + 1.0)
    big = _lower(lambda x: x + torch.arange(300), torch.randn(300), explain=True)
    assert any("exactly only to 256" in r for r in _reasons(big, "arange"))


@pytest.mark.parametrize(
    ("fn", "make", "fired", "present"),
    [
        (lambda x: F.relu6(x * 4.0), lambda: (torch.randn(4, 8),), "ttnn_clamp", ops.clamp),
        (
            lambda x, y: torch.xlogy(x * 1.0, y.abs()),  # zeros in x: 0, even where y is 0 too
            lambda: (torch.randn(3, 5) * (torch.rand(3, 5) > 0.5), torch.randn(3, 5) * (torch.rand(3, 5) > 0.3)),
            "ttnn_xlogy",
            ops.where,
        ),
        (lambda x: torch.all(x > -0.5, -1), lambda: (torch.randn(4, 6),), "ttnn_all", ops_extra.reduce_min),
        (
            lambda x, s: torch.slice_scatter(x * 1.0, s * 2.0, 1, 2, 4),
            lambda: (torch.randn(3, 6), torch.randn(3, 2)),
            "ttnn_slice_scatter",
            ops.concat,
        ),
        (
            lambda x, s: torch.select_scatter(x * 1.0, s * 2.0, 0, -1),
            lambda: (torch.randn(3, 6), torch.randn(6)),
            "ttnn_slice_scatter",
            ops.concat,
        ),
        (lambda x: F.elu(x, 0.5), lambda: (torch.randn(4, 8),), "ttnn_elu", ops_extra.elu),
        (lambda x: torch.tril(x * 2.0, -1), lambda: (torch.randn(6, 6),), "ttnn_tril", ops_extra.tril),
        (
            lambda x, y: torch.addcmul(x, x, y, value=0.5),
            lambda: (torch.randn(3, 5), torch.randn(3, 5)),
            "ttnn_addcmul_addcdiv",
            ops_extra.addcmul,
        ),
        (lambda x: torch.cumsum(x * 1.0, 1), lambda: (torch.randn(3, 7),), "ttnn_cumsum", ops_extra.cumsum),
        (lambda x: torch.amin(x * 1.0, -1), lambda: (torch.randn(3, 7),), "ttnn_reduce", ops_extra.reduce_min),
        (
            lambda x, y: torch.stack([x * 1.0, y * 1.0], 1),
            lambda: (torch.randn(3, 4), torch.randn(3, 4)),
            "ttnn_stack",
            ops_extra.stack,
        ),
        (lambda x: (x * 1.0).repeat(2, 3), lambda: (torch.randn(3, 4),), "ttnn_repeat", ops_extra.repeat),
        (lambda x: torch.roll(x * 1.0, (1, -2), (0, 1)), lambda: (torch.randn(3, 4),), "ttnn_roll", ops_extra.roll),
        (
            lambda c, a, b: torch.baddbmm(c, a, b, beta=0.5, alpha=2.0),
            lambda: (torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 4, 5)),
            "ttnn_baddbmm",
            ops.matmul,
        ),
        (lambda x: torch.log_softmax(x, -1), lambda: (torch.randn(3, 9),), "ttnn_log_softmax", ops.reduce_max),
        (
            lambda t, i: torch.index_select(t * 1.0, 0, i),
            lambda: (torch.randn(10, 8), torch.tensor([3, 0, 9, 3])),
            "ttnn_index_select",
            ops.embedding,
        ),
    ],
    ids=[
        "relu6",
        "xlogy",
        "all",
        "slice_scatter",
        "select_scatter",
        "elu",
        "tril",
        "addcmul",
        "cumsum",
        "amin",
        "stack",
        "repeat",
        "roll",
        "baddbmm",
        "log_softmax",
        "index_select",
    ],
)
def test_the_rest_of_torch_ttnns_list(fn, make, fired, present):
    args = make()
    result = _lower(fn, *args)
    rt.assert_fired(result, fired)
    rt.assert_ops(result, present=[present])
    assert [t for t in _targets(result) if not ops.is_standin(t)] == []
    again = tuple(a * 0.5 if a.is_floating_point() else a for a in args)
    for inputs in (args, again):
        assert_close_bf16(result.program.module()(*inputs), fn(*inputs))


def test_argmax_stays_on_the_host_and_says_why():
    result = _lower(lambda x: torch.argmax(x * 2.0, -1), torch.randn(4, 8), explain=True)
    rt.assert_ops(result, present=[aten.argmax.default])
    assert any("round together" in r for r in _reasons(result, "argmax"))


def test_logical_not_of_a_device_mask():
    fn = lambda x: torch.where(torch.logical_not(x > 0.0), x, x * 2.0)
    result = _lower(fn, torch.randn(4, 8))
    rt.assert_fired(result, "ttnn_logical_not")
    assert [t for t in _targets(result) if not ops.is_standin(t)] == []
    x = torch.randn(4, 8)
    assert_close_bf16(result.program.module()(x), fn(x))


def test_isinf_stays_on_the_host_and_says_why():
    result = _lower(lambda x: torch.isinf(x * 2.0), torch.randn(4, 8), explain=True)
    rt.assert_ops(result, present=[aten.isinf.default])
    assert any("clamped to bfloat16's finite range" in r for r in _reasons(result, "isinf"))


@pytest.mark.parametrize(
    ("fn", "args", "node", "reason"),
    [
        # (on the host input itself: a device op before it would feed it bfloat16-rounded values)
        (lambda x: torch.remainder(x, 0.75), (torch.randn(4, 8),), "remainder", "off by a whole unit"),
        (lambda x: torch.all(x > 0.0), (torch.randn(4, 8),), "all", "all() over every dimension"),
        (
            lambda x, s: torch.slice_scatter(x * 1.0, s * 1.0, 1, 0, 6, 2),
            (torch.randn(3, 6), torch.randn(3, 3)),
            "slice_scatter",
            "step=2: a strided slice write",
        ),
    ],
    ids=["remainder", "all_elements", "strided_slice_scatter"],
)
def test_leftovers_decline_with_a_reason(fn, args, node, reason):
    result = _lower(fn, *args, explain=True)
    (left,) = [n for n in result.graph_module.graph.nodes if n.name.startswith(node)]
    assert any(reason in r for r in _reasons(result, left.name)), _reasons(result, left.name)
    for inputs in (args, tuple(a * 0.5 for a in args)):
        assert_close_bf16(result.program.module()(*inputs), fn(*inputs))


def test_leftovers_with_a_symbolic_batch():
    """xlogy and all take symbolic sizes (elementwise, reductions); slice_scatter's bounds are constants in
    ttnn.slice, so it declines."""
    from torch.export import Dim

    def fn(x, y):
        return torch.xlogy(x * 1.0, y.abs()).all(-1), torch.slice_scatter(x * 1.0, y[:, :2] * 2.0, 1, 1, 3)

    ep = rt.export(fn, torch.randn(3, 6), torch.randn(3, 6), dynamic_shapes=[{0: Dim("b")}, {0: Dim("b")}])
    result = rt.apply_rules(rt.apply_rules(ep, DEFAULT).program, RULES, explain=True)
    rt.assert_fired(result, "ttnn_xlogy")
    rt.assert_fired(result, "ttnn_all")
    assert any("symbolic sizes" in r for r in _reasons(result, "slice_scatter"))
    for b in (2, 5):
        x, y = torch.randn(b, 6), torch.randn(b, 6)
        got, expected = result.program.module()(x, y), fn(x, y)
        torch.testing.assert_close(got[0], expected[0])
        assert_close_bf16(got[1], expected[1])
