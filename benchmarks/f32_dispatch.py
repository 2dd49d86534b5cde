"""Hand-written float32 matmul dispatches for IREE 3.13 (issue 32): a register block per ISA against IREE's product.

    python benchmarks/f32_dispatch.py                              # the four shapes of issue 32's products
    python benchmarks/f32_dispatch.py --shapes 128x1024x1024 --kc 256,512 --per 4,8
    python benchmarks/f32_dispatch.py --isa avx512 --rows 12,14 --bias   # AVX-512's 32-channel blocks, with a bias

`--isa avx512` times AVX-512's block (`f32_dispatch.BLOCKS`: 12x32 in zmm; `--rows` others of 32 channels),
otherwise AVX2's 6x16 (described below). `--bias`: y = x @ W^T + b, the kernel adding b in its first store of y
(`f32_linear`), and also the kernel followed by a separate add (`+ add`), against IREE's and torch's linear with a
bias.

y[M, N] = x[M, K] @ W^T, W [N, K] held by the program and laid out at build time as [N/16, K, 16] (`pack`): a strip
of 16 output channels, K-major, two ymm a step of K. The kernel (`executable`) keeps a 6x16 block of y in 12 ymm
accumulators; per step of K it loads the strip's two vectors and broadcasts x's six values (row-major x, one
`vbroadcastss` each) into 12 FMAs (oneDNN's AVX2 shape; IREE's `mmt4d` 8x8x1 does 8 broadcasts + 1 load per 8
FMAs). The loops, outer to inner: K blocks of `kc` (the strip's block, 16 kc floats, stays in L1 across the row
blocks; y is re-read between K blocks), row chunks of `mc` rows (x's block in L2), the workgroup's `per` strips,
blocks of 6 rows (the M % 6 left over by a block of that many), the K steps unrolled by 4. Workgroups go over
the strips (N / 16 / per of them).

It enters a graph as the custom op `fx_rewrites::f32_matmul(x, packed, n, 2, per)` (the kernel, its op and splice in
`backends/iree/f32_dispatch.py`; the rule `rules/f32_matmul.py`). Timed alone, one thread (`iree-benchmark-module`
local-sync, median CPU time of its repetitions) against IREE's own compile of `linear(x, W)` (the backend's flags
for the ISA, its performance flags, aggressive fusion) and torch's eager `F.linear` (one thread, CPU time),
interleaved rounds; each output against float64, beside torch's own float32 error. `--x-pad` (default: the ISA's
`f32_dispatch.X_PAD`) sets x's row copy where it applies; the tool's heap allocator maps the copy's transient afresh
at every call (page faults the library's caching allocator does not pay: docs/performance.md, "x's rows 4 KiB
apart"), so time that form with `iree-benchmark-module --device_allocator=caching` too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_dispatch import compile_form, cpu_ms, eager_ms, run_vmfb  # benchmarks/int4_dispatch.py

from fx_rewrites.backends.iree.f32_dispatch import BLOCKING, BLOCKS, X_PAD, Block, f32_linear, f32_matmul, pack


class Dispatch(torch.nn.Module):
    """The kernel of `block` (`b`: the bias in its store; `separate`: added after it)."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, per: int, block: Block, separate: bool = False) -> None:
        super().__init__()
        self.n, self.per, self.tile, self.separate = w.shape[0], per, block.tile, separate
        self.register_buffer("packed", pack(w, block.strip))
        self.register_buffer("b", b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.b is None or self.separate:
            y = f32_matmul(x, self.packed, self.n, self.tile, self.per)
            return y if self.b is None else y + self.b
        return f32_linear(x, self.packed, self.b, self.n, self.tile, self.per)


class Linear(torch.nn.Module):
    def __init__(self, w: torch.Tensor, b: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("w", w)
        self.register_buffer("b", b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w, self.b)


def run(argv: list[str] | None = None) -> int:
    import os

    from cpu_isa import backend, cpu_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="128x1024x1024,788x256x1024,788x1024x256,3136x576x64", help="MxKxN")
    parser.add_argument("--per", default="4", help="strips of 16 channels a workgroup, comma separated")
    parser.add_argument("--kc", default="256", help="K blocks, comma separated")
    parser.add_argument("--mc", default="96", help="row chunks, comma separated")
    parser.add_argument("--ks", default="128", help="K steps summed from zero before added to y, comma separated")
    parser.add_argument("--x-pad", default="", help="x's rows padded by (`f32_dispatch.X_PAD`), comma separated")
    parser.add_argument("--rows", default="", help="AVX-512: the block's rows (of 32 channels), comma separated")
    parser.add_argument("--bias", action="store_true", help="a bias: in the kernel's store, and added after it")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--isa", default="host", choices=("host", "avx2", "avx512"))
    parser.add_argument("--keep", default="")
    parser.add_argument("--no-iree", action="store_true", help="skip IREE's own linear")
    parser.add_argument("--reuse", action="store_true", help="time the .vmfb files --keep holds, not recompiled")
    parser.add_argument("--compile-only", action="store_true", help="compile into --keep, time nothing")
    args = parser.parse_args(argv)
    iree = backend(args.isa)
    flags = [*iree.flags, *iree.perf_flags, "--iree-dispatch-creation-enable-aggressive-fusion"]
    print(f"CPU: {cpu_model()}; IREE flags {' '.join(iree.flags)}; load {os.getloadavg()}")
    print(time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    isa = "avx512" if args.isa == "avx512" or (args.isa == "host" and iree.target.isa == "avx512") else "avx2"
    default = BLOCKS[isa]
    blocks = [Block(default.lanes, default.vectors, int(r)) for r in args.rows.split(",")] if args.rows else [default]
    pads = [int(p) for p in args.x_pad.split(",")] if args.x_pad else [X_PAD[isa]]
    variants = [(bl, int(p), int(kc), int(mc), int(ks), xp) for bl in blocks for p in args.per.split(",")
                for kc in args.kc.split(",") for mc in args.mc.split(",") for ks in args.ks.split(",")
                for xp in pads]  # fmt: skip
    print(f"blocks ({isa}): {', '.join(b.name for b in blocks)}; bias: {args.bias}")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.keep or scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        for shape in args.shapes.split(","):
            m, k, n = map(int, shape.split("x"))
            gen = torch.Generator().manual_seed(0)
            w = torch.randn(n, k, generator=gen) / k**0.5
            x = torch.randn(m, k, generator=gen)
            b = torch.randn(n, generator=gen) if args.bias else None
            ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
            torch_err = (torch.nn.functional.linear(x, w, b).double() - ref).abs().max().item()
            vmfbs: dict[str, Path] = {}
            if not args.no_iree:
                vmfbs["IREE linear"] = tmp / f"iree_{shape}.vmfb"
                if not (args.reuse and vmfbs["IREE linear"].exists()):
                    compile_form(Linear(w, b), x, flags, vmfbs["IREE linear"])
            default_pad = X_PAD[isa]
            for block, per, kc, mc, ks, xp in variants:
                BLOCKING.update(kc=kc, mc=mc, ks=ks)
                BLOCKS[isa], X_PAD[isa] = block, xp
                for separate in (False, True) if args.bias else (False,):
                    name = f"dispatch {block.name} p{per} kc{kc} mc{mc} ks{ks} xpad{xp}{' + add' if separate else ''}"
                    stem = f"f32_{shape}_{block.name}_p{per}_kc{kc}_mc{mc}_ks{ks}_x{xp}_{int(separate)}"
                    vmfbs[name] = tmp / f"{stem}.vmfb"
                    if not (args.reuse and vmfbs[name].exists()):
                        compile_form(Dispatch(w, b, per, block, separate), x, flags, vmfbs[name])
            BLOCKS[isa], X_PAD[isa] = default, default_pad
            if args.compile_only:
                continue
            errs = {name: (run_vmfb(v, x).double() - ref).abs().max().item() for name, v in vmfbs.items()}
            times: dict[str, list[float]] = {name: [] for name in [*vmfbs, "torch F.linear"]}
            for _ in range(args.rounds):
                for name, vmfb in vmfbs.items():
                    times[name].append(cpu_ms(vmfb, m, k, args.repetitions))
                times["torch F.linear"].append(eager_ms(Linear(w, b), x, args.repetitions, calls=10))
            errs["torch F.linear"] = torch_err
            eager = statistics.median(times["torch F.linear"])
            own = statistics.median(times.get("IREE linear") or [float("nan")])
            print(f"\n{m} x {k} -> {n} (load {os.getloadavg()[0]:.1f})")
            print("| form | ms CPU, median | min-max | / torch | / IREE's | max abs err vs float64 |")
            print("|---|---:|---:|---:|---:|---:|")
            for name, ts in times.items():
                ms = statistics.median(ts)
                print(f"| {name} | {ms:.3f} | {min(ts):.3f}-{max(ts):.3f} | {ms / eager:.2f} | {ms / own:.2f} | "
                      f"{errs[name]:.2e} |", flush=True)  # fmt: skip
    print(time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
