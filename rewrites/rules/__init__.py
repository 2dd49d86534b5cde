"""The rule packs, one module per family of known failures.

`DEFAULT` is the backend-neutral set `rewrites.apply` uses when given no
rules; backends add their own packs on top of it.
"""

from rewrites.rules import (
    composites,
    constants,
    control_flow,
    inplace,
    masks,
    pooling,
    symbolic,
    ttnn,
    view_or_copy,
    vmap,
    wrappers,
)
from rewrites.ruleset import RuleSet

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
}

DEFAULT = RuleSet([rule for pack in PACKS.values() for rule in pack], name="default")

#: backend lowering packs, listed in PACKS but not in DEFAULT (they decide what runs where)
PACKS["ttnn"] = ttnn.RULES

__all__ = ["DEFAULT", "PACKS"]
