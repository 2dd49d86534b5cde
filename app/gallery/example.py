"""What a gallery example is: a named factory of `(module, example_args)` and its failure family."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

Factory = Callable[[], tuple[torch.nn.Module, tuple[Any, ...]]]


@attrs.frozen
class Example:
    name: str
    family: str
    make: Factory = attrs.field(repr=False)
    summary: str = ""
    #: `dynamic_shapes` for torch.export.export (None: static)
    dynamic_shapes: Any = None
