"""The IREE backend: ExportedProgram or aot_autograd graph -> torch-dialect MLIR -> llvm-cpu vmfb -> local-task.

    fn = backends.get("iree").compile(fx_rewrites.apply(ep).program, args)
    fn(*args)  # same inputs and output structure as program.module()

An ExportedProgram's parameters, buffers and lifted constants are bound
into the module (`FxImporter.import_frozen_program`), so the callable takes
the user inputs only: those of `parameters.inline_limit()` bytes or more
(64 KiB) as named parameters the runtime reads from the tensors' memory
(`parameters`), never as MLIR text; smaller ones inline, where IREE folds
and packs them. Mutated buffers (BUFFER_MUTATION outputs) stay
arguments, read from and written back to the program's state at each call
as `program.module()` does; mutated inputs are written back too.

A GraphModule (the forward graph of `torch.compile` through aot_autograd,
see `backends.dynamo`) is imported with `FxImporter.import_graph_module`:
the callable takes what the graph takes, parameters included, except that
SymInt inputs which are an input's size are recomputed from that input
(`preparing` says how).

`iree-compile` runs as a subprocess (a compiler crash does not take Python
down) with a time limit (`IreeBackend.compile_timeout_s`; past it,
`IreeCompileTimeout`; `invoke` says why); compiled modules are cached by
the hash of the MLIR text, in memory and on disk (`cache`: the user's cache
directory, bounded; `FX_REWRITES_IREE_CACHE=off` for none). A step the
machine's memory cannot hold raises `IreeMemoryError` before it starts
(`memory`). iree is imported on first compile:
`pip install -e '.[iree]'`.

One backend per compile target is registered: `iree` (llvm-cpu, this host),
`iree-cuda`, `iree-rocm`, `iree-vulkan` (`targets`); the same rules (plus
each target's performance rules) and call convention. `artifact(program)`
compiles without a device; `compile` also loads on the device
(`IreeDeviceError` when it is absent).

Modules: `errors` (what it raises), `invoke` (running iree-compile), `cpus` (the CPU llvm-cpu
code is built for, what it needs, the host's features: `IreeBackend.for_cpu`, `IreeCpuError`),
`cache`, `preparing` (a private copy of the graph and its call plan), `importing` (-> MLIR),
`assumptions` (the Dims told to IREE), `state` (written buffers as module globals), `parameters`, `memory`, `runtime`
(`IreeCompiled`, `IreeArtifact`), `targets` (`IreeTarget`, `TARGETS`),
`backend` (`IreeBackend`).
"""

from fx_rewrites.backends.iree.backend import IREE_RULES, IreeBackend, rules_for
from fx_rewrites.backends.iree.cache import CACHE_ENV, CompileCache
from fx_rewrites.backends.iree.cpus import CPUS, IreeCpuError
from fx_rewrites.backends.iree.errors import (
    IreeCompileError,
    IreeDeviceError,
    IreeImportError,
    IreeMemoryError,
    IreeUnsupportedError,
)
from fx_rewrites.backends.iree.importing import INSTALL_HINT
from fx_rewrites.backends.iree.invoke import TIMEOUT_ENV, IreeCompileTimeout
from fx_rewrites.backends.iree.runtime import IreeArtifact, IreeCompiled
from fx_rewrites.backends.iree.targets import BACKEND_TARGETS, TARGETS, IreeTarget


def registered(name: str) -> IreeBackend:
    """The backend registered as `name` (`BACKEND_TARGETS`: iree, iree-cuda, iree-rocm, iree-vulkan)."""
    return IreeBackend(name=name, target=TARGETS[BACKEND_TARGETS[name]])


# zero-argument factories the `fx_rewrites.backends` entry points in pyproject.toml name (`backends.get`)
def llvm_cpu() -> IreeBackend:
    return registered("iree")


def cuda() -> IreeBackend:
    return registered("iree-cuda")


def rocm() -> IreeBackend:
    return registered("iree-rocm")


def vulkan() -> IreeBackend:
    return registered("iree-vulkan")


__all__ = [
    "BACKEND_TARGETS",
    "CACHE_ENV",
    "CPUS",
    "INSTALL_HINT",
    "IREE_RULES",
    "TARGETS",
    "TIMEOUT_ENV",
    "CompileCache",
    "IreeArtifact",
    "IreeBackend",
    "IreeCompileError",
    "IreeCompileTimeout",
    "IreeCompiled",
    "IreeCpuError",
    "IreeDeviceError",
    "IreeImportError",
    "IreeMemoryError",
    "IreeTarget",
    "IreeUnsupportedError",
    "registered",
    "rules_for",
]
