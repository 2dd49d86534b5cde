"""The rule packs, one module per family of known failures.

`DEFAULT` is the backend-neutral set `fx_rewrites.apply` uses when given no
rules; backends add their own packs on top of it. A backend's own rules live
in its folder (`backends/iree/rules/`, `backends/ttnn/rules/`) and are imported
by it, never here.
"""

from fx_rewrites.rules import (
    composites,
    constants,
    control_flow,
    inplace,
    masks,
    pooling,
    quantized,
    symbolic,
    view_or_copy,
    vmap,
    wrappers,
)
from fx_rewrites.ruleset import RuleSet

PACKS: dict[str, RuleSet] = {
    "pooling": pooling.RULES,
    "constants": constants.RULES,
    "composites": composites.RULES,
    "wrappers": wrappers.RULES,
    "vmap": vmap.RULES,
    "control_flow": control_flow.RULES,
    "view_or_copy": view_or_copy.RULES,
    "inplace": inplace.RULES,
    "symbolic": symbolic.RULES,
    "masks": masks.RULES,
    "quantized": quantized.RULES,
}

DEFAULT = RuleSet([rule for pack in PACKS.values() for rule in pack], name="default")

__all__ = ["DEFAULT", "PACKS"]
