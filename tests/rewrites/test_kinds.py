"""Each declarative rule kind: on a real export, and refused when written wrong."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fx_rewrites
from fx_rewrites import (
    Decompose,
    FillDefaults,
    Forward,
    Miss,
    Pattern,
    RuleDefinitionError,
    RuleSet,
    Substitute,
    from_arg,
)
from fx_rewrites import testing as rt

aten = torch.ops.aten


class FreshConstant(torch.nn.Module):
    """torch.tensor in forward: lift_fresh_copy + detach_ in the export."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = torch.tensor([1.0, 2.0, 3.0])
        return F.hardswish(x) + c + x.detach()


@pytest.fixture
def fresh_ep():
    return rt.export(FreshConstant(), torch.randn(2, 3))


lift_to_clone = Substitute(op=aten.lift_fresh_copy.default, to=aten.clone.default)
drop_detach = Forward(ops=(aten.detach_.default, aten.detach.default), name="drop_detach")


def test_substitute_swaps_the_op(fresh_ep):
    result = rt.apply_rules(fresh_ep, lift_to_clone)
    assert lift_to_clone.name == "substitute_lift_fresh_copy_to_clone"
    rt.assert_fired(result, lift_to_clone, times=1)
    rt.assert_ops(result, present=[aten.clone.default], absent=[aten.lift_fresh_copy.default])
    rt.assert_matches_eager(result, FreshConstant(), [(torch.randn(2, 3),), (torch.randn(2, 3) * 5,)])
    rt.assert_idempotent(result, lift_to_clone)


def test_forward_drops_identity_ops(fresh_ep):
    result = rt.apply_rules(fresh_ep, drop_detach)
    rt.assert_fired(result, drop_detach, times=2)
    rt.assert_ops(result, absent=[aten.detach_.default, aten.detach.default])
    rt.assert_matches_eager(result, FreshConstant(), [(torch.randn(2, 3),)])


def test_forward_removes_ops_that_return_nothing():
    def f(x):
        torch.ops.aten._assert_tensor_metadata.default(x, dtype=torch.float32)
        return x + 1

    gm = torch.fx.symbolic_trace(f)
    rule = Forward(ops=aten._assert_tensor_metadata.default)
    result = fx_rewrites.apply(gm, [rule], example_inputs=(torch.randn(3),))
    rt.assert_fired(result, rule, times=1)
    rt.assert_ops(result, absent=[aten._assert_tensor_metadata.default])


def test_decompose_inlines_torch_decomposition(fresh_ep):
    rule = Decompose(ops=aten.hardswish.default)
    result = rt.apply_rules(fresh_ep, rule)
    rt.assert_fired(result, rule, times=1)
    rt.assert_ops(result, absent=[aten.hardswish.default], present=[aten.clamp.default])
    rt.assert_matches_eager(result, FreshConstant(), [(torch.randn(2, 3) * 4,)])


def test_decompose_with_dynamic_shapes():
    fn = lambda x: F.hardswish(x) * 2
    ep = rt.export(fn, torch.randn(4, 3), dynamic_shapes=({0: torch.export.Dim("b")},))
    rule = Decompose(ops=aten.hardswish.default)
    result = rt.apply_rules(ep, rule)
    rt.assert_fired(result, rule, times=1)
    rt.assert_matches_eager(result, fn, [(torch.randn(4, 3),), (torch.randn(7, 3) * 4,)])


def test_decompose_multi_output_op():
    fn = lambda x: torch.var_mean(x, dim=1)
    ep = rt.export(fn, torch.randn(4, 6))
    assert aten.var_mean.dim in rt.targets(ep)
    rule = Decompose(ops=aten.var_mean)  # every overload of the packet
    result = rt.apply_rules(ep, rule)
    rt.assert_fired(result, rule, times=1)
    rt.assert_ops(result, absent=[aten.var_mean.dim])
    rt.assert_matches_eager(result, fn, [(torch.randn(4, 6),)])


def test_pattern_with_when_and_near_miss():
    def scale(x):
        return aten.mul.Tensor(x, 2)

    def doubled(x):
        return aten.add.Tensor(x, x)

    only_floats = lambda node: node.meta["val"].is_floating_point() or Miss("not a float tensor")
    rule = Pattern(name="mul2_to_add", pattern=scale, replacement=doubled, when=only_floats)
    fn = lambda x, i: (x * 2, i * 2, x * 3)
    ep = rt.export(fn, torch.randn(3), torch.arange(3))
    result = rt.apply_rules(ep, rule, explain=True)
    rt.assert_fired(result, rule, times=1)
    reasons = {a.node: a.reason for a in result.report.explain("mul2_to_add")}
    assert reasons["mul_1"] == "when: not a float tensor"
    assert reasons["mul_2"] == "mul_2 arg 1: expected 2, found 3"
    rt.assert_matches_eager(result, fn, [(torch.randn(3), torch.arange(3))])


def test_fill_defaults_with_a_function():
    rule = FillDefaults(
        name="stride_fn", ops=aten.max_pool2d.default, fill={"stride": lambda bound: bound["kernel_size"]}
    )
    fn = lambda x: F.max_pool2d(x, 2)
    ep = rt.export(fn, torch.randn(1, 1, 6, 6))
    result = rt.apply_rules(ep, rule)
    rt.assert_fired(result, rule, times=1)
    rt.assert_matches_eager(result, fn, [(torch.randn(1, 1, 6, 6),)])


def test_fill_that_changes_the_result_is_refused():
    # padding is absent: a fill that is not the schema's default changes the
    # output shape, and the structural check rolls it back.
    rule = FillDefaults(name="pad_one", ops=aten.max_pool2d.default, fill={"padding": [1, 1]})
    ep = rt.export(lambda x: F.max_pool2d(x, 3, 1), torch.randn(1, 1, 5, 5))
    before = str(ep.graph)
    with pytest.raises(
        fx_rewrites.RuleError, match=r"pad_one.*'max_pool2d'.*shape changed from \(1, 1, 3, 3\) to \(1, 1, 5, 5\)"
    ):
        rt.apply_rules(ep, rule)
    skipped = rt.apply_rules(ep, rule, on_error="skip")
    assert [s.rule for s in skipped.report.skips] == ["pad_one"]
    assert str(skipped.program.graph) == before


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (
            lambda: FillDefaults(name="r1", ops=aten.max_pool2d.default, fill={"strides": 1}),
            "r1.*no argument 'strides'",
        ),
        (
            lambda: FillDefaults(name="r2", ops="aten.max_pool9d.default", fill={}),
            "r2.*no op 'aten.max_pool9d.default'",
        ),
        (
            lambda: FillDefaults(name="r3", ops=aten.max_pool2d.default, fill={"stride": from_arg("kernel")}),
            "r3.*no argument 'kernel'",
        ),
        (lambda: Substitute(name="r4", op=aten.lift_fresh_copy.default, to=aten.add.Tensor), "r4.*needs 'other'"),
        (lambda: Substitute(name="r5", op=aten.relu.default, to=aten.add), "r5.*one overload"),
        (lambda: Forward(name="r6", ops=aten.detach_.default, arg="input"), "r6.*no argument 'input'"),
        (
            lambda: Pattern(
                name="r7",
                pattern=lambda x: x if x > 0 else x,  # noqa: RUF034 - control flow on purpose
                replacement=lambda x: x,
            ),
            "r7.*does not trace",
        ),
        (
            lambda: Pattern(name="r8", pattern=lambda x, y: aten.add.Tensor(x, y), replacement=lambda x: x),
            "r8.*2 wildcards.*1",
        ),
        (lambda: Pattern(name="r9", pattern=lambda x: x, replacement=lambda x: x), "r9.*one op call"),
        (lambda: Decompose(name="r10", ops=aten.relu.default, table={}), "r10.*no decomposition"),
        (lambda: FillDefaults(name="r11", ops=42), "r11.*not an op"),
    ],
)
def test_bad_rules_fail_when_built_naming_the_rule(build, words):
    with pytest.raises(RuleDefinitionError, match=words):
        build()


def test_rules_are_frozen_and_ruleset_composes():
    with pytest.raises(AttributeError):
        lift_to_clone.priority = 3  # type: ignore[misc]
    a = RuleSet([lift_to_clone], name="a")
    b = RuleSet([drop_detach], name="b")
    both = a | b
    assert both.names() == [lift_to_clone.name, "drop_detach"]
    assert both.without("drop_detach").names() == [lift_to_clone.name]
    tagged = Forward(ops=aten.alias.default, tags="views")
    assert (both | [tagged]).tagged("views").names() == ["forward_alias"]
    assert "forward_alias" not in (both | [tagged]).untagged("views")
    with pytest.raises(RuleDefinitionError, match="two different rules are named 'drop_detach'"):
        RuleSet([drop_detach, Forward(ops=aten.alias.default, name="drop_detach")])
    with pytest.raises(KeyError, match="no rules named"):
        both.without("nope")
    with pytest.raises(RuleDefinitionError, match="is not a rule"):
        RuleSet([object()])


def test_decompose_falls_back_to_the_composite_kernel():
    fn = lambda x: torch.diff(x, dim=-1) * 2
    ep = rt.export(fn, torch.randn(3, 5))
    assert aten.diff.default not in torch._decomp.decomposition_table
    rule = Decompose(ops=aten.diff.default)
    result = rt.apply_rules(ep, rule)
    rt.assert_fired(result, rule, times=1)
    rt.assert_ops(result, absent=[aten.diff.default], present=[aten.sub.Tensor])
    rt.assert_matches_eager(result, fn, [(torch.randn(3, 5),)])


class ScaledRelu(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 3.0


def test_function_rule_body_receives_what_when_found():
    """`when` takes the node apart once; the body gets the parts instead of computing them again."""
    seen = []

    def scale_of(node):
        (user,) = node.users
        if user.target is not aten.mul.Tensor or not isinstance(user.args[1], float) or user.args[1] <= 0:
            return Miss("not multiplied by a positive constant")
        return user, user.args[1]

    @fx_rewrites.rule(roots=(aten.relu.default,), when=scale_of)
    def fold_positive_scale(node, rw, *, found):
        user, scale = found
        seen.append(scale)
        rw.replace(user, rw.call(aten.relu.default, rw.call(aten.mul.Tensor, node.args[0], scale)))

    ep = rt.export(ScaledRelu(), torch.randn(4))
    result = rt.apply_rules(ep, fold_positive_scale)
    assert seen == [3.0]
    rt.assert_fired(result, fold_positive_scale, times=1)
    rt.assert_matches_eager(result, ScaledRelu(), [(torch.randn(4),), (torch.randn(4) * 7,)])


def test_function_rule_body_with_a_wrong_signature_is_refused_naming_the_rule():
    with pytest.raises(RuleDefinitionError, match=r"'four_params'.*\(node, rw, \*, args, found\)"):

        @fx_rewrites.rule(roots=(aten.relu.default,))
        def four_params(node, rw, found, extra):
            return None


def test_a_positional_found_is_refused_naming_the_rule_and_the_idiom():
    """Issue 36: one body signature. The spelling `fn(node, rw, found)` is gone, with the fix in the error."""
    with pytest.raises(RuleDefinitionError, match=r"'old_spelling'.*third parameter 'found' is positional.*\*, found"):

        @fx_rewrites.rule(roots=(aten.relu.default,), when=lambda node: node)
        def old_spelling(node, rw, found):
            return None

    with pytest.raises(RuleDefinitionError, match=r"'extra_keyword'.*args and found, not plan"):

        @fx_rewrites.rule(roots=(aten.relu.default,))
        def extra_keyword(node, rw, *, plan):
            return None


class ReflectAndZeroPad(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (1, 2), mode="reflect") + F.pad(x, (1, 2)).sum()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_when_and_body_receive_the_bound_arguments(dynamic):
    """A `when` and a body that declare `args` get the node's arguments by schema name (defaults left out, as
    given), so no rule binds them by hand; a body may take `args` and `found` together (keyword-only)."""
    seen = []

    def reflect(node, args):
        return args.get("mode", "constant") == "reflect" or Miss(f"mode {args.get('mode', 'constant')!r}")

    @fx_rewrites.rule(roots=(aten.pad.default,), when=reflect)
    def reflect_pad_as_cat(node, rw, *, args, found):
        seen.append((found, dict(args)))
        x, (left, right) = args["self"], args["pad"]
        edge_left = rw.call(aten.flip.default, rw.call(aten.slice.Tensor, x, -1, 1, 1 + left), [-1])
        edge_right = rw.call(aten.flip.default, rw.call(aten.slice.Tensor, x, -1, -1 - right, -1), [-1])
        rw.replace(node, rw.call(aten.cat.default, [edge_left, x, edge_right], -1))

    x = torch.randn(2, 3, 8)
    shapes = ({2: torch.export.Dim("n", min=4)},) if dynamic else None
    ep = rt.export(ReflectAndZeroPad(), x, dynamic_shapes=shapes)
    result = rt.apply_rules(ep, reflect_pad_as_cat, explain=True)
    rt.assert_fired(result, reflect_pad_as_cat, times=1)
    assert [(found, sorted(args)) for found, args in seen] == [(True, ["mode", "pad", "self"])]
    assert seen[0][1]["pad"] == [1, 2] and seen[0][1]["mode"] == "reflect"
    reasons = [a.reason for a in result.report.explain(reflect_pad_as_cat.name) if not a.fired]
    assert reasons == ["when: mode 'constant'"]
    other = torch.randn(2, 3, 11 if dynamic else 8) * 5
    rt.assert_matches_eager(result, ReflectAndZeroPad(), [(torch.randn(2, 3, 8),), (other,)])


def test_the_bound_arguments_are_read_only():
    @fx_rewrites.rule(roots=(aten.relu.default,))
    def writes_its_args(node, rw, *, args):
        args["self"] = None

    ep = rt.export(lambda x: torch.relu(x), torch.randn(3))
    with pytest.raises(fx_rewrites.RuleError, match="writes_its_args"):
        fx_rewrites.apply(ep, RuleSet([writes_its_args]), on_error="raise")
