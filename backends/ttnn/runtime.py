"""Which `ttnn` runs the device regions, and its device.

`ttnn_module()` is the module injected with `use(module)` (tests inject
their test double), else the installed `ttnn`. Without either it raises
`TtnnUnavailable`, which says what to install. `device()` opens device 0 once
per module.
"""

from __future__ import annotations

import importlib
from typing import Any

from fx_rewrites.backends.base import BackendUnavailable

INSTALL_HINT = (
    "ttnn (Tenstorrent TT-NN) is not installed. Its wheels exist for Python 3.10 on Linux x86_64 only and it "
    "needs a Tenstorrent device (Wormhole or Blackhole) with its driver: on such a machine, "
    "`pip install ttnn` (or build tt-metal, see docs.tenstorrent.com). Lowering, partitioning and "
    "`fx-rewrites check MODEL --backend ttnn` (the coverage report) work without it."
)


class TtnnUnavailable(BackendUnavailable):
    """ttnn cannot be imported, or its device cannot be opened."""


#: bytes of L1_SMALL per core. ttnn's default is 0, and then conv2d and pooling fail with an `L1_SMALL`
#: out-of-memory error (ttnn.open_device's docstring; its conv and pool tests use 16384 or 32768)
L1_SMALL_SIZE = 32768
#: the module `ttnn_module()` imports when none is injected
MODULE_NAME = "ttnn"
_injected: Any = None
_devices: dict[int, Any] = {}


def use(module: Any) -> Any:
    """Run device regions on `module` (the test double, or None for the installed ttnn).
    Returns the module used before, to restore it."""
    global _injected
    previous, _injected = _injected, module
    return previous


def ttnn_module() -> Any:
    """The ttnn in use: injected by `use()`, else `import ttnn`."""
    if _injected is not None:
        return _injected
    try:
        return importlib.import_module(MODULE_NAME)
    except ImportError as e:
        raise TtnnUnavailable(f"{INSTALL_HINT} (import ttnn: {e})") from None


def device(ttnn: Any) -> Any:
    """Device 0 of `ttnn`, opened on first use and kept open."""
    key = id(ttnn)
    if key not in _devices:
        try:
            _devices[key] = ttnn.open_device(device_id=0, l1_small_size=L1_SMALL_SIZE)
        except Exception as e:
            raise TtnnUnavailable(
                f"ttnn is installed but device 0 cannot be opened ({type(e).__name__}: {e}). "
                "Check that a Tenstorrent card is present and its driver loaded (tt-smi lists it)."
            ) from e
    return _devices[key]


def forget_devices() -> None:
    """Drop the opened devices (tests that change how a device is opened)."""
    _devices.clear()
