"""The CNN row of benchmarks/scale.py: ResNet-50 at 224x224 through the export route (issue 25).

    python benchmarks/scale.py --cnn              # the row, in a child process of its own
    python benchmarks/scale_cnn.py --rounds 11    # the same, in this process
    python benchmarks/scale_cnn.py --isa avx2     # AVX2 (on an AVX-512 host: emulated, benchmarks/cpu_isa.py)

transformers' default `ResNetConfig` (ResNet-50, bottleneck layers, 25.6M
parameters; seeded random weights, eval), batch 1, 3x224x224, through
`fx_rewrites.compile(model, (x,), backend=IreeBackend(driver="local-sync"))`:
the time of each step (build, export, rules, import, iree-compile, load,
first call; wall clock) and the peak RSS (VmHWM). Then the steady call,
one thread each (`torch.set_num_threads(1)`, IREE `local-sync` on the
calling thread), CPU time of the process (`time.process_time`), the
variants called in turn round after round: torch eager, Inductor
(`torch.compile`, default mode), the export route, and with `--before` the
export route without the convolution performance rules of
`backends/iree/rules/conv_performance.py` (the route before them). Medians,
with the fastest and slowest round; every variant's output is compared with
eager's (rtol 1e-4, atol 1e-4 of the output's scale).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu_isa  # noqa: E402


def _peak_gb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024 / 1e9


def _before(backend: Any) -> Any:
    """`backend` without the convolution performance rules (what the export route compiled before them)."""
    import attrs

    from fx_rewrites.backends.iree import CompileCache
    from fx_rewrites.backends.iree.rules import conv_performance, performance
    from fx_rewrites.ruleset import Phases

    perf = performance.for_target(backend.target.name, backend.target.isa)
    names = [n for n in conv_performance.NAMES if n in perf.names()]
    sets = [s for s in backend.rules.sets if s is not perf]
    for name in names:
        perf = perf.without(name)
    return attrs.evolve(backend, rules=Phases(*sets, perf), cache=CompileCache())


def cnn_row(
    rounds: int = 11, before: bool = False, inductor: bool = True, isa: str = "host", also_without: str = ""
) -> dict[str, Any]:
    """ResNet-50's steps, peak and steady calls (see the module's docstring), as a JSON-able dict."""
    sys.path.insert(0, str(ROOT))
    from tests.zoo import torchvision_cpu

    torchvision_cpu.install()  # PyPI's torchvision (a CUDA build) is imported by transformers
    import torch
    import transformers

    import fx_rewrites
    from fx_rewrites import api
    from fx_rewrites.app import compile as app_compile
    from fx_rewrites.backends.iree import CompileCache
    from fx_rewrites.backends.iree import backend as iree_backend

    torch.set_num_threads(1)
    steps: dict[str, float] = {}

    def timed(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        steps[name] = steps.get(name, 0.0) + time.perf_counter() - start
        return result

    originals = [(iree_backend, "import_mlir"), (iree_backend, "run_iree_compile"), (app_compile, "_export")]
    originals.append((api, "apply"))
    saved = [(m, a, getattr(m, a)) for m, a in originals]
    for (module, attribute, original), name in zip(saved, ("import", "iree-compile", "export", "rules"), strict=True):
        setattr(module, attribute, lambda *a, _o=original, _n=name, **k: timed(_n, _o, *a, **k))
    try:
        torch.manual_seed(0)
        model = timed("build", lambda: transformers.ResNetModel(transformers.ResNetConfig()).eval())
        x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
        backend = cpu_isa.backend(isa, driver="local-sync", cache=CompileCache())
        with torch.no_grad():
            start = time.perf_counter()
            compiled = fx_rewrites.compile(model, (x,), backend=backend)
            others = sum(steps.get(s, 0.0) for s in ("export", "rules", "import", "iree-compile"))
            steps["load"] = time.perf_counter() - start - others
            timed("first call", compiled, x)
    finally:
        for module, attribute, original in saved:
            setattr(module, attribute, original)
    row: dict[str, Any] = {"model": "ResNet-50", "parameters": sum(p.numel() for p in model.parameters())}
    row["steps_s"], row["peak_gb"] = steps, _peak_gb()
    fns: dict[str, Any] = {"eager": lambda: model(x), "export route": lambda: compiled(x)}
    with torch.no_grad():
        if inductor:
            torch._dynamo.reset()
            inductor_fn = torch.compile(model)
            start = time.perf_counter()
            inductor_fn(x)
            row["inductor_first_call_s"] = time.perf_counter() - start
            fns["Inductor"] = lambda: inductor_fn(x)
        if before:
            program = fx_rewrites.apply(torch.export.export(model, (x,)), _before(backend).rules).program
            old = _before(backend).compile(program, (x,))
            fns["export route, before"] = lambda: old(x)
        for label, other in cpu_isa.without(backend, also_without).items():
            fn = other.compile(fx_rewrites.apply(torch.export.export(model, (x,)), other.rules).program, (x,))
            fns[f"export route {label}"] = lambda fn=fn: fn(x)
        expected = model(x).last_hidden_state
        scale = expected.abs().max().item()
        row["max_abs_diff"] = {}
        for label, fn in fns.items():
            got = fn().last_hidden_state
            row["max_abs_diff"][label] = (got - expected).abs().max().item()
        row["output_scale"] = scale
        # torch's own float32 error: eager float32 against the same model in float64
        exact = copy.deepcopy(model).double()(x.double()).last_hidden_state
        row["float32_error"] = {
            label: (fn().last_hidden_state.double() - exact).abs().max().item() for label, fn in fns.items()
        }
        row["matches_eager"] = all(d <= 1e-4 * scale for d in row["max_abs_diff"].values())
        times: dict[str, list[float]] = {label: [] for label in fns}
        for fn in fns.values():  # one call each first: nothing is measured cold
            fn()
        for _ in range(rounds):
            for label, fn in fns.items():
                start = time.process_time()
                fn()
                times[label].append((time.process_time() - start) * 1e3)
    row["rounds"] = rounds
    row["ms"] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in times.items()}
    return row


def cnn_table(row: dict[str, Any], cpu: str) -> str:
    """Markdown: the steps, then the steady calls (median ms, the range of the rounds, ratio to eager); `cpu`
    names the CPU and the ISA measured (`cpu_isa.header`)."""
    steps = ("build", "export", "rules", "import", "iree-compile", "load", "first call")
    s = row["steps_s"]
    lines = [
        f"ResNet-50 (transformers' default `ResNetConfig`, {row['parameters'] / 1e6:.1f}M parameters), batch 1, "
        f"3x224x224, through `fx_rewrites.compile` (IREE llvm-cpu, local-sync). {cpu}",
        "",
        "| " + " | ".join(f"{k} s" for k in steps) + " | peak RSS |",
        "|" + "---|" * (len(steps) + 1),
        "| " + " | ".join(f"{s.get(k, float('nan')):.1f}" for k in steps) + f" | {row['peak_gb']:.2f} GB |",
        "",
        f"Steady call, one thread each, CPU time, {row['rounds']} interleaved rounds (ms: median, fastest-slowest):",
        "",
        "| variant | median ms | range ms | / eager | / Inductor | max abs diff from eager | from float64 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    ms = row["ms"]
    for label, t in ms.items():
        eager = t["median"] / ms["eager"]["median"]
        ind = f"{t['median'] / ms['Inductor']['median']:.2f}" if "Inductor" in ms else "-"
        lines.append(
            f"| {label} | {t['median']:.1f} | {t['min']:.1f}-{t['max']:.1f} | {eager:.2f} | {ind} | "
            f"{row['max_abs_diff'][label]:.1e} | {row['float32_error'][label]:.1e} |"
        )
    lines.append(f"\nOutput scale (max abs of eager's output): {row['output_scale']:.3g}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--before", action="store_true", help="also the export route without the conv rules")
    parser.add_argument("--no-inductor", dest="inductor", action="store_false")
    parser.add_argument("--out", type=Path, help="write the row as JSON here")
    cpu_isa.add_argument(parser)
    cpu_isa.add_without_argument(parser)
    args = parser.parse_args(argv)
    rc = cpu_isa.run_in_child(args.isa, __file__, argv)
    if rc is not None:
        return rc
    row = cnn_row(args.rounds, args.before, args.inductor, args.isa, args.also_without)
    if args.out:
        args.out.write_text(json.dumps(row))
    print(cnn_table(row, cpu_isa.header(args.isa)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
