"""Bad inputs meet one clear error each: its type, and a message naming what went wrong
and the fix. The index (bad input -> test, here or elsewhere in tests/) is in
docs/reliability.md; the cases tested elsewhere are not repeated here, except
where this file asserts more of the message."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.app.cli import main
from fx_rewrites.engine.errors import GraphInputError, NonConvergence, RuleError
from tests.engine import rules as r

aten = torch.ops.aten


class AddRelu(torch.nn.Module):
    def forward(self, x, w):
        return torch.relu(x + w) * 2


def _ep():
    return rt.export(AddRelu(), torch.randn(3, 4), torch.randn(3, 4))


@fx_rewrites.rule(roots=(aten.relu.default,))
def halves_rows(node, rw):
    """relu(x) -> relu(x)[:1]: same rank and dtype, another shape."""
    rw.replace(node, rw.call(aten.slice.Tensor, rw.call(aten.relu.default, node.args[0]), 0, 0, 1))


@pytest.mark.parametrize(
    ("bad_rule", "what"),
    [
        (r.changes_dtype, "dtype changed from torch.float32 to torch.float64"),
        (r.changes_shape, "rank changed from 2 to 1"),
        (halves_rows, "shape changed from (3, 4) to (1, 4)"),
    ],
)
def test_rule_changing_dtype_or_shape(bad_rule, what):
    ep = _ep()
    with pytest.raises(RuleError) as info:
        fx_rewrites.apply(ep, [bad_rule])
    error = info.value
    assert (error.rule, error.node, error.op) == (bad_rule.name, "relu", "aten.relu.default")
    message = str(error)
    assert message.startswith(f"rule {bad_rule.name!r} failed on node 'relu' (aten.relu.default): ")
    assert what in message
    assert "The rewrite was rolled back; fix the rule, or pass on_error='skip'" in message
    # skip instead: the run goes on and the report says what was skipped, the graph is as exported
    result = fx_rewrites.apply(ep, [bad_rule], on_error="skip")
    assert [(s.rule, s.node) for s in result.report.skips] == [(bad_rule.name, "relu")]
    assert what in result.report.summary()
    rt.assert_matches_eager(result, AddRelu(), [(torch.randn(3, 4), torch.randn(3, 4))])


def test_rule_that_raises():
    with pytest.raises(RuleError) as info:
        fx_rewrites.apply(_ep(), [r.raises_midway])
    assert str(info.value) == (
        "rule 'raises_midway' failed on node 'relu' (aten.relu.default): RuntimeError: boom. The rewrite was "
        "rolled back; fix the rule, or pass on_error='skip' to skip it on this node and go on."
    )
    assert isinstance(info.value.__cause__, RuntimeError)  # the rule's own error, for the traceback


def test_rules_that_undo_each_other():
    # the order of the two names is the engine's business; both names, the node and the words are checked
    pattern = (
        r"non-convergence: rules '(add_to_sub|sub_to_add)' and '(add_to_sub|sub_to_add)' undo each other on node 'add'"
    )
    result = fx_rewrites.apply(_ep(), [r.add_to_sub, r.sub_to_add])
    found = re.fullmatch(pattern, result.report.stop_reason)
    assert found and found[1] != found[2], result.report.stop_reason
    with pytest.raises(NonConvergence) as info:
        fx_rewrites.apply(_ep(), [r.add_to_sub, r.sub_to_add], strict=True)
    assert str(info.value) == result.report.stop_reason


def test_graph_without_meta_val():
    gm = torch.fx.symbolic_trace(AddRelu())
    with pytest.raises(GraphInputError) as info:
        fx_rewrites.apply(gm)
    message = str(info.value)
    assert "the graph's nodes carry no meta['val'] (first without: ['x', 'w'," in message
    assert "torch.fx.symbolic_trace" in message
    assert "Pass example_inputs=(...) to apply()" in message and "torch.export.export()" in message


@pytest.mark.parametrize(
    ("bad", "hint"),
    [
        (torch.nn.Linear(2, 2), "got Linear. Export it first: torch.export.export(model, example_args)."),
        ("model.pt2", "got str. Load a saved program first: torch.export.load(path)"),
        (Path("model.pt2"), "got PosixPath. Load a saved program first: torch.export.load(path)"),
        (None, "got NoneType."),
        (lambda x: x, "got function."),
    ],
)
def test_unsupported_object_passed_to_apply(bad, hint):
    with pytest.raises(GraphInputError) as info:
        fx_rewrites.apply(bad)
    message = str(info.value)
    assert message.startswith("apply() takes a torch.export.ExportedProgram or a torch.fx.GraphModule, ")
    assert hint in message
    assert isinstance(info.value, TypeError)  # a GraphInputError is also a TypeError


# ----------------------------------------------------------------------------- saved programs, from Python


@pytest.fixture(scope="module")
def broken_pt2(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pt2")
    good = d / "net.pt2"
    torch.export.save(_ep(), good)
    data = good.read_bytes()
    (d / "truncated.pt2").write_bytes(data[: len(data) // 2])
    (d / "empty.pt2").write_bytes(b"")
    (d / "text.pt2").write_text("not a program\n")
    return {"dir": d, "good": good}


def test_python_api_reads_a_good_pt2(broken_pt2):
    result = fx_rewrites.apply(torch.export.load(broken_pt2["good"]))
    assert result.report.converged


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("truncated.pt2", "starts like a .pt2 (zip) archive but cannot be read to the end: it is truncated or damaged"),
        ("empty.pt2", "is empty"),
        ("text.pt2", "is not a .pt2 archive"),
    ],
)
def test_cli_names_a_broken_pt2(broken_pt2, capsys, name, what):
    # test_cli.py covers random bytes and a half file from `check`; here: empty and text, through `explain`
    path = broken_pt2["dir"] / name
    code = main(["explain", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{path} {what}" in err
    assert "Fix: save the program again with torch.export.save(ep, path)" in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- factories and export, from the CLI

FACTORIES = """
import torch
raise_on_import = __import__("os").environ.get("FX_REWRITES_TEST_IMPORT_ERROR")
if raise_on_import:
    raise ImportError("No module named 'my_private_layers'")


def make():
    return torch.nn.ReLU(), (torch.randn(2),)
"""


def test_factory_file_that_does_not_import(tmp_path, capsys, monkeypatch):
    model = tmp_path / "model.py"
    model.write_text(FACTORIES)
    monkeypatch.setenv("FX_REWRITES_TEST_IMPORT_ERROR", "1")
    code = main(["check", f"{model}:make", "--backend", "eager"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"importing {model} raised ImportError: No module named 'my_private_layers' at {model}:5" in err
    assert f"Fix: make `python {model}` run without errors first." in err


def test_factory_in_a_directory_that_does_not_exist(tmp_path, capsys):
    code = main(["check", f"{tmp_path}/nowhere/model.py:make"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"no such file: {tmp_path}/nowhere/model.py (the model's Python file" in err and "Fix: check the path" in err


class Branchy(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x + 1
        return x - 1


def test_model_torch_cannot_export_raises_torchs_error_from_python():
    # fx-rewrites does not wrap torch.export: the Python API shows torch's own error type and text
    with pytest.raises(Exception) as info:
        rt.export(Branchy(), torch.ones(2, 3))
    assert type(info.value).__module__.startswith("torch.")
    assert "data-dependent" in str(info.value)
    assert not isinstance(info.value, fx_rewrites.RewriteError)
