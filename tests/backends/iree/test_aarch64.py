"""ARM, checked (issue 32, item 3): the gallery and benchmarks/runtime.py's models compiled for aarch64
(`fx_rewrites.compile(..., cpu="aarch64")`, cross-compiled here), saved, and run under qemu-aarch64 by IREE's own
aarch64 `iree-run-module` (tests/emulated.py) on an emulated Cortex-A53 (ARMv8.0-A with NEON, nothing newer),
results equal to eager. Also: x86-64-v3 code runs on an emulated AVX2 CPU without AVX-512 (qemu-x86_64 -cpu
Haswell-noTSX), and x86-64-v4 code stops there with SIGILL, which `fx_rewrites.load` now says before.

Speed is not measured: qemu's user mode translates every instruction. Without qemu, the aarch64 C libraries or
the wheel, these tests skip with how to install them, and fail where `CI` is set (.ci/run installs them).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

import fx_rewrites
from fx_rewrites.app.gallery import gallery
from fx_rewrites.backends.iree import cpus
from tests.emulated import EmulatedBackend, aarch64_emulator, x86_emulator

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
#: the demo's agreement with eager (app/demo.py) and benchmarks/runtime.py's
GALLERY_RTOL, GALLERY_ATOL = 1e-4, 1e-5
RUNTIME_RTOL = RUNTIME_ATOL = 1e-4

EXAMPLES = {example.name: example for example in gallery()}
#: run in CI: one per kind of module (a convolution, a size dispatch of two functions, module state, boolean-mask
#: gathers with data-dependent sizes, SymInt arithmetic); the rest where this variable is set (about 4 minutes more
#: on 2 cores: each is an IREE compile as the x86 tests make of the same models, plus two runs under qemu)
ALL_ENV = "FX_REWRITES_ARM_ALL"
QUICK = ("conv_bn_rrelu", "cond_batch_size", "running_stats", "mask_rows", "size_scaled")
EVERY = os.environ.get(ALL_ENV, "") not in ("", "0")
OPT_IN = pytest.mark.skipif(not EVERY, reason=f"NOT RUN: one of the models CI leaves out; set {ALL_ENV}=1 to run it")


@pytest.fixture(scope="module")
def arm() -> EmulatedBackend:
    return EmulatedBackend(aarch64_emulator())


def _second_inputs(args: tuple, seed: int = 1) -> tuple:
    """`args` with each floating tensor drawn again (same shape and dtype); the rest as they are."""
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(a.shape, generator=g, dtype=a.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in args
    )


def _assert_close(got, expected, rtol: float, atol: float) -> None:
    got_leaves, expected_leaves = (torch.utils._pytree.tree_leaves(x) for x in (got, expected))
    assert len(got_leaves) == len(expected_leaves)
    for g, e in zip(got_leaves, expected_leaves):
        torch.testing.assert_close(g, e, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=(pytest.mark.slow, OPT_IN)) for n in EXAMPLES], ids=str
)
def test_gallery_model_runs_on_aarch64(name, arm, tmp_path):
    example = EXAMPLES[name]
    module, args = example.make()
    reference = copy.deepcopy(module)  # eager runs on its own copy: some examples update their buffers
    compiled = fx_rewrites.compile(module, args, dynamic_shapes=example.dynamic_shapes, cpu="aarch64")
    path = tmp_path / f"{name}.vmfb"
    compiled.save(path)
    loaded = fx_rewrites.load(path, backend=arm)
    for inputs in (args, _second_inputs(args)):
        expected = copy.deepcopy(reference)(*copy.deepcopy(inputs))
        _assert_close(loaded(*copy.deepcopy(inputs)), expected, GALLERY_RTOL, GALLERY_ATOL)


def _runtime_models():
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import runtime_models

    return runtime_models


RUNTIME = ("bert", "llama", "gpt2", "vit", "resnet", "whisper_encoder")
RUNTIME_QUICK = ("bert", "vit")


@pytest.mark.parametrize(
    "name", [n if n in RUNTIME_QUICK else pytest.param(n, marks=(pytest.mark.slow, OPT_IN)) for n in RUNTIME], ids=str
)
def test_runtime_benchmark_model_runs_on_aarch64(name, arm, tmp_path):
    """benchmarks/runtime.py's models at their --quick sizes, the weights in an .irpa beside the module."""
    spec = _runtime_models().MODELS[name]
    model = spec.model(quick=True)
    args, kwargs = spec.inputs(True, 0)
    compiled = fx_rewrites.compile(model, args, kwargs, cpu="aarch64")
    path, params = tmp_path / f"{name}.vmfb", tmp_path / f"{name}.irpa"
    compiled.save(path, params=params)
    loaded = fx_rewrites.load(path, backend=arm)
    for seed in (0, 1):
        args, kwargs = spec.inputs(True, seed)
        with torch.no_grad():
            expected = model(*args, **kwargs)
        _assert_close(loaded(*args, **kwargs), expected, RUNTIME_RTOL, RUNTIME_ATOL)


def test_a_failed_emulated_run_says_so(arm, tmp_path):
    """The emulated runner fails loudly (a module for x86 under qemu-aarch64): no test passes on a silent no-op."""
    torch.manual_seed(0)
    model, x = torch.nn.Linear(4, 3).eval(), torch.randn(2, 4)
    path = tmp_path / "x86.vmfb"
    fx_rewrites.compile(model, (x,), cpu="x86-64-v3").save(path)
    with pytest.raises(RuntimeError, match=r"iree-run-module on .*x86\.vmfb @main: exit [1-9]"):
        fx_rewrites.load(path, backend=arm)(x)


X86 = cpus.host().arch == "x86_64"


@pytest.mark.skipif(not X86, reason="runs this machine's x86-64 iree-run-module under qemu-x86_64")
def test_avx2_code_runs_on_an_emulated_avx2_cpu_and_avx512_code_does_not(tmp_path):
    """What the CPU record guards against, on an emulated Haswell (AVX2, FMA, BMI; no AVX-512): x86-64-v3 code
    runs and matches eager; x86-64-v4 code dies of SIGILL in IREE, which checks no CPU feature itself."""
    haswell = EmulatedBackend(x86_emulator("Haswell-noTSX"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).eval()
    x = torch.randn(16, 64)
    compiled = fx_rewrites.compile(model, (x,), cpu="x86-64-v3")
    compiled.save(tmp_path / "v3.vmfb")
    with torch.no_grad():
        expected = model(x)
    _assert_close(fx_rewrites.load(tmp_path / "v3.vmfb", backend=haswell)(x), expected, 1e-5, 1e-5)
    compiled.save(tmp_path / "v4.vmfb", cpu="x86-64-v4")
    with pytest.raises(RuntimeError, match=r"Illegal instruction"):
        fx_rewrites.load(tmp_path / "v4.vmfb", backend=haswell)(x)
