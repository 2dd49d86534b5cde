"""How many calls each rewriter needs to reach the fixpoint on relu^N chains.

One rule, relu(relu(x)) -> relu(x), on a real export of a chain of N relus.
fx-rewrites' worklist reaches the fixpoint in one `apply`; a single sweep of
`torch.fx.subgraph_rewriter.replace_pattern` or of Inductor's
`PatternMatcherPass` rewrites non-overlapping matches only, so they are
called until a call changes nothing (that last call counts: it is how a
caller learns the fixpoint is reached). Call counts are deterministic;
times are printed for information (same graph, same process).

    python benchmarks/fixpoint_calls.py [N ...]
"""

from __future__ import annotations

import sys
import time

import torch
from torch.fx import subgraph_rewriter

import fx_rewrites
from fx_rewrites import Pattern

aten = torch.ops.aten


def relu_relu(x):
    return aten.relu.default(aten.relu.default(x))


def relu(x):
    return aten.relu.default(x)


class Chain(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = torch.relu(x)
        return x


def _relus(gm: torch.fx.GraphModule) -> int:
    return sum(n.target is aten.relu.default for n in gm.graph.nodes)


def ours(ep: torch.export.ExportedProgram) -> tuple[int, int, float]:
    start = time.perf_counter()
    result = fx_rewrites.apply(ep, [Pattern(name="collapse_relu", pattern=relu_relu, replacement=relu)])
    return 1, _relus(result.graph_module), time.perf_counter() - start


def subgraph_rewriter_calls(ep: torch.export.ExportedProgram) -> tuple[int, int, float]:
    gm = ep.module()  # an unlifted copy to edit
    start, calls = time.perf_counter(), 0
    while True:
        calls += 1
        if not subgraph_rewriter.replace_pattern(gm, relu_relu, relu):
            break
    return calls, _relus(gm), time.perf_counter() - start


def inductor_calls(ep: torch.export.ExportedProgram) -> tuple[int, int, float]:
    from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

    patterns = PatternMatcherPass()
    example = [torch.empty(4)]
    register_replacement(relu_relu, relu, example, fwd_only, patterns)
    gm = ep.module()
    start, calls = time.perf_counter(), 0
    while True:
        calls += 1
        if not patterns.apply(gm.graph):
            break
    gm.graph.eliminate_dead_code()
    return calls, _relus(gm), time.perf_counter() - start


def main(sizes: list[int]) -> None:
    print(f"{'N':>5} | {'rewriter':<24} | {'calls to fixpoint':>17} | {'relus left':>10} | {'seconds':>8}")
    for n in sizes:
        ep = torch.export.export(Chain(n), (torch.randn(4),))
        for name, fn in (("fx-rewrites apply", ours), ("subgraph_rewriter", subgraph_rewriter_calls),
                         ("Inductor PatternMatcher", inductor_calls)):  # fmt: skip
            calls, left, seconds = fn(ep)
            print(f"{n:>5} | {name:<24} | {calls:>17} | {left:>10} | {seconds:>8.3f}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [16, 64])
