"""Record the ttnn calls the backend makes, for the check against the real package (tools/ttnn_check).

`Recorder(module)` stands in for a ttnn module (the test double): every
function called through it is recorded (path, arguments described by kind,
the result's shape, the double's signature) and then run on the module;
constants read from it (`ttnn.TILE_LAYOUT`, ...) are recorded as attributes.
`record.json()` is what `tools/ttnn_check/check_calls.py` reads.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import torch

from tests.backends.ttnn import reference_ttnn as double

_CONSTANT_TYPES = (double.DataType, double.Layout, double.MemoryConfig, int, float, str, bool)


def describe(value: Any) -> dict:
    """A JSON description of a value passed to ttnn, by kind (what the real signature's types are matched with)."""
    if value is None:
        return {"kind": "none"}
    if isinstance(value, double.Tensor):
        return {
            "kind": "tensor",
            "shape": [int(s) for s in value.shape],
            "dtype": value.dtype.name,
            "layout": value.layout.name,
            "on_device": value.device() is not None,
        }
    if isinstance(value, torch.Tensor):
        return {"kind": "torch_tensor", "shape": list(value.shape), "dtype": str(value.dtype)}
    if isinstance(value, torch.dtype):
        return {"kind": "torch_dtype", "name": str(value)}
    if isinstance(value, double.DataType):
        return {"kind": "dtype", "name": value.name}
    if isinstance(value, double.Layout):
        return {"kind": "layout", "name": value.name}
    if isinstance(value, double.MemoryConfig):
        return {"kind": "memory_config", "name": value.buffer_type}
    if isinstance(value, double.MeshDevice):
        return {"kind": "device"}
    if isinstance(value, bool):
        return {"kind": "bool", "value": value}
    if isinstance(value, int):
        return {"kind": "int", "value": value}
    if isinstance(value, float):
        return {"kind": "float", "value": value}
    if isinstance(value, str):
        return {"kind": "str", "value": value}
    if isinstance(value, (list, tuple)):
        return {"kind": "list" if isinstance(value, list) else "tuple", "items": [describe(v) for v in value]}
    raise TypeError(f"the recorder cannot describe a {type(value).__name__} passed to ttnn")


def _signature(fn: Any) -> list[dict] | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return [
        {"name": p.name, "kind": p.kind.name.lower()}
        for p in params
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]


class Record:
    """What a Recorder saw: distinct calls and attributes."""

    def __init__(self) -> None:
        self.calls: dict[str, dict] = {}
        self.attributes: set[str] = set()
        self.site = "?"

    def add(self, path: str, fn: Any, args: tuple, kwargs: dict, result: Any) -> None:
        call = {
            "path": path,
            "site": self.site,
            "args": [describe(a) for a in args],
            "kwargs": {k: describe(v) for k, v in kwargs.items()},
            "result": describe(result) if isinstance(result, double.Tensor) else None,
            "double_signature": _signature(fn),
        }
        key = json.dumps({k: call[k] for k in ("path", "args", "kwargs")}, sort_keys=True)
        self.calls.setdefault(key, call)

    def json(self) -> str:
        tensor_attributes = sorted(
            name for name in dir(double.Tensor) if not name.startswith("_") and name not in ("shape",)
        )
        return json.dumps(
            {
                "calls": list(self.calls.values()),
                "attributes": sorted(self.attributes),
                "tensor_attributes": ["shape", *tensor_attributes],
            },
            indent=1,
        )


class Recorder:
    """A ttnn module that records what is called on it, then runs it on `module`."""

    def __init__(self, module: Any, record: Record | None = None, path: str = "ttnn") -> None:
        self._module, self._record, self._path = module, record or Record(), path

    @property
    def record(self) -> Record:
        return self._record

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        path = f"{self._path}.{name}"
        if isinstance(value, _CONSTANT_TYPES):
            self._record.attributes.add(path)
            return value
        if callable(value) and not isinstance(value, type):

            def call(*args: Any, **kwargs: Any) -> Any:
                result = value(*args, **kwargs)
                self._record.add(path, value, args, kwargs, result)
                return result

            return call
        return Recorder(value, self._record, path)
