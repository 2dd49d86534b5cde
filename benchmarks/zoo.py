"""The transformers zoo (tests/zoo) on IREE: what the rules do and what it costs.

Per model: graph nodes (call_function) before and after the rules, the
rules that fired, what IREE does with the plain export and with the
rewritten one, the largest difference from eager over the zoo's input sets,
export / rules / compile seconds (compile from an empty cache), and the
median run time of the compiled module and of eager torch on this CPU
(called in turn, after 3 warm-up calls each, so that load from other
processes hits both alike).

    python benchmarks/zoo.py [--models bert,gpt2_sdpa] [--repeat 20] [--no-as-is]

Prints a Markdown table (and the registry's expectations that disagree
with what was measured); exits 1 if a model that torch exports does not
match eager after the rules.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.zoo from a checkout

os.environ.pop("FX_REWRITES_IREE_CACHE", None)  # compile times from an empty cache, never from disk

import torch
from torch.utils import _pytree as pytree

import backends
import rewrites
from tests.zoo import registry


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


def measure(entry: registry.ZooModel, backend: Any, rules: Any, *, repeat: int, as_is: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"model": entry.name, "family": entry.family}
    model = entry.model()
    args, kwargs = entry.inputs(registry.SEEDS[0])
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            program = torch.export.export(model, args, kwargs or None)  # torch prints whole graphs on failure
    except Exception as e:
        row["export"] = f"torch.export fails: {type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
        return row
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
    result = rewrites.apply(program, rules)
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
        return row
    row["compile_s"] = time.perf_counter() - start
    diffs, row["after"] = [], "matches"
    with torch.no_grad():
        for seed in registry.SEEDS:
            a, k = entry.inputs(seed)
            got, expected = compiled(*a, **k), model(*a, **k)
            diffs.append(_max_diff(got, expected))
            try:
                registry.assert_matches(got, expected)
            except AssertionError as e:
                row["after"], row["error"] = "differs", str(e)[:300]
    row["max_diff"] = max(diffs)
    row["iree_ms"], row["eager_ms"] = _medians_ms([compiled, model], args, kwargs, repeat)
    return row


def _fmt(row: dict[str, Any]) -> str:
    if "export" in row:
        return f"| {row['model']} | {row['family']} | {row['export']} | | | | | | | |"
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
        f"{row['iree_ms']:.2f} / {row['eager_ms']:.2f}" if "iree_ms" in row else "",
        f"{row['export_s']:.1f} / {row['rules_s']:.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| model | transformers class | nodes before -> after | rules fired | IREE as is | after rules "
    "| max diff | compile s | run ms IREE / eager (median) | export s / rules s |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def _disagreements(entry: registry.ZooModel, row: dict[str, Any]) -> list[str]:
    out = []
    if "fired" in row and set(row["fired"]) != set(entry.fires):
        out.append(f"{entry.name}: fires={sorted(row['fired'])}, registry says {sorted(entry.fires)}")
    if "as_is_op" in row or row.get("as_is") == "compiles":
        measured = row.get("as_is_op", "")
        if measured != entry.as_is:
            out.append(f"{entry.name}: as_is={measured!r}, registry says {entry.as_is!r}")
    if "export" in row and not entry.export_error:
        out.append(f"{entry.name}: {row['export']}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated zoo names (default: all)")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per model for the medians")
    parser.add_argument("--no-as-is", action="store_true", help="skip compiling the plain exports")
    options = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    names = [n for n in options.models.split(",") if n] or [m.name for m in registry.MODELS]
    backend = backends.get("iree")
    rules = registry.rules()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads")
    print(HEADER, flush=True)
    rows, notes, failed = [], [], 0
    for name in names:
        entry = registry.BY_NAME[name]
        row = measure(entry, backend, rules, repeat=options.repeat, as_is=not options.no_as_is)
        rows.append(row)
        print(_fmt(row), flush=True)
        notes += _disagreements(entry, row)
        failed += "export" not in row and row.get("after") != "matches"
    done = [r for r in rows if "compile_s" in r]
    if done:
        seconds = [r["compile_s"] for r in done]
        print(f"\n{len(done)} models compiled: {sum(seconds):.0f} s in all, median {statistics.median(seconds):.1f} s")
    for row in rows:
        if "error" in row:
            print(f"{row['model']}: {row['error']}")
    for note in notes:
        print(f"registry disagrees: {note}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
