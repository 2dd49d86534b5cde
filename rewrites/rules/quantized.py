"""torchao's quantization ops, lowered by torchao's own reference implementation.

A model quantized with torchao exports its quantize/dequantize steps as custom ops
(`torchao::choose_qparams_affine`, `quantize_affine`, `dequantize_affine`: W8A8's dynamic activations,
`IntxWeightOnlyConfig`'s grouped int4/int8 weights). No backend knows them (IREE 3.13: "failed to legalize
operation 'torch.operator'"); torchao registers each with a CompositeImplicitAutograd kernel, its reference
implementation in `torchao/quantization/quant_primitives.py`, which `Decompose` traces into plain ATen
(amin/amax, div, round, clamp, casts), exactly what torchao's eager model computes.

The ops exist only once torchao is imported, so the rule finds them when the rules run (like the MoE op of
`backends/iree/rules/moe.py`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

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

RULES = RuleSet([lower_torchao_quantization_ops], name="quantized")
