"""torchao's quantization ops, and PT2E's `quantized_decomposed` ops, lowered by their own reference implementations.

A model quantized with torchao exports its quantize/dequantize steps as custom ops
(`torchao::choose_qparams_affine`, `quantize_affine`, `dequantize_affine`: W8A8's dynamic activations,
`IntxWeightOnlyConfig`'s grouped int4/int8 weights). No backend knows them (IREE 3.13: "failed to legalize
operation 'torch.operator'"); torchao registers each with a CompositeImplicitAutograd kernel, its reference
implementation in `torchao/quantization/quant_primitives.py`, which `Decompose` traces into plain ATen
(amin/amax, div, round, clamp, casts), exactly what torchao's eager model computes.

The ops exist only once torchao is imported, so the rule finds them when the rules run (like the MoE op of
`backends/iree/rules/moe.py`).

A model quantized by PT2E (`prepare_pt2e` / `convert_pt2e`) exports `quantized_decomposed.quantize_per_tensor`,
`dequantize_per_tensor` and their per-channel forms, which torch defines in Python
(`torch/ao/quantization/fx/_decomposed.py`, a CompositeExplicitAutograd kernel: `round(x * (1 / scale)) + zp`,
clamped). IREE 3.13 lowers them itself, differently: `round(x / scale)`, which disagrees with torch on about 3
values in a million (4.09 with scale 0.02: 205 against torch's 204), and a scale that is not a float32 value
(0.02) fails to compile ("failed to legalize operation 'arith.truncf'", a float64 -> float32 on the host).
`lower_quantized_decomposed_ops` inlines torch's kernels, so every backend computes what torch computes.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.ao.quantization.fx._decomposed as pt2e_reference  # defines the quantized_decomposed ops

from fx_rewrites.kinds import Decompose
from fx_rewrites.ruleset import RuleSet
from fx_rewrites.torchao_ops import TORCHAO_OPS, torchao_ops


def _not_registered() -> None:
    """The root of the rule while torchao has not registered its ops: no node calls it."""


class _OnTorchaoOps:
    """`Decompose` over torchao's quantization ops, built once they exist (the engine reads `roots` each
    time it runs its rules and re-indexes when they changed); before that, a rule nothing meets."""

    name = "lower_torchao_quantization_ops"
    priority = 0
    tags = frozenset({"quantized"})
    doc = (
        "torchao's quantization ops (`torchao.choose_qparams_affine`, `quantize_affine`, "
        "`dequantize_affine`: int8 dynamic activations, grouped int4/int8 weights) become torchao's own "
        "reference implementation in ATen. IREE 3.13: \"failed to legalize operation 'torch.operator'\" "
        "(torchao.choose_qparams_affine)."
    )

    def _rule(self) -> Decompose | None:
        ops = torchao_ops()
        return Decompose(ops=ops, name=self.name, tags=set(self.tags), doc=self.doc) if ops else None

    @property
    def roots(self) -> tuple[Hashable, ...]:
        ops = torchao_ops()
        return ops if ops else (_not_registered,)

    def match(self, node: Any) -> Any:
        rule = self._rule()
        return None if rule is None else rule.match(node)

    def rewrite(self, node: Any, match: Any, rw: Any) -> Any:
        rule = self._rule()
        assert rule is not None  # matched, so the ops exist
        return rule.rewrite(node, match, rw)

    def __repr__(self) -> str:
        return f"Decompose(name={self.name!r}, ops=torchao.{{{', '.join(TORCHAO_OPS)}}})"


lower_torchao_quantization_ops = _OnTorchaoOps()

_quantized_decomposed = torch.ops.quantized_decomposed
#: PT2E's quantize / dequantize ops -> torch's Python implementation of each (what torch runs for them)
PT2E_REFERENCE = {
    _quantized_decomposed.quantize_per_tensor.default: pt2e_reference.quantize_per_tensor,
    _quantized_decomposed.dequantize_per_tensor.default: pt2e_reference.dequantize_per_tensor,
    _quantized_decomposed.quantize_per_channel.default: pt2e_reference.quantize_per_channel,
    _quantized_decomposed.dequantize_per_channel.default: pt2e_reference.dequantize_per_channel,
}

lower_quantized_decomposed_ops = Decompose(
    ops=tuple(PT2E_REFERENCE),
    table=PT2E_REFERENCE,
    name="lower_quantized_decomposed_ops",
    tags={"quantized"},
    doc=(
        "PT2E's `quantized_decomposed` quantize / dequantize ops (per tensor, per channel) become torch's own "
        "implementation in ATen (`round(x * (1 / scale)) + zero_point`, clamped). IREE 3.13 lowers them as "
        "`round(x / scale)`, 3 values in a million one step off torch's, and fails on a scale that is not a "
        "float32 value: \"failed to legalize operation 'arith.truncf'\"."
    ),
)

RULES = RuleSet([lower_torchao_quantization_ops, lower_quantized_decomposed_ops], name="quantized")
