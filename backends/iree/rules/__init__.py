"""IREE's rules (IREE 3.13), and the phases an IREE backend applies them in.

    phases(target)   # Phases(DEFAULT | OWN, LEGALIZE, the target's performance rules)

- first phase, with DEFAULT: `ops` (what the importer or compiler cannot take, with `attention`,
  `lowerings`, `scatters`, `moe`, `counting_sort`, `topk`, `conv`, `unbatched`), and `quantized_matmul`
  (quantized weights read in blocks, `weight_layout`);
- `legalize`: legality-driven decomposition (`fx_rewrites.kinds.legalize` over the measured
  `backends/iree/legality.py`) and the guards against IREE's silent wrong results (`guards`,
  `compare_guards`, `activations`, `index_guards`, `views`, `live_scatters`, `steps`, `pooling`);
- `performance`: per compile target and, for llvm-cpu, per vector ISA, chosen by measurement
  (`performance.for_target`, the names in `targets.CPU_ISAS`).

Rule names keep their `_for_iree` suffix: they are what `explain --rule` and reports name.
"""

from __future__ import annotations

from fx_rewrites.backends.iree.rules import (
    a8int4_decode,
    int4_decode,
    legalize,
    moe_packed,
    ops,
    performance,
    quantized_conv,
    quantized_matmul,
)
from fx_rewrites.rules import DEFAULT
from fx_rewrites.ruleset import Phases, RuleSet

#: IREE's own first-phase rules, unioned with DEFAULT
OWN: RuleSet = ops.RULES | quantized_matmul.RULES | quantized_conv.RULES
#: first-phase rules on per vector ISA (`targets.CpuIsa.first_rules`), before OWN's rules of the same roots
FIRST_BY_ISA: RuleSet = a8int4_decode.RULES | int4_decode.RULES | moe_packed.RULES
#: the second phase: decompose what IREE cannot lower, guard what it computes wrong
LEGALIZE: RuleSet = legalize.LEGALIZE


def phases(target: str = "llvm-cpu", isa: str | None = None) -> Phases:
    """What an IREE backend for compile target `target` ("llvm-cpu", "cuda", ...) applies: DEFAULT and
    `OWN`, `LEGALIZE`, then the target's performance phase where it has rules (llvm-cpu's for vector ISA
    `isa`, "avx512" or "avx2"; None: this host's, `targets.host_isa()`)."""
    if isa is None:
        from fx_rewrites.backends.iree.targets import host_isa

        isa = host_isa()
    perf = performance.for_target(target, isa)
    own = [perf] if len(perf) else []
    name = "iree" if target == "llvm-cpu" else f"iree-{target}"
    first = _first_for(target, isa)
    return Phases(DEFAULT | OWN | first if len(first) else DEFAULT | OWN, LEGALIZE, *own, name=name)


def _first_for(target: str, isa: str) -> RuleSet:
    """The first-phase rules on for llvm-cpu's vector ISA `isa` (`targets.CpuIsa.first_rules`)."""
    from fx_rewrites.backends.iree.targets import CPU_ISAS

    names = CPU_ISAS[isa].first_rules if target == "llvm-cpu" and isa in CPU_ISAS else ()
    return RuleSet([FIRST_BY_ISA[name] for name in names], name="iree-isa-first")


__all__ = ["FIRST_BY_ISA", "LEGALIZE", "OWN", "phases"]
