"""A hand-written int4 g32 matvec dispatch for IREE 3.13 (issue 33): the kernel written by us, not derived by IREE.

    python benchmarks/int4_dispatch.py                          # 2816 x 1024 and 32000 x 1024, one row
    python benchmarks/int4_dispatch.py --shapes 2816 --rounds 5 --tiles 4,8
    python benchmarks/int4_dispatch.py --zeros                  # also the kernel with zero points (asymmetric)

The weight's int4 values are stored eight to an int32 word, two a byte (half int8's bytes): for a block of
8 * `tile` output channels and a group of 32 positions, word (w, t, c) holds channel 8t + c's values at positions
8w .. 8w + 7 of the group, value p in bits 4p .. 4p + 3 ([N / (8 tile), G, 4, tile, 8] int32). The kernel runs
along the output channels, one ymm lane a channel: value p of a word is `(word << (28 - 4p)) & 0xF0000000` (q * 2^28,
exact; value 0 needs the shift only, value 7 the mask only), converted by `sitofp` and multiplied into `tile`
group accumulators by x[32g + 8w + p] broadcast; each group's sum is then multiplied by its scales (s * 2^-28,
exact) into `tile` running totals: per 8 values one shift, one and, one convert, one FMA and a share of a broadcast.

It is MLIR we write (scf loops, vector and arith ops over the bindings' memrefs) in a `stream.executable`
(IREE's samples/custom_dispatch/cpu/embedded/example_stream.mlir form, without the external object): IREE compiles
its body as it is, with no tiling or vectorization of its own, and links it like any dispatch. It enters the model
through the backend's `torch.library` custom op (`fx_rewrites::int4_matvec`, eager: the same values unpacked by torch;
the kernel, packing and splice live in `backends/iree/int4_dispatch.py`): torch.export
keeps it as one node, torch-mlir imports it as `torch.operator "torch.fx_rewrites.int4_matvec"`, and `splice` replaces
that line with a `flow.dispatch` of the executable between `torch_c` conversions (the step IreeBackend runs
on the module text). The row count may be static or a `Dim` (then an index operand of the dispatch).

Timed against `benchmarks/int4_forms.py`'s forms on the same weights (`int4_tiles4_symmetric`: the rule's int4 form,
one value a byte; `int8_blocked`: int8 per channel; `f32`), compiled with the backend's flags, each run by
`iree-benchmark-module` (local-sync: one thread; the median CPU time of its repetitions), the forms interleaved in
rounds, with torch's eager float32 `linear` (one thread, CPU time) in each round.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fx_rewrites.backends.iree import kernels
from fx_rewrites.backends.iree.int4_dispatch import (
    GROUP,
    UNIT,
    asym_int4_matvec,
    executable,
    int4_matvec,
    pack_scales,
    pack_words,
    pack_zeros,
    splice,
    unpack,
)

__all__ = [
    "GROUP",
    "Int4Dispatch",
    "compile_form",
    "cpu_ms",
    "eager_ms",
    "executable",
    "pack_scales",
    "pack_words",
    "run_vmfb",
    "splice",
    "unpack",
]


class Int4Dispatch(torch.nn.Module):
    """One int4 g32 linear (no bias) through the custom op: words and scales (and zero points, `z`) are buffers."""

    def __init__(
        self, q: torch.Tensor, s: torch.Tensor, tile: int = 4, per: int = 8, z: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        if q.shape[0] % (8 * tile) or q.shape[1] % GROUP:
            raise ValueError(f"a weight {tuple(q.shape)}: N a multiple of {8 * tile}, K of {GROUP} (not padded)")
        self.n, self.tile, self.per = q.shape[0], tile, per
        self.register_buffer("words", pack_words(q, tile))
        self.register_buffer("scales", pack_scales(s, tile, UNIT if z is None else 1.0))
        self.register_buffer("zeros", None if z is None else pack_zeros(z, tile))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zeros is not None:
            return asym_int4_matvec(x, self.words, self.scales, self.zeros, self.n, self.tile, self.per)
        return int4_matvec(x, self.words, self.scales, self.n, self.tile, self.per)


MEDIAN = re.compile(r"process_time/real_time_median\s+[\d.]+ (\w+)\s+([\d.]+) (\w+)")
UNITS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def compile_form(
    module: torch.nn.Module, x: torch.Tensor, flags: list[str], vmfb: Path, rows_dim: bool = False
) -> None:
    """Export `module` at `x` (its rows a `Dim` where `rows_dim`), import it as the backend does, splice any
    int4_matvec call, compile to `vmfb`."""
    from fx_rewrites.backends.iree.importing import import_mlir, iree_modules
    from fx_rewrites.backends.iree.preparing import prepare_program

    dynamic = ({0: torch.export.Dim("rows", max=4096)},) if rows_dim else None
    program = torch.export.export(module, (x,), dynamic_shapes=dynamic)
    mlir = str(import_mlir(iree_modules(), prepare_program(program)[0]))
    mlir = kernels.spliced(mlir)  # every hand-written dispatch's calls, as `IreeBackend` splices them
    src = vmfb.with_suffix(".mlir")
    src.write_text(mlir)
    cmd = ["iree-compile", "--iree-input-type=torch", "--iree-hal-target-backends=llvm-cpu", *flags]
    done = subprocess.run([*cmd, str(src), "-o", str(vmfb)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"iree-compile failed on {vmfb.stem}: {done.stderr[-2000:]}")


def run_vmfb(vmfb: Path, x: torch.Tensor) -> torch.Tensor:
    import numpy as np

    inp, out = vmfb.with_suffix(".in.npy"), vmfb.with_suffix(".out.npy")
    np.save(inp, x.numpy())
    subprocess.run(
        ["iree-run-module", f"--module={vmfb}", "--device=local-sync", "--function=main", f"--input=@{inp}",
         f"--output=@{out}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return torch.from_numpy(np.load(out))


def cpu_ms(vmfb: Path, rows: int, k: int, repetitions: int) -> float:
    """iree-benchmark-module's median CPU time of `repetitions` (local-sync: one thread), x filled with 0.5."""
    done = subprocess.run(
        ["iree-benchmark-module", f"--module={vmfb}", "--device=local-sync", "--function=main",
         f"--input={rows}x{k}xf32=0.5", f"--benchmark_repetitions={repetitions}"],
        capture_output=True, text=True,
    )  # fmt: skip
    found = MEDIAN.findall(done.stdout)
    if not found:
        raise RuntimeError(f"no median from iree-benchmark-module: {done.stdout[-500:]} {done.stderr[-500:]}")
    return float(found[0][1]) * UNITS[found[0][2]]


def forms(
    n: int, k: int, tiles: list[int], per: int, baselines: list[str], zeros: bool = False
) -> tuple[dict[str, torch.nn.Module], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The dispatch per tile (with `zeros`, also with zero points in [-2, 1], as torchao's asymmetric mapping
    gives) and the baseline forms of `int4_forms.py` on its weights (seed 0), with q, s and those zero points."""
    import int4_forms

    int4_forms.BLOCK = 16
    w, q, q8, s8, s, z = int4_forms.weights(n, k, GROUP)
    zq = torch.randint(-2, 2, s.shape, generator=torch.Generator().manual_seed(2), dtype=torch.int8)
    out: dict[str, Any] = {f"dispatch_t{t}": Int4Dispatch(q, s, t, per) for t in tiles}
    if zeros:
        out |= {f"dispatch_zeros_t{t}": Int4Dispatch(q, s, t, per, zq) for t in tiles}
    out |= {name: int4_forms.FORMS[name](w, q, q8, s8, s, z, GROUP) for name in baselines}
    return {name: m.eval() for name, m in out.items()}, (q, s, zq)


def eager_ms(module: torch.nn.Module, x: torch.Tensor, repetitions: int, calls: int = 20) -> float:
    """torch's median CPU time of a call of `module` (one thread), over `repetitions` batches of `calls`."""
    torch.set_num_threads(1)
    samples = []
    with torch.no_grad():
        module(x)
        for _ in range(repetitions):
            start = time.process_time()
            for _ in range(calls):
                module(x)
            samples.append((time.process_time() - start) / calls * 1e3)
    return statistics.median(samples)


def run(argv: list[str] | None = None) -> int:
    from cpu_isa import backend, cpu_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="2816,32000", help="output channels N (K is --k)")
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--tiles", default="4", help="channel tiles of 8 per accumulator set, comma separated")
    parser.add_argument("--per", type=int, default=8, help="channel tiles per workgroup")
    parser.add_argument("--baselines", default="int4_tiles4_symmetric,int8_blocked,f32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--keep", default="", help="a folder to keep the .mlir and .vmfb files in")
    parser.add_argument("--isa", default="host", choices=("host", "avx2", "avx512"))
    parser.add_argument("--zeros", action="store_true", help="also the dispatch with zero points")
    parser.add_argument("--reuse", action="store_true", help="time the .vmfb files --keep holds, not recompiled")
    args = parser.parse_args(argv)
    iree = backend(args.isa)
    flags = [*iree.flags, *iree.perf_flags, "--iree-dispatch-creation-enable-aggressive-fusion"]
    tiles = [int(t) for t in args.tiles.split(",")]
    baselines = [b for b in args.baselines.split(",") if b]
    print(f"CPU: {cpu_model()}; IREE flags {' '.join(iree.flags[:1])}; rows {args.rows}, K {args.k}, group {GROUP}")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.keep or scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        for n in map(int, args.shapes.split(",")):
            modules, (q, s, zq) = forms(n, args.k, tiles, args.per, baselines, args.zeros)
            torch.manual_seed(1)
            x = torch.randn(args.rows, args.k)
            deq = (q.view(n, -1, GROUP).double() * s.double().unsqueeze(-1)).view(n, args.k)
            ref = x.double() @ deq.t()
            shifted = (q.view(n, -1, GROUP).double() - zq.double().unsqueeze(-1)) * s.double().unsqueeze(-1)
            ref_zeros = x.double() @ shifted.view(n, args.k).t()
            torch_err = ((x @ deq.float().t()).double() - ref).abs().max().item()
            print(f"\n{n} x {args.k}: torch float32 (x @ dequantized w.T) vs float64: max abs {torch_err:.2e}")
            print("| form | weight bytes | IREE vs float64 | ms CPU, median of rounds | min-max | vs int4 bytes |")
            print("|---|---:|---:|---:|---:|---:|")
            vmfbs, errs = {}, {}
            for name, module in modules.items():
                vmfb = tmp / f"{name}_{n}.vmfb"
                if not (args.reuse and vmfb.exists()):
                    compile_form(module, x, flags, vmfb)
                vmfbs[name] = vmfb
                got = run_vmfb(vmfb, x).double()
                want = ref_zeros if name.startswith("dispatch_zeros") else ref
                errs[name] = (got - want).abs().max().item() if name != "int8_blocked" and name != "f32" else None
            times: dict[str, list[float]] = {name: [] for name in [*modules, "f32 (torch eager)"]}
            for _ in range(args.rounds):
                for name, vmfb in vmfbs.items():
                    times[name].append(cpu_ms(vmfb, args.rows, args.k, args.repetitions))
                if "f32" in modules:
                    times["f32 (torch eager)"].append(eager_ms(modules["f32"], x, args.repetitions))
            base = statistics.median(times.get("int4_tiles4_symmetric") or [float("nan")])
            if "f32" in modules:
                modules["f32 (torch eager)"] = modules["f32"]
                errs["f32 (torch eager)"] = None
            for name, module in modules.items():
                nbytes = sum(b.numel() * b.element_size() for b in module.buffers())
                ms = statistics.median(times[name] or [float("nan")])
                err = f"{errs[name]:.2e}" if errs[name] is not None else "- (other weights)"
                spread = f"{min(times[name]):.3f}-{max(times[name]):.3f}" if times[name] else "-"
                print(
                    f"| {name} | {nbytes / 1e6:.2f} MB | {err} | {ms:.3f} | {spread} | {base / ms:.2f}x |", flush=True
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
