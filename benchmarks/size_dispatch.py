"""A torch.cond on the input sizes: the dispatched call against each branch compiled alone and cond_to_where.

    python benchmarks/size_dispatch.py [--rounds 15] [--cases matmul,elementwise]

Two conds: `matmul` (a 256-wide matmul + relu up to 16 tokens, 8 tanh layers past it; x: 4 x n x 256, n = 8
and 48) and `elementwise` (sin up to 512 columns, 24 x (tanh(x * 1.01 + 0.1) + cos(x)) past it, both
element-wise; x: 64 x n, n = 64 and 640). One thread each (torch.set_num_threads(1), IREE local-sync), CPU
time (time.process_time), interleaved rounds (the order rotated each round) of 200 calls on the short side
and 20 on the long one, each sample after one untimed call. Prints what `fx_rewrites.compile` made of each cond
(dispatch or select, with `app/branch_cost.py`'s estimate), the median per call of each function on each side,
the median over rounds of the dispatched call's time over its branch alone's (same round), and the two figures
`branch_cost.DISPATCH_COST` is made of: the dispatch's own cost per call (dispatched - branch alone, us) and
the time of one element operation of the long element-wise branch (ns).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites.app.branch_cost import branch_cost, dispatch_cost
from fx_rewrites.app.dispatch import SizeDispatch
from fx_rewrites.backends.iree import IreeBackend
from fx_rewrites.backends.iree.cache import CompileCache


class Dispatched(torch.nn.Module):
    """`matmul`: a short matmul path up to 16 tokens, 8 tanh layers past it."""

    threshold = 16

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(256, 256, generator=g) / 16)

    def short(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w)

    def long(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(8):
            y = torch.tanh(y @ self.w) + y
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.shape[1] <= self.threshold, self.short, self.long, (x,))


class ElementwiseDispatched(Dispatched):
    """`elementwise`: both branches element-wise, one of 1 op, one of 120 (issue 36's case)."""

    threshold = 512

    def short(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x)

    def long(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(24):
            y = torch.tanh(y * 1.01 + 0.1) + torch.cos(y)
        return y


class Branch(torch.nn.Module):
    def __init__(self, model: Dispatched, side: str) -> None:
        super().__init__()
        self.model, self.side = model, side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.model, self.side)(x)


#: case -> (model, the example input's shape with n for the Dim, the Dim's range, n on the short and long side)
CASES = {
    "matmul": (Dispatched, (4, "n", 256), (2, 64), (8, 48)),
    "elementwise": (ElementwiseDispatched, (64, "n"), (2, 1024), (64, 640)),
}


#: calls a sample per side (samples of ~5 ms: the short side's 20 calls were ~0.6 ms, within the noise of a
#: loaded machine)
CALLS = {"short": 200, "long": 20}


def _cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    lines = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = [f for f in lines.get("Flags", "").split() if f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")]
    return f"{lines.get('Model name', '?').strip()} ({', '.join(flags)})"


def _shape(template: tuple, n: int) -> tuple[int, ...]:
    return tuple(n if d == "n" else d for d in template)


def run_case(case: str, rounds: int, iree: IreeBackend) -> None:
    cls, template, (low, high), sides = CASES[case]
    model = cls().eval()
    dim = template.index("n")
    seq = ({dim: Dim("n", min=low, max=high)},)
    x = torch.randn(_shape(template, sides[0]))
    funcs = {
        "dispatched": fx_rewrites.compile(model, (x,), dynamic_shapes=seq, backend=iree),
        "short alone": fx_rewrites.compile(Branch(model, "short"), (x,), dynamic_shapes=seq, backend=iree),
        "long alone": fx_rewrites.compile(Branch(model, "long"), (x,), dynamic_shapes=seq, backend=iree),
    }
    program = torch.export.export(model, (x,), dynamic_shapes=seq)
    (node,) = [n for n in program.graph.nodes if n.target is torch.ops.higher_order.cond]
    made = "a size dispatch" if isinstance(funcs["dispatched"].runtime, SizeDispatch) else "one program (select)"
    print(f"{case}: compiled as {made}; at the example sizes {dispatch_cost(node)}")
    where = fx_rewrites.apply(program, iree.rules).program  # what cond_to_where compiles: both sides, selected
    funcs["cond_to_where"] = iree.compile(where, (x,))
    medians = {}
    for n, side in zip(sides, ("short", "long")):
        xs = torch.randn(_shape(template, n))
        names = [name for name in funcs if name != ("long alone" if side == "short" else "short alone")]
        times: dict[str, list[float]] = {name: [] for name in names}
        calls = CALLS[side]
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # each in every place of the order
                fn = funcs[name]
                fn(xs)  # untimed: the cost of coming back to this module after another is not the call's
                start = time.process_time()
                for _ in range(calls):
                    fn(xs)
                times[name].append((time.process_time() - start) / calls * 1e3)
        medians[side] = {name: statistics.median(t) for name, t in times.items() if t}
        cells = ", ".join(f"{name} {m:.3f}" for name, m in medians[side].items())
        ratio = statistics.median(a / b for a, b in zip(times["dispatched"], times[f"{side} alone"]))
        print(f"{case}, n = {n} ({side} side): {cells}; dispatched / {side} alone {ratio:.2f}x (median of rounds)")
    overhead_us = (medians["short"]["dispatched"] - medians["short"]["short alone"]) * 1e3
    print(f"{case}: the dispatch's own cost (dispatched - short alone, short side) {overhead_us:.1f} us")
    if case == "elementwise":  # one element op of the long branch, from the two branches alone at n = 64
        branches = [branch_cost(b) for b in node.args[1:3]]
        alone = (funcs["long alone"], funcs["short alone"])
        xs = torch.randn(_shape(template, sides[0]))
        spans: list[list[float]] = [[], []]
        for _ in range(rounds):
            for span, fn in zip(spans, alone):
                start = time.process_time()
                for _ in range(20):
                    fn(xs)
                span.append((time.process_time() - start) / 20)
        per_op = (statistics.median(spans[0]) - statistics.median(spans[1])) / (branches[1] - branches[0]) * 1e9
        print(f"{case}: one element op {per_op:.3f} ns (long alone - short alone, over their element ops)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    iree = IreeBackend(driver="local-sync", cache=CompileCache())
    print(f"CPU: {_cpu()}; one thread each, CPU time, {ns.rounds} interleaved rounds, median ms per call")
    for case in ns.cases.split(","):
        run_case(case, ns.rounds, iree)


if __name__ == "__main__":
    main()
