"""What the IREE backend's legalize phase costs in `apply` time.

For a few zoo models (tests/zoo; exported as in the zoo tests) and a graph
the legalize rule rewrites (nn.Unfold, xlogy, nll_loss), `apply` runs with the
IREE backend's rules without the legalize phase (DEFAULT + the IREE pack) and
with it (`backends.get("iree").rules`), in turn, `--repeat` times each; the
best time of each and their ratio are printed, with the machine's load.

    python benchmarks/legalize_cost.py [--models bert,gpt2_sdpa,resnet] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.zoo from a checkout

import torch
import torch.nn.functional as F

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites.backends.iree import IREE_RULES
from fx_rewrites.rules import DEFAULT
from fx_rewrites.ruleset import Phases


class Legalized(torch.nn.Module):
    """Ops only the legalize phase makes compile (aten.im2col, xlogy, nll_loss_nd, multiply)."""

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
        patches = F.unfold(x, 2)
        logits = torch.multiply(patches.mean(1), 2.0)
        return torch.xlogy(x, x.abs() + 1), F.nll_loss(F.log_softmax(logits, -1), target)


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert,gpt2_sdpa,llama,resnet,wav2vec2")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    from tests.zoo import registry

    without = Phases(DEFAULT | IREE_RULES, name="without legalize")
    with_phase = backends.get("iree").rules
    programs = {}
    for entry in registry.MODELS:
        if entry.name in args.models.split(","):
            a, k = entry.inputs(registry.SEEDS[0])
            programs[entry.name] = torch.export.export(entry.model(), a, k or None)
    programs["unfold+xlogy+nll_loss"] = torch.export.export(
        Legalized(), (torch.randn(2, 3, 6, 6), torch.tensor([1, 3]))
    )
    print(f"load average {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} cores; best of {args.repeat}")
    print("| graph | call nodes | apply without legalize, s | with, s | ratio | legalize rewrites |")
    print("|---|---|---|---|---|---|")
    for name, program in programs.items():
        calls = sum(n.op == "call_function" for n in program.graph.nodes)
        t0 = _best(lambda p=program: fx_rewrites.apply(p, without), args.repeat)
        t1 = _best(lambda p=program: fx_rewrites.apply(p, with_phase), args.repeat)
        fired = fx_rewrites.apply(program, with_phase).report.rewrites.get("legalize_for_iree", 0)
        print(f"| {name} | {calls} | {t0:.3f} | {t1:.3f} | {t1 / t0:.2f} | {fired} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
