"""Go/no-go for an integer int8 x int4 g32 matvec dispatch on AVX2 (issue 33): llama.cpp Q4_0's own scheme.

    python benchmarks/a8int4_dispatch.py                        # 2816 x 1024 and 32000 x 1024, one row
    python benchmarks/a8int4_dispatch.py --shapes 2816 --forms intrinsic --keep /tmp/a8 --asm

torchao's `Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))`
quantizes x per token, asymmetric (`choose_qparams_affine(x, ASYMMETRIC, [1, K], int8, -128, 127, ...)`: a float32
scale sx and an int8 zero point zx a row), then computes in float `linear((qx - zx) sx, q s)`. The kernel
(`backends/iree/a8int4_dispatch.py`, whose docstring has the layout) sums the same products in integers: with
x' = qx + 128 (uint8), sum_k (qx_k - zx) q_k = sum_k x'_k q_k - (128 + zx) W, W = sum_k q_k of the group (packed
with the weights); x' x q is what AVX2's `vpmaddubsw` (u8 x s8 -> pairs summed in s16) takes, `vpmaddwd` by ones
sums the pairs into int32 lanes once per group.

Forms: `intrinsic` (the backend's kernel) calls `llvm.x86.avx2.pmadd.ub.sw` / `llvm.x86.avx2.pmadd.wd` through
`llvm.call_intrinsic`; `generic` writes the same sums in arith (extsi/extui, muli, even/odd shuffles, the saturating
clamp) for LLVM's X86 pattern matching. Timed against the float int4 dispatch (`backends/iree/int4_dispatch.py`) on
the same weights, both as hand-written modules whose inputs are the packed buffers, and torch's eager float32
linear, `iree-benchmark-module` local-sync (one thread), interleaved rounds. Results: docs/iree-3.13-findings.md,
the int8 x int4 section.
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_dispatch import eager_ms  # benchmarks/int4_dispatch.py

from fx_rewrites.backends.iree import a8int4_dispatch as a8
from fx_rewrites.backends.iree.int4_dispatch import GROUP, executable, executable_name, pack_scales, pack_words

MEDIAN = re.compile(r"process_time/real_time_median\s+[\d.]+ (\w+)\s+([\d.]+) (\w+)")
UNITS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def _maddubs(form: str, a: str, b: str, out: str) -> list[str]:
    """`out` (vector<16xi16>) = vpmaddubsw(a u8, b s8) over vector<32xi8>s."""
    if form == "intrinsic":
        return [
            f'{out} = llvm.call_intrinsic "llvm.x86.avx2.pmadd.ub.sw"({a}, {b}) : '
            "(vector<32xi8>, vector<32xi8>) -> vector<16xi16>"
        ]
    even, odd = list(range(0, 32, 2)), list(range(1, 32, 2))
    v = out[1:]
    lines = []
    for name, idx in (("e", even), ("o", odd)):
        lines += [
            f"%{v}a{name} = vector.shuffle {a}, {a} {idx} : vector<32xi8>, vector<32xi8>",
            f"%{v}b{name} = vector.shuffle {b}, {b} {idx} : vector<32xi8>, vector<32xi8>",
            f"%{v}A{name} = arith.extui %{v}a{name} : vector<16xi8> to vector<16xi32>",
            f"%{v}B{name} = arith.extsi %{v}b{name} : vector<16xi8> to vector<16xi32>",
            f"%{v}m{name} = arith.muli %{v}A{name}, %{v}B{name} : vector<16xi32>",
        ]
    lines += [
        f"%{v}s = arith.addi %{v}me, %{v}mo : vector<16xi32>",
        f"%{v}lo = arith.maxsi %{v}s, %smin : vector<16xi32>",
        f"%{v}hi = arith.minsi %{v}lo, %smax : vector<16xi32>",
        f"{out} = arith.trunci %{v}hi : vector<16xi32> to vector<16xi16>",
    ]
    return lines


def _maddwd(form: str, a: str, out: str) -> list[str]:
    """`out` (vector<8xi32>) = the pairs of a (vector<16xi16>) summed (vpmaddwd by ones)."""
    if form == "intrinsic":
        return [
            f'{out} = llvm.call_intrinsic "llvm.x86.avx2.pmadd.wd"({a}, %ones16) : '
            "(vector<16xi16>, vector<16xi16>) -> vector<8xi32>"
        ]
    v = out[1:]
    return [
        f"%{v}e = vector.shuffle {a}, {a} {list(range(0, 16, 2))} : vector<16xi16>, vector<16xi16>",
        f"%{v}o = vector.shuffle {a}, {a} {list(range(1, 16, 2))} : vector<16xi16>, vector<16xi16>",
        f"%{v}E = arith.extsi %{v}e : vector<8xi16> to vector<8xi32>",
        f"%{v}O = arith.extsi %{v}o : vector<8xi16> to vector<8xi32>",
        f"%{v}Em = arith.muli %{v}E, %one32 : vector<8xi32>",
        f"%{v}Om = arith.muli %{v}O, %one32 : vector<8xi32>",
        f"{out} = arith.addi %{v}Em, %{v}Om : vector<8xi32>",
    ]


_INTRINSIC = re.compile(
    r'^(\s*)(%\w+) = llvm\.call_intrinsic "llvm\.x86\.avx2\.(pmadd\.ub\.sw|pmadd\.wd)"\((%\w+), (%\w+)\).*$'
)


def generic(text: str) -> str:
    """The backend's executable with its intrinsic calls written in arith for LLVM's pattern matching."""
    out = []
    for line in text.splitlines():
        found = _INTRINSIC.match(line)
        if not found:
            out.append(line)
            continue
        pad, res, name, a, b = found.groups()
        lines = _maddubs("generic", a, b, res) if name == "pmadd.ub.sw" else _maddwd("generic", a, res)
        out += [pad + x for x in lines]
    consts = ["%smin = arith.constant dense<-32768> : vector<16xi32>",
              "%smax = arith.constant dense<32767> : vector<16xi32>",
              "%one32 = arith.constant dense<1> : vector<8xi32>"]  # fmt: skip
    at = next(i for i, line in enumerate(out) if "%zero16 = arith.constant" in line)
    pad = out[at][: len(out[at]) - len(out[at].lstrip())]
    return "\n".join([*out[:at], *(pad + c for c in consts), *out[at:]])


def a8_module(rows: int, n: int, k: int, tile: int, per: int, form: str) -> str:
    """The backend's a8 int4 executable (`form` intrinsic) or its arith variant (`generic`) in a module whose inputs
    are qx, sx, zx, the bytes and the groups' data."""
    name, g = a8.executable_name(rows, n, k, tile, per), k // GROUP
    text = a8.executable(rows, n, k, tile, per)
    count = -(-n // (8 * tile) // per)
    types = (f"tensor<{rows}x{k}xi8>, tensor<{rows}xf32>, tensor<{rows}xi32>, tensor<{n * k // 2}xi8>, "
             f"tensor<{2 * n * g}xf32>")  # fmt: skip
    return f"""module {{
{generic(text) if form == "generic" else text}
  func.func @main(%x: tensor<{rows}x{k}xi8>, %q: tensor<{rows}xf32>, %z: tensor<{rows}xi32>,
                  %w: tensor<{n * k // 2}xi8>, %s: tensor<{2 * n * g}xf32>) -> tensor<{rows}x{n}xf32> {{
    %n = arith.constant {count} : index
    %d = flow.dispatch @{name}::@{name}[%n](%x, %q, %z, %w, %s) : ({types}) -> tensor<{rows}x{n}xf32>
    return %d : tensor<{rows}x{n}xf32>
  }}
}}
"""


def f32_module(rows: int, n: int, k: int, tile: int, per: int) -> str:
    """The float int4 dispatch (the backend's kernel) as a module whose inputs are x, the words and the scales."""
    name, g = executable_name(rows, n, k, tile, per), k // GROUP
    count = -(-n // (8 * tile) // per)
    types = f"tensor<{rows}x{k}xf32>, tensor<{n * k // 8}xi32>, tensor<{n * g}xf32>"
    return f"""module {{
{executable(rows, n, k, tile, per)}
  func.func @main(%x: tensor<{rows}x{k}xf32>, %w: tensor<{n * k // 8}xi32>, %s: tensor<{n * g}xf32>)
      -> tensor<{rows}x{n}xf32> {{
    %n = arith.constant {count} : index
    %d = flow.dispatch @{name}::@{name}[%n](%x, %w, %s) : ({types}) -> tensor<{rows}x{n}xf32>
    return %d : tensor<{rows}x{n}xf32>
  }}
}}
"""


def compile_mlir(text: str, flags: list[str], vmfb: Path, asm: bool) -> None:
    src = vmfb.with_suffix(".mlir")
    src.write_text(text)
    extra = [f"--iree-hal-dump-executable-intermediates-to={vmfb.with_suffix('')}_dump"] if asm else []
    cmd = ["iree-compile", "--iree-hal-target-backends=llvm-cpu", *flags, *extra, str(src), "-o", str(vmfb)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"iree-compile failed on {vmfb.stem}: {done.stderr[-3000:]}")


def run_vmfb(vmfb: Path, inputs: list[np.ndarray]) -> np.ndarray:
    args = []
    for i, a in enumerate(inputs):
        path = vmfb.with_suffix(f".in{i}.npy")
        np.save(path, a)
        args.append(f"--input=@{path}")
    out = vmfb.with_suffix(".out.npy")
    subprocess.run(
        ["iree-run-module", f"--module={vmfb}", "--device=local-sync", "--function=main", *args, f"--output=@{out}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return np.load(out)


def cpu_ms(vmfb: Path, repetitions: int) -> float:
    args = [f"--input=@{p}" for p in sorted(vmfb.parent.glob(vmfb.stem + ".in*.npy"))]
    done = subprocess.run(
        ["iree-benchmark-module", f"--module={vmfb}", "--device=local-sync", "--function=main", *args,
         f"--benchmark_repetitions={repetitions}"],
        capture_output=True, text=True,
    )  # fmt: skip
    found = MEDIAN.findall(done.stdout)
    if not found:
        raise RuntimeError(f"no median: {done.stdout[-500:]} {done.stderr[-500:]}")
    return float(found[0][1]) * UNITS[found[0][2]]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's per-token asymmetric int8 quantization of x (its own ops): qx int8, sx float32, zx int32."""
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

    block = [1, x.shape[1]]
    sx, zx = choose_qparams_affine(x, MappingType.ASYMMETRIC, block, torch.int8, -128, 127, None, None, torch.int8)
    qx = quantize_affine(x, block, sx, zx, torch.int8, -128, 127)
    return qx, sx.view(-1).float(), zx.view(-1).to(torch.int32)


def run(argv: list[str] | None = None) -> int:
    from cpu_isa import backend, cpu_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="2816,32000")
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--forms", default="intrinsic,generic")
    parser.add_argument("--tiles", default="4")
    parser.add_argument("--per", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--keep", default="")
    parser.add_argument("--asm", action="store_true", help="dump the executables' intermediates (.s) next to them")
    parser.add_argument("--reuse", action="store_true", help="the .vmfb files --keep holds, not recompiled")
    args = parser.parse_args(argv)
    iree = backend("host")
    flags = [*iree.flags, *iree.perf_flags]
    print(f"CPU: {cpu_model()}; rows {args.rows}, K {args.k}, group {GROUP}")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.keep or scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        for n in map(int, args.shapes.split(",")):
            k, rows = args.k, args.rows
            gen = torch.Generator().manual_seed(0)
            q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
            s = torch.rand(n, k // GROUP, generator=gen) * 0.02 + 0.001
            x = torch.randn(rows, k, generator=gen)
            qx, sx, zx = quantize_rows(x)
            xd = (qx.double() - zx.double().unsqueeze(1)) * sx.double().unsqueeze(1)
            wd = (q.view(n, -1, GROUP).double() * s.double().unsqueeze(-1)).view(n, k)
            ref = xd @ wd.t()
            torch_err = ((xd.float() @ wd.float().t()).double() - ref).abs().max().item()
            print(f"\n{n} x {k}: torch float32 (dequantized x @ w.T) vs float64: max abs {torch_err:.2e}")
            vmfbs: dict[str, Path] = {}
            errs: dict[str, float] = {}
            for tile in map(int, args.tiles.split(",")):
                vmfb = tmp / f"f32_t{tile}_{n}.vmfb"
                if not (args.reuse and vmfb.exists()):
                    compile_mlir(f32_module(rows, n, k, tile, args.per), flags, vmfb, args.asm)
                got = run_vmfb(vmfb, [xd.float().numpy(), pack_words(q, tile).numpy(), pack_scales(s, tile).numpy()])
                vmfbs[vmfb.stem], errs[vmfb.stem] = vmfb, float(np.abs(got - ref.numpy()).max())
                for form in args.forms.split(","):
                    vmfb = tmp / f"a8_{form}_t{tile}_{n}.vmfb"
                    if not (args.reuse and vmfb.exists()):
                        compile_mlir(a8_module(rows, n, k, tile, args.per, form), flags, vmfb, args.asm)
                    inputs = [qx.numpy(), sx.numpy(), zx.numpy(), a8.pack_bytes(q, tile).numpy(),
                              a8.pack_groups(q, s, tile).numpy()]  # fmt: skip
                    got = run_vmfb(vmfb, inputs)
                    vmfbs[vmfb.stem], errs[vmfb.stem] = vmfb, float(np.abs(got - ref.numpy()).max())
            times: dict[str, list[float]] = {name: [] for name in [*vmfbs, "torch eager f32"]}
            wf = wd.float()
            for _ in range(args.rounds) if args.rounds else ():
                for name, vmfb in vmfbs.items():
                    times[name].append(cpu_ms(vmfb, args.repetitions))
                times["torch eager f32"].append(
                    eager_ms(functools.partial(torch.nn.functional.linear, weight=wf), xd.float(), args.repetitions)
                )
            print("| form | vs float64 | ms CPU, median of rounds | min-max |")
            print("|---|---:|---:|---:|")
            for name, t in times.items() if args.rounds else ():
                err = f"{errs[name]:.2e}" if name in errs else f"{torch_err:.2e}"
                print(f"| {name} | {err} | {statistics.median(t):.3f} | {min(t):.3f}-{max(t):.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
