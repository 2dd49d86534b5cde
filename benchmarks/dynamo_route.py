"""The torch.compile route (`backend=fx_rewrites_iree`) against eager and the export route, per op class.

    python benchmarks/dynamo_route.py                 # conv2d, depthwise, grouped, conv3d, linear
    python benchmarks/dynamo_route.py --resnet50      # and transformers' ResNet-50 (minutes of compile)
    python benchmarks/dynamo_route.py --cases conv2d --parameters   # and the export route with IREE parameters
    python benchmarks/dynamo_route.py --models bert,llama,vit,resnet --resnet50 \
        --variants "compile, frozen;compile, frozen, batch norm folded"   # runtime.py's models, BN folded or not
    python benchmarks/dynamo_route.py --resnet50 --cases ResNet --isa avx2   # AVX2 (benchmarks/cpu_isa.py)

Per case, in one process, on the same input: torch eager; torch.compile
through the IREE backend with freezing off (every weight a run-time input,
the route before `backends/freezing.py`) and on (weights compiled in as
constants); the export route (`fx_rewrites.apply(ep, rules)` then
`IreeBackend.compile`: weights frozen as literals); with --parameters, the
export route's module with its weights as IREE parameters (globals read from
a parameter archive, `compiled.save(params=)` then `fx_rewrites.load`).
One thread each (torch.set_num_threads(1), IREE local-sync), CPU time of
the process (`time.process_time`), every variant called in turn round after
round, medians; outputs compared with eager: the largest |difference| is printed, and a line for each
variant not within rtol 1e-4, atol 1e-5. `--isa` picks the vector ISA measured
(benchmarks/cpu_isa.py: IREE's llvm-cpu target for it, torch held to its width).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from fx_rewrites.api import apply
from fx_rewrites.backends import freezing
from fx_rewrites.backends.dynamo import dynamo_backend
from fx_rewrites.backends.iree import CompileCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_isa

RTOL, ATOL = 1e-4, 1e-5


class Int8Conv(torch.nn.Module):
    """A conv whose weight is int8 with a per-channel scale, dequantized in forward: the form a PT2E-quantized
    model's weights take (`dequantize_per_channel` of a constant), here without torchao."""

    def __init__(self, c: int) -> None:
        super().__init__()
        weight = torch.randn(c, c, 3, 3)
        scale = weight.abs().amax((1, 2, 3)) / 127
        self.register_buffer("qweight", torch.round(weight / scale[:, None, None, None]).to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = torch.nn.Parameter(torch.randn(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.qweight.to(torch.float32) * self.scale[:, None, None, None]
        return torch.nn.functional.conv2d(x, weight, self.bias, padding=1)


def cases(resnet50: bool) -> dict[str, Callable[[], tuple[torch.nn.Module, torch.Tensor]]]:
    def conv(cls: type, c: int, groups: int, shape: tuple[int, ...]) -> Callable[[], Any]:
        return lambda: (cls(c, c, 3, padding=1, groups=groups), torch.randn(shape))

    out: dict[str, Callable[[], Any]] = {
        "conv2d 64->64 3x3, 56x56": conv(torch.nn.Conv2d, 64, 1, (1, 64, 56, 56)),
        "depthwise conv2d 64 3x3, 56x56": conv(torch.nn.Conv2d, 64, 64, (1, 64, 56, 56)),
        "grouped conv2d 64->64 g8 3x3, 56x56": conv(torch.nn.Conv2d, 64, 8, (1, 64, 56, 56)),
        "conv3d 32->32 3x3x3, 8x28x28": conv(torch.nn.Conv3d, 32, 1, (1, 32, 8, 28, 28)),
        "linear 1024->1024, batch 16": lambda: (torch.nn.Linear(1024, 1024), torch.randn(16, 1024)),
        "int8-weight conv2d 64->64 3x3, 56x56 (dequantized at run time)": lambda: (
            Int8Conv(64),
            torch.randn(1, 64, 56, 56),
        ),
    }
    if resnet50:

        def resnet() -> tuple[torch.nn.Module, torch.Tensor]:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from runtime_models import _tf  # transformers, importable on CPU torch with PyPI's torchvision

            transformers = _tf()
            return transformers.ResNetModel(transformers.ResNetConfig()), torch.randn(1, 3, 224, 224)

        out["ResNet-50 (transformers), 1x3x224x224"] = resnet
    return out


def output(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "last_hidden_state"):
        return value.last_hidden_state
    return value[0]


def runtime_cases(names: str) -> dict[str, Callable[[], tuple[torch.nn.Module, tuple, dict]]]:
    """benchmarks/runtime.py's models (`runtime_models.MODELS`, full size) by name."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from runtime_models import MODELS

    def make(spec: Any) -> Callable[[], tuple[torch.nn.Module, tuple, dict]]:
        return lambda: (spec.model(), *spec.inputs(False, 0))

    return {f"{name}: {MODELS[name].what}": make(MODELS[name]) for name in names.split(",") if name}


#: the torch.compile variants: label -> (freeze, fold batch norm into the frozen convolutions)
VARIANTS = {
    "compile, weights as inputs": (False, False),
    "compile, frozen": (True, False),
    "compile, frozen, batch norm folded": (True, True),
}


def measure(
    name: str,
    make: Callable[[], Any],
    repeat: int,
    parameters: bool,
    variants: list[str],
    isa: str = "host",
    also_without: str = "",
) -> dict[str, Any]:
    torch.manual_seed(0)
    made = make()
    model, args, kwargs = (made[0], (made[1],), {}) if len(made) == 2 else made
    model = model.eval()
    backend = cpu_isa.backend(isa, driver="local-sync", cache=CompileCache())
    fns: dict[str, Callable[[], Any]] = {"eager": lambda: model(*args, **kwargs)}
    compile_s: dict[str, float] = {}
    with torch.no_grad():
        expected = output(model(*args, **kwargs))
        backends = {"": backend, **{f" {k}": v for k, v in cpu_isa.without(backend, also_without).items()}}
        for suffix, each in backends.items():
            for variant in variants:
                freeze, fold = VARIANTS[variant]
                label = variant + suffix
                torch._dynamo.reset()
                compiled = torch.compile(model, backend=dynamo_backend(each, freeze=freeze, strict=True))
                start = time.perf_counter()
                with _folding(fold):
                    compiled(*args, **kwargs)  # compiles
                compile_s[label] = time.perf_counter() - start
                fns[label] = lambda compiled=compiled: compiled(*args, **kwargs)
        routes = {}
        for suffix, each in backends.items():
            start = time.perf_counter()
            ep = torch.export.export(model, args, kwargs)
            routes[suffix] = each.compile(apply(ep, each.rules).program, args)
            compile_s["export route" + suffix] = time.perf_counter() - start
            fns["export route" + suffix] = lambda route=routes[suffix]: route(*args, **kwargs)
        exported = routes[""]
        if parameters:
            import fx_rewrites
            from fx_rewrites.backends.iree.errors import IreeCompileError

            folder = Path(tempfile.mkdtemp())
            try:
                exported.save(folder / "m.vmfb", params=folder / "m.irpa")
            except IreeCompileError as e:  # IREE 3.13: an int8 global reads as si8, which it cannot lower
                print(f"  {name}, weights as IREE parameters: {str(e).splitlines()[0][:300]}")
            else:
                loaded = fx_rewrites.load(folder / "m.vmfb", params=folder / "m.irpa", driver="local-sync")
                fns["export route, weights as IREE parameters"] = lambda: loaded(*args, **kwargs)
        diffs = {}
        for label, fn in fns.items():
            got = output(fn())
            diffs[label] = (got - expected).abs().max().item()
            if not torch.allclose(got, expected, rtol=RTOL, atol=ATOL):
                print(
                    f"  {name}, {label}: not close to eager at rtol {RTOL}, atol {ATOL}: max |diff| {diffs[label]:.2e}"
                )
        times: dict[str, list[float]] = {label: [] for label in fns}
        for _ in range(repeat):
            for label, fn in fns.items():
                start = time.process_time()
                fn()
                times[label].append(time.process_time() - start)
    torch._dynamo.reset()
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"name": name, "ms": ms, "compile_s": compile_s, "max_diff": diffs, "scale": expected.abs().max().item()}


@contextlib.contextmanager
def _folding(on: bool) -> Iterator[None]:
    """Batch norm folded into the frozen convolutions (`backends/freezing_fold.py`) or not, while compiling."""
    real, env = freezing.fold_conv_affine, os.environ.get(freezing.FOLD_ENV)
    os.environ[freezing.FOLD_ENV] = "1" if on else "0"

    def counted(gm: Any) -> int:
        count = real(gm)
        print(f"  {count} per-channel ops folded into convolutions")
        return count

    freezing.fold_conv_affine = counted
    try:
        yield
    finally:
        freezing.fold_conv_affine = real
        if env is None:
            os.environ.pop(freezing.FOLD_ENV, None)
        else:
            os.environ[freezing.FOLD_ENV] = env


def table(rows: list[dict[str, Any]]) -> str:
    labels = list(max((row["ms"] for row in rows), key=len))
    lines = [
        "| case | " + " | ".join(f"{label} ms" for label in labels) + " | frozen / eager | frozen / export route |",
        "|---" * (len(labels) + 3) + "|",
    ]
    for row in rows:
        ms = row["ms"]
        cells = " | ".join(f"{ms[label]:.2f}" if label in ms else "failed" for label in labels)
        frozen = ms.get("compile, frozen", float("nan"))
        lines.append(f"| {row['name']} | {cells} | {frozen / ms['eager']:.2f}x | {frozen / ms['export route']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resnet50", action="store_true", help="add transformers' ResNet-50 (minutes of compile)")
    parser.add_argument("--cases", default="", help="comma-separated prefixes of the case names to run")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--parameters", action="store_true", help="also the export route with IREE parameters")
    parser.add_argument("--models", default="", help="benchmarks/runtime.py's models, e.g. bert,llama,vit,resnet")
    parser.add_argument(
        "--variants",
        default="compile, weights as inputs;compile, frozen",
        help=f"';'-separated torch.compile variants, of {list(VARIANTS)}",
    )
    cpu_isa.add_argument(parser)
    cpu_isa.add_without_argument(parser)
    args = parser.parse_args(argv)
    rc = cpu_isa.run_in_child(args.isa, __file__, argv)
    if rc is not None:
        return rc
    torch.set_num_threads(1)
    chosen = {
        k: v
        for k, v in cases(args.resnet50).items()
        if (not args.cases and not args.models)
        or (args.cases and k.startswith(tuple(args.cases.split(","))))
        or (args.resnet50 and k.startswith("ResNet-50"))
    }
    chosen.update(runtime_cases(args.models))
    variants = [v for v in args.variants.split(";") if v]
    print(
        f"{cpu_isa.header(args.isa)} torch {torch.__version__}; one thread each, CPU time, medians of "
        f"{args.repeat} rounds"
    )
    rows = []
    for name, make in chosen.items():
        row = measure(name, make, args.repeat, args.parameters, variants, args.isa, args.also_without)
        print(name, "ms", {k: round(v, 3) for k, v in row["ms"].items()})
        print("  compile s", {k: round(v, 1) for k, v in row["compile_s"].items()})
        print(
            "  max |diff| from eager",
            {k: f"{v:.1e}" for k, v in row["max_diff"].items()},
            f"max |eager| {row['scale']:.2f}",
        )
        sys.stdout.flush()
        rows.append(row)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
