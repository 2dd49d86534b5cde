"""The README's code runs as written."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


#: the README's python blocks by what they show (a new block goes in this list where it sits)
USE, COMPILE, DEPLOY, RULE_PACK, RULE_TEST, BACKEND, TORCH_COMPILE, TTNN, PARTITION = range(9)


def test_the_block_list_is_current():
    blocks = _python_blocks()
    assert len(blocks) == 9
    assert blocks[COMPILE].startswith("compiled = fx_rewrites.compile(") and "compiled.save(" in blocks[DEPLOY]
    assert blocks[RULE_PACK].startswith("# rewrites/rules/my_pack.py") and blocks[RULE_TEST].startswith(
        "# tests/rules/"
    )


def test_usage_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(_python_blocks()[USE], namespace)
    result = namespace["result"]
    assert result.report.converged and result.report.rewrites["pool_stride_defaults"] == 1
    assert (tmp_path / "net.pt2").exists()


def test_rule_example_and_its_test_pass_each_file_on_its_own(monkeypatch):
    """The pack and its test are two files: each runs with its own imports (no shared namespace)."""
    blocks = _python_blocks()
    pack = types.ModuleType("fx_rewrites.rules.my_pack")
    exec(blocks[RULE_PACK], pack.__dict__)
    monkeypatch.setitem(__import__("sys").modules, "fx_rewrites.rules.my_pack", pack)
    namespace: dict = {"__name__": "test_my_pack"}
    exec(blocks[RULE_TEST], namespace)
    namespace["test_lift_to_clone"]()


def test_adding_a_rule_to_the_defaults_as_the_readme_says():
    import attrs

    import fx_rewrites
    from fx_rewrites import backends

    pack: dict = {}
    exec(_python_blocks()[RULE_PACK], pack)
    rule = attrs.evolve(pack["lift_to_clone"], name="my_lift_to_clone")  # DEFAULT has one of that name already
    default = fx_rewrites.rules.DEFAULT
    for rules in (default + rule, default | rule, default + [rule]):
        assert rules.names()[-1] == "my_lift_to_clone" and set(default.names()) < set(rules.names())
    iree_rules = backends.get("iree").rules + rule  # Phases: the rule ends the first phase
    assert iree_rules.sets[0].names()[-1] == "my_lift_to_clone" and set(default.names()) < set(iree_rules.names())
    assert (rule + default).names()[0] == "my_lift_to_clone"
    with pytest.raises(
        fx_rewrites.RuleDefinitionError, match="two different rules are named 'lift_fresh_copy_to_clone'"
    ):
        default + pack["lift_to_clone"]
    with pytest.raises(TypeError, match="unsupported operand"):
        default + 3


def test_compile_and_deploy_examples_run(tmp_path, monkeypatch):
    import torch

    monkeypatch.chdir(tmp_path)
    blocks = _python_blocks()
    namespace: dict = {}
    exec(blocks[USE], namespace)
    exec(blocks[COMPILE], namespace)
    exec(blocks[DEPLOY], namespace)
    x = torch.randn(1, 3, 8, 8)
    expected = namespace["Net"]()(x)
    torch.testing.assert_close(namespace["compiled"](x), expected)
    torch.testing.assert_close(namespace["net"](x), expected)
    assert {p.name for p in tmp_path.iterdir()} >= {"net.vmfb", "net_lean.vmfb", "net_lean.irpa"}


def test_backend_example_runs_on_iree(tmp_path, monkeypatch):
    import torch

    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(_python_blocks()[USE], namespace)
    exec(_python_blocks()[BACKEND], namespace)
    x = namespace["x"]
    torch.testing.assert_close(namespace["fn"](x), namespace["Net"]()(x))


def test_torch_compile_example_runs(tmp_path, monkeypatch):
    import torch

    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(_python_blocks()[USE], namespace)
    model, x = namespace["Net"](), torch.randn(2, 3, 8, 8)
    namespace.update(model=model, x=x)
    exec(_python_blocks()[TORCH_COMPILE], namespace)
    with torch.no_grad():
        torch.testing.assert_close(namespace["compiled"](x), model(x))


def test_ttnn_example_lowers_and_says_what_is_missing(tmp_path, monkeypatch, capsys):
    import pytest

    from fx_rewrites.backends.ttnn.runtime import TtnnUnavailable

    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(_python_blocks()[USE], namespace)
    exec(_python_blocks()[BACKEND], namespace)
    try:
        import ttnn  # noqa: F401
    except ImportError:
        with pytest.raises(TtnnUnavailable, match=r"ttnn .* is not installed"):
            exec(_python_blocks()[TTNN], namespace)
    else:  # a machine with ttnn runs the example to the end
        exec(_python_blocks()[TTNN], namespace)
    assert "1 regions (1 device, 0 host); 9 of 9 nodes on device (100.0%)" in capsys.readouterr().out


def test_partition_example_runs():
    import torch

    namespace: dict = {}
    exec(_python_blocks()[PARTITION], namespace)
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


def test_item_in_forward_recompiles_as_the_readme_says():
    """README: with dynamic=False every new `.item()` value compiles the graph after the break again;
    the default compiles once more, then treats it as dynamic; dynamic=True compiles each graph once."""
    import torch

    from fx_rewrites.backends.dynamo import dynamo_backend

    def f(x):
        v = x.sum().item()
        return torch.relu(x) * v

    counts = {}
    for dynamic in (False, None, True):
        graphs: list = []
        torch._dynamo.reset()
        compiled = torch.compile(f, backend=dynamo_backend("eager", on_graph=graphs.append), dynamic=dynamic)
        with torch.no_grad():
            for i in range(4):
                x = torch.full((4,), float(i + 1))
                torch.testing.assert_close(compiled(x), f(x))
        counts[dynamic] = len(graphs)
    torch._dynamo.reset()
    assert counts == {False: 1 + 4, None: 1 + 2, True: 1 + 1}
    text = " ".join(README.read_text().split())
    assert "with `dynamic=False` dynamo specialises on it and compiles that graph again for every new value" in text
