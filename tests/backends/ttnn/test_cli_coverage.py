"""`fx-rewrites check MODEL --backend ttnn`: the coverage report, the host emulation, and what was not run."""

from __future__ import annotations

import re

import pytest

from fx_rewrites.app.cli import main
from fx_rewrites.backends.ttnn import runtime
from tests.backends.ttnn import reference_ttnn

MODEL = """
import torch
import torch.nn.functional as F


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(40, 40)

    def forward(self, x):
        h = torch.special.i0(F.gelu(self.fc(x)))   # i0: no ttnn lowering
        return torch.softmax(h, -1), (x > 0).sum(-1), x.argmax(-1)  # sum of bools, argmax: host


def make():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(3, 40),)


def wrong():
    torch.manual_seed(0)
    return torch.nn.Linear(40, 40).eval(), (torch.randn(3, 40),)  # bfloat16 is not within 1e-6
"""


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ttnn_cli") / "net.py"
    path.write_text(MODEL)
    return path


@pytest.fixture
def no_ttnn(monkeypatch):
    previous = runtime.use(None)
    monkeypatch.setattr(runtime, "MODULE_NAME", "ttnn_is_not_installed_in_this_test")
    yield
    runtime.use(previous)


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _row(out: str, op: str) -> list[str]:
    line = next(ln for ln in out.splitlines() if ln.startswith(op + " "))
    return re.split(r"\s{2,}", line.strip())


def test_coverage_report_without_ttnn(model_file, capsys, no_ttnn):
    code, out, err = _run(capsys, "check", f"{model_file}:make", "--backend", "ttnn")
    assert code == 2, out + err  # not a pass: ttnn did not run (the environment, not the model)
    assert "net.py:make: 4 of 7 nodes on device (57.1%); 3 regions (2 device, 1 host)" in out
    assert _row(out, "aten.linear.default") == ["aten.linear.default", "1", "0", "-"]
    assert _row(out, "aten.special_i0.default") == [
        "aten.special_i0.default",
        "0",
        "1",
        "no ttnn lowering for aten.special_i0.default",
    ]
    assert _row(out, "aten.gt.Scalar") == ["aten.gt.Scalar", "1", "0", "-"]
    _, device, host, why = _row(out, "aten.argmax.default")
    assert (device, host) == ("0", "1") and "round together" in why
    _, device, host, why = _row(out, "aten.sum.dim_IntList")
    assert (device, host) == ("0", "1") and "is bool; the ttnn lowering takes float tensors" in why
    assert "the rewritten program run by torch vs eager: ok" in out  # the stand-ins' bodies: bfloat16 emulation
    assert re.search(r"not run on ttnn: ttnn \(Tenstorrent TT-NN\) is not installed.*Python 3\.10", out)
    assert "PASS" not in out
    assert (
        "NOT CHECKED: after the rules, the program matches eager on torch, but ttnn cannot run here "
        "(rtol 0.03, atol 0.03). Fix: run the check where ttnn is installed" in out
    )


def test_runs_on_the_double_when_it_is_injected(model_file, capsys):
    previous = runtime.use(reference_ttnn)
    try:
        code, out, err = _run(capsys, "check", f"{model_file}:make", "--backend", "ttnn")
    finally:
        runtime.use(previous)
    assert code == 0, out + err
    assert "on ttnn vs eager: ok" in out and "not run on ttnn" not in out


def test_fails_with_exit_1_beyond_bfloat16_tolerance(model_file, capsys, no_ttnn):
    code, out, err = _run(
        capsys, "check", f"{model_file}:wrong", "--backend", "ttnn", "--atol", "1e-6", "--rtol", "1e-6"
    )
    assert code == 1, out + err
    assert "vs eager: WrongResult: max abs diff" in out
    assert "FAIL: after the rules, the rewritten program differs from eager (see above; rtol 1e-06, atol 1e-06)" in out


def test_demo_on_ttnn_without_ttnn_emulates_the_device_and_says_so(capsys, no_ttnn):
    code, out, err = _run(capsys, "demo", "--backend", "ttnn", "--only", "functional_pool2d", "conv_bn_rrelu")
    assert code == 0, out + err
    assert "ttnn (not installed: device regions emulated on the host)" in out
    assert "2/2 pass after rules" in out
