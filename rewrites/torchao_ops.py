"""torchao's quantization ops as exported programs hold them: which exist, and what to say about the others."""

from __future__ import annotations

import torch
from torch._ops import OpOverload

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
