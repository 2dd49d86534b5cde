"""One op per class (convolutions and a linear) through the export route against eager and Inductor (issue 25).

    python benchmarks/conv_classes.py                     # every class, 11 rounds
    python benchmarks/conv_classes.py --cases depthwise,conv3d --rounds 21
    python benchmarks/conv_classes.py --models            # torchvision models holding those classes
    python benchmarks/conv_classes.py --shapes --im2col-every-shape --also-without \
        conv_as_im2col_matmul,conv_as_im2col_matmul+im2col   # ResNet-50's convolutions: im2col per shape
    python benchmarks/conv_classes.py --isa avx2           # AVX2 (on an AVX-512 host: emulated, benchmarks/cpu_isa.py)
    python benchmarks/conv_classes.py --isa both           # AVX-512 and AVX2, each in a child, side by side

Per case, in one process, on the same input: torch eager, Inductor
(`torch.compile`, default mode), the export route
(`fx_rewrites.apply(ep, iree.rules)` then `IreeBackend(driver="local-sync")
.compile`, weights of 64 KiB or more as IREE parameters) and the export
route without the convolution performance rules
(`backends/iree/rules/conv_performance.py`: "before"). One thread each
(`torch.set_num_threads(1)`, IREE local-sync), CPU time of the process
(`time.process_time`), the variants called in turn round after round (`--shuffle`: in a new order each round);
medians with the fastest and slowest round. Each output is compared with
eager's (rtol 1e-4, atol 1e-5), and the rules that fired are listed. `--isa`
picks the vector ISA measured (benchmarks/cpu_isa.py): IREE's llvm-cpu target
for it (its flags and performance rules) and torch held to its width.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu_isa

RTOL, ATOL = 1e-4, 1e-5


def _conv(cls: type, cin: int, cout: int, k: int, shape: tuple[int, ...], **kw: Any) -> Callable[[], Any]:
    return lambda: (cls(cin, cout, k, **kw), torch.randn(shape, generator=torch.Generator().manual_seed(1)))


#: name -> a module and its input (ResNet-50's shapes where it has the class)
CASES: dict[str, Callable[[], tuple[torch.nn.Module, torch.Tensor]]] = {
    "conv2d 3x3 64->64, 56x56": _conv(torch.nn.Conv2d, 64, 64, 3, (1, 64, 56, 56), padding=1),
    "conv2d 1x1 256->64, 56x56": _conv(torch.nn.Conv2d, 256, 64, 1, (1, 256, 56, 56)),
    "strided conv2d 3x3/2 128->128, 56x56": _conv(torch.nn.Conv2d, 128, 128, 3, (1, 128, 56, 56), padding=1, stride=2),
    "strided conv2d 1x1/2 256->512, 56x56": _conv(torch.nn.Conv2d, 256, 512, 1, (1, 256, 56, 56), stride=2),
    "depthwise conv2d 3x3 64, 56x56": _conv(torch.nn.Conv2d, 64, 64, 3, (1, 64, 56, 56), padding=1, groups=64),
    "depthwise conv2d 7x7 96, 56x56": _conv(torch.nn.Conv2d, 96, 96, 7, (1, 96, 56, 56), padding=3, groups=96),
    # EfficientNet-B0's strided 5x5 (docs/performance.md: 1.6-2.8x eager as IREE's convolution or the taps)
    "strided depthwise conv2d 5x5/2 144, 56x56": _conv(
        torch.nn.Conv2d, 144, 144, 5, (1, 144, 56, 56), padding=2, stride=2, groups=144
    ),
    "grouped conv2d 3x3 64->64 g8, 56x56": _conv(torch.nn.Conv2d, 64, 64, 3, (1, 64, 56, 56), padding=1, groups=8),
    "conv3d 3x3x3 32->32, 8x28x28": _conv(torch.nn.Conv3d, 32, 32, 3, (1, 32, 8, 28, 28), padding=1),
    "grouped conv2d 3x3 128->128 g32, 56x56": _conv(
        torch.nn.Conv2d, 128, 128, 3, (1, 128, 56, 56), padding=1, groups=32
    ),
    "linear 1024->1024, 128 rows": lambda: (
        torch.nn.Linear(1024, 1024),
        torch.randn(128, 1024, generator=torch.Generator().manual_seed(1)),
    ),
}


class _ConvBnRelu(torch.nn.Sequential):
    """A ResNet layer: convolution (no bias), batch norm with running statistics that are not the identity, ReLU."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1) -> None:
        super().__init__(
            torch.nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False),
            torch.nn.BatchNorm2d(cout),
            torch.nn.ReLU(),
        )
        with torch.no_grad():
            self[1].running_mean.uniform_(-0.5, 0.5)
            self[1].running_var.uniform_(0.5, 1.5)


def _layer(cin: int, cout: int, k: int, size: int, stride: int = 1) -> Callable[[], Any]:
    return lambda: (
        _ConvBnRelu(cin, cout, k, stride),
        torch.randn(1, cin, size, size, generator=torch.Generator().manual_seed(1)),
    )


#: `--shapes`: each distinct convolution of ResNet-50 (torchvision's and transformers' v1.5: the stride on the
#: 3x3), + BN + ReLU, batch 1 at 224x224; what rules/im2col.py's threshold is chosen over
SHAPES: dict[str, Callable[[], tuple[torch.nn.Module, torch.Tensor]]] = {
    "stem 7x7/2 3->64, 224x224": _layer(3, 64, 7, 224, 2),
    "3x3 64->64, 56x56": _layer(64, 64, 3, 56),
    "3x3 128->128, 28x28": _layer(128, 128, 3, 28),
    "3x3 256->256, 14x14": _layer(256, 256, 3, 14),
    "3x3 512->512, 7x7": _layer(512, 512, 3, 7),
    "3x3/2 128->128, 56x56": _layer(128, 128, 3, 56, 2),
    "3x3/2 256->256, 28x28": _layer(256, 256, 3, 28, 2),
    "3x3/2 512->512, 14x14": _layer(512, 512, 3, 14, 2),
    "1x1 64->256, 56x56": _layer(64, 256, 1, 56),
    "1x1 256->64, 56x56": _layer(256, 64, 1, 56),
    "1x1 512->128, 28x28": _layer(512, 128, 1, 28),
    "1x1 1024->256, 14x14": _layer(1024, 256, 1, 14),
    "1x1 2048->512, 7x7": _layer(2048, 512, 1, 7),
    "1x1/2 1024->2048, 14x14": _layer(1024, 2048, 1, 14, 2),
}


def _torchvision(name: str, shape: tuple[int, ...]) -> Callable[[], tuple[torch.nn.Module, torch.Tensor]]:
    def make() -> tuple[torch.nn.Module, torch.Tensor]:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.zoo import torchvision_cpu

        torchvision_cpu.install()  # PyPI's torchvision is a CUDA build
        import torchvision

        torch.manual_seed(0)
        builder = getattr(torchvision.models.video, name, None) or getattr(torchvision.models, name)
        return builder(weights=None), torch.randn(shape, generator=torch.Generator().manual_seed(1))

    return make


#: whole torchvision models (seeded random weights) that hold the classes the convolution rules take
MODELS: dict[str, Callable[[], tuple[torch.nn.Module, torch.Tensor]]] = {
    "r3d_18 (3-D), 1x3x8x112x112": _torchvision("r3d_18", (1, 3, 8, 112, 112)),
    "mobilenet_v2 (depthwise 3x3), 1x3x224x224": _torchvision("mobilenet_v2", (1, 3, 224, 224)),
    "convnext_tiny (depthwise 7x7), 1x3x224x224": _torchvision("convnext_tiny", (1, 3, 224, 224)),
    "resnext50_32x4d (grouped, 32 groups), 1x3x224x224": _torchvision("resnext50_32x4d", (1, 3, 224, 224)),
    "efficientnet_b0 (depthwise 3x3, 5x5), 1x3x224x224": _torchvision("efficientnet_b0", (1, 3, 224, 224)),
    "mobilenet_v3_large (depthwise 3x3, 5x5), 1x3x224x224": _torchvision("mobilenet_v3_large", (1, 3, 224, 224)),
}


def measure(
    make: Callable[[], Any],
    rounds: int,
    inductor: bool,
    isa: str = "host",
    also_without: str = "",
    before: bool = True,
    shuffle: bool = False,
) -> dict[str, Any]:
    from scale_cnn import _before

    import fx_rewrites
    from fx_rewrites.backends.iree import CompileCache

    torch.manual_seed(0)
    model, x = make()
    model = model.eval()
    backend = cpu_isa.backend(isa, driver="local-sync", cache=CompileCache())
    fns: dict[str, Callable[[], Any]] = {"eager": lambda: model(x)}
    fired: set[str] = set()
    with torch.no_grad():
        expected = model(x)
        if inductor:
            torch._dynamo.reset()
            ind = torch.compile(model)
            ind(x)
            fns["Inductor"] = lambda: ind(x)
        routes = {"export route": backend, **({"before": _before(backend)} if before else {})}
        routes.update({f"export route {k}": v for k, v in cpu_isa.without(backend, also_without).items()})
        for label, b in routes.items():
            result = fx_rewrites.apply(torch.export.export(model, (x,)), b.rules)
            if label == "export route":  # the route's own rules, not a variant's (`--also-without +RULE`)
                fired |= {k for k, v in result.report.rewrites.items() if v}
            fn = b.compile(result.program, (x,))
            fns[label] = lambda fn=fn: fn(x)
        diffs = {}
        for label, fn in fns.items():
            got = fn()
            diffs[label] = (got - expected).abs().max().item()
            if not torch.allclose(got, expected, rtol=RTOL, atol=ATOL):
                print(f"  {label}: not close to eager (max |diff| {diffs[label]:.2e})")
        times: dict[str, list[float]] = {label: [] for label in fns}
        order, rng = list(fns), random.Random(0)
        for _ in range(rounds):
            if shuffle:  # no variant always after the same one (the route after Inductor, whose run evicts the caches)
                rng.shuffle(order)
            for label in order:
                fn = fns[label]
                start = time.process_time()
                fn()
                times[label].append((time.process_time() - start) * 1e3)
    torch._dynamo.reset()
    ms = {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}
    return {"ms": ms, "diffs": diffs, "fired": sorted(fired)}


def table(rows: dict[str, dict[str, Any]]) -> str:
    labels = list(next(iter(rows.values()))["ms"])
    lines = [
        "| op | "
        + " | ".join(f"{label} ms" for label in labels)
        + " | route / eager | route / before | "
        + "".join(f"{label} / eager | " for label in labels if label.startswith("export route -"))
        + "rules |",
        "|---|" + "---:|" * (len(labels) + 2 + sum(k.startswith("export route -") for k in labels)) + "---|",
    ]
    for name, row in rows.items():
        ms = row["ms"]
        cells = " | ".join(f"{ms[k][0]:.2f} ({ms[k][1]:.2f}-{ms[k][2]:.2f})" for k in labels)
        route, eager, before = ms["export route"][0], ms["eager"][0], ms.get("before", (float("nan"),))[0]
        rules = ", ".join(f for f in row["fired"] if f in PERFORMANCE) or "-"
        extra = "".join(f"{ms[k][0] / eager:.2f} | " for k in labels if k.startswith("export route -"))
        lines.append(f"| {name} | {cells} | {route / eager:.2f} | {route / before:.2f} | {extra}{rules} |")
    return "\n".join(lines)


def table_both(runs: dict[str, dict[str, Any]]) -> str:
    """`--isa both`: per op, each ISA's eager ms and Inductor, route and before over eager, side by side."""
    isas = list(runs)
    first = runs[isas[0]]["rows"]
    lines = [f"- {isa.upper()}: {runs[isa]['header']}" for isa in isas]
    head = " | ".join(f"{isa.upper()} {c}" for isa in isas for c in ("eager ms", "Inductor", "**route**", "before"))
    lines += ["", f"| op | {head} | rules that fired |", "|---|" + "---:|" * (4 * len(isas)) + "---|"]
    for name in first:
        cells = []
        for isa in isas:
            ms = {k: v[0] for k, v in runs[isa]["rows"][name]["ms"].items()}
            keys = ("Inductor", "export route", "before", *(k for k in ms if k.startswith("export route -")))
            ratio = {k: f"{ms[k] / ms['eager']:.2f}" if k in ms else "-" for k in keys}
            route = f"**{ratio['export route']}**" + "".join(
                f" ({k.removeprefix('export route ')}: {ratio[k]})" for k in keys[3:]
            )
            cells += [f"{ms['eager']:.2f}", ratio["Inductor"], route, ratio["before"]]
        fired = sorted({f for isa in isas for f in runs[isa]["rows"][name]["fired"] if f in PERFORMANCE})
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {', '.join(fired) or '-'} |")
    return "\n".join(lines)


PERFORMANCE: set[str] = set()


def main(argv: list[str] | None = None) -> int:
    from fx_rewrites.backends.iree.rules import performance

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="comma-separated substrings of the case names")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--models", action="store_true", help="whole torchvision models instead of single ops")
    parser.add_argument("--shapes", action="store_true", help="ResNet-50's convolutions (+ BN + ReLU) one by one")
    parser.add_argument(
        "--im2col-every-shape",
        action="store_true",
        help="conv_as_im2col_matmul takes every shape (its threshold off, in this process): the form on each",
    )
    parser.add_argument("--no-inductor", dest="inductor", action="store_false")
    parser.add_argument("--no-before", dest="before", action="store_false", help="not the route without the rules")
    parser.add_argument(
        "--shuffle", action="store_true", help="the variants in a new (seeded) order each round, not eager's first"
    )
    cpu_isa.add_argument(parser, both=True)
    cpu_isa.add_without_argument(parser)
    args = parser.parse_args(argv)
    PERFORMANCE.update(performance.ALL.names())
    if args.isa == "both":
        print(table_both(cpu_isa.each(__file__, argv)))
        return 0
    rc = cpu_isa.run_in_child(args.isa, __file__, argv)
    if rc is not None:
        return rc
    from fx_rewrites.backends.iree.rules import im2col

    threads, bounds = torch.get_num_threads(), (im2col.MIN_IM2COL_CHANNELS, im2col.MAX_IM2COL_POSITIONS)
    rows = {}
    try:  # a caller in the same process (the smoke tests) keeps its threads and the rule's bounds, even on an error
        torch.set_num_threads(1)
        wanted = [c for c in args.cases.split(",") if c]
        pool = MODELS if args.models else SHAPES if args.shapes else CASES
        if args.im2col_every_shape:
            im2col.MIN_IM2COL_CHANNELS, im2col.MAX_IM2COL_POSITIONS = 0, sys.maxsize
        chosen = {k: v for k, v in pool.items() if not wanted or any(w in k for w in wanted)}
        header = (
            f"{cpu_isa.header(args.isa)} torch {torch.__version__}; one thread each, CPU time, {args.rounds} rounds"
        )
        print(header)
        for name, make in chosen.items():
            rows[name] = measure(
                make, args.rounds, args.inductor, args.isa, args.also_without, args.before, args.shuffle
            )
            print(name, {k: round(v[0], 3) for k, v in rows[name]["ms"].items()}, rows[name]["fired"], flush=True)
    finally:
        torch.set_num_threads(threads)
        im2col.MIN_IM2COL_CHANNELS, im2col.MAX_IM2COL_POSITIONS = bounds
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"header": f"{header}; {runtime_load()}", "rows": rows}))
    return 0


def runtime_load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
