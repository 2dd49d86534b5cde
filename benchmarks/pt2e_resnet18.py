"""PT2E int8 ResNet-18 (issue 33): torchao's static int8 flow through `fx_rewrites.compile`, against torch.

    python benchmarks/pt2e_resnet18.py                     # 1x3x224x224, one thread, CPU time, interleaved rounds
    python benchmarks/pt2e_resnet18.py --rounds 3 --no-inductor --isa avx2

Model: torchvision's `resnet18(weights=None)`, seeded, eval, with each BasicBlock's second ReLU its own module
(`untie_relus`: torchvision calls one `nn.ReLU` twice, and torchao's X86 quantizer refuses a module called twice:
"Input partition has more than one output node"; the numbers are the same). Quantized with torchao 0.18's PT2E flow:
`torch.export` -> `prepare_pt2e(X86InductorQuantizer(default config))` -> calibration on `CALIBRATION` seeded random
batches -> `convert_pt2e` (uint8 activations per tensor, int8 weights per channel, `quantized_decomposed` q/dq ops
around float convs and the linear), exported again.

Routes: `float eager` (the float model in torch), `PT2E eager` (the converted model in torch: float convs between
q/dq), `Inductor` (`torch.compile` of the converted model; torchao's X86 passes turn q/dq/conv into oneDNN's int8
convs only under `freezing`, set here), `IREE` (`fx_rewrites.compile` of the exported PT2E program, local-sync: its
convs as integer matmuls, backends/iree/rules/quantized_conv.py), `IREE, dq conv` (the same without that rule: float
convs of the dequantized operands).
One thread, CPU time (`time.process_time`), routes interleaved round by round, medians; ratios against float eager;
`IREE float`: the float model through `fx_rewrites.compile`, the anchor of what IREE's float convs cost. `max abs diff`
on the timed input: IREE float and PT2E eager against float eager (PT2E's: the quantization's own error), the IREE
PT2E routes and Inductor against PT2E eager. The output is the float logits of the last linear (1000 classes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cpu_isa

#: random calibration batches for the observers
CALIBRATION = 4
#: the rule whose absence the `IREE, dq conv` route measures (PT2E convs as float convs of dequantized operands)
INT_MM_RULE = "quantized_conv_as_int_mm_for_iree"
#: the compiled routes (`--routes`: a subset; the eager ones always run)
COMPILED = ("IREE float", "IREE", "IREE, dq conv", "Inductor")


def _untied_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """torchvision's BasicBlock.forward, with the second ReLU a module of its own (`relu_out`)."""
    identity = x if self.downsample is None else self.downsample(x)
    out = self.relu(self.bn1(self.conv1(x)))
    out = self.bn2(self.conv2(out))
    return self.relu_out(out + identity)


def untie_relus(model: torch.nn.Module) -> torch.nn.Module:
    """Give each torchvision BasicBlock a second ReLU module, so no module is called twice (same numbers)."""
    import torchvision

    for block in model.modules():
        if isinstance(block, torchvision.models.resnet.BasicBlock):
            block.relu_out = torch.nn.ReLU(inplace=True)
            block.forward = types.MethodType(_untied_forward, block)
    return model


def resnet18() -> torch.nn.Module:
    """torchvision's ResNet-18, random weights seeded 0, eval, ReLUs untied."""
    from tests.zoo import torchvision_cpu

    torchvision_cpu.install()  # PyPI's torchvision is a CUDA build
    import torchvision

    torch.manual_seed(0)
    return untie_relus(torchvision.models.resnet18(weights=None).eval())


def pt2e_quantize(
    model: torch.nn.Module, example: torch.Tensor, batches: int = CALIBRATION, dynamic_shapes: Any = None
) -> torch.nn.Module:
    """torchao's PT2E static int8 (X86 quantizer's default config), calibrated on seeded random batches. Export
    the result again with the same `dynamic_shapes` (the first export's sizes are fixed in the converted graph)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(torch.export.export(model, (example,), dynamic_shapes=dynamic_shapes).module(), quantizer)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(batches):
            prepared(torch.randn(example.shape, generator=generator))
    return convert_pt2e(prepared)


def inductor(quantized: torch.nn.Module, example: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """`torch.compile` of the PT2E model with `freezing` (torchao's X86 passes fold q/dq/conv into oneDNN int8)."""
    import torch._inductor.config as config

    config.freezing = True
    compiled = torch.compile(quantized)
    with torch.no_grad():
        compiled(example)
    return compiled


def routes(
    isa: str, use_inductor: bool, example: torch.Tensor, compiled: tuple[str, ...] = COMPILED
) -> tuple[dict[str, Any], dict[str, float]]:
    """name -> callable (or why the route failed), and the compile seconds of the compiled routes (those of
    `compiled` that are built; Inductor's only with `use_inductor`)."""
    import fx_rewrites

    model = resnet18()
    quantized = pt2e_quantize(model, example)
    out: dict[str, Any] = {"float eager": model, "PT2E eager": quantized}
    seconds: dict[str, float] = {}
    backend = cpu_isa.backend(isa, driver="local-sync")
    without_int_mm = attrs.evolve(backend, rules=backend.rules.without(INT_MM_RULE))
    builders = {
        "IREE float": lambda: fx_rewrites.compile(torch.export.export(model, (example,)), (example,), backend=backend),
        "IREE": lambda: fx_rewrites.compile(torch.export.export(quantized, (example,)), (example,), backend=backend),
        "IREE, dq conv": lambda: fx_rewrites.compile(
            torch.export.export(quantized, (example,)), (example,), backend=without_int_mm
        ),
    }
    if use_inductor:
        builders["Inductor"] = lambda: inductor(quantized, example)
    for name, build in builders.items():
        if name not in compiled:
            continue
        start = time.perf_counter()
        try:
            out[name] = build()
        except Exception as e:  # a route that fails is a row saying why
            out[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        seconds[name] = time.perf_counter() - start
    return out, seconds


def measure(runs: dict[str, Any], x: torch.Tensor, rounds: int) -> dict[str, Any]:
    """name -> (median CPU ms, max |d| against PT2E eager), routes interleaved round by round."""
    callables = {name: f for name, f in runs.items() if not isinstance(f, str)}
    with torch.no_grad():
        outputs = {name: f(x) for name, f in callables.items()}  # warm-up, and the numbers compared
        times: dict[str, list[float]] = {name: [] for name in callables}
        for _ in range(rounds):
            for name, f in callables.items():
                start = time.process_time()
                f(x)
                times[name].append(time.process_time() - start)
    results: dict[str, Any] = {name: f for name, f in runs.items() if isinstance(f, str)}
    for name in callables:  # the float routes against float eager, the quantized ones against PT2E eager
        reference = outputs["float eager" if name in ("float eager", "PT2E eager", "IREE float") else "PT2E eager"]
        diff = (outputs[name] - reference).abs().max().item()
        results[name] = (statistics.median(times[name]) * 1e3, diff)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--no-inductor", action="store_true")
    parser.add_argument("--routes", nargs="+", default=list(COMPILED), choices=COMPILED, help="compiled routes")
    cpu_isa.add_argument(parser)
    args = parser.parse_args(argv)
    if (rc := cpu_isa.run_in_child(args.isa, __file__, argv)) is not None:
        return rc
    torch.set_num_threads(1)
    example = torch.randn(args.batch, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    runs, seconds = routes(args.isa, not args.no_inductor, example, tuple(args.routes))
    x = torch.randn(example.shape, generator=torch.Generator().manual_seed(3))
    results = measure(runs, x, args.rounds)
    print(f"# ResNet-18 {tuple(x.shape)}, PT2E int8 (X86 quantizer), 1 thread, CPU time, median of {args.rounds}")
    print(f"{cpu_isa.header(args.isa)} Load average: {' '.join(f'{v:.1f}' for v in os.getloadavg())}.")
    print("| route | ms | x float eager | max abs diff | compile s |")
    print("|---|---:|---:|---:|---:|")
    base = results["float eager"][0]
    for name, value in results.items():
        compile_s = f"{seconds[name]:.0f}" if name in seconds else "-"
        if isinstance(value, str):
            print(f"| {name} | - | - | {value} | {compile_s} |")
            continue
        print(f"| {name} | {value[0]:.1f} | {value[0] / base:.2f} | {value[1]:.3g} | {compile_s} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
