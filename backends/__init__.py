"""Backends: where rewritten graphs go. `backends.get("eager")`.

A backend is a name, a RuleSet and `compile(program, example_args)`; see
`backends.base.Backend`. Register your own with `backends.register(...)` or
the `fx_rewrites.backends` entry point group.
"""

from fx_rewrites.backends.base import (
    ENTRY_POINT_GROUP,
    Backend,
    BackendUnavailable,
    UnknownBackend,
    get,
    names,
    register,
)
from fx_rewrites.backends.eager import EagerBackend
from fx_rewrites.backends.iree import BACKEND_TARGETS, TARGETS, IreeBackend

register(EagerBackend())
for _name, _target in BACKEND_TARGETS.items():  # iree (llvm-cpu), iree-cuda, iree-rocm, iree-vulkan
    register(IreeBackend(name=_name, target=TARGETS[_target]))


def _ttnn_backend() -> Backend:
    from fx_rewrites.backends.ttnn import TtnnBackend  # defines the ttnn stand-in ops on first use

    return TtnnBackend()


register(_ttnn_backend, name="ttnn")

__all__ = [
    "ENTRY_POINT_GROUP",
    "Backend",
    "BackendUnavailable",
    "EagerBackend",
    "UnknownBackend",
    "get",
    "names",
    "register",
]
