"""Backends: where rewritten graphs go. `backends.get("eager")`, `backends.get("iree")`.

A backend is a name, a RuleSet and `compile(program, example_args)`; see
`backends.base.Backend`. Register your own with `backends.register(...)` or
the `fx_rewrites.backends` entry point group.
"""

from fx_rewrites.backends.base import (
    ENTRY_POINT_GROUP,
    ArtifactError,
    Backend,
    BackendUnavailable,
    CpuTargets,
    Module,
    ModuleBackend,
    UnknownBackend,
    get,
    names,
    register,
)
from fx_rewrites.backends.eager import EagerBackend

# IREE (iree, iree-cuda, iree-rocm, iree-vulkan) and ttnn are registered as third-party backends are: by the
# `fx_rewrites.backends` entry points in pyproject.toml, loaded on first use (`get`, `names`).
register(EagerBackend())

__all__ = [
    "ENTRY_POINT_GROUP",
    "ArtifactError",
    "Backend",
    "BackendUnavailable",
    "CpuTargets",
    "EagerBackend",
    "Module",
    "ModuleBackend",
    "UnknownBackend",
    "get",
    "names",
    "register",
]
