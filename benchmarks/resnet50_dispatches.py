"""ResNet-50 dispatch by dispatch through the export route, beside eager's convolutions by class (issue 32).

    python benchmarks/resnet50_dispatches.py                        # this host's ISA, the route's flags
    python benchmarks/resnet50_dispatches.py --extra-flags=--iree-llvmcpu-matmul-tile-bytes=524288
    python benchmarks/resnet50_dispatches.py --keep DIR             # keep module.mlir and module.vmfb in DIR

transformers' default `ResNetConfig` (ResNet-50), batch 1, 1x3x224x224. The model is exported, rewritten by the
default `iree` rules of the ISA's llvm-cpu target (benchmarks/cpu_isa.py), imported with its weights inline and
compiled with that target's flags (plus `--extra-flags`, comma-separated); `iree-benchmark-module` (local-sync: one
thread) gives the plain median CPU time of a call, then a profiled run
(`--device_profiling_mode=host-execution,executable-metadata`, `iree-profile statistics`) each dispatch function's
calls and host wall time per call, grouped by kind (`mmt4d` / `batch_mmt4d` products, packs, unpacks, the rest).
Eager is profiled by `torch.profiler` (one thread, the median of `--rounds` profiled calls' self CPU time per op),
its convolutions grouped by class (kernel, stride, channels). Times are wall time inside a profile and move with
the host's load: compare the shares and the rows of one run.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_profile import per_call

MEDIAN = re.compile(r"real_time_median\s+([\d.]+) (\w+)\s+([\d.]+) (\w+)")
UNITS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def model_and_input() -> tuple[Any, Any]:
    """ResNet-50 (transformers' default config, seed 0) in eval mode and a 1x3x224x224 input."""
    from tests.zoo import torchvision_cpu

    torchvision_cpu.install()
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.ResNetModel(transformers.ResNetConfig()).eval()
    return model, torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))


def route_mlir(model: Any, x: Any, isa: str) -> tuple[str, list[str]]:
    """The model exported, rewritten by the `iree` rules for `isa`, imported (weights inline); the target's flags."""
    import cpu_isa
    import torch

    import fx_rewrites
    from fx_rewrites.backends.iree import kernels
    from fx_rewrites.backends.iree.importing import import_mlir, iree_modules
    from fx_rewrites.backends.iree.preparing import prepare_program

    iree = cpu_isa.backend(isa)
    with torch.no_grad():
        rewritten = fx_rewrites.apply(torch.export.export(model, (x,)), iree.rules).program
    mlir = import_mlir(iree_modules(), prepare_program(rewritten)[0])
    # the hand-written dispatches spliced, as IreeBackend does (the AVX2 route's float32 linears are one)
    return kernels.spliced(str(mlir)), [*iree.flags, *iree.perf_flags]


def kind(name: str) -> str:
    """A dispatch function's kind from its name."""
    for key in ("batch_mmt4d", "mmt4d", "unpack", "pack", "conv", "matmul"):
        if key in name:
            return key
    return "other"


def iree_profile(vmfb: Path, repetitions: int, workdir: Path) -> tuple[float, float, list[tuple[str, float, float]]]:
    """(plain median CPU ms a call, profiled command buffer ms a call, [(function, calls a call, ms a call)])."""
    base = ["iree-benchmark-module", f"--module={vmfb}", "--device=local-sync", "--function=main"]
    base.append("--input=1x3x224x224xf32=0.5")
    plain = subprocess.run([*base, f"--benchmark_repetitions={repetitions}"], capture_output=True, text=True)
    found = MEDIAN.search(plain.stdout)
    if not found:
        raise RuntimeError(f"no median: {plain.stdout[-500:]} {plain.stderr[-500:]}")
    out = workdir / "resnet50.ireeprof"
    flags = ["--benchmark_repetitions=3", "--device_profiling_mode=host-execution,executable-metadata"]
    subprocess.run([*base, *flags, f"--device_profiling_output={out}"], capture_output=True, check=True)
    stats = subprocess.run(["iree-profile", "statistics", "--format=jsonl", str(out)], capture_output=True, text=True)
    calls = per_call([json.loads(line) for line in stats.stdout.splitlines() if line.strip()])
    functions = [(re.sub(r"^main\$async_", "", name), n, ms) for name, n, ms in calls["functions"]]
    return float(found.group(3)) * UNITS[found.group(4)], calls["execute"], functions


def conv_label(conv: Any) -> str:
    """`conv 3x3/2 128->128 56x56`-style class of a Conv2d (its input size filled in by the hook)."""
    kh, kw = conv.kernel_size
    stride = f"/{conv.stride[0]}" if conv.stride[0] != 1 else ""
    return f"conv {kh}x{kw}{stride} {conv.in_channels}->{conv.out_channels}"


def eager_profile(model: Any, x: Any, rounds: int) -> tuple[float, dict[str, float], dict[str, int]]:
    """(median CPU ms of a call unprofiled, {conv class or op: median CPU ms a call in the profile}, {class: count}).
    Each Conv2d runs inside a `record_function` named by its class and input size."""
    import time

    import torch

    torch.set_num_threads(1)

    def wrap(conv: Any) -> None:
        forward = conv.forward

        def labelled(inp: Any) -> Any:
            with torch.profiler.record_function(f"{conv_label(conv)} {inp.shape[2]}x{inp.shape[3]}"):
                return forward(inp)

        conv.forward = labelled

    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d):
            wrap(module)
    ops = ("aten::batch_norm", "aten::relu_", "aten::relu", "aten::add_", "aten::add", "aten::max_pool2d")
    times: list[float] = []
    per: dict[str, list[float]] = collections.defaultdict(list)
    counts: dict[str, int] = {}
    with torch.no_grad():
        model(x)
        for _ in range(rounds):
            start = time.process_time()
            model(x)
            times.append((time.process_time() - start) * 1e3)
        for _ in range(rounds):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                model(x)
            bucket: dict[str, float] = collections.defaultdict(float)
            seen: dict[str, int] = collections.defaultdict(int)
            for event in prof.events():
                if event.name.startswith("conv ") or event.name in ops:
                    bucket[event.name] += event.cpu_time_total / 1e3
                    seen[event.name] += 1
            for k, v in bucket.items():
                per[k].append(v)
            counts = dict(seen)
    return statistics.median(times), {k: statistics.median(v) for k, v in per.items()}, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", default="host", choices=("host", "avx2", "avx512"))
    parser.add_argument("--extra-flags", default="", help="comma-separated iree-compile flags added to the route's")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5, help="eager's profiled calls")
    parser.add_argument("--keep", type=Path, default=None, help="a folder to keep module.mlir and module.vmfb in")
    parser.add_argument("--no-eager", action="store_true")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    import cpu_isa

    print(cpu_isa.header(args.isa))
    model, x = model_and_input()
    if not args.no_eager:
        eager_ms, eager, counts = eager_profile(model, x, args.rounds)
        print(f"\n# eager: median CPU {eager_ms:.1f} ms a call; torch.profiler self+children CPU ms by class")
        print("| class | count | ms | share |\n|---|---:|---:|---:|")
        total = sum(eager.values())
        for k, v in sorted(eager.items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {counts.get(k, 0)} | {v:.2f} | {v / total:.1%} |")
    mlir, flags = route_mlir(model, x, args.isa)
    flags += [f for f in args.extra_flags.split(",") if f]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        (work / "module.mlir").write_text(mlir)
        vmfb = work / "module.vmfb"
        compile_ = ["iree-compile", "--iree-input-type=torch", "--iree-hal-target-backends=llvm-cpu", *flags]
        subprocess.run([*compile_, str(work / "module.mlir"), "-o", str(vmfb)], check=True)
        cpu, execute, functions = iree_profile(vmfb, args.repetitions, Path(tmp))
    print(f"\n# route ({' '.join(flags)}): plain median CPU {cpu:.1f} ms a call; profiled command buffer "
          f"{execute:.1f} ms a call (wall)")  # fmt: skip
    by_kind: dict[str, float] = collections.defaultdict(float)
    for name, _, ms in functions:
        by_kind[kind(name)] += ms
    print("| kind | ms | share |\n|---|---:|---:|")
    for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v:.2f} | {v / execute:.1%} |")
    print("\n| dispatch | a call | ms | share |\n|---|---:|---:|---:|")
    for name, count, ms in functions[: args.top]:
        print(f"| `{name}` | {count:g} | {ms:.3f} | {ms / execute:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
