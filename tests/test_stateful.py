"""Programs that update buffers in forward (issue 26 item 3): the state lives in the IREE module as mutable
globals, calls advance it as eager calls do, and `save` + `fx_rewrites.load` (in a fresh process) keeps that.

Each model is compiled static and with a Dim on the batch; "big" variants hold a buffer of 64 KiB or more, which
starts from the parameter archive (.irpa) instead of the module. About ten small IREE compiles.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import fx_rewrites
from fx_rewrites.backends.iree.parameters import INLINE_LIMIT

BIG = INLINE_LIMIT // 4  # float32 features in a buffer of exactly the inline limit: a parameter


class Counter(torch.nn.Module):
    """Counts its calls (per feature); the output depends on the count."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("n", torch.zeros(features) if features > 1 else torch.zeros((), dtype=torch.long))
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n.add_(1)
        return x * self.scale + self.n


class RunningMean(torch.nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.linspace(-1, 1, features))
        self.register_buffer("calls", torch.zeros(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        self.calls.add_(1)
        return (x - self.mean) * self.calls


CASES = {
    "counter": lambda: Counter(1),
    "counter_big": lambda: Counter(BIG),
    "mean": lambda: RunningMean(8),
    "mean_big": lambda: RunningMean(BIG),
}


def _features(model: torch.nn.Module) -> int:
    return model.scale.numel() if isinstance(model, Counter) else model.mean.numel()


def _inputs(model: torch.nn.Module, dynamic: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    f = _features(model)
    return [torch.randn(b if dynamic else 3, f, generator=g) for b in (3, 5, 2)]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (model as compiled, inputs, eager outputs of a fresh copy, compiled, saved path)."""
    out = tmp_path_factory.mktemp("stateful")
    result = {}
    for name, make in CASES.items():
        for dynamic in (False, True):
            torch.manual_seed(0)
            model = make()
            xs = _inputs(model, dynamic)
            with torch.no_grad():
                fresh = copy.deepcopy(model)
                expected = [fresh(x) for x in xs]
            shapes = ({0: torch.export.Dim("batch", min=2, max=64)},) if dynamic else None
            compiled = fx_rewrites.compile(model, (xs[0],), dynamic_shapes=shapes)
            key = f"{name}-{'dim' if dynamic else 'static'}"
            path = out / f"{key}.vmfb"
            compiled.save(path, params=out / f"{key}.irpa")  # before any call: the initial state
            result[key] = (model, xs, expected, compiled, path)
    return result


@pytest.mark.parametrize("key", [f"{n}-{d}" for n in CASES for d in ("static", "dim")])
def test_calls_advance_the_state_as_eager_does(built, key):
    model, xs, expected, compiled, _ = built[key]
    before = {k: v.clone() for k, v in compiled.program.state_dict.items()}
    for x, want in zip(xs, expected, strict=True):
        _close(compiled(x), want)
    # the state lives in the module: neither the model, nor compiled.program, nor the parameters moved
    for k, v in compiled.program.state_dict.items():
        assert torch.equal(v, before[k]), k
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, v in (compiled.runtime.parameters or {}).items():
        assert torch.equal(v, before.get(k, compiled.program.constants.get(k))), k
    fourth = _fourth_call(model, xs)
    # compiled.program's own call starts from the initial state, not from compiled's, and moves nothing there
    with torch.no_grad():
        _close(compiled.program.module()(xs[0]), expected[0])
    _close(compiled(xs[0]), fourth)  # the fourth call goes on from the third


def _fourth_call(model: torch.nn.Module, xs: list[torch.Tensor]) -> torch.Tensor:
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        for x in xs:
            fresh(x)
        return fresh(xs[0])


def test_the_state_is_in_the_module(built):
    """Mutable globals, each initialised from a parameter of its own whatever its size (two equal inline
    initial values would share one storage in IREE 3.13: tests/backends/iree/test_equal_state.py)."""
    small = built["mean-static"][3].runtime
    for key in ("mean", "calls"):  # a copy of the parameter (a saved archive is mapped read-only)
        assert f'util.global private @__state_{key}__initial = #stream.parameter.named<"model"::"{key}">' in small.mlir
        assert f"util.global private mutable @__state_{key} : tensor<" in small.mlir
    assert sorted(small.parameters) == ["calls", "mean"]
    big = built["counter_big-dim"][3].runtime
    assert 'util.global private @__state_n__initial = #stream.parameter.named<"model"::"n">' in big.mlir
    assert sorted(big.parameters) == ["n", "scale"]
    assert big.plan.args == (0,) and all(o.write is None for o in big.plan.outputs)  # no state passed per call


def test_save_and_load_in_a_fresh_process(built, tmp_path):
    """Every saved case is loaded by another Python, called three times; each result matches eager's."""
    keys = sorted(built)
    for key in keys:
        for i, x in enumerate(built[key][1]):
            np.save(tmp_path / f"{key}-x{i}.npy", x.numpy())
    script = f"""
import sys
from pathlib import Path
import numpy as np
import torch
import fx_rewrites
out = Path({str(tmp_path)!r})
for key, path in {[(k, str(built[k][4])) for k in keys]!r}:
    loaded = fx_rewrites.load(path)
    for i in range(3):
        x = torch.from_numpy(np.load(out / f"{{key}}-x{{i}}.npy"))
        np.save(out / f"{{key}}-y{{i}}.npy", loaded(x).numpy())
print("done")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-3000:]
    for key in keys:
        for i, want in enumerate(built[key][2]):
            _close(torch.from_numpy(np.load(tmp_path / f"{key}-y{i}.npy")), want)


def test_a_self_contained_save_keeps_the_state_too(built, tmp_path):
    """Without params=, the big state's initial value goes inside the .vmfb with the weights."""
    _, xs, expected, compiled, _ = built["mean_big-static"]
    path = tmp_path / "inside.vmfb"
    compiled.save(path)
    loaded = fx_rewrites.load(path)
    for x, want in zip(xs, expected, strict=True):
        _close(loaded(x), want)


def test_iree_run_module_starts_from_the_saved_state(built, tmp_path):
    """One iree-run-module invocation is one call from the initial state: run twice, both give eager's first
    call (the state persists only within one invocation)."""
    tool = shutil.which("iree-run-module")
    assert tool, "iree-run-module (iree-base-runtime) is not on PATH: pip install -e '.[iree]'"
    _, xs, expected, _, path = built["counter_big-static"]
    np.save(tmp_path / "x.npy", xs[0].numpy())
    for run in range(2):
        argv = [tool, "--device=local-task", f"--module={path}", "--function=main"]
        argv += [f"--parameters=model={path.with_suffix('.irpa')}", f"--input=@{tmp_path / 'x.npy'}"]
        argv += [f"--output=@{tmp_path / f'y{run}.npy'}"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _close(torch.from_numpy(np.load(tmp_path / f"y{run}.npy")), expected[0])


class CountedDispatch(torch.nn.Module):
    """A counter and a cond on the batch size: `fx_rewrites.compile` builds a module per side."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("n", torch.zeros(1))
        # 128 wide: a product of 3 x 128 @ 128 x 128 saves more than a dispatch costs (app/branch_cost.py)
        self.w = torch.nn.Parameter(torch.randn(128, 128, generator=torch.Generator().manual_seed(0)) / 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n.add_(1)
        return torch.cond(x.shape[0] <= 4, lambda x: x @ self.w, lambda x: torch.tanh(x @ self.w), (x,)) + self.n


def test_a_size_dispatch_shares_one_state_between_its_modules():
    """The two sides of a size dispatch are two modules: their state is passed by the host (state="host"),
    so calls that alternate sides count on from each other as eager does."""
    from fx_rewrites.app.dispatch import SizeDispatch

    model = CountedDispatch()
    reference = copy.deepcopy(model)
    compiled = fx_rewrites.compile(
        model, (torch.randn(3, 128),), dynamic_shapes=({0: torch.export.Dim("batch", min=2, max=64)},)
    )
    assert isinstance(compiled.runtime, SizeDispatch)
    with torch.no_grad():
        for batch in (3, 6, 2, 8):
            x = torch.randn(batch, 128)
            _close(compiled(x), reference(x))


class Dtypes(torch.nn.Module):
    """State of each kind a global holds: signless integers, bool (inline as a list), bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("i32", torch.zeros(4, dtype=torch.int32))
        self.register_buffer("u8", torch.full((4,), 250, dtype=torch.uint8))  # wraps around, as eager's does
        self.register_buffer("flag", torch.tensor([True, False, True, False]))
        self.register_buffer("bf16", torch.zeros(4, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.i32.add_(2)
        self.u8.add_(3)
        self.flag.logical_not_()
        self.bf16.add_(0.5)
        return x + self.i32 + self.u8 + self.flag + self.bf16.float()


class Cache(torch.nn.Module):
    """A static cache written at the given positions (`index_copy_`, as transformers' StaticCache does)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(64, 8))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.k.index_copy_(0, pos, x)
        return self.k.cumsum(0)[:32] + x.mean(0)


@pytest.mark.parametrize("case", ["dtypes", "cache"])
def test_state_of_other_dtypes_and_a_cache(case, tmp_path):
    if case == "dtypes":
        model, shapes = Dtypes(), None
        calls = [(torch.randn(4),) for _ in range(3)]
    else:
        model, seq = Cache(), torch.export.Dim("seq", min=1, max=63)
        shapes = ({0: seq}, {0: seq})
        calls = [(torch.randn(5, 8), torch.arange(5)), (torch.randn(1, 8), torch.tensor([5]))]
        calls.append((torch.randn(1, 8), torch.tensor([6])))
    eager, again = copy.deepcopy(model), copy.deepcopy(model)
    compiled = fx_rewrites.compile(model, calls[0], dynamic_shapes=shapes)
    compiled.save(tmp_path / "m.vmfb", params=tmp_path / "m.irpa")
    loaded = fx_rewrites.load(tmp_path / "m.vmfb")
    with torch.no_grad():
        for args in calls:
            want = eager(*args)
            _close(compiled(*args), want)
            _close(loaded(*args), again(*args))
