"""The Backend protocol and the registry backends are found in."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from torch.export import ExportedProgram
from torch.fx import GraphModule

from fx_rewrites.engine import RewriteError
from fx_rewrites.ruleset import Phases, RuleSet

#: entry point group backends register under (value: a Backend instance or a zero-argument callable returning
#: one, such as the Backend class): third parties' and fx-rewrites' own (pyproject.toml).
ENTRY_POINT_GROUP = "fx_rewrites.backends"


@runtime_checkable
class Backend(Protocol):
    """A compiler fx-rewrites can hand rewritten graphs to.

    - `name`: what users pass as `backend=`.
    - `rules`: what `fx_rewrites.apply(program, backend.rules)` runs before
      `compile`: a RuleSet (usually DEFAULT plus the backend's own packs) or
      `Phases` run one after another (ttnn: DEFAULT, then its lowering).
    - `compile(program, example_args)`: a callable taking the same tensors
      as the program and returning its outputs. It takes a program the rules
      have already rewritten and rewrites nothing itself.
    """

    name: str
    rules: RuleSet | Phases

    def compile(self, program: ExportedProgram | GraphModule, example_args: Sequence[Any]) -> Callable[..., Any]: ...


class Module(Protocol):
    """Several compiled programs in one module: its `functions` by name (each called like the program it
    came from), sharing the weights and the state they update; `save` writes the whole module."""

    functions: Mapping[str, Callable[..., Any]]

    def save(self, path: str | os.PathLike[str], *, params: str | os.PathLike[str] | None = None) -> None: ...


@runtime_checkable
class ModuleBackend(Protocol):
    """A backend that compiles several programs into one module and reads such a module back from a file.

    `fx_rewrites.compile_lm` (prefill and decode over one KV cache) and the size dispatch (a cond's two
    sides) use it by these names; IREE (`backends/iree/`) has it.

    - `compile_module(programs, metadata=, weights_as_parameters=, same_state=)`: the programs (function name ->
      ExportedProgram, rules applied) as one loaded `Module`. A weight the programs share (the same tensor) is
      one copy; a buffer they update under one name is one state every function reads and writes.
      `metadata`: function -> {key: text} carried in the file and given back by `read_metadata`;
      `weights_as_parameters`: every weight in the parameter file, none inside the module; `same_state`:
      refuse programs that do not all update the same buffers; `state_restarts`: the state may start over from
      its initial values between uses (each use writes it before reading it: a KV cache every generate fills
      from its prefill), so a save may move the module onto the files it wrote.
    - `read_metadata(path)`: each function of the module file at `path` -> its metadata.
    - `load_file(path, names, params=, driver=)`: the module at `path` with functions `names`, its weights
      from `params` (default: beside it).
    """

    name: str

    def compile_module(
        self,
        programs: Mapping[str, ExportedProgram],
        *,
        metadata: Mapping[str, Mapping[str, str]] | None = None,
        weights_as_parameters: bool = False,
        same_state: bool = False,
        state_restarts: bool = False,
    ) -> Module: ...

    def read_metadata(self, path: str | os.PathLike[str]) -> dict[str, dict[str, str]]: ...

    def load_file(
        self,
        path: str | os.PathLike[str],
        names: Sequence[str] = ("main",),
        *,
        params: str | os.PathLike[str] | None = None,
        driver: str | None = None,
    ) -> Module: ...


@runtime_checkable
class CpuTargets(Protocol):
    """A backend that builds code for a CPU chosen by name, not only for the machine it runs on.

    `fx_rewrites.compile(..., cpu=)`, `compile_lm(..., cpu=)`, `Compiled.save(..., cpu=)` and
    `fx-rewrites compile --target` use it by these names; IREE's llvm-cpu (`backends/iree/cpus.py`) has it.

    - `cpus`: the names `for_cpu` takes ("host", "x86-64-v3", "x86-64-v4", "aarch64" for IREE).
    - `cpu`: the CPU this instance builds for.
    - `for_cpu(cpu)`: this backend building for `cpu`. Its `compile` of code this machine cannot run returns
      a callable that saves and raises a `BackendUnavailable` when called.
    """

    name: str
    cpus: tuple[str, ...]

    @property
    def cpu(self) -> str | None: ...

    def for_cpu(self, cpu: str) -> Backend: ...


def for_cpu(backend: Backend, cpu: str | None) -> Backend:
    """`backend` building code for `cpu` (`CpuTargets`; None: as it is), or ValueError naming the backends
    that take a CPU."""
    if cpu is None:
        return backend
    if not isinstance(backend, CpuTargets):
        raise ValueError(
            f"cpu={cpu!r}: backend {backend.name!r} builds code for no CPU by name. Fix: backend='iree' "
            "(llvm-cpu: host, x86-64-v3, x86-64-v4, aarch64), or leave cpu= out"
        )
    if cpu not in backend.cpus:
        raise ValueError(f"cpu={cpu!r}: backend {backend.name!r} builds for {', '.join(backend.cpus)}")
    return backend.for_cpu(cpu)


def save_for_cpu(
    compiled: Any,
    path: str | os.PathLike[str],
    *,
    params: str | os.PathLike[str] | None,
    cpu: str | None,
) -> bool:
    """`save(path, params=, cpu=)` of a compiled model (`Compiled`, `CompiledLM`: their `cpu` and `retarget`)
    when `cpu` names another CPU than the one it was built for: the same compile for that CPU
    (`compiled.retarget(cpu=)`) saved to `path` and `params`, and True. False when `cpu` asks for nothing
    other (None, or its own CPU): the caller saves itself. ValueError, with the fix, for a compiled model
    that cannot be built again for a CPU (its backend takes none, or it was loaded from a file)."""
    if cpu is None or cpu == compiled.cpu:
        return False
    if compiled.retarget is None:
        raise ValueError(
            f"cpu={cpu!r}: this compiled model is built for no other CPU by name (its backend takes no CPU, or it "
            "was loaded from a file). Fix: compile with backend='iree' (llvm-cpu: fx_rewrites.compile(..., cpu=) "
            "or compile_lm(..., cpu=)), or leave cpu= out"
        )
    compiled.retarget(cpu=cpu).save(path, params=params)
    return True


class ArtifactError(RewriteError):
    """A compiled program cannot be saved, or a file cannot be loaded as one."""


class BackendUnavailable(RuntimeError):
    """The backend's runtime (a package, a device) is missing here: programs compile, but cannot run.

    Optional members a backend may have, which `fx-rewrites check` reads:
    `rtol` and `atol` (the agreement with eager to expect) and
    `describe(program, label) -> str` (a report printed before the results).
    """


class UnknownBackend(LookupError):
    """No backend is registered under the name asked for."""


_REGISTRY: dict[str, Backend | Callable[[], Backend]] = {}


def register(backend: Backend | Callable[[], Backend], name: str | None = None) -> None:
    """Register a backend (or a factory, called on first `get`) by name."""
    key = name or getattr(backend, "name", None)
    if not key:
        raise ValueError("register(factory) needs name=; a Backend instance brings its own .name")
    _REGISTRY[key] = backend


def _load_entry_points() -> None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _REGISTRY:
            _REGISTRY[ep.name] = ep.load()


def get(name: str) -> Backend:
    """The backend registered as `name` (built-in or by entry point)."""
    if name not in _REGISTRY:
        _load_entry_points()
    if name not in _REGISTRY:
        raise UnknownBackend(
            f"no backend named {name!r}; known: {sorted(names())}. fx-rewrites' own backends (iree, iree-cuda, "
            "iree-rocm, iree-vulkan, ttnn) are registered by its package metadata: if one is missing, reinstall "
            "the package (pip install -e .)"
        )
    entry = _REGISTRY[name]
    if isinstance(entry, type) or not isinstance(entry, Backend):  # a factory (a class is one)
        entry = entry()
        if isinstance(entry, type) or not isinstance(entry, Backend):
            raise TypeError(f"backend factory {name!r} returned {entry!r}, which is not a Backend")
        _REGISTRY[name] = entry
    return entry


def names() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)
