"""IREE's own pack: ops its importer or compiler cannot take (IREE 3.13).

Not part of DEFAULT: other backends may lower these ops themselves.
"""

from __future__ import annotations

import torch

from rewrites.kinds import Decompose
from rewrites.ruleset import RuleSet

aten = torch.ops.aten

decompose_for_iree = Decompose(
    name="decompose_for_iree",
    ops=(aten.diff.default, aten._weight_norm.default, aten._weight_norm_interface.default),
    tags={"iree"},
    doc=(
        "aten.diff (GPT-2 / Llama mask code) and aten._weight_norm (wav2vec2, weight_norm "
        'parametrizations) decomposed into ops IREE lowers. IREE: "failed to legalize operation '
        '\'torch.operator\' that was explicitly marked illegal: ... torch.aten.diff" / "torch.aten._weight_norm".'
    ),
)

RULES = RuleSet([decompose_for_iree], name="iree")
