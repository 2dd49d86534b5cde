"""How fast what the project compiles runs: IREE (llvm-cpu) against torch eager and torch.compile (Inductor).

    python benchmarks/runtime.py                    # full run (cpu1); writes docs/performance.md's table + plot
    python benchmarks/runtime.py --mode wall        # wall time, default threads; writes its own section
    python benchmarks/runtime.py --quick            # tiny models, 3 runs, no Inductor, no ablation (the CI smoke test)
    python benchmarks/runtime.py --models bert,vit --no-write
    python benchmarks/runtime.py --isa avx2         # AVX2 (on an AVX-512 host: emulated, benchmarks/cpu_isa.py)

Per model (benchmarks/runtime_models.py), in one process, on the same inputs:
torch eager; `torch.compile` (Inductor); the project's default IREE route
(`fx_rewrites.apply(ep, iree.rules)` then `iree.compile`: the IREE rules, then
the llvm-cpu performance phase and flags); the same without the performance
phase and flags (the route before them); and, for the ablation, the default
route without each performance rule that fired and without each
performance flag. Every function is called in turn, round after round
(load from other processes hits all alike); medians of --repeat rounds
(at least 9 outside --quick), ratios against eager from the same rounds.
Each IREE variant's outputs are compared with eager (rtol 1e-4, atol 1e-4).

Modes: `cpu1` (default) gives each one thread (torch.set_num_threads(1), IREE local-sync)
and measures the calling thread's CPU time, which other processes' load
barely moves; `wall` is wall time with each runtime's default threads
(torch: its intra-op threads; IREE: local-task, a worker per core), each
timed call after a short idle (`SETTLE_S`).
Compile time is split into export, rules (the engine), IREE import and
iree-compile, from an empty cache. `--isa` picks the vector ISA measured
(benchmarks/cpu_isa.py: IREE's llvm-cpu target for it, its flags and
performance rules; torch held to its width); the table names the CPU, its
vector extensions and the ISA.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attrs
import cpu_isa
import torch
from runtime_models import MODELS, QUICK, Spec
from torch.utils import _pytree as pytree

import fx_rewrites
from fx_rewrites.backends.iree import CompileCache, IreeBackend
from fx_rewrites.backends.iree.importing import import_mlir, iree_modules
from fx_rewrites.backends.iree.parameters import inline_limit, parameter_hooks
from fx_rewrites.backends.iree.preparing import prepare_program
from fx_rewrites.backends.iree.rules import performance
from fx_rewrites.ruleset import Phases

DOCS = Path(__file__).resolve().parents[1] / "docs"
RTOL = ATOL = 1e-4


def load() -> str:
    """The machine's load averages (1, 5, 15 min) and core count, for the record."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} on {os.cpu_count()} cores"


def default_backend(mode: str, isa: str = "host") -> IreeBackend:
    """The `iree` backend for `isa`'s llvm-cpu target: local-sync in cpu1 mode, local-task in wall mode."""
    target = cpu_isa.target(isa)
    return cpu_isa.backend(isa, driver="local-sync" if mode == "cpu1" else target.driver, cache=CompileCache())


def perf_phase(backend: IreeBackend) -> Any:
    """The performance rules `backend` applies (its target's, for its ISA)."""
    return performance.for_target(backend.target.name, backend.target.isa)


def variants(backend: IreeBackend, fired: set[str], ablation: bool, also_without: str = "") -> dict[str, IreeBackend]:
    """The IREE routes to measure: default, before the performance phase, the default without each piece (with
    `ablation`), and without the flags `also_without` names (`cpu_isa.without`)."""
    perf = perf_phase(backend)
    before = [s for s in backend.rules.sets if s is not perf]
    out = {
        "iree": backend,
        "iree_before": attrs.evolve(backend, rules=Phases(*before), perf_flags=(), cache=CompileCache()),
    }
    if ablation:
        for name in [n for n in perf.names() if n in fired]:
            rules = Phases(*before, perf.without(name))
            out[f"-{name}"] = attrs.evolve(backend, rules=rules, cache=CompileCache())
        for flag in backend.perf_flags:
            rest = tuple(f for f in backend.perf_flags if f != flag)
            out[f"-{flag_name(flag)}"] = attrs.evolve(backend, perf_flags=rest, cache=CompileCache())
    out.update(cpu_isa.without(backend, also_without))
    return out


def flag_name(flag: str) -> str:
    """A short name for a flag: its pass name for a preprocessing pipeline."""
    inner = re.search(r"\(([\w-]+)\)\)$", flag)
    return inner.group(1) if inner else flag.lstrip("-").split("=")[0]


def max_diff(got: Any, expected: Any) -> float:
    pairs = zip(pytree.tree_leaves(got), pytree.tree_leaves(expected), strict=True)
    diffs = [
        (g.double() - e.double()).abs().max().item() for g, e in pairs if isinstance(e, torch.Tensor) and e.numel()
    ]
    return max(diffs, default=0.0)


def close(got: Any, expected: Any) -> bool:
    pairs = zip(pytree.tree_leaves(got), pytree.tree_leaves(expected), strict=True)
    return all(torch.allclose(g, e, rtol=RTOL, atol=ATOL) for g, e in pairs if isinstance(e, torch.Tensor))


#: wall mode: the pause before each timed call. After a parallel region torch's OpenMP workers (libgomp) spin
#: for GOMP_SPINCOUNT = 300,000 rounds before they sleep, ~5 ms on this machine: holding a core that the next
#: runtime's workers need. Measured on BERT's IREE module (local-task): 11.9 ms a call alone, 16.5 ms right
#: after one torch linear, 10.5 ms after it with OMP_WAIT_POLICY=passive. Functions called in turn would each
#: pay for the one before; a user running one model does not.
SETTLE_S = 0.03


def medians(
    fns: dict[str, Callable[[], Any]], repeat: int, clock: Callable[[], float], settle: float = 0.0
) -> dict[str, float]:
    """Median seconds per function, called in turn each round (2 warm-up rounds first), `settle` seconds
    of idle before each timed call."""
    spent: dict[str, list[float]] = {name: [] for name in fns}
    with torch.no_grad():
        for _ in range(2):
            for fn in fns.values():
                fn()
        for _ in range(repeat):
            for name, fn in fns.items():
                if settle:
                    time.sleep(settle)
                start = clock()
                fn()
                spent[name].append(clock() - start)
    return {name: statistics.median(times) for name, times in spent.items()}


def compile_iree(backend: IreeBackend, program: torch.export.ExportedProgram, args: Sequence[Any]) -> tuple:
    """(callable, rules result, seconds by stage) for one IREE route, from an empty cache."""
    start = time.perf_counter()
    result = fx_rewrites.apply(program, backend.rules)
    rules_s = time.perf_counter() - start
    start = time.perf_counter()
    prepared = prepare_program(result.program)[0]  # imported as the backend does: large weights as parameters
    import_mlir(iree_modules(), prepared, hooks=parameter_hooks(iree_modules(), prepared, limit=inline_limit()))
    import_s = time.perf_counter() - start
    start = time.perf_counter()
    fn = backend.compile(result.program, args)
    compile_s = max(time.perf_counter() - start - import_s, 0.0)
    return fn, result, {"rules": rules_s, "import": import_s, "iree-compile": compile_s}


def measure(spec: Spec, args: argparse.Namespace) -> dict[str, Any]:
    """One model's row: times, ratios, numerics, compile stages, what fired."""
    quick, mode = args.quick, args.mode
    model = spec.model(quick)
    (pos, kw), (pos1, kw1) = spec.inputs(quick, 0), spec.inputs(quick, 1)
    with torch.no_grad():
        expected, expected1 = model(*pos, **kw), model(*pos1, **kw1)
    start = time.perf_counter()
    program = torch.export.export(model, pos, kw)
    export_s = time.perf_counter() - start

    backend = default_backend(mode, args.isa)
    fn, result, stages = compile_iree(backend, program, pos)
    fired = {n for n, c in result.report.rewrites.items() if c}
    row: dict[str, Any] = {"model": spec.name, "what": spec.what, "export": export_s, **stages}
    row["perf_fired"] = sorted(fired & set(perf_phase(backend).names()))
    fns: dict[str, Callable[[], Any]] = {"eager": lambda: model(*pos, **kw)}
    row["numerics"] = {}
    for name, variant in variants(backend, fired, args.ablation, args.also_without).items():
        compiled = fn if name == "iree" else compile_iree(variant, program, pos)[0]
        got, got1 = compiled(*pos, **kw), compiled(*pos1, **kw1)
        row["numerics"][name] = (max(max_diff(got, expected), max_diff(got1, expected1)), close(got, expected))
        fns[name] = lambda c=compiled: c(*pos, **kw)
    if args.inductor:
        torch._dynamo.reset()
        inductor = torch.compile(model)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                got = inductor(*pos, **kw)
            row["inductor_compile"] = time.perf_counter() - start
            row["numerics"]["inductor"] = (max_diff(got, expected), close(got, expected))
            fns["inductor"] = lambda: inductor(*pos, **kw)
        except Exception as e:  # no C++ compiler, an Inductor bug: say so in the table
            row["inductor_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if mode == "cpu1":
        row["seconds"] = medians(fns, args.repeat, time.thread_time)
    else:
        row["seconds"] = medians(fns, args.repeat, time.perf_counter, settle=SETTLE_S)
    return row


# ----------------------------------------------------------------------------- output


def _ratio(row: dict[str, Any], name: str) -> float | None:
    seconds = row["seconds"]
    return seconds[name] / seconds["eager"] if name in seconds else None


def _cell(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def tables(
    rows: list[dict[str, Any]], mode: str, repeat: int, loads: tuple[str, str], isa: str = "host", cached: bool = False
) -> str:
    what = "wall time, default threads" if mode == "wall" else "CPU time of the calling thread, one thread each"
    lines = [
        f"Run on {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, IREE 3.13 llvm-cpu; {what}; median of "
        f"{repeat} rounds. Machine: {loads[0]} at the start, {loads[1]} at the end.",
        "",
        cpu_isa.header(isa),
        "",
        "| model | eager ms | Inductor / eager | IREE before / eager | **IREE / eager** "
        "| IREE matches eager (max diff) | performance rules that fired |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        diff, ok = row["numerics"]["iree"]
        inductor = _cell(_ratio(row, "inductor")) if "inductor_error" not in row else "fails"
        lines.append(
            f"| {row['model']} | {row['seconds']['eager'] * 1e3:.1f} | {inductor} | "
            f"{_cell(_ratio(row, 'iree_before'))} | **{_cell(_ratio(row, 'iree'))}** | "
            f"{'yes' if ok else 'NO'} ({diff:.1e}) | {', '.join(row['perf_fired']) or '-'} |"
        )
    ratios = [_ratio(row, "iree") for row in rows]
    lines += ["", f"Median IREE / eager over the models: **{statistics.median(ratios):.2f}**."]
    if any(name.startswith("-") for row in rows for name in row["seconds"]):  # an ablation or --also-without
        lines += ["", *gains(rows)]
    lines += ["", *compile_stages(rows, cached)]
    return "\n".join(lines)


def gains(rows: list[dict[str, Any]]) -> list[str]:
    """Per performance rule and flag: time without it / time with it, per model it touches (> 1: it helps)."""
    pieces = sorted({name[1:] for row in rows for name in row["seconds"] if name.startswith("-")})
    lines = [
        "Gain of each performance piece: IREE time without it / with it (above 1: it helps; - : it does not touch "
        "that model).",
        "",
        "| piece | " + " | ".join(row["model"] for row in rows) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for piece in pieces:
        cells = []
        for row in rows:
            seconds = row["seconds"]
            cells.append(_cell(seconds[f"-{piece}"] / seconds["iree"]) if f"-{piece}" in seconds else "-")
        lines.append(f"| {piece} | " + " | ".join(cells) + " |")
    return lines


def compile_stages(rows: list[dict[str, Any]], cached: bool = False) -> list[str]:
    source = "with the disk cache (--keep-cache: not compile times)" if cached else "from an empty cache"
    lines = [
        f"Compile time of the default IREE route, {source} (seconds), and the engine's share "
        "(the rules, `fx_rewrites.apply`) of export + rules + import + iree-compile:",
        "",
        "| model | export | rules (engine) | IREE import | iree-compile | engine share | Inductor first call |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        total = row["export"] + row["rules"] + row["import"] + row["iree-compile"]
        lines.append(
            f"| {row['model']} | {row['export']:.2f} | {row['rules']:.2f} | {row['import']:.2f} | "
            f"{row['iree-compile']:.2f} | {row['rules'] / total:.1%} | {_cell(row.get('inductor_compile'), '{:.1f}')} |"
        )
    return lines


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [
        ("iree_before", "IREE before the performance rules"),
        ("inductor", "Inductor"),
        ("iree", "IREE (default)"),
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        values = [_ratio(row, key) or 0.0 for row in rows]
        ax.bar([j + i * width for j in range(len(rows))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width for j in range(len(rows))], [row["model"] for row in rows])
    ax.set_yscale("log")
    ax.set_ylabel("time / torch eager (log)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_docs(text: str, mode: str, path: Path) -> None:
    """Replace the section between this mode's markers in docs/performance.md."""
    begin, end = f"<!-- runtime:{mode}:begin -->", f"<!-- runtime:{mode}:end -->"
    doc = path.read_text()
    if begin not in doc or end not in doc:
        print(f"{path} has no {begin} ... {end} markers: the table is printed only", file=sys.stderr)
        return
    head, rest = doc.split(begin, 1)
    path.write_text(f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}")


def main(argv: list[str] | None = None) -> int:
    """Compile times from an empty cache: the disk cache (on by default) is off while this runs (unless
    `--keep-cache`), and the environment is restored after it (a test that imports this module and calls `main` in
    its process keeps its own cache for the tests after it)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.keep_cache:
        return _main(parser, args, argv)
    with mock.patch.dict(os.environ, {"FX_REWRITES_IREE_CACHE": "off"}):
        return _main(parser, args, argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--mode", choices=("wall", "cpu1"), default="cpu1")
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds (default 11; --quick: 3)")
    parser.add_argument("--quick", action="store_true", help="tiny models, 3 rounds, no Inductor, no ablation")
    parser.add_argument("--no-inductor", dest="inductor", action="store_false")
    parser.add_argument("--no-ablation", dest="ablation", action="store_false")
    parser.add_argument("--no-write", dest="write", action="store_false", help="print only")
    parser.add_argument("--plot", type=Path, default=None, help="plot path (default: docs/runtime-<mode>.png)")
    parser.add_argument(
        "--keep-cache",
        action="store_true",
        help="use the disk compile cache (warm it with an unlocked run first, so a locked run times, not compiles); "
        "the compile times are then not from an empty cache",
    )
    cpu_isa.add_argument(parser)
    cpu_isa.add_without_argument(parser)
    return parser


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None) -> int:
    rc = cpu_isa.run_in_child(args.isa, __file__, argv)
    if rc is not None:
        return rc
    if args.quick:
        args.inductor = args.ablation = args.write = False
    args.repeat = args.repeat or (3 if args.quick else 11)
    if not args.quick and args.repeat < 9:
        parser.error("--repeat: at least 9 rounds outside --quick")
    names = [n for n in args.models.split(",") if n] or list(QUICK if args.quick else MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    threads = torch.get_num_threads()
    if args.mode == "cpu1":
        torch.set_num_threads(1)
    start_load = load()
    rows = []
    try:
        for name in names:
            print(f"[{name}] {load()}", file=sys.stderr, flush=True)
            rows.append(measure(MODELS[name], args))
    finally:
        torch.set_num_threads(threads)  # a caller in the same process (the smoke test) keeps its threads
    text = tables(rows, args.mode, args.repeat, (start_load, load()), args.isa, args.keep_cache)
    print(text)
    section = args.mode if args.isa == "host" else f"{args.mode}-{cpu_isa.resolve(args.isa)}"
    plot_path = args.plot or (DOCS / f"runtime-{section}.png" if args.write else None)
    if plot_path is not None:
        plot(rows, plot_path, f"{section}: time relative to torch eager ({start_load})")
    if args.write:
        write_docs(text + f"\n\n![IREE, Inductor vs eager](runtime-{section}.png)", section, DOCS / "performance.md")
    return 0 if all(row["numerics"]["iree"][1] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
