"""The README's code runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_usage_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(_python_blocks()[0], namespace)
    result = namespace["result"]
    assert result.report.converged and result.report.rewrites["pool_stride_defaults"] == 1
    assert (tmp_path / "net.pt2").exists()


def test_rule_example_and_its_test_pass():
    namespace: dict = {}
    exec(_python_blocks()[1], namespace)
    namespace["test_lift_to_clone"]()


def test_backend_example_runs_on_iree(tmp_path, monkeypatch):
    import torch

    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(_python_blocks()[0], namespace)
    exec(_python_blocks()[2], namespace)
    x = namespace["x"]
    torch.testing.assert_close(namespace["fn"](x), namespace["Net"]()(x))


def test_torch_compile_example_runs(tmp_path, monkeypatch):
    import torch

    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(_python_blocks()[0], namespace)
    model, x = namespace["Net"](), torch.randn(2, 3, 8, 8)
    namespace.update(model=model, x=x)
    exec(_python_blocks()[3], namespace)
    with torch.no_grad():
        torch.testing.assert_close(namespace["compiled"](x), model(x))


def test_ttnn_example_lowers_and_says_what_is_missing(tmp_path, monkeypatch, capsys):
    import pytest

    from fx_rewrites.backends.ttnn.runtime import TtnnUnavailable

    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(_python_blocks()[0], namespace)
    exec(_python_blocks()[2], namespace)
    try:
        import ttnn  # noqa: F401
    except ImportError:
        with pytest.raises(TtnnUnavailable, match=r"ttnn .* is not installed"):
            exec(_python_blocks()[4], namespace)
    else:  # a machine with ttnn runs the example to the end
        exec(_python_blocks()[4], namespace)
    assert "1 regions (1 device, 0 host); 9 of 9 nodes on device (100.0%)" in capsys.readouterr().out


def test_partition_example_runs():
    import torch

    namespace: dict = {}
    exec(_python_blocks()[5], namespace)
    parts, runner, model = namespace["parts"], namespace["runner"], namespace["model"]
    assert parts.summary() == "3 regions (2 device, 1 host); 3 of 4 nodes on device (75.0%)"
    assert [name for name, _ in runner.named_children()] == ["device_0", "host_1", "device_2"]
    x = torch.randn(2, 4)
    torch.testing.assert_close(runner(x), model(x))


def test_ci_runs_the_readme_test_command():
    bash = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)[0]
    commands = [line for line in bash.splitlines() if line and not line.startswith("#")]
    ci = (README.parent / ".ci" / "run").read_text()
    assert len(commands) == 2, commands
    assert commands[1] in ci, f"README test command not in .ci/run: {commands[1]}"
    assert "fx-rewrites demo" in commands[0] and "fx-rewrites demo" in ci
