"""The Backend protocol and the registry backends are found in."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from torch.export import ExportedProgram
from torch.fx import GraphModule

from fx_rewrites.ruleset import Phases, RuleSet

#: entry point group third-party backends register under (value: a Backend
#: instance or a zero-argument callable returning one).
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
        raise UnknownBackend(f"no backend named {name!r}; known: {sorted(names())}")
    entry = _REGISTRY[name]
    if not isinstance(entry, Backend):
        entry = entry()
        if not isinstance(entry, Backend):
            raise TypeError(f"backend factory {name!r} returned {entry!r}, which is not a Backend")
        _REGISTRY[name] = entry
    return entry


def names() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)
