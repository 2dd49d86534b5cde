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

import torch
from torch._ops import OpOverload

from fx_rewrites.kinds import Decompose
from fx_rewrites.ruleset import RuleSet

#: torchao's ops (namespace `torchao`) that carry the quantization steps of an exported model, with a
#: reference implementation as their CompositeImplicitAutograd kernel
TORCHAO_OPS: tuple[str, ...] = ("choose_qparams_affine", "quantize_affine", "dequantize_affine")


def torchao_ops() -> tuple[OpOverload, ...]:
    """The ops of `TORCHAO_OPS` torchao has registered so far (none before `import torchao`)."""
    found = []
    namespace = torch.ops.torchao
    for name in TORCHAO_OPS:
        try:
            found.append(getattr(namespace, name).default)
        except (AttributeError, RuntimeError):
            continue
    return tuple(found)


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


#: the torchao configs whose exported ops the rules lower (torchao 0.18)
SUPPORTED_CONFIGS = (
    "Int8WeightOnlyConfig",
    "Int8DynamicActivationInt8WeightConfig",
    "IntxWeightOnlyConfig (int1-int8, per group or per channel)",
    "Int8DynamicActivationIntxWeightConfig",
)


def unsupported_hint(op: str) -> str | None:
    """What to say about a torchao op that reached a backend unlowered (`op` as `torchao.name`), else None."""
    if not op.startswith("torchao."):
        return None
    name = op.split(".")[1]
    covered = name in TORCHAO_OPS
    return (
        f"`{op}` is torchao's; "
        + (
            "fx-rewrites lowers it by torchao's reference implementation (rule lower_torchao_quantization_ops), "
            "which declined this call: `fx_rewrites.explain(program, rule='lower_torchao_quantization_ops')` "
            "says why"
            if covered
            else "no rule lowers it: the torchao config that produced it is not covered"
        )
        + f". Covered: the configs {', '.join(SUPPORTED_CONFIGS)}, whose graphs hold torchao."
        + ", torchao.".join(TORCHAO_OPS)
        + "; quantize with one of them, or add a rule for this op"
    )
