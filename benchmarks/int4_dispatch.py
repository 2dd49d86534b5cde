"""A hand-written int4 g32 matvec dispatch for IREE 3.13 (issue 33): the kernel written by us, not derived by IREE.

    python benchmarks/int4_dispatch.py                          # 2816 x 1024 and 32000 x 1024, one row
    python benchmarks/int4_dispatch.py --shapes 2816 --rounds 5 --tiles 4,8

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
through a `torch.library` custom op (`fxr_bench::int4_matvec`, eager: the same values unpacked by torch): torch.export
keeps it as one node, torch-mlir imports it as `torch.operator "torch.fxr_bench.int4_matvec"`, and `splice` replaces
that line with a `flow.dispatch` of the executable between `torch_c` conversions (the step a backend rule would run
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

GROUP = 32
#: the top nibble of an int32 (0xF0000000 as a signed value)
TOP = -(1 << 28)
UNIT = 2.0**-28
OP = "fxr_bench::int4_matvec"


def pack_words(q: torch.Tensor, tile: int) -> torch.Tensor:
    """int4 values q [N, K] (int8 in [-8, 7]) as int32 words [N / (8 tile), G, 4, tile, 8] (flattened): word
    (b, g, w, t, c) holds q[8 (b tile + t) + c, 32 g + 8 w + p] in bits 4p .. 4p + 3."""
    n, k = q.shape
    nb, g = n // (8 * tile), k // GROUP
    nib = (q.to(torch.int64) & 15).view(nb, tile, 8, g, 4, 8)  # n = (b, t, c), k = (g, w, p)
    word = (nib << (4 * torch.arange(8))).sum(-1)  # disjoint bits: the sum is the or
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.permute(0, 3, 4, 1, 2).contiguous().flatten()


def pack_scales(s: torch.Tensor, tile: int) -> torch.Tensor:
    """Scales s [N, G] times 2^-28 (exact) as [N / (8 tile), G, tile, 8] (flattened)."""
    n, g = s.shape
    return (s.to(torch.float32) * UNIT).view(n // (8 * tile), tile, 8, g).permute(0, 3, 1, 2).contiguous().flatten()


def unpack(words: torch.Tensor, scales: torch.Tensor, n: int, tile: int) -> torch.Tensor:
    """The float32 weight [N, K] (q * s) that `pack_words(q, tile)` and `pack_scales(s, tile)` hold."""
    k = words.numel() * 8 // n
    nb, g = n // (8 * tile), k // GROUP
    nib = ((words.to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> (4 * torch.arange(8))) & 15
    q = torch.where(nib >= 8, nib - 16, nib).to(torch.float32)  # [N K / 8, 8]
    values = q.view(nb, g, 4, tile, 8, 8).permute(0, 3, 4, 1, 2, 5).reshape(n, k)  # (b, t, c) x (g, w, p)
    s = (scales / UNIT).view(nb, g, tile, 8).permute(0, 2, 3, 1).reshape(n, g)
    return (values.view(n, g, GROUP) * s.unsqueeze(-1)).view(n, k)


def _kernel(rows: int, n: int, k: int, tile: int, per: int) -> str:
    """The body of the executable's function: workgroup `wg` computes tiles [wg per, min(wg per + per, N/8tile))
    of 8 * tile channels for every row."""
    nb, g, nw = n // (8 * tile), k // GROUP, n * k // 8
    wt, st = f"memref<{nw}xi32>", f"memref<{n * g}xf32>"
    xt, ot = (f"memref<{rows * k}xf32>", f"memref<{rows * n}xf32>") if rows else ("memref<?xf32>", "memref<?xf32>")
    xsize, osize, bound = ("", "", f"%c{rows}w") if rows else ("{%xsize}", "{%osize}", "%rows")
    lines = [
        "%c0 = arith.constant 0 : index",
        "%c1 = arith.constant 1 : index",
        "%zero = arith.constant dense<0.0> : vector<8xf32>",
        f"%mask = arith.constant dense<{TOP}> : vector<8xi32>",
        *(f"%sh{p} = arith.constant dense<{28 - 4 * p}> : vector<8xi32>" for p in range(7)),
        f"%xsize = arith.muli %rows, %c{k}w : index" if not rows else "",
        f"%osize = arith.muli %rows, %c{n}w : index" if not rows else "",
        f"%xm = stream.binding.subspan %bx[%c0] : !stream.binding -> {xt}{xsize}",
        f"%wm = stream.binding.subspan %bw[%c0] : !stream.binding -> {wt}",
        f"%sm = stream.binding.subspan %bs[%c0] : !stream.binding -> {st}",
        f"%om = stream.binding.subspan %bo[%c0] : !stream.binding -> {ot}{osize}",
        "%wg = stream.dispatch.workgroup.id[0] : index",
        f"%b0 = arith.muli %wg, %c{per}w : index",
        f"%b1p = arith.addi %b0, %c{per}w : index",
        f"%b1 = arith.minui %b1p, %c{nb}w : index",
        f"scf.for %r = %c0 to {bound} step %c1 {{",
        f"%xr = arith.muli %r, %c{k}w : index",
        f"%or = arith.muli %r, %c{n}w : index",
        "scf.for %b = %b0 to %b1 step %c1 {",
    ]
    add = lines.append
    totals = ", ".join(f"%tot{t} = %zero" for t in range(tile))
    vectors = ", ".join(["vector<8xf32>"] * tile)
    add(f"%res:{tile} = scf.for %g = %c0 to %c{g}w step %c1 iter_args({totals}) -> ({vectors}) {{")
    add(f"%bg0 = arith.muli %b, %c{g}w : index")
    add("%bg = arith.addi %bg0, %g : index")
    add(f"%wbase = arith.muli %bg, %c{32 * tile}w : index")
    add(f"%sbase = arith.muli %bg, %c{8 * tile}w : index")
    add(f"%xg = arith.muli %g, %c{GROUP}w : index")
    add("%xbase = arith.addi %xr, %xg : index")
    acc = ["%zero"] * tile
    for w in range(4):
        for t in range(tile):
            add(f"%wo{w}_{t} = arith.addi %wbase, %c{(w * tile + t) * 8}w : index")
            add(f"%wd{w}_{t} = vector.load %wm[%wo{w}_{t}] : {wt}, vector<8xi32>")
        for p in range(8):
            add(f"%xo{w}_{p} = arith.addi %xbase, %c{8 * w + p}w : index")
            add(f"%xs{w}_{p} = memref.load %xm[%xo{w}_{p}] : {xt}")
            add(f"%xb{w}_{p} = vector.broadcast %xs{w}_{p} : f32 to vector<8xf32>")
            for t in range(tile):
                value, name = f"%wd{w}_{t}", f"{w}_{p}_{t}"
                if p < 7:  # value p to the top nibble
                    add(f"%sl{name} = arith.shli {value}, %sh{p} : vector<8xi32>")
                    value = f"%sl{name}"
                if p > 0:  # the values below it cleared
                    add(f"%an{name} = arith.andi {value}, %mask : vector<8xi32>")
                    value = f"%an{name}"
                add(f"%fl{name} = arith.sitofp {value} : vector<8xi32> to vector<8xf32>")
                add(f"%ac{name} = vector.fma %fl{name}, %xb{w}_{p}, {acc[t]} : vector<8xf32>")
                acc[t] = f"%ac{name}"
    for t in range(tile):
        add(f"%so{t} = arith.addi %sbase, %c{8 * t}w : index")
        add(f"%sv{t} = vector.load %sm[%so{t}] : {st}, vector<8xf32>")
        add(f"%nt{t} = vector.fma {acc[t]}, %sv{t}, %tot{t} : vector<8xf32>")
    add(f"scf.yield {', '.join(f'%nt{t}' for t in range(tile))} : {vectors}")
    add("}")
    add(f"%ob = arith.muli %b, %c{8 * tile}w : index")
    add("%obr = arith.addi %or, %ob : index")
    for t in range(tile):
        add(f"%oo{t} = arith.addi %obr, %c{8 * t}w : index")
        add(f"vector.store %res#{t}, %om[%oo{t}] : {ot}, vector<8xf32>")
    add("}")
    add("}")
    add("return")
    text = "\n".join(line for line in lines if line)
    constants = sorted({int(c) for c in re.findall(r"%c(\d+)w\b", text)})
    return "\n".join([*(f"%c{c}w = arith.constant {c} : index" for c in constants), text])


def executable_name(rows: int, n: int, k: int, tile: int, per: int) -> str:
    return f"int4mv_{rows or 'dyn'}x{k}x{n}_t{tile}_p{per}"


def executable(rows: int, n: int, k: int, tile: int, per: int) -> str:
    """A `stream.executable` whose export `@matvec` takes x [rows, K] f32, the words, the scales (and, for rows 0:
    dynamic, the row count) and writes [rows, N] f32 over ceil(N / (8 tile) / per) workgroups of `per` channel
    tiles."""
    dynamic = "" if rows else ", %rows: index"
    bindings = ", ".join(f"%b{name}: !stream.binding" for name in "xwso")
    body = "\n".join("        " + line for line in _kernel(rows, n, k, tile, per).splitlines())
    return f"""  stream.executable private @{executable_name(rows, n, k, tile, per)} {{
    stream.executable.export public @matvec workgroups(%count: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      stream.return %count, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func @matvec({bindings}{dynamic}) {{
{body}
      }}
    }}
  }}"""


@torch.library.custom_op(OP, mutates_args=())
def int4_matvec(
    x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, n: int, tile: int, per: int
) -> torch.Tensor:
    """x [rows, K] times the int4 g32 weight [N, K] that `words` and `scales` hold (`pack_words`, `pack_scales`),
    transposed: what the dispatch computes (eager: unpacked by torch, float32)."""
    return x @ unpack(words, scales, n, tile).t()


@int4_matvec.register_fake
def _(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, n: int, tile: int, per: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


class Int4Dispatch(torch.nn.Module):
    """One int4 g32 linear (no bias) through the custom op: words and scales are buffers."""

    def __init__(self, q: torch.Tensor, s: torch.Tensor, tile: int = 4, per: int = 8) -> None:
        super().__init__()
        if q.shape[0] % (8 * tile) or q.shape[1] % GROUP:
            raise ValueError(f"a weight {tuple(q.shape)}: N a multiple of {8 * tile}, K of {GROUP} (not padded)")
        self.n, self.tile, self.per = q.shape[0], tile, per
        self.register_buffer("words", pack_words(q, tile))
        self.register_buffer("scales", pack_scales(s, tile))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_matvec(x, self.words, self.scales, self.n, self.tile, self.per)


_CALL = re.compile(
    r'^(\s*)(%[\w]+) = torch\.operator "torch\.fxr_bench\.int4_matvec"\((%[\w]+), (%[\w]+), (%[\w]+), (%[\w]+), '
    r"(%[\w]+), (%[\w]+)\) : \((!torch\.vtensor<\[(\d+|\?),(\d+)\],f32>), (!torch\.vtensor<\[(\d+)\],si32>), "
    r"(!torch\.vtensor<\[(\d+)\],f32>), [^)]*\) -> (!torch\.vtensor<\[(?:\d+|\?),\d+\],f32>)"
)


def splice(mlir: str) -> str:
    """`mlir` (torch-mlir's import) with every `fxr_bench.int4_matvec` call replaced by a `flow.dispatch` of its
    executable (declared once at the module's start; a dynamic row count is passed to it as an operand);
    ValueError where there is none, or one this form does not match."""
    ints = dict(re.findall(r"^\s*(%[\w]+) = torch\.constant\.int (-?\d+)", mlir, re.M))
    out, executables = [], {}
    for line in mlir.splitlines():
        found = _CALL.match(line)
        if not found:
            if "torch.fxr_bench.int4_matvec" in line:
                raise ValueError(f"an int4_matvec call of an unknown form: {line.strip()[:200]}")
            out.append(line)
            continue
        pad, res, x, w, s, *consts = found.groups()[:8]
        xtype, rows, k, wtype, nw, stype, ns, otype = found.groups()[8:]
        n, tile, per = (int(ints[c]) for c in consts)
        rows, k = (0 if rows == "?" else int(rows)), int(k)
        name = executable_name(rows, n, k, tile, per)
        executables[name] = executable(rows, n, k, tile, per)
        count = -(-n // (8 * tile) // per)
        v, r = f"fxr{res[1:]}", str(rows or "?")
        out += [
            f"{pad}%{v}_x = torch_c.to_builtin_tensor {x} : {xtype} -> tensor<{r}x{k}xf32>",
            f"{pad}%{v}_w = torch_c.to_builtin_tensor {w} : {wtype} -> tensor<{nw}xi32>",
            f"{pad}%{v}_s = torch_c.to_builtin_tensor {s} : {stype} -> tensor<{ns}xf32>",
            f"{pad}%{v}_n = arith.constant {count} : index",
        ]
        operands, types, dims = f"%{v}_x, %{v}_w, %{v}_s", f"tensor<{r}x{k}xf32>", ""
        if not rows:
            out += [f"{pad}%{v}_0 = arith.constant 0 : index", f"{pad}%{v}_r = tensor.dim %{v}_x, %{v}_0 : {types}"]
            operands, types, dims = f"{operands}, %{v}_r", f"{types}{{%{v}_r}}", f"{{%{v}_r}}"
        out += [
            f"{pad}%{v}_d = flow.dispatch @{name}::@matvec[%{v}_n]({operands}) : ({types}, tensor<{nw}xi32>, "
            f"tensor<{ns}xf32>{', index' if not rows else ''}) -> tensor<{r}x{n}xf32>{dims}",
            f"{pad}{res} = torch_c.from_builtin_tensor %{v}_d : tensor<{r}x{n}xf32> -> {otype}",
        ]
    if not executables:
        raise ValueError("no fxr_bench.int4_matvec call in the module")
    start = next(i for i, line in enumerate(out) if line.startswith("module"))
    return "\n".join([*out[: start + 1], *executables.values(), *out[start + 1 :]])


MEDIAN = re.compile(r"process_time/real_time_median\s+[\d.]+ (\w+)\s+([\d.]+) (\w+)")
UNITS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def compile_form(
    module: torch.nn.Module, x: torch.Tensor, flags: list[str], vmfb: Path, rows_dim: bool = False
) -> None:
    """Export `module` at `x` (its rows a `Dim` where `rows_dim`), import it as the backend does, splice any
    int4_matvec call, compile to `vmfb`."""
    from fx_rewrites.backends.iree.importing import import_mlir, iree_modules, prepare_program

    dynamic = ({0: torch.export.Dim("rows", max=4096)},) if rows_dim else None
    program = torch.export.export(module, (x,), dynamic_shapes=dynamic)
    mlir = str(import_mlir(iree_modules(), prepare_program(program)[0]))
    if "torch.fxr_bench.int4_matvec" in mlir:
        mlir = splice(mlir)
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
    n: int, k: int, tiles: list[int], per: int, baselines: list[str]
) -> tuple[dict[str, torch.nn.Module], tuple[torch.Tensor, torch.Tensor]]:
    """The dispatch per tile and the baseline forms of `int4_forms.py` on its weights (seed 0), with q and s."""
    import int4_forms

    int4_forms.BLOCK = 16
    w, q, q8, s8, s, z = int4_forms.weights(n, k, GROUP)
    out: dict[str, Any] = {f"dispatch_t{t}": Int4Dispatch(q, s, t, per) for t in tiles}
    out |= {name: int4_forms.FORMS[name](w, q, q8, s8, s, z, GROUP) for name in baselines}
    return {name: m.eval() for name, m in out.items()}, (q, s)


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
            modules, (q, s) = forms(n, args.k, tiles, args.per, baselines)
            torch.manual_seed(1)
            x = torch.randn(args.rows, args.k)
            deq = (q.view(n, -1, GROUP).double() * s.double().unsqueeze(-1)).view(n, args.k)
            ref = x.double() @ deq.t()
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
                errs[name] = (got - ref).abs().max().item() if name != "int8_blocked" and name != "f32" else None
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
