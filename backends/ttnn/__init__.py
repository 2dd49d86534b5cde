"""The ttnn backend: aten -> ttnn lowering as rules, capability partitioning, coverage.

    backend = backends.get("ttnn")
    fn = backend.compile(fx_rewrites.apply(program, backend.rules).program, args)  # partitions, without ttnn
    fn(*args)                                          # runs device regions on ttnn

Modules: `runtime` (which ttnn, its device; `use(module)` injects one),
`dispatch` (stand-in op -> ttnn call), `backend` (`TtnnBackend`,
`TtnnCompiled`), `coverage` (per op: on device or host, and why).
The lowering rules and the stand-in ops are in `backends/ttnn/rules/`.
"""

from fx_rewrites.backends.ttnn.backend import TtnnBackend, TtnnCompiled, TtnnLoweringError, is_device_node, lower
from fx_rewrites.backends.ttnn.runtime import INSTALL_HINT, TtnnUnavailable, use

__all__ = [
    "INSTALL_HINT",
    "TtnnBackend",
    "TtnnCompiled",
    "TtnnLoweringError",
    "TtnnUnavailable",
    "is_device_node",
    "lower",
    "use",
]
