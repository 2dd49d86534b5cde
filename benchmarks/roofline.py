"""How close to its floor each benchmark model runs: the matmul work alone, at this core's matmul rate.

    python benchmarks/roofline.py                   # the models of benchmarks/runtime.py, cpu1
    python benchmarks/roofline.py --models bert --repeat 9

Per model (benchmarks/runtime_models.py): the floating-point operations of its
matrix products (linear, matmul, convolution; counted by torch's
`FlopCounterMode` running the program the default IREE route compiles, where
attention is written out as matmuls), and torch eager's time (one thread,
CPU time of the calling thread, median of --repeat calls). The matmul rate
of this core is measured in the same run: a [512, 1024] x [1024, 1024]
linear compiled by the project's default IREE route (IREE's data-tiled
`mmt4d` microkernel) and torch eager's `F.linear` of the same size. The
floor is the model's matmul operations at IREE's rate: what IREE's time
would be if everything between the products were free. Its ratio to eager
bounds what any rule can reach on that model (docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from runtime_models import MODELS, QUICK
from torch.utils.flop_counter import FlopCounterMode

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites.backends.iree import CompileCache, IreeBackend


def cpu_median(fn: Callable[[], Any], repeat: int) -> float:
    """Median CPU seconds of the calling thread per call (2 warm-up calls first)."""
    times = []
    with torch.no_grad():
        for i in range(repeat + 2):
            start = time.thread_time()
            fn()
            if i >= 2:
                times.append(time.thread_time() - start)
    return statistics.median(times)


def matmul_rates(repeat: int, quick: bool) -> dict[str, float]:
    """FLOP/s of one linear layer on this core: IREE (the project's default route, local-sync) and eager."""
    rows, width = (64, 128) if quick else (512, 1024)
    layer = torch.nn.Linear(width, width).eval()
    x = torch.randn(rows, width)
    iree = backends.get("iree")
    backend = IreeBackend(name=iree.name, driver="local-sync", cache=CompileCache())
    program = fx_rewrites.apply(torch.export.export(layer, (x,)), backend.rules).program
    compiled = backend.compile(program, (x,))
    torch.testing.assert_close(compiled(x), layer(x), rtol=1e-4, atol=1e-4)
    flops = 2 * rows * width * width
    return {
        "iree": flops / cpu_median(lambda: compiled(x), repeat),
        "eager": flops / cpu_median(lambda: layer(x), repeat),
    }


def model_row(name: str, repeat: int, quick: bool) -> dict[str, Any]:
    """The model's eager time and the matmul operations of the program IREE compiles from it (after the
    default route's rules: attention and the convolutions are matmuls there; torch's counter does not
    count CPU attention kernels, so eager's own call would miss them)."""
    spec = MODELS[name]
    model = spec.model(quick)
    pos, kw = spec.inputs(quick, 0)
    program = fx_rewrites.apply(torch.export.export(model, pos, kw), backends.get("iree").rules).program
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        program.module()(*pos, **kw)
    return {"model": name, "flops": counter.get_total_flops(), "eager_s": cpu_median(lambda: model(*pos, **kw), repeat)}


def table(rows: list[dict[str, Any]], rates: dict[str, float]) -> str:
    lines = [
        f"Matmul rate of this core, one thread: IREE {rates['iree'] / 1e9:.0f} GFLOP/s, "
        f"torch eager {rates['eager'] / 1e9:.0f} GFLOP/s.",
        "",
        "| model | matmul GFLOP per call | eager ms | eager's matmuls at eager's rate (ms) "
        "| floor: matmuls at IREE's rate (ms) | **floor / eager** |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        floor = row["flops"] / rates["iree"]
        lines.append(
            f"| {row['model']} | {row['flops'] / 1e9:.2f} | {row['eager_s'] * 1e3:.1f} | "
            f"{row['flops'] / rates['eager'] * 1e3:.1f} | {floor * 1e3:.1f} | **{floor / row['eager_s']:.2f}** |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--repeat", type=int, default=11)
    parser.add_argument("--quick", action="store_true", help="tiny models and layer (the CI smoke test)")
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n] or list(QUICK if args.quick else MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = matmul_rates(args.repeat, args.quick)
        rows = [model_row(name, args.repeat, args.quick) for name in names]
    finally:
        torch.set_num_threads(threads)
    print(table(rows, rates))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
