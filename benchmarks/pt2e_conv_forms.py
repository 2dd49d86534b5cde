"""One PT2E int8 convolution in two forms on IREE (issue 33): what an integer convolution would gain.

    python benchmarks/pt2e_conv_forms.py            # ResNet-18's 3x3 convs of each stage, 1 thread, CPU time

`dq conv`: what a PT2E model holds and IREE compiles today: `quantize_per_tensor` of the float input (uint8, zero
point 3), `dequantize_per_tensor`, and a float convolution with the `dequantize_per_channel` int8 weight (IREE folds
the weight's dequantize at load). `int8 matmul`: the same product in integers, by hand: the uint8 input shifted to
int8 (minus 128), padded with the shifted zero point, its 3x3 windows gathered as strided slices (im2col), one
`torch._int_mm` (i8 x i8 -> i32, which IREE data-tiles onto its s8s8s32 microkernel) with the weight as an int8
[9C, C] matrix, plus the per-channel (128 - zero point) x sum(weight) correction, times scale_x x scale_w, plus
the bias. Not a rule yet: the prototype of one (benchmarks/pt2e_resnet18.py measures the whole model). `torch`: the
`dq conv` module in torch eager (its weight dequantized each call, as PT2E eager does). Medians of interleaved
rounds; `max |d|`: the int8 form against torch's `dq conv` (float32 sums in another order).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu_isa

#: (channels, height = width) of ResNet-18's 3x3 stride-1 convs, one per stage
SHAPES = ((64, 56), (128, 28), (256, 14), (512, 7))
#: the activation's quantization (a float32 scale, as PT2E's observers give) and zero point
SCALE, ZERO = float(torch.tensor(0.02)), 3


class DqConv(torch.nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        w = torch.randn(channels, channels, 3, 3, generator=torch.Generator().manual_seed(0))
        scale = w.abs().amax((1, 2, 3)) / 127
        self.register_buffer("wq", torch.round(w / scale[:, None, None, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("zeros", torch.zeros(channels, dtype=torch.int64))
        self.register_buffer("bias", torch.randn(channels, generator=torch.Generator().manual_seed(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qd = torch.ops.quantized_decomposed
        xq = qd.quantize_per_tensor(x, SCALE, ZERO, 0, 255, torch.uint8)
        xf = qd.dequantize_per_tensor(xq, SCALE, ZERO, 0, 255, torch.uint8)
        w = qd.dequantize_per_channel(self.wq, self.scale, self.zeros, 0, -128, 127, torch.int8)
        return torch.nn.functional.conv2d(xf, w, self.bias, padding=1)


class Int8Matmul(DqConv):
    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.register_buffer("wmat", self.wq.permute(2, 3, 1, 0).reshape(9 * channels, channels).contiguous())
        self.register_buffer("correction", (128 - ZERO) * self.wq.to(torch.int32).sum((1, 2, 3)))
        self.register_buffer("out_scale", SCALE * self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qd = torch.ops.quantized_decomposed
        xq = qd.quantize_per_tensor(x, SCALE, ZERO, 0, 255, torch.uint8)
        n, c, h, w = xq.shape
        shifted = (xq.to(torch.int16) - 128).to(torch.int8)
        padded = torch.nn.functional.pad(shifted, (1, 1, 1, 1), value=ZERO - 128)
        windows = torch.stack([padded[:, :, i : i + h, j : j + w] for i in range(3) for j in range(3)], 1)
        cols = windows.permute(0, 3, 4, 1, 2).reshape(n * h * w, 9 * c)
        acc = torch._int_mm(cols, self.wmat) + self.correction
        out = acc.to(torch.float32) * self.out_scale + self.bias
        return out.reshape(n, h, w, -1).permute(0, 3, 1, 2)


def main(argv: list[str] | None = None) -> int:
    import torch.ao.quantization.fx._decomposed  # defines the quantized_decomposed ops

    import fx_rewrites

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    cpu_isa.add_argument(parser)
    args = parser.parse_args(argv)
    if (rc := cpu_isa.run_in_child(args.isa, __file__, argv)) is not None:
        return rc
    torch.set_num_threads(1)
    backend = cpu_isa.backend(args.isa, driver="local-sync")
    print(f"# one PT2E 3x3 conv, batch 1, 1 thread, CPU time ms per call, median of {args.rounds} rounds")
    print(f"{cpu_isa.header(args.isa)} Load average: {' '.join(f'{v:.1f}' for v in os.getloadavg())}.")
    print("| C x H x W | IREE dq conv | IREE int8 matmul | x | torch dq conv | max abs diff (int8 vs torch) |")
    print("|---|---:|---:|---:|---:|---:|")
    for channels, size in SHAPES:
        x = 2 * torch.rand(1, channels, size, size, generator=torch.Generator().manual_seed(2))
        eager = DqConv(channels).eval()
        forms = {"torch": eager}
        for name, cls in (("dq", DqConv), ("int", Int8Matmul)):
            module = cls(channels).eval()
            forms[name] = fx_rewrites.compile(torch.export.export(module, (x,)), (x,), backend=backend)
        times: dict[str, list[float]] = {name: [] for name in forms}
        with torch.no_grad():
            diff = (forms["int"](x) - eager(x)).abs().max().item()
            for _ in range(args.rounds):
                for name, f in forms.items():
                    f(x)
                    start = time.process_time()
                    for _ in range(args.calls):
                        f(x)
                    times[name].append((time.process_time() - start) / args.calls * 1e3)
        ms = {name: statistics.median(t) for name, t in times.items()}
        print(
            f"| {channels} x {size} x {size} | {ms['dq']:.2f} | {ms['int']:.2f} | {ms['dq'] / ms['int']:.2f} "
            f"| {ms['torch']:.2f} | {diff:.2g} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
