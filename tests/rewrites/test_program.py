"""ExportedProgram in, ExportedProgram out: the signature stays true."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.program import ProgramError
from tests.engine import rules as r

aten = torch.ops.aten


class WithState(torch.nn.Module):
    """Parameters, a buffer mutated in forward, a constant, two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.count.add_(1)
        y = torch.relu(torch.relu(self.lin(x)) + x)
        return F.max_pool1d(y, 2), y * self.count


def _export():
    return rt.export(WithState(), torch.randn(2, 4, 8))


def test_signature_names_the_new_output_nodes():
    # torch.export keeps `add_` on the buffer in 2.13; run_decompositions
    # functionalises it into a BUFFER_MUTATION output.
    ep = _export().run_decompositions()
    result = rt.apply_rules(ep, r.add_to_sub, fx_rewrites.rules.DEFAULT)
    outputs = next(n for n in result.program.graph.nodes if n.op == "output").args[0]
    names = [spec.arg.name for spec in result.program.graph_signature.output_specs]
    assert names == [n.name for n in outputs]
    kinds = [spec.kind.name for spec in result.program.graph_signature.output_specs]
    assert kinds == [spec.kind.name for spec in ep.graph_signature.output_specs]
    assert "BUFFER_MUTATION" in kinds


@pytest.mark.parametrize("decompose", [False, True], ids=["export", "run_decompositions"])
def test_rewritten_program_runs_and_keeps_state(decompose):
    torch.manual_seed(0)
    eager = WithState().eval()
    ep = rt.export(WithState().eval(), torch.randn(2, 4, 8))
    ep = ep.run_decompositions() if decompose else ep
    eager.load_state_dict(ep.state_dict)
    result = rt.apply_rules(ep, r.add_to_sub, fx_rewrites.rules.DEFAULT)
    assert result.report.total_rewrites >= 2
    module = result.program.module()
    for _ in range(3):
        x = torch.randn(2, 4, 8)
        torch.testing.assert_close(module(x), eager(x))
    torch.testing.assert_close(module.count, eager.count)


def test_save_and_load_round_trip(tmp_path):
    ep = _export()
    result = rt.apply_rules(ep, r.add_to_sub, fx_rewrites.rules.DEFAULT)
    path = tmp_path / "rewritten.pt2"
    torch.export.save(result.program, path)
    loaded = torch.export.load(path)
    x = torch.randn(2, 4, 8)
    torch.testing.assert_close(loaded.module()(x), result.program.module()(x))
    assert aten.sub.Tensor in rt.targets(loaded)
    (pool,) = [n for n in loaded.graph.nodes if n.target is aten.max_pool1d.default]
    assert pool.args[1:] == ([2], [2], [0], [1], False)  # stride filled in, survives save/load


def test_graph_module_in_graph_module_out():
    ep = rt.export(lambda x, w: torch.relu(x + w), torch.randn(3), torch.randn(3))
    gm = ep.module()
    result = fx_rewrites.apply(ep.graph_module, [r.add_to_sub])
    assert result.program is None
    assert aten.sub.Tensor in rt.targets(result)
    x, w = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(result.graph_module(x, w)[0], gm(x, w))


def test_symbolic_trace_graph_needs_example_inputs():
    def f(x):
        return torch.ops.aten.add.Tensor(x, x)

    gm = torch.fx.symbolic_trace(f)
    with pytest.raises(fx_rewrites.GraphInputError, match="example_inputs"):
        fx_rewrites.apply(gm, [r.add_to_sub])
    result = fx_rewrites.apply(gm, [r.add_to_sub], example_inputs=(torch.randn(3),))
    rt.assert_fired(result, "add_to_sub", times=1)
    x = torch.randn(3)
    torch.testing.assert_close(result.graph_module(x), x + x)


@pytest.mark.parametrize("bad", [torch.nn.Linear(2, 2), "model.pt2", None])
def test_unsupported_input_is_named(bad):
    with pytest.raises(fx_rewrites.GraphInputError, match=r"ExportedProgram or a torch\.fx\.GraphModule") as info:
        fx_rewrites.apply(bad)
    if isinstance(bad, torch.nn.Module):
        assert "torch.export.export" in str(info.value)


def test_invalid_program_names_the_rule():
    # a rule that writes an in-place op into a functional (ATen dialect, decomposed) program
    @fx_rewrites.rule(roots=(aten.relu.default,))
    def relu_in_place(node, rw, *, args):
        rw.replace(node, rw.call(aten.relu_.default, args["self"]))

    ep = rt.export(lambda x: torch.relu(x) * 2, torch.randn(4)).run_decompositions()
    with pytest.raises(ProgramError, match=r"not functional.*from rule 'relu_in_place'"):
        rt.apply_rules(ep, relu_in_place)


def test_a_decomposition_that_writes_its_inputs_is_declined_with_the_reason():
    # torch's decomposition of the eval batch norm writes its running stats (copy_ into the op's own inputs, even
    # functionalized); Decompose declines it, naming why, instead of leaving a program that is not functional
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()
    ep = rt.export(model, torch.randn(1, 3, 6, 6)).run_decompositions()
    rule = fx_rewrites.Decompose(ops=aten._native_batch_norm_legit_no_training.default, name="bn_decomp")
    result = rt.apply_rules(ep, rule, explain=True)
    rt.assert_not_fired(result, rule)
    reasons = [a.reason for a in result.report.explain("bn_decomp")]
    assert reasons == [
        "the decomposition of aten._native_batch_norm_legit_no_training.default writes to its inputs (aten.copy_.default)"
    ]
