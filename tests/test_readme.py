"""The README's code runs as written, from a scratch directory outside the repository.

Each test writes the README's blocks (and its own checks after them) to a script in `tmp_path` and runs it
there with the installed package, as a user outside the clone would: the repository is not on sys.path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
ROOT = README.parent


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)


#: the README's python blocks by what they show (a new block goes in this list where it sits)
USE, COMPILE, DEPLOY, RULE_PACK, RULE_TEST, BACKEND, TORCH_COMPILE, TTNN, PARTITION = range(9)


def _outside(tmp_path: Path, checks: str, *, timeout: int = 600) -> str:
    """Run `checks` in a fresh Python in `tmp_path` (outside the repository), where `run(i)` executes the
    README's python block i in the script's one namespace, as one script of the blocks in order would;
    returns stdout."""
    assert ROOT not in tmp_path.resolve().parents
    script = tmp_path / "readme_blocks.py"
    script.write_text(
        "import json, os, sys\n"
        f"BLOCKS = json.loads({json.dumps(json.dumps(_python_blocks()))})\n"
        "def run(i):\n"
        "    exec(compile(BLOCKS[i], f'README.md, python block {i}', 'exec'), globals())\n"
        f"assert not any(os.path.realpath(p or '.') == {str(ROOT)!r} for p in sys.path), sys.path\n"
        + textwrap.dedent(checks)
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_the_block_list_is_current():
    blocks = _python_blocks()
    assert len(blocks) == 9
    assert blocks[COMPILE].startswith("compiled = fx_rewrites.compile(") and "compiled.save(" in blocks[DEPLOY]
    assert blocks[RULE_PACK].startswith("# my_rules.py") and blocks[RULE_TEST].startswith("# test_my_rules.py")


def test_usage_example_runs(tmp_path):
    _outside(
        tmp_path,
        f"""
        run({USE})
        assert result.report.converged and result.report.rewrites["pool_stride_defaults"] == 1
        assert os.path.exists("net.pt2")
        """,
    )


def test_rule_example_and_its_test_pass_with_pytest_outside_the_clone(tmp_path):
    """The rule in the user's own my_rules.py, its test beside it, run as the README says."""
    blocks = _python_blocks()
    (tmp_path / "my_rules.py").write_text(blocks[RULE_PACK])
    (tmp_path / "test_my_rules.py").write_text(blocks[RULE_TEST])
    assert "python -m pytest test_my_rules.py" in " ".join(README.read_text().split())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_rules.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_adding_a_rule_to_the_defaults_as_the_readme_says(tmp_path):
    (tmp_path / "my_rules.py").write_text(_python_blocks()[RULE_PACK])
    text = " ".join(README.read_text().split())
    assert "`fx_rewrites.apply(ep, fx_rewrites.rules.DEFAULT + my_lift_to_clone)`" in text
    assert '`backends.get("iree").rules + my_lift_to_clone`' in text
    _outside(
        tmp_path,
        f"""
        run({USE})
        from my_rules import my_lift_to_clone
        from fx_rewrites import backends
        result = fx_rewrites.apply(ep, fx_rewrites.rules.DEFAULT + my_lift_to_clone)   # as the README writes it
        assert result.report.converged
        default = fx_rewrites.rules.DEFAULT
        for rules in (default + my_lift_to_clone, default | my_lift_to_clone, default + [my_lift_to_clone]):
            assert rules.names()[-1] == "my_lift_to_clone" and set(default.names()) < set(rules.names())
        iree_rules = backends.get("iree").rules + my_lift_to_clone  # Phases: the rule ends the first phase
        assert iree_rules.sets[0].names()[-1] == "my_lift_to_clone"
        assert (my_lift_to_clone + default).names()[0] == "my_lift_to_clone"
        import attrs
        same_name = attrs.evolve(my_lift_to_clone, name="lift_fresh_copy_to_clone")
        try:
            default + same_name
        except fx_rewrites.RuleDefinitionError as e:
            assert "two different rules are named 'lift_fresh_copy_to_clone'" in str(e)
        else:
            raise AssertionError("two rules with one name were accepted")
        """,
    )


def test_compile_and_deploy_examples_run(tmp_path):
    _outside(
        tmp_path,
        f"""
        run({USE}); run({COMPILE}); run({DEPLOY})
        x = torch.randn(1, 3, 8, 8)
        expected = Net()(x)
        torch.testing.assert_close(compiled(x), expected)
        torch.testing.assert_close(net(x), expected)
        assert set(os.listdir(".")) >= {{"net.vmfb", "net_lean.vmfb", "net_lean.irpa"}}
        """,
    )


def test_backend_example_runs_on_iree(tmp_path):
    _outside(
        tmp_path,
        f"""
        run({USE}); run({BACKEND})
        torch.testing.assert_close(fn(x), Net()(x))
        """,
    )


def test_torch_compile_example_runs(tmp_path):
    _outside(
        tmp_path,
        f"""
        run({USE}); run({TORCH_COMPILE})
        x = torch.randn(2, 3, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
        """,
    )


def test_ttnn_example_lowers_and_says_what_is_missing(tmp_path):
    out = _outside(
        tmp_path,
        f"""
        run({USE}); run({BACKEND})
        from fx_rewrites.backends.ttnn.runtime import TtnnUnavailable
        try:
            import ttnn  # noqa: F401
        except ImportError:
            try:
                run({TTNN})
            except TtnnUnavailable as e:
                assert "is not installed" in str(e), e
            else:
                raise AssertionError("no TtnnUnavailable without ttnn")
        else:  # a machine with ttnn runs the example to the end
            run({TTNN})
        """,
    )
    assert "1 regions (1 device, 0 host); 9 of 9 nodes on device (100.0%)" in out


def test_partition_example_runs(tmp_path):
    _outside(
        tmp_path,
        f"""
        run({PARTITION})
        assert parts.summary() == "3 regions (2 device, 1 host); 3 of 4 nodes on device (75.0%)"
        assert [name for name, _ in runner.named_children()] == ["device_0", "host_1", "device_2"]
        x = torch.randn(2, 4)
        torch.testing.assert_close(runner(x), model(x))
        """,
    )


#: PyTorch's CPU wheel index, as its install selector gives it: from PyPI, torch on Linux x86_64 is the CUDA build
CPU_TORCH = "python -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def test_ci_runs_the_readme_test_command():
    setup, install = _bash_blocks()[:2]
    assert "git clone" in setup and "python3 -m venv .venv && . .venv/bin/activate" in setup
    commands = [line for line in install.splitlines() if line and not line.startswith("#")]
    ci = (ROOT / ".ci" / "run").read_text()
    assert len(commands) == 2, commands
    assert commands[1] in ci, f"README test command not in .ci/run: {commands[1]}"
    assert "fx-rewrites demo" in commands[0] and "fx-rewrites demo" in ci
    assert all(CPU_TORCH + " && " in command for command in commands)


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
