"""The known-failure gallery: one small module per failure family.

Each example builds `(module, example_args)` with seeded random weights;
`fx-rewrites demo` exports it, tries the backend as is, applies the rules,
compiles, runs and compares with eager.
"""

from __future__ import annotations

from fx_rewrites.app.gallery import composites, constants, control_flow, inplace, masks, pooling, symbolic, wrappers
from fx_rewrites.app.gallery.example import Example, Factory


def gallery() -> list[Example]:
    """Every example, in a stable order."""
    modules = (pooling, constants, composites, wrappers, control_flow, inplace, symbolic, masks)
    return [example for module in modules for example in module.EXAMPLES]


__all__ = ["Example", "Factory", "gallery"]
