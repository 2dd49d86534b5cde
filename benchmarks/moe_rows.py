"""The decode form of MoE experts alone: one row times its expert's weight, the sum along K or along N (issue 34).

    python benchmarks/moe_rows.py                        # benchmarks/moe_sort.py's gate_up: 64 experts, 512 x 512
    python benchmarks/moe_rows.py --experts 128 --n 1536 --k 2048   # Qwen3-30B-A3B's gate_up

A module holding transformers' [E, N, K] expert weight, passed transposed ([E, K, N]) as `_grouped_linear`
does, and 8 rows (top 8 of one token), each multiplied by the weight of an expert read at run time
(`item`), as `grouped_mm_per_row_for_iree` writes it: `K-outer`, the sum over dimension 0 of the [K, N] slice
(the rule before); `K-inner`, the sum over the last dimension of the [N, K] slice the weight is stored as (the
rule now). Each form exported, rewritten by the IREE rules, compiled for local-sync; eager: `w[e] @ x[r]` per
row. One thread, CPU time (time.process_time) per call, median of `--rounds`; the forms' outputs compared.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = 8


class Rows(torch.nn.Module):
    def __init__(self, experts: int, n: int, k: int, form: str) -> None:
        super().__init__()
        self.form = form
        self.weight = torch.nn.Parameter(torch.randn(experts, n, k, generator=torch.Generator().manual_seed(0)) * 0.05)

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        kn = self.weight.transpose(1, 2)
        out = []
        for r in range(ROWS):
            e = expert[r].item()
            torch._check(e >= 0)
            torch._check(e < self.weight.shape[0])
            if self.form == "K-outer":
                out.append((kn[e] * x[r][:, None]).sum(0))
            else:
                out.append((kn.transpose(1, 2)[e] * x[r][None, :]).sum(1))
        return torch.stack(out)


def _median_ms(call, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.process_time()
        call()
        times.append(time.process_time() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    import fx_rewrites
    from fx_rewrites.backends.iree import IreeBackend

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x, expert = torch.randn(ROWS, args.k, generator=g), torch.randint(0, args.experts, (ROWS,), generator=g)
    backend = IreeBackend(driver="local-sync")
    pairs = list(enumerate(expert.tolist()))
    outputs = {}
    for form in ("K-outer", "K-inner"):
        module = Rows(args.experts, args.n, args.k, form).eval()
        program = fx_rewrites.apply(torch.export.export(module, (x, expert)), backend.rules).program
        compiled = backend.compile(program, (x, expert))
        outputs[form] = compiled(x, expert)
        iree_ms = _median_ms(lambda c=compiled: c(x, expert), args.rounds)
        with torch.no_grad():
            eager_ms = _median_ms(lambda w=module.weight: [w[e] @ x[r] for r, e in pairs], args.rounds)
        print(f"{form}: IREE {iree_ms:.3f} ms, eager {eager_ms:.3f} ms (8 rows, {args.n} x {args.k})", flush=True)
    print(f"max difference between the forms: {(outputs['K-outer'] - outputs['K-inner']).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
