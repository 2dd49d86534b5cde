"""The known-failure gallery: one small module per failure family.

Each example builds `(module, example_args)` with seeded random weights;
`fx-rewrites demo` exports it, tries the backend as is, applies the rules,
compiles, runs and compares with eager.
"""

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


def gallery() -> list[Example]:
    """Every example, in a stable order."""
    from fx_rewrites.app.gallery import composites, constants, control_flow, inplace, masks, pooling, symbolic, wrappers

    modules = (pooling, constants, composites, wrappers, control_flow, inplace, symbolic, masks)
    return [example for module in modules for example in module.EXAMPLES]


__all__ = ["Example", "Factory", "gallery"]
