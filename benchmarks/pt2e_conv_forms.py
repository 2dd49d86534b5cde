"""One PT2E int8 convolution per ResNet-18 form on IREE, with and without the integer-matmul rule (issue 33).

    python benchmarks/pt2e_conv_forms.py            # ResNet-18's conv forms, 1 thread, CPU time
    python benchmarks/pt2e_conv_forms.py --isa avx2 --forms 1x1 stem

The module is what a PT2E model holds: `quantize_per_tensor` of the float input (uint8, zero point 3),
`dequantize_per_tensor`, and a float convolution with the `dequantize_per_channel` int8 weight. `dq conv`: IREE
without `quantized_conv_as_int_mm_for_iree` (a float32 conv of the dequantized operands; IREE folds the weight's
dequantize at load). `int mm`: with it (backends/iree/rules/quantized_conv.py: int8 im2col padded with the zero
point, `aten._int_mm`, i8 x i8 -> i32 on IREE's s8s8s32 microkernel, the zero points' terms, times the scales).
`torch`: the module in torch eager (its weight dequantized each call, as PT2E eager does). Medians of
interleaved rounds; `max |d|`: the `int mm` form against torch's (float32 sums in another order).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu_isa

#: ResNet-18's conv forms at 224x224: name -> (in channels, out channels, kernel, stride, padding, input size)
SHAPES = {
    "stem 7x7/2": (3, 64, 7, 2, 3, 224),
    "3x3 64": (64, 64, 3, 1, 1, 56),
    "3x3 128": (128, 128, 3, 1, 1, 28),
    "3x3 256": (256, 256, 3, 1, 1, 14),
    "3x3 512": (512, 512, 3, 1, 1, 7),
    "3x3/2 64->128": (64, 128, 3, 2, 1, 56),
    "3x3/2 256->512": (256, 512, 3, 2, 1, 14),
    "1x1/2 64->128": (64, 128, 1, 2, 0, 56),
    "1x1/2 256->512": (256, 512, 1, 2, 0, 14),
}
#: the rule measured
RULE = "quantized_conv_as_int_mm_for_iree"
#: the activation's quantization (a float32 scale, as PT2E's observers give) and zero point
SCALE, ZERO = float(torch.tensor(0.02)), 3


class DqConv(torch.nn.Module):
    def __init__(self, channels: int, out: int, kernel: int, stride: int, padding: int) -> None:
        super().__init__()
        w = torch.randn(out, channels, kernel, kernel, generator=torch.Generator().manual_seed(0))
        scale = w.abs().amax((1, 2, 3)) / 127
        self.register_buffer("wq", torch.round(w / scale[:, None, None, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("zeros", torch.zeros(out, dtype=torch.int64))
        self.register_buffer("bias", torch.randn(out, generator=torch.Generator().manual_seed(1)))
        self.stride, self.padding = stride, padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qd = torch.ops.quantized_decomposed
        xq = qd.quantize_per_tensor(x, SCALE, ZERO, 0, 255, torch.uint8)
        xf = qd.dequantize_per_tensor(xq, SCALE, ZERO, 0, 255, torch.uint8)
        w = qd.dequantize_per_channel(self.wq, self.scale, self.zeros, 0, -128, 127, torch.int8)
        return torch.nn.functional.conv2d(xf, w, self.bias, stride=self.stride, padding=self.padding)


def main(argv: list[str] | None = None) -> int:
    import torch.ao.quantization.fx._decomposed  # defines the quantized_decomposed ops

    import fx_rewrites

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--forms", nargs="*", help="only the forms whose name holds one of these, e.g. 1x1")
    cpu_isa.add_argument(parser)
    args = parser.parse_args(argv)
    if (rc := cpu_isa.run_in_child(args.isa, __file__, argv)) is not None:
        return rc
    torch.set_num_threads(1)
    backend = cpu_isa.backend(args.isa, driver="local-sync")
    backends = {"dq": attrs.evolve(backend, rules=backend.rules.without(RULE)), "int": backend}
    print(f"# one PT2E conv, batch 1, 1 thread, CPU time ms per call, median of {args.rounds} rounds")
    print(f"{cpu_isa.header(args.isa)} Load average: {' '.join(f'{v:.1f}' for v in os.getloadavg())}.")
    print("| conv (C_in x H x W) | IREE dq conv | IREE int mm | x | torch dq conv | max abs diff (int mm vs torch) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (channels, out, kernel, stride, padding, size) in SHAPES.items():
        if args.forms and not any(part in name for part in args.forms):
            continue
        x = 2 * torch.rand(1, channels, size, size, generator=torch.Generator().manual_seed(2))
        eager = DqConv(channels, out, kernel, stride, padding).eval()
        forms = {"torch": eager}
        failed = {}
        for form, form_backend in backends.items():
            try:
                forms[form] = fx_rewrites.compile(torch.export.export(eager, (x,)), (x,), backend=form_backend)
            except Exception as e:  # a form IREE fails to compile is a row saying why
                failed[form] = f"fails: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
        times: dict[str, list[float]] = {form: [] for form in forms}
        with torch.no_grad():
            diff = (forms["int"](x) - eager(x)).abs().max().item() if "int" in forms else float("nan")
            for _ in range(args.rounds):
                for form, f in forms.items():
                    f(x)
                    start = time.process_time()
                    for _ in range(args.calls):
                        f(x)
                    times[form].append((time.process_time() - start) / args.calls * 1e3)
        ms = {form: f"{statistics.median(t):.2f}" for form, t in times.items()} | failed
        ratio = f"{float(ms['dq']) / float(ms['int']):.2f}" if not failed else "-"
        print(
            f"| {name} ({channels} x {size} x {size}) | {ms['dq']} | {ms['int']} | {ratio} | {ms['torch']} "
            f"| {diff:.2g} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
