"""IREE on GPUs: `iree-cuda`, `iree-rocm`, `iree-vulkan` beside `iree` (llvm-cpu).

CI has no GPU, so these tests compile for every target (the compile needs
no device) and check the artifact is code for that target; running is
checked on the CPU target here and on a lent GPU by
benchmarks/gpu_runtime.py (docs/performance.md). Without the device, a
GPU backend's `compile` fails with an `IreeDeviceError` that says so.
"""

from __future__ import annotations

import copy
import importlib.metadata
import sys
from pathlib import Path

import pytest
import torch

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites.app.gallery import gallery
from fx_rewrites.backends import dynamo
from fx_rewrites.backends.iree import TARGETS, CompileCache, IreeBackend, IreeCompileError, IreeDeviceError
from fx_rewrites.backends.iree.targets import CPU_ISAS

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[3]
GPU_BACKENDS = ("iree-cuda", "iree-rocm", "iree-vulkan")
#: the executable format iree-compile writes into the vmfb for each target
FORMATS = {
    "llvm-cpu": b"embedded-elf-",
    "cuda": b"cuda-nvptx-fb",
    "rocm": b"rocm-hsaco-fb",
    "vulkan-spirv": b"vulkan-spirv-fb",
}


def _fresh(name: str) -> IreeBackend:
    """The registered backend with an empty cache of its own."""
    registered = backends.get(name)
    return IreeBackend(name=registered.name, target=registered.target, cache=CompileCache())


def _assert_artifact(backend: IreeBackend, program) -> None:
    artifact = backend.artifact(program)
    assert b"IREE" in artifact.vmfb[:256], "not an IREE VM flatbuffer (file identifier IREE)"
    assert FORMATS[backend.target.name] in artifact.vmfb, f"no {backend.target.name} executable in the vmfb"
    assert artifact.target == backend.target.name and not artifact.from_cache


def test_every_target_is_registered_with_the_same_rules_and_a_torch_compile_name():
    cpu = backends.get("iree")
    assert cpu.target is TARGETS["llvm-cpu"] and cpu.driver == "local-task"
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    for name, target, driver in zip(GPU_BACKENDS, ("cuda", "rocm", "vulkan-spirv"), ("cuda", "hip", "vulkan")):
        backend = backends.get(name)
        assert (backend.name, backend.target.name, backend.driver) == (name, target, driver)
        # every IREE target starts with DEFAULT and the IREE pack; llvm-cpu adds its ISA's first-phase rules
        isa = CPU_ISAS.get(cpu.target.isa)
        first = [n for n in cpu.rules.sets[0].names() if isa is None or n not in isa.first_rules]
        assert backend.rules.sets[0].names() == first
        function = f"fx_rewrites_{name.replace('-', '_')}"
        assert getattr(dynamo, function).__name__ == function
        assert entry_points["torch_dynamo_backends"][function] == f"fx_rewrites.backends.dynamo:{function}"
    assert "--iree-cuda-target=sm_80" in backends.get("iree-cuda").flags  # IREE 3.13 refuses sm_90
    # registered as a third party's backend is: by the entry points pyproject.toml declares, as installed
    declared = entry_points[backends.ENTRY_POINT_GROUP]
    assert set(declared) == {"iree", *GPU_BACKENDS, "ttnn"}
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=backends.ENTRY_POINT_GROUP)}
    assert {name: installed.get(name) for name in declared} == declared, "stale metadata: pip install -e ."
    assert backends.get("ttnn").name == "ttnn"  # the entry point names the class: a factory


#: what IREE 3.13's mobile Vulkan baseline (no Int64 in its SPIR-V environment) cannot compile, by gallery
#: example: the op it names. Desktop targets (`--iree-vulkan-target=ampere`, the default, or `rdna3`) have Int64.
VULKAN_BASELINE_FAILS = {"size_scaled": "remainder", "item_exponent": "remainder", "mask_rows": "nonzero"}
#: bf16 arithmetic: no SPIR-V target of IREE 3.13 lowers it ("failed to legalize operation 'vector.bitcast'")
VULKAN_FAILS = {"autocast_mlp": "vector.bitcast"}


def _gallery_programs(backend: IreeBackend):
    for example in gallery():
        module, args = example.make()
        program = torch.export.export(copy.deepcopy(module), tuple(args), dynamic_shapes=example.dynamic_shapes)
        yield example.name, fx_rewrites.apply(program, backend.rules).program


@pytest.mark.usefixtures("no_compile_cache")  # compiled here, never from the session's cache
@pytest.mark.slow
@pytest.mark.parametrize("name", ["iree-cuda", "iree-rocm"])
def test_every_target_compiles_the_gallery(name):
    backend = _fresh(name)
    for _, program in _gallery_programs(backend):
        _assert_artifact(backend, program)


@pytest.mark.usefixtures("no_compile_cache")  # compiled here, never from the session's cache
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["ampere", ""], ids=["default", "baseline"])
def test_vulkan_compiles_the_gallery_but_what_its_spirv_lacks(arch):
    """Every example compiles for Vulkan except the named ones, which fail naming their op."""
    flags = (f"--iree-vulkan-target={arch}",) if arch else ()
    backend = IreeBackend(name="iree-vulkan", target=TARGETS["vulkan-spirv"], flags=flags, cache=CompileCache())
    assert arch != "ampere" or backend.flags == backends.get("iree-vulkan").flags
    failing = {**VULKAN_FAILS, **(VULKAN_BASELINE_FAILS if not arch else {})}
    for example, program in _gallery_programs(backend):
        if example not in failing:
            _assert_artifact(backend, program)
            continue
        with pytest.raises(IreeCompileError) as info:
            backend.artifact(program)
        assert failing[example] in str(info.value), f"{example}: {info.value}"


@pytest.mark.usefixtures("no_compile_cache")  # compiled here, never from the session's cache
@pytest.mark.parametrize("name", ["iree", *GPU_BACKENDS])
def test_every_target_compiles_a_zoo_model(name):
    sys.path.insert(0, str(ROOT))
    from tests.zoo import registry

    entry = next(m for m in registry.MODELS if m.name == "bert")
    args, kwargs = entry.inputs(0)
    program = torch.export.export(entry.model(), args, kwargs)
    backend = _fresh(name)
    _assert_artifact(backend, fx_rewrites.apply(program, backend.rules).program)


@pytest.mark.parametrize(
    "name, device", [("iree-cuda", "cuda://99"), ("iree-rocm", "hip://99"), ("iree-vulkan", "vulkan://99")]
)
def test_an_absent_device_is_a_clear_error(name, device):
    """No such device on any machine (index 99): compile builds the artifact, loading names what is missing."""
    registered = backends.get(name)
    backend = IreeBackend(name=name, target=registered.target, device=device, cache=CompileCache())
    x = torch.randn(2, 4)
    program = fx_rewrites.apply(torch.export.export(torch.nn.ReLU(), (x,)), backend.rules).program
    with pytest.raises(IreeDeviceError) as info:
        backend.compile(program, (x,))
    message = str(info.value)
    assert name in message and device in message and registered.target.device in message, message
    assert "artifact(program)" in message and "'iree' backend" in message
    assert info.value.driver == registered.driver and info.value.device == device


def test_a_device_of_another_driver_is_refused():
    with pytest.raises(ValueError, match="not one the cuda code of backend 'iree-cuda' runs on; give a cuda device"):
        IreeBackend(name="iree-cuda", target=TARGETS["cuda"], device="hip://0")
    with pytest.raises(ValueError, match="local-task or local-sync"):
        IreeBackend(device="cuda://0")


def test_the_cpu_backend_runs_on_the_device_asked_for():
    """`device=` picks the runtime device: local-sync runs on the calling thread, same numbers."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
    x = torch.randn(3, 8)
    backend = IreeBackend(device="local-sync", cache=CompileCache())
    fn = backend.compile(fx_rewrites.apply(torch.export.export(module, (x,)), backend.rules).program, (x,))
    torch.testing.assert_close(fn(x), module(x), rtol=1e-4, atol=1e-5)


def test_the_cpu_device_reuses_buffers_without_stale_values():
    """CPU devices use IREE's caching allocator (bounded by default: backends/iree/runtime.py `get_device`): a
    call's transient buffers are the last call's, so a kernel that forgot to initialise one would show the last
    call's numbers."""
    from fx_rewrites.backends.iree.runtime import get_device

    class Reduce(torch.nn.Module):
        def forward(self, x):
            scores = x @ x.transpose(-2, -1)
            return torch.softmax(scores, -1).sum(-1) + scores.amax(-1)

    iree = backends.get("iree")
    import iree.runtime as ireert

    assert get_device(ireert, iree.driver) is get_device(ireert, iree.driver)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3, 40, 16, generator=g) * scale for scale in (1.0, 100.0, 0.01)]
    fn = fx_rewrites.compile(Reduce(), (inputs[0],), backend="iree")
    for x in [*inputs, inputs[0], inputs[1]]:
        torch.testing.assert_close(fn(x), Reduce()(x), rtol=1e-4, atol=1e-4)
