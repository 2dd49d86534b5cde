"""The zoo (tests/zoo: transformers, torchvision, timm) on IREE: what the rules do and what it costs.

Per model: graph nodes (call_function) before and after the rules, the
rules that fired, what IREE does with the plain export and with the
rewritten one, the largest difference from eager over the zoo's input sets,
export / rules / compile seconds (compile from an empty cache), and the
median run time of the compiled module and of eager torch on this CPU
(called in turn, after 3 warm-up calls each, so that load from other
processes hits both alike).

The torch.compile route (`torch.compile(model, backend=fx_rewrites_iree,
dynamic=False)`, after `torch._dynamo.reset()`): whether it matches eager,
the graphs dynamo made, the seconds of the first call (dynamo trace,
aot_autograd, rules, IREE compile from an empty cache, one run) and the
median run time of the compiled function.

    python benchmarks/zoo.py [--models bert,gpt2_sdpa] [--repeat 20] [--no-as-is] [--no-compile-route]

Prints a Markdown table (and the registry's expectations that disagree
with what was measured: a failure no row's `known` names, or a `known` that
no longer fails); exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.zoo from a checkout

os.environ["FX_REWRITES_IREE_CACHE"] = "off"  # compile times from an empty cache, never from disk (on by default)

import torch
from torch.utils import _pytree as pytree

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites.backends.dynamo import CompiledGraph, dynamo_backend
from tests.zoo import float64, registry
from tests.zoo.spec import leaves


def _calls(program: torch.export.ExportedProgram) -> int:
    return sum(n.op == "call_function" for n in program.graph.nodes)


def _medians_ms(fns: list[Any], args: tuple, kwargs: dict, repeat: int) -> list[float]:
    """Median wall time of each function, called in turn (so load from elsewhere hits them alike)."""
    times: list[list[float]] = [[] for _ in fns]
    with torch.no_grad():
        for fn in fns:
            for _ in range(3):  # warm up
                fn(*args, **kwargs)
        for _ in range(repeat):
            for fn, spent in zip(fns, times):
                start = time.perf_counter()
                fn(*args, **kwargs)
                spent.append(time.perf_counter() - start)
    return [statistics.median(spent) * 1e3 for spent in times]


def _max_diff(got: Any, expected: Any) -> float:
    diffs = [
        (g.double() - e.double()).abs().max().item() if e.numel() else 0.0
        for g, e in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected), strict=True)
        if isinstance(e, torch.Tensor)
    ]
    return max(diffs, default=0.0)


def _short(e: BaseException) -> str:
    op = getattr(e, "op", "")
    return f"fails: {op}" if op else f"fails: {type(e).__name__}"


def _compare(fn: Any, model: Any, entry: registry.ZooModel) -> tuple[str, float, str]:
    """("matches" or "differs", the largest difference from eager over the input sets, the first mismatch); an
    output not close to eager matches if float64 says it is float noise (tests/zoo/float64.py)."""
    diffs, verdict, error = [], "matches", ""
    with torch.no_grad():
        for seed in registry.SEEDS:
            a, k = entry.inputs(seed)
            got, expected = fn(*a, **k), model(*a, **k)
            diffs.append(_max_diff(got, expected))
            try:
                exact = functools.partial(float64.reference, model, a, k, flatten=leaves)  # noise or fault
                registry.assert_matches(got, expected, entry.tolerance, exact=exact)
            except AssertionError as e:
                verdict, error = "differs", error or str(e)[:300]
    return verdict, max(diffs), error


def measure_compile_route(entry: registry.ZooModel, backend: Any, model: Any, row: dict[str, Any]) -> Any:
    """torch.compile(model, backend=fx_rewrites_iree) into `row`; returns the compiled function (or None)."""
    graphs: list[CompiledGraph] = []
    torch._dynamo.reset()
    backend.cache.clear()
    compiled = torch.compile(model, backend=dynamo_backend(backend, on_graph=graphs.append, strict=True), dynamic=False)
    args, kwargs = entry.inputs(registry.SEEDS[0])
    start = time.perf_counter()
    try:
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            compiled(*args, **kwargs)
    except Exception as e:
        row["tc"] = f"fails: {type(e).__name__}"
        row["tc_error"] = str(e).strip().splitlines()[0][:300]
        return None
    row["tc_compile_s"] = time.perf_counter() - start
    row["tc_graphs"] = len(graphs)
    row["tc_fired"] = sorted({rule for g in graphs for rule in g.result.report.rewrites})
    row["tc"], row["tc_max_diff"], error = _compare(compiled, model, entry)
    if error:
        row["tc_error"] = error
    return compiled


def measure_export_route(
    entry: registry.ZooModel, backend: Any, rules: Any, model: Any, row: dict[str, Any], *, as_is: bool
) -> Any:
    """export -> rules -> IREE into `row`; returns the compiled module (or None where a stage failed)."""
    args, kwargs = entry.inputs(registry.SEEDS[0])
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            program = torch.export.export(model, args, kwargs or None)  # torch prints whole graphs on failure
    except Exception as e:
        row["export"] = f"torch.export fails: {type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
        return None
    row["export_s"] = time.perf_counter() - start
    row["nodes_before"] = _calls(program)
    if as_is:
        backend.cache.clear()
        try:
            backend.compile(program, args)
            row["as_is"] = "compiles"
        except Exception as e:
            row["as_is"] = _short(e)
            row["as_is_op"] = getattr(e, "op", "")
    start = time.perf_counter()
    try:
        result = fx_rewrites.apply(program, rules)
    except Exception as e:
        row["export"] = f"rules fail: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        return None
    row["rules_s"] = time.perf_counter() - start
    row["nodes_after"] = _calls(result.program)
    row["fired"] = dict(sorted(result.report.rewrites.items()))
    backend.cache.clear()
    start = time.perf_counter()
    try:
        compiled = backend.compile(result.program, args)
    except Exception as e:
        row["after"] = _short(e)
        row["error"] = str(e)[:300]
        return None
    row["compile_s"] = time.perf_counter() - start
    row["after"], row["max_diff"], error = _compare(compiled, model, entry)
    if error:
        row["error"] = error
    return compiled


def measure(
    entry: registry.ZooModel, backend: Any, rules: Any, *, repeat: int, as_is: bool, compile_route: bool
) -> dict[str, Any]:
    row: dict[str, Any] = {"model": entry.name, "family": entry.family}
    model = entry.model()
    args, kwargs = entry.inputs(registry.SEEDS[0])
    compiled = measure_export_route(entry, backend, rules, model, row, as_is=as_is)
    tc = measure_compile_route(entry, backend, model, row) if compile_route else None
    timed = {"iree_ms": compiled, "tc_ms": tc}
    timed = {key: fn for key, fn in timed.items() if fn is not None}
    if timed and repeat:
        times = _medians_ms([*timed.values(), model], args, kwargs, repeat)
        row.update(zip([*timed, "eager_ms"], times))
    torch._dynamo.reset()
    return row


def _tc_cell(row: dict[str, Any]) -> str:
    if "tc" not in row:
        return "not run"
    if "tc_compile_s" not in row:
        return row["tc"]
    graphs = f", {row['tc_graphs']} graphs" if row["tc_graphs"] != 1 else ""
    return f"{row['tc']}{graphs}, {row['tc_compile_s']:.1f} s"


def _fmt(row: dict[str, Any]) -> str:
    if "export" in row:
        run = f"- / {row['tc_ms']:.2f} / {row['eager_ms']:.2f}" if "tc_ms" in row and "eager_ms" in row else ""
        return f"| {row['model']} | {row['family']} | {row['export']} | | | | | | {_tc_cell(row)} | {run} | |"
    fired = ", ".join(f"{k} {v}" for k, v in row["fired"].items()) or "none"
    cells = [
        row["model"],
        row["family"],
        f"{row['nodes_before']} -> {row['nodes_after']}",
        fired,
        row.get("as_is", "not run"),
        row["after"],
        f"{row['max_diff']:.1e}" if "max_diff" in row else "",
        f"{row['compile_s']:.1f}" if "compile_s" in row else "",
        _tc_cell(row),
        " / ".join(f"{row[k]:.2f}" if k in row else "-" for k in ("iree_ms", "tc_ms", "eager_ms"))
        if "eager_ms" in row
        else "",
        f"{row['export_s']:.1f} / {row['rules_s']:.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| model | transformers class | nodes before -> after | rules fired | IREE as is | after rules "
    "| max diff | compile s | torch.compile: result, first call s | run ms: export-IREE / torch.compile / eager "
    "(median) | export s / rules s |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def _disagreements(entry: registry.ZooModel, row: dict[str, Any]) -> list[str]:
    """Where the measurement and the row's `known` failures or `graphs` disagree."""
    out = []
    known_export, known_compile = entry.known.get("export"), entry.known.get("compile")
    export_failed = "export" in row or row.get("after", "matches") != "matches"
    if export_failed and not known_export:
        out.append(f"{entry.name}: export route {row.get('export') or row.get('after')}: {row.get('error', '')}")
    if known_export and not export_failed:
        out.append(f"{entry.name}: export route passes; the row's Known ({known_export.reason}) is stale")
    compile_failed = row.get("tc", "matches") != "matches"
    if compile_failed and not known_compile:
        out.append(f"{entry.name}: torch.compile {row['tc']}: {row.get('tc_error', '')}")
    if known_compile and "tc" in row and not compile_failed:
        out.append(f"{entry.name}: torch.compile passes; the row's Known ({known_compile.reason}) is stale")
    if "tc_graphs" in row and row["tc_graphs"] != entry.graphs:
        out.append(f"{entry.name}: graphs={row['tc_graphs']}, the row says {entry.graphs}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated zoo names (default: all)")
    parser.add_argument("--from", dest="start", default="", help="start at this zoo name (in table order)")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per model for the medians")
    parser.add_argument("--no-as-is", action="store_true", help="skip compiling the plain exports")
    parser.add_argument("--no-compile-route", action="store_true", help="skip torch.compile(backend=fx_rewrites_iree)")
    options = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    names = [n for n in options.models.split(",") if n] or [m.name for m in registry.MODELS]
    if options.start:
        names = names[names.index(options.start) :]
    backend = backends.get("iree")
    rules = backend.rules
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads")
    print(HEADER, flush=True)
    rows, notes, failed = [], [], 0
    for name in names:
        entry = registry.BY_NAME[name]
        row = measure(
            entry,
            backend,
            rules,
            repeat=options.repeat,
            as_is=not options.no_as_is,
            compile_route=not options.no_compile_route,
        )
        rows.append(row)
        print(_fmt(row), flush=True)
        notes += _disagreements(entry, row)
        failed += bool(_disagreements(entry, row))
    print()
    for route, key in (("export route", "compile_s"), ("torch.compile route (first call)", "tc_compile_s")):
        seconds = [r[key] for r in rows if key in r]
        if seconds:
            print(
                f"{route}: {len(seconds)} models compiled, {sum(seconds):.0f} s in all, "
                f"median {statistics.median(seconds):.1f} s"
            )
    for row in rows:
        for key in ("error", "tc_error"):
            if key in row:
                print(f"{row['model']} ({'export' if key == 'error' else 'torch.compile'} route): {row[key]}")
    for note in notes:
        print(f"registry disagrees: {note}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
