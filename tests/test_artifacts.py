"""Compiled programs as files: `compiled.save`, `fx_rewrites.load`, `fx-rewrites compile -o`, and `iree-run-module`
(from iree-base-runtime) running what was written, with the weights inside the .vmfb or in an .irpa beside it.

About ten IREE compiles of small models (a second or two each) and a few iree-run-module runs.
"""

from __future__ import annotations

import pickle
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import fx_rewrites
from fx_rewrites.app.cli import main
from fx_rewrites.backends.iree.artifact import CALL_KEY, ArtifactError

MODEL = """
import torch
import torch.nn.functional as F


class Net(torch.nn.Module):
    # 128 KiB of weights, and max_pool1d's stride missing (the rules fill it in)
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 512)
        self.out = torch.nn.Linear(256, 5)

    def forward(self, x):
        return self.out(F.max_pool1d(torch.relu(self.fc(x)).unsqueeze(1), 2).squeeze(1))


def make():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(3, 64),)
"""


def _net() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    namespace: dict = {"__name__": "artifact_model"}
    exec(MODEL, namespace)
    return namespace["make"]()


class Nested(torch.nn.Module):
    """Tensor and constant keyword inputs; outputs a dict holding a tuple, None and an int."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, n: int, *, scale: torch.Tensor, flag: bool = False) -> dict:
        y = self.fc(x) * scale
        return {"y": y, "pair": (y.argmax(-1), (x * n) > 1), "none": None, "n": 3}


@pytest.fixture(scope="module")
def nested(tmp_path_factory):
    torch.manual_seed(0)
    model = Nested().eval()
    x, scale = torch.randn(3, 4), torch.randn(4)
    compiled = fx_rewrites.compile(model, (x, 2), {"scale": scale, "flag": True})
    path = tmp_path_factory.mktemp("nested") / "nested.vmfb"
    compiled.save(path)
    return model, compiled, path


def _same(got, expected) -> None:
    got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
    exp_leaves, exp_spec = torch.utils._pytree.tree_flatten(expected)
    assert got_spec == exp_spec
    for g, e in zip(got_leaves, exp_leaves, strict=True):
        if isinstance(e, torch.Tensor):
            assert g.dtype == e.dtype and g.shape == e.shape
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
        else:
            assert g == e


def test_save_load_round_trip_keeps_the_call_convention(nested, monkeypatch):
    model, compiled, path = nested

    # loading reads JSON and hands the module to IREE: nothing is unpickled
    def refuse(*args, **kwargs):
        raise AssertionError("load unpickled something")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    loaded = fx_rewrites.load(path)
    monkeypatch.undo()
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        x, scale = torch.randn(3, 4, generator=g), torch.randn(4, generator=g)
        expected = model(x, 2, scale=scale, flag=True)
        _same(loaded(x, 2, scale=scale), expected)  # flag, a constant, comes back with the file
        _same(loaded(x, 2, scale=scale, flag=True), compiled(x, 2, scale=scale))
    with pytest.raises(TypeError, match=r"keyword argument 'scale' \(a float32 tensor of shape \(4,\)\) is missing"):
        loaded(x, 2)
    with pytest.raises(ValueError, match=r"input 'x' \(args\[0\]\) has shape \(5, 4\)"):
        loaded(torch.randn(5, 4), 2, scale=scale)
    # the convention is JSON in main's reflection; the file is still one IREE module
    import iree.runtime

    module = iree.runtime.VmModule.mmap(iree.runtime.VmInstance(), str(path))
    assert '"format":"fx-rewrites.iree-call"' in module.lookup_function("main").reflection[CALL_KEY]
    loaded.save(path.with_name("again.vmfb"))  # a loaded module saves again, byte for byte
    assert path.with_name("again.vmfb").read_bytes() == path.read_bytes()


@pytest.mark.usefixtures("no_compile_cache")  # it counts the compiles
def test_weights_in_a_parameter_archive(tmp_path, monkeypatch):
    from fx_rewrites.backends.iree import invoke
    from fx_rewrites.backends.iree.parameters import inline_limit

    model, (x,) = _net()
    compiles = []
    run = invoke.run_iree_compile
    monkeypatch.setattr(invoke, "run_iree_compile", lambda *a, **k: compiles.append(1) or run(*a, **k))
    monkeypatch.setattr("fx_rewrites.backends.iree.backend.run_iree_compile", invoke.run_iree_compile)
    compiled = fx_rewrites.compile(model, (x,))
    # fc.weight (128 KiB) is a parameter, read from the model's memory; the small ones are inline
    big = {k for k, t in model.state_dict().items() if t.numel() * t.element_size() >= inline_limit()}
    assert big == {"fc.weight"} and set(compiled.runtime.parameters) == big
    assert "fc.weight" in compiled.runtime.mlir and "dense_resource<" in compiled.runtime.mlir
    assert len(compiled.runtime.mlir) < 64 * 1024  # no parameter's bytes in the text
    assert len(compiles) == 1
    compiled.save(tmp_path / "net.vmfb", params=tmp_path / "net.irpa")
    # on llvm-cpu the module is compiled again with the packing of its weights split out (encoding.py): the
    # archive holds the weights as its kernels read them, the encoder's output, not the state-dict tensors
    assert len(compiles) == 2, "save(params=) compiles the module once more, with the weights' packing split out"
    assert (tmp_path / "net.vmfb").read_bytes() != compiled.runtime.vmfb
    compiled.save(tmp_path / "inline.vmfb")  # self-contained: compiled again with the parameters inside
    assert len(compiles) == 3
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    assert sizes["inline.vmfb"] > weights  # the weights are inside
    assert sizes["net.vmfb"] < weights // 2 and sizes["net.irpa"] >= 512 * 64 * 4  # here they are not
    import iree.runtime

    index = iree.runtime.ParameterIndex()
    index.load(str(tmp_path / "net.irpa"))
    assert {key for key, _ in index.items()} == {"parameter0"}  # the encoder's output: the packed weight
    torch.testing.assert_close(fx_rewrites.load(tmp_path / "inline.vmfb")(x), model(x), rtol=1e-4, atol=1e-5)
    for loaded in (
        fx_rewrites.load(tmp_path / "net.vmfb"),
        fx_rewrites.load(tmp_path / "net.vmfb", params=tmp_path / "net.irpa"),
    ):
        for batch in (x, torch.randn(3, 64)):
            torch.testing.assert_close(loaded(batch), model(batch), rtol=1e-4, atol=1e-5)
    shutil.move(tmp_path / "net.irpa", tmp_path / "weights.irpa")
    with pytest.raises(ArtifactError, match=r"net\.irpa does not exist\. Fix: pass params='PATH\.irpa'"):
        fx_rewrites.load(tmp_path / "net.vmfb")
    loaded = fx_rewrites.load(tmp_path / "net.vmfb", params=tmp_path / "weights.irpa")
    torch.testing.assert_close(loaded(x), model(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(ArtifactError, match=r"this module reads its weights from .*weights\.irpa\. Fix: pass params="):
        loaded.save(tmp_path / "copy.vmfb")
    with pytest.raises(ArtifactError, match="holds its weights itself"):
        fx_rewrites.load(tmp_path / "inline.vmfb", params=tmp_path / "weights.irpa")


def test_what_cannot_be_loaded_says_why(tmp_path, nested):
    # (programs that mutate buffers are saved since issue 26: tests/test_stateful.py)
    (tmp_path / "text.vmfb").write_text("not a module")
    with pytest.raises(ArtifactError, match=r"is not an IREE module \(\.vmfb\)"):
        fx_rewrites.load(tmp_path / "text.vmfb")
    with pytest.raises(ArtifactError, match="no such file"):
        fx_rewrites.load(tmp_path / "nope.vmfb")
    import iree.compiler

    plain = iree.compiler.compile_str(
        "func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> { return %a : tensor<2xf32> }",
        target_backends=["llvm-cpu"],
    )
    (tmp_path / "plain.vmfb").write_bytes(plain)
    with pytest.raises(ArtifactError, match="carries no fx-rewrites call convention"):
        fx_rewrites.load(tmp_path / "plain.vmfb")


# ----------------------------------------------------------------------------- iree-run-module


_RESULT = re.compile(r"^(?P<shape>(?:\d+x)*)(?P<dtype>[a-z]+\d+)=(?P<values>.*)$", re.M)


def _run_module(vmfb: Path, inputs: list[Path], params: Path | None = None) -> list[np.ndarray]:
    """Run `vmfb`'s main with iree-run-module and parse the results it prints."""
    tool = shutil.which("iree-run-module")
    assert tool, "iree-run-module (iree-base-runtime) is not on PATH: pip install -e '.[iree]'"
    argv = [tool, "--device=local-task", f"--module={vmfb}", "--function=main"]
    argv += [f"--parameters=model={params}"] if params is not None else []
    argv += [f"--input=@{p}" for p in inputs]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = []
    for m in _RESULT.finditer(proc.stdout):
        shape = [int(d) for d in m["shape"].split("x") if d]
        values = [float(v) for v in re.findall(r"-?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf)", m["values"])]
        results.append(np.array(values, dtype=np.float64).reshape(shape))
    return results


def _save_inputs(tmp_path: Path, *tensors: torch.Tensor) -> list[Path]:
    paths = []
    for i, t in enumerate(tensors):
        paths.append(tmp_path / f"input{i}.npy")
        np.save(paths[-1], t.numpy())
    return paths


@pytest.mark.parametrize("with_params", [False, True], ids=["weights_inside", "weights_in_irpa"])
def test_cli_compile_writes_what_iree_run_module_runs(tmp_path, capsys, with_params):
    (tmp_path / "model.py").write_text(MODEL)
    out, params = tmp_path / "net.vmfb", tmp_path / "net.irpa"
    argv = ["compile", f"{tmp_path / 'model.py'}:make", "-o", str(out)] + (
        ["--params", str(params)] if with_params else []
    )
    code = main(argv)
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    assert "rules fired: pool_stride_defaults x1" in printed.out
    assert "on the example inputs vs eager: ok" in printed.out
    assert f"wrote {out}" in printed.out and (f"and {params}" in printed.out) == with_params
    assert params.exists() == with_params
    # the command it prints runs as printed
    command = next(line.strip() for line in printed.out.splitlines() if line.strip().startswith("iree-run-module"))
    assert command.endswith("--input=3x64xf32=0") and ("--parameters=model=" in command) == with_params
    model, (x,) = _net()
    for batch in (x, torch.randn(3, 64)):
        (got,) = _run_module(out, _save_inputs(tmp_path, batch), params if with_params else None)
        np.testing.assert_allclose(got, model(batch).detach().double().numpy(), rtol=1e-4, atol=1e-5)
    # and fx_rewrites.load reads the same file back
    torch.testing.assert_close(fx_rewrites.load(out)(x), model(x), rtol=1e-4, atol=1e-5)


def test_iree_run_module_runs_a_saved_module_with_kwargs(nested, tmp_path):
    """The flat inputs iree-run-module takes are the tensors in call order; the constants are not inputs."""
    model, _, path = nested
    x, scale = torch.randn(3, 4), torch.randn(4)
    results = _run_module(path, _save_inputs(tmp_path, x, scale))
    expected = model(x, 2, scale=scale, flag=True)
    assert len(results) == 3  # y, argmax, the mask; None and 3 are constants of the convention
    np.testing.assert_allclose(results[0], expected["y"].detach().double().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(results[1], expected["pair"][0].numpy())
    np.testing.assert_array_equal(results[2], expected["pair"][1].numpy())


def test_cli_compile_for_a_gpu_target_needs_no_gpu(tmp_path, capsys):
    """`compile --backend iree-cuda` on a machine without a GPU compiles for it and saves (exit 0), saying the
    comparison with eager was not run; it exited 1 after doing the work."""
    (tmp_path / "model.py").write_text(MODEL)
    out, params = tmp_path / "net.vmfb", tmp_path / "net.irpa"
    code = main(
        ["compile", f"{tmp_path / 'model.py'}:make", "-o", str(out), "--params", str(params), "--backend", "iree-cuda"]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "rules fired: pool_stride_defaults x1" in printed and f"and {params}" in printed
    import iree.runtime

    from fx_rewrites.backends.iree.runtime import get_device

    try:
        get_device(iree.runtime, "cuda")
    except (RuntimeError, ValueError):  # no GPU here: compiled, saved, not run
        assert "not compared with eager: compiled for iree-cuda without running it (backend 'iree-cuda'" in printed
    else:  # a machine with an NVIDIA GPU compares it as for the CPU
        assert "on the example inputs vs eager: ok" in printed
    assert out.read_bytes()[:4] == b"PK\x03\x04" and params.stat().st_size > 128 * 2**10  # the weights
    assert "iree-run-module --device=cuda" in printed


def test_cli_compile_errors(tmp_path, capsys):
    (tmp_path / "model.py").write_text(MODEL)
    code = main(["compile", f"{tmp_path / 'model.py'}:make", "-o", str(tmp_path / "nope" / "net.vmfb")])
    err = capsys.readouterr().err
    assert code == 2 and "no directory" in err and "Fix:" in err
    out = str(tmp_path / "net.vmfb")
    code = main(["compile", f"{tmp_path / 'model.py'}:make", "-o", out, "--params", out])
    assert code == 2 and "name the same file" in capsys.readouterr().err
    code = main(["compile", f"{tmp_path / 'model.py'}:make", "-o", out, "--backend", "eager"])
    printed = capsys.readouterr().out
    assert code == 1 and "the eager backend writes no artifact" in printed


def test_version(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fx-rewrites {version('fx-rewrites')}"
    assert fx_rewrites.__version__ == version("fx-rewrites")


def test_a_module_that_takes_its_weights_as_inputs_writes_no_archive(tmp_path):
    from torch.fx.experimental.proxy_tensor import make_fx

    from fx_rewrites.backends.iree import CompileCache, IreeBackend

    x, w = torch.randn(2, 4), torch.randn(4, 4)
    graph = make_fx(lambda x, w: torch.relu(x @ w))(x, w)  # as torch.compile hands a graph: weights are inputs
    compiled = IreeBackend(cache=CompileCache()).compile(graph, (x, w))
    assert compiled.parameters is None
    with pytest.raises(ArtifactError, match="takes them as inputs"):
        compiled.save(tmp_path / "g.vmfb", params=tmp_path / "g.irpa")
    assert not (tmp_path / "g.irpa").exists()
