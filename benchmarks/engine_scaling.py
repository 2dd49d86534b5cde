"""Engine scaling: fx-rewrites against Inductor, subgraph_rewriter and
run_decompositions, on the same graphs in one run (issue 7).

    python benchmarks/engine_scaling.py                 # everything, ~10 min on 2 cores
    python benchmarks/engine_scaling.py --quick         # small sizes, ~1 min (the CI smoke run)
    python benchmarks/engine_scaling.py --only rule     # one section: rule | pack | decomp | fixpoint

Sections (each prints a Markdown table; --plot writes time vs nodes as PNG):

- rule: one rule relu(add(x, w)) -> relu(sub(x, w)) on `graphs.chain(n)`.
  Ours: `engine.run(graph, [rule])` to the fixpoint (values of new nodes
  computed, every rewrite checked, the graph linted at the end), and
  `fx_rewrites.apply(gm, rule)` (the same on a copy of the graph module, whose
  code is generated when first called). Inductor: one sweep of
  `PatternMatcherPass.apply`, the pattern registered (a) with a hand-written
  graph-editing handler (Inductor's fastest route; it computes no values) and
  (b) with `register_replacement` (the documented route; it traces the
  replacement per match, so only small sizes). subgraph_rewriter: one
  `replace_pattern` call, small sizes only. Every anchor edits the graph in
  place, as ours does with inplace=True.
- pack: DEFAULT on `graphs.replicate(bad-forms block export, n)`, one call
  to the fixpoint; the cost must grow linearly (time(100k) / time(10k) <= 12).
- decomp: DEFAULT via `fx_rewrites.apply` against `ep.run_decompositions()` on
  the same ExportedProgram: the bad-forms export and a deep BERT export.
- fixpoint: calls each rewriter needs on relu^16 (benchmarks/fixpoint_calls.py).

Times are CPU seconds of this process (`time.process_time`; the machine
is shared), best of --repeats runs on fresh copies (rule and pack sections);
ratios compare rewriters measured back to back on the same graph.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import graphs

import fx_rewrites
from fx_rewrites import Pattern, engine

aten = torch.ops.aten
RULE = Pattern(name="relu_add_to_sub", pattern=graphs.relu_of_add, replacement=graphs.relu_of_sub)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """CPU seconds of this process (the machine is shared: wall time would
    count other jobs' turns on the cores) and the result."""
    gc.collect()
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def best_of(repeats: int, make: Callable[[], Any], run: Callable[[Any], Any]) -> tuple[float, Any]:
    """The fastest of `repeats` runs, each on a fresh `make()` (not timed)."""
    best: tuple[float, Any] | None = None
    for _ in range(repeats):
        subject = make()
        seconds, out = timed(lambda subject=subject: (subject, run(subject)))
        if best is None or seconds < best[0]:
            best = (seconds, out)
    assert best is not None
    return best


def count(gm: torch.fx.GraphModule, target: Any) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=target))


# -- the anchors -----------------------------------------------------------------


def inductor_handler_pass() -> Any:
    from torch._inductor.pattern_matcher import CallFunction, KeywordArg, PatternMatcherPass, register_graph_pattern

    patterns = PatternMatcherPass()
    pattern = CallFunction(aten.relu.default, CallFunction(aten.add.Tensor, KeywordArg("x"), KeywordArg("w")))

    @register_graph_pattern(pattern, pass_dict=patterns)
    def _(match: Any, x: Any, w: Any) -> None:
        relu = match.output_node()
        add = relu.args[0]
        with match.graph.inserting_before(add):
            sub = match.graph.call_function(aten.sub.Tensor, (x, w))
        sub.meta["val"] = add.meta["val"]  # same shape: no value computed
        add.replace_all_uses_with(sub)
        match.graph.erase_node(add)

    return patterns


def inductor_replacement_pass() -> Any:
    from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

    patterns = PatternMatcherPass()
    example = [torch.empty(8, 8), torch.empty(8, 8)]
    register_replacement(graphs.relu_of_add, graphs.relu_of_sub, example, fwd_only, patterns)
    return patterns


def subgraph_rewriter(gm: torch.fx.GraphModule) -> Any:
    return torch.fx.subgraph_rewriter.replace_pattern(gm, graphs.relu_of_add, graphs.relu_of_sub)


def rule_section(sizes: list[int], small: list[int], repeats: int) -> list[dict]:
    rows = []
    handler, replacement = inductor_handler_pass(), inductor_replacement_pass()
    for n in sizes:
        row: dict[str, Any] = {"nodes": n}
        make = lambda n=n: graphs.chain(n)  # noqa: E731
        row["ours"], (gm, report) = best_of(repeats, make, lambda gm: engine.run(gm.graph, [RULE]))
        assert report.converged and count(gm, aten.add.Tensor) == 0, report.summary()
        row["rewrites"] = report.total_rewrites
        row["apply"], (gm, result) = best_of(1, make, lambda gm: fx_rewrites.apply(gm, RULE))
        assert count(result.graph_module, aten.add.Tensor) == 0
        row["inductor"], (gm, changed) = best_of(repeats, make, lambda gm: handler.apply(gm.graph))
        assert count(gm, aten.add.Tensor) == 0 and changed == row["rewrites"]
        if n in small:
            row["inductor_replacement"], (gm, _) = best_of(1, make, lambda gm: replacement.apply(gm.graph))
            assert count(gm, aten.add.Tensor) == 0
            row["subgraph_rewriter"], (gm, _) = best_of(1, make, subgraph_rewriter)
            assert count(gm, aten.add.Tensor) == 0
        rows.append(row)
        print_rule_row(row)
    return rows


def print_rule_row(row: dict) -> None:
    def cell(key: str) -> str:
        return f"{row[key]:.2f}" if key in row else "-"

    ratio = row["ours"] / row["inductor"]
    print(
        f"| {row['nodes']:>7,} | {row['rewrites']:>6,} | {cell('ours'):>6} | {cell('apply'):>6} | "
        f"{cell('inductor'):>8} | {ratio:>5.2f} | {cell('inductor_replacement'):>11} | "
        f"{cell('subgraph_rewriter'):>9} |",
        flush=True,
    )


def pack_section(sizes: list[int], repeats: int) -> list[dict]:
    block = graphs.export_bad_forms(1)
    rows = []
    for n in sizes:
        seconds, (gm, result) = best_of(repeats, lambda n=n: graphs.replicate(block, n), fx_rewrites.apply)
        nodes, report = len(gm.graph.nodes), result.report
        assert report.converged, report.summary()
        again = fx_rewrites.apply(result.graph_module).report.total_rewrites
        rows.append({"nodes": nodes, "seconds": seconds, "rewrites": report.total_rewrites, "again": again})
        print(
            f"| {nodes:>7,} | {report.total_rewrites:>8,} | {report.nodes_after:>7,} | {seconds:>7.2f} | "
            f"{seconds / rows[0]['seconds'] * rows[0]['nodes'] / nodes:>10.2f} | {again:>7} |",
            flush=True,
        )
    return rows


def decomp_section(blocks: int, bert_layers: int) -> list[dict]:
    programs: list[tuple[str, Callable[[], Any]]] = [
        (f"bad forms x {blocks}", lambda: graphs.export_bad_forms(blocks)),
        (f"BERT, {bert_layers} layers", lambda: graphs.export_bert(bert_layers)),
    ]
    rows = []
    for name, make in programs:
        export_s, ep = timed(make)
        ours, result = timed(lambda ep=ep: fx_rewrites.apply(ep))
        assert result.report.converged, result.report.summary()
        decomp, _ = timed(lambda ep=ep: ep.run_decompositions())
        rows.append({"program": name, "nodes": len(ep.graph.nodes), "ours": ours, "decomp": decomp})
        print(
            f"| {name:<22} | {len(ep.graph.nodes):>7,} | {export_s:>6.1f} | {ours:>6.2f} | {decomp:>7.2f} | "
            f"{ours / decomp:>6.3f} |",
            flush=True,
        )
    return rows


def plot(rule_rows: list[dict], pack_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [
        ("fx-rewrites engine.run, one rule (to fixpoint)", rule_rows, "ours", "o-"),
        ("Inductor PatternMatcherPass, handler (1 sweep)", rule_rows, "inductor", "s-"),
        ("Inductor register_replacement (1 sweep)", rule_rows, "inductor_replacement", "^-"),
        ("subgraph_rewriter.replace_pattern (1 call)", rule_rows, "subgraph_rewriter", "v-"),
        ("fx-rewrites apply, DEFAULT pack, bad-forms graph", pack_rows, "seconds", "D--"),
    ]
    for label, rows, key, style in series:
        pts = [(r["nodes"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("graph nodes")
    ax.set_ylabel("seconds")
    ax.set_title("Rewriting time vs graph size (same graphs, one run)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot written to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only (about a minute)")
    parser.add_argument("--only", choices=("rule", "pack", "decomp", "fixpoint"), action="append")
    parser.add_argument("--plot", type=Path, default=None, help="write the time-vs-nodes plot here (PNG)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs (rule and pack sections)")
    parser.add_argument("--bert-layers", type=int, default=None, help="BERT depth for the decomp section")
    args = parser.parse_args(argv)
    only = set(args.only or ("rule", "pack", "decomp", "fixpoint"))
    if args.quick:
        rule_sizes, small, pack_sizes, blocks, layers = [1_000, 3_000], [1_000], [1_000, 3_000], 4, 2
    else:
        rule_sizes, small, pack_sizes, blocks, layers = (
            [1_000, 3_000, 10_000, 30_000, 100_000],
            [1_000, 3_000],
            [10_000, 30_000, 100_000],
            60,
            256,
        )
    layers = args.bert_layers or layers
    print(f"torch {torch.__version__}; {sys.platform}; CPU seconds of this process\n")
    rule_rows: list[dict] = []
    pack_rows: list[dict] = []
    if "rule" in only:
        print("## One rule, relu(add(x, w)) -> relu(sub(x, w)), on chains of add -> relu -> mul\n")
        print(
            "| nodes | rewrites | engine.run | fx_rewrites.apply | Inductor (1 sweep) | engine.run / Inductor "
            "| Inductor register_replacement | subgraph_rewriter |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        rule_rows = rule_section(rule_sizes, small, args.repeats)
        print()
    if "pack" in only:
        print("## DEFAULT pack on chained bad-forms blocks (one call to the fixpoint)\n")
        print("| nodes | rewrites | nodes after | seconds | cost per node vs first | 2nd call rewrites |")
        print("|---:|---:|---:|---:|---:|---:|")
        pack_rows = pack_section(pack_sizes, args.repeats)
        if len(pack_rows) > 1:
            first, last = pack_rows[0], pack_rows[-1]
            print(
                f"\ntime({last['nodes']:,}) / time({first['nodes']:,}) = {last['seconds'] / first['seconds']:.1f} "
                f"for {last['nodes'] / first['nodes']:.1f}x the nodes"
            )
        print()
    if "decomp" in only:
        print("## DEFAULT via fx_rewrites.apply vs ep.run_decompositions(), same ExportedProgram\n")
        print("| program | nodes | export s | apply s | run_decompositions s | apply / run_decompositions |")
        print("|---|---:|---:|---:|---:|---:|")
        decomp_section(blocks, layers)
        print()
    if "fixpoint" in only:
        import fixpoint_calls

        print("## Calls to the fixpoint on relu^N chains\n")
        fixpoint_calls.main([16])
    if args.plot and (rule_rows or pack_rows):
        plot(rule_rows, pack_rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
