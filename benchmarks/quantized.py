"""Quantized LLM decoding (issue 33): float32, torchao int8 weight-only, W8A8 and int4 g32, eager against
`fx_rewrites.compile_lm` on IREE, with llama.cpp's Q8_0 / Q4_0 of the same weights beside them.

    python benchmarks/quantized.py                                    # the 160M shape, one thread, CPU time
    python benchmarks/quantized.py --size tiny --prompt 8 --new 4 --rounds 1 --schemes float32,int8_wo  # smoke
    LLAMA_CPP_DIR=/path/to/llama.cpp-build python benchmarks/quantized.py --llama-cpp   # + llama.cpp columns
    python benchmarks/quantized.py --isa avx2        # IREE compiled for znver3, torch limited to AVX2

Model: a seeded random `LlamaForCausalLM` (benchmarks/generate.py's `seeded_for_greedy`: randn x 0.05, eos off);
`160m`: hidden 1024, 8 layers, 16 / 8 heads, MLP 2816, vocab 32000 (the issue's shape); `1b`: TinyLlama's.
Schemes (torchao 0.18 `quantize_` on a copy): `int8_wo` Int8WeightOnlyConfig, `w8a8`
Int8DynamicActivationInt8WeightConfig, `int4_g32` IntxWeightOnlyConfig(int4, PerGroup(32)) (symmetric: its zero
points are all 0 and the module drops them, `weight_layout.fold_blocked_rows`); `int4_g32_zp` the same model compiled
with the zero points' share kept (that drop turned off for its compile: the A/B of it, like for like);
`int8_wo_b8`, `int4_g32_b8`: those models compiled with the weights in blocks of 8 output channels (AVX2's float32
lanes) instead of the rules' 16 (`quantized_matmul.BLOCK`, patched for their compile);
`int4_g32_bf16s` the same config with `scale_dtype=torch.bfloat16` (other scales: other tokens than int4_g32's);
`a8_int4_g32` Int8DynamicActivationIntxWeightConfig(int4, PerGroup(32)): x quantized per token to int8 (asymmetric),
llama.cpp Q4_0's scheme (its decode through the integer a8int4 dispatch on AVX2: rules/a8int4_decode.py).
`--saved DIR` keeps each compile_lm module (.vmfb + .irpa) and loads it the next time (compile outside the shared
lock with `--routes compile_lm --rounds 0`, measure under it; the loaded module's peak RSS is not the compile's).
`--routes compile_lm` leaves out the eager rows (the 1B shape: its eager int4 takes minutes a token); `peak RSS`
after each scheme is this process's (`ru_maxrss`, cumulative: run one scheme a process for each one's own) and its
children's (iree-compile).
Routes: `eager` (transformers' generate, DynamicCache) and `compile_lm` (IREE local-sync). Prefill = a generate
of 1 new token; decode tokens/s = (N - 1) / (time(N) - time(1)); one thread, CPU time of this process
(`time.process_time`), routes interleaved round by round, medians. `match`: the tokens equal the same scheme's
eager tokens (without the eager route: compile_lm's). `irpa MB`: the size of the module's saved weights (`save(...,
params=)`). `compile_lm_torch_steps` (asked for in `--routes`): the same module with each greedy step through
transformers' processors and torch (`Decoding.next_tokens`), as every step was before `app/lm/greedy.py`; its
`x float32` is to float32's row of the same route.

llama.cpp (`--llama-cpp`, `LLAMA_CPP_DIR` or `--llama-cpp-dir`: a build with `bin/llama-bench` and
`bin/llama-quantize`, and the source tree's `convert_hf_to_gguf.py` found from `--llama-cpp-src` or beside it):
the same checkpoint saved with `save_pretrained`, converted to F32 GGUF (a synthetic vocabulary of the model's
size: there is no tokenizer), quantized to Q8_0 and Q4_0, `llama-bench -t 1 -p PROMPT --repack R` with `-n 1` and
`-n NEW+1`: decode tokens/s from the difference of their CPU times (getrusage of the children; the prefill is its
wall time). `--llama-repack` (R): `auto` is 0 on a CPU that reports AMX (ggml's AMX kernels die on a host that
reports AMX but does not grant it: the Sapphire Rapids VM) and 1 elsewhere, llama.cpp's default; on x86 repacking
turns Q4_0 into ggml's interleaved `q4_0_8x8` AVX2 kernels (F32 and Q8_0 are not repacked on x86); `0,1` runs both.
Without a build the column says why.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import generate as gen  # benchmarks/generate.py: model building, timing helpers
from cpu_isa import AVX2_ENV, cpu_model  # benchmarks/cpu_isa.py: the CPU line every table names, AVX2's env
from llama_cpp_bench import llama_cpp, llama_cpp_paths, llama_repacks  # benchmarks/llama_cpp_bench.py

SIZES = {
    "tiny": gen.SIZES["tiny"],
    "160m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=8, vocab_size=32000),
    "1b": gen.SIZES["1b"],
}  # fmt: skip
SCHEMES = ("float32", "int8_wo", "w8a8", "int4_g32")
#: a scheme measured as another one's model compiled differently: name -> (the scheme it quantizes as, how)
VARIANTS = {"int4_g32_zp": "int4_g32", "int8_wo_b8": "int8_wo", "int4_g32_b8": "int4_g32"}
#: schemes run only when named
OTHERS = ("int4_g32_bf16s", "a8_int4_g32")


def build(size: str, max_len: int) -> torch.nn.Module:
    tf = gen.transformers_module()
    torch.manual_seed(0)
    config = tf.LlamaConfig(**SIZES[size], max_position_embeddings=max(max_len, 256), tie_word_embeddings=False)
    return gen.seeded_for_greedy(tf.LlamaForCausalLM(config).eval())


def quantize(model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    if scheme == "float32":
        return model
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        Int8DynamicActivationIntxWeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
        quantize_,
    )
    from torchao.quantization.granularity import PerGroup

    configs = {
        "int8_wo": Int8WeightOnlyConfig,
        "w8a8": Int8DynamicActivationInt8WeightConfig,
        "int4_g32": lambda: IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
        "int4_g32_bf16s": lambda: IntxWeightOnlyConfig(
            weight_dtype=torch.int4, granularity=PerGroup(32), scale_dtype=torch.bfloat16
        ),
        "a8_int4_g32": lambda: Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(32)
        ),
    }
    out = copy.deepcopy(model)
    quantize_(out, configs[VARIANTS.get(scheme, scheme)]())
    return out


#: what `--isa avx2` compiles IREE's code for (an AVX2 CPU without AVX-512), as on the issue's AMD EPYC Zen 3
AVX2_CPU = "znver3"


def backend(isa: str) -> Any:
    """IREE on one thread (local-sync) for this host's CPU, or for `AVX2_CPU` with `--isa avx2`."""
    from fx_rewrites.backends.iree import IreeBackend

    if isa == "host":
        return gen.iree_backend("1")
    flags = tuple(f for f in IreeBackend().flags if not f.startswith("--iree-llvmcpu-target-cpu="))
    # without AMD's SSE4a, which LLVM emits for znver3 and an Intel host dies on (SIGILL)
    cpu = (f"--iree-llvmcpu-target-cpu={AVX2_CPU}", "--iree-llvmcpu-target-cpu-features=-sse4a")
    return IreeBackend(driver="local-sync", flags=(*cpu, *flags))


@contextlib.contextmanager
def blocks_of_8(scheme: str) -> Iterator[None]:
    """For the `_b8` variants: the quantized rules lay weights out in blocks of 8 output channels."""
    if not scheme.endswith("_b8"):
        yield
        return
    from fx_rewrites.backends.iree.rules import quantized_matmul

    block = quantized_matmul.BLOCK
    quantized_matmul.BLOCK = 8
    try:
        yield
    finally:
        quantized_matmul.BLOCK = block


@contextlib.contextmanager
def zero_points_kept(scheme: str) -> Iterator[None]:
    """For `int4_g32_zp`: `fold_blocked_rows` keeps zero points of 0 and their share (its drop turned off)."""
    if scheme != "int4_g32_zp":
        yield
        return
    from fx_rewrites.backends.iree import weight_layout

    drop = weight_layout._drop_zero_zero_points
    weight_layout._drop_zero_zero_points = lambda program, tables: False
    try:
        yield
    finally:
        weight_layout._drop_zero_zero_points = drop


def routes(
    model: torch.nn.Module, max_len: int, isa: str = "host", names: tuple[str, ...] = ("eager", "compile_lm"),
    scheme: str = "", saved: Path | None = None,
) -> tuple[dict[str, Any], float | None]:  # fmt: skip
    """eager and compile_lm generators for `model` (those in `names`); the compile_lm module's .irpa size in MB.
    `saved`: a .vmfb path; the module is loaded from it if it exists (`--saved`), else compiled and saved there."""
    import fx_rewrites

    out: dict[str, Any] = {}
    if "eager" in names:
        out["eager"] = gen.hf_generate(model, static=False, max_len=max_len)
    irpa = None
    if "compile_lm" not in names:
        return out, irpa
    try:
        if saved is not None and saved.exists():
            lm = fx_rewrites.load(saved)
        else:
            with zero_points_kept(scheme), blocks_of_8(scheme):
                lm = fx_rewrites.compile_lm(model, max_cache_len=max_len, backend=backend(isa))
        out["compile_lm"] = lambda ids, n: lm.generate(ids, max_new_tokens=n)[:, ids.shape[1] :]
        if "compile_lm_torch_steps" in names:  # the same module, each greedy step through torch (before issue 33's)
            out["compile_lm_torch_steps"] = lambda ids, n: torch_steps(lm.generate, ids, n)
        with tempfile.TemporaryDirectory() as tmp:
            path = saved or Path(tmp) / "lm.vmfb"
            if not path.exists():
                lm.save(path)
            irpa = path.with_suffix(".irpa").stat().st_size / 1e6
    except Exception as e:  # a route that fails is a row saying why
        out["compile_lm"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return out, irpa


def torch_steps(generate: Any, ids: torch.Tensor, n: int) -> torch.Tensor:
    """`generate` with every greedy step through `Decoding.next_tokens` (torch), as before `app/lm/greedy.py`."""
    from fx_rewrites.app.lm import greedy

    plain, greedy.plain = greedy.plain, lambda decoding: None
    try:
        return generate(ids, max_new_tokens=n)[:, ids.shape[1] :]
    finally:
        greedy.plain = plain


def measure(gens: dict[str, Any], prompt: torch.Tensor, new: int, rounds: int) -> dict[str, Any]:
    tokens = {name: g(prompt, new) for name, g in gens.items() if not isinstance(g, str)}  # warm-up
    times: dict[str, dict[int, list[float]]] = {name: {1: [], new: []} for name in tokens}
    for _ in range(rounds):
        for name in tokens:
            for n in (1, new):
                start = time.process_time()
                gens[name](prompt, n)
                times[name][n].append(time.process_time() - start)
    results: dict[str, Any] = {name: g for name, g in gens.items() if isinstance(g, str)}
    for name in tokens:
        first, full = statistics.median(times[name][1]), statistics.median(times[name][new])
        rate = (new - 1) / (full - first) if full > first else float("nan")
        other = "eager" if "eager" in tokens else "compile_lm" if "compile_lm" in tokens.keys() - {name} else ""
        same = torch.equal(tokens[name], tokens[other]) if other else None  # without eager: = compile_lm's
        results[name] = (first * 1e3, rate, same)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="160m", choices=sorted(SIZES))
    parser.add_argument("--schemes", default=",".join(SCHEMES), help=f"of {', '.join([*SCHEMES, *VARIANTS, *OTHERS])}")
    parser.add_argument(
        "--routes", default="eager,compile_lm", help="eager,compile_lm or one of them; compile_lm_torch_steps: + the "
        "same module with each greedy step in torch (the loop before app/lm/greedy.py), in the same rounds",
    )  # fmt: skip
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--isa", default="host", choices=("host", "avx2"), help="avx2: IREE for znver3, torch AVX2")
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp's F32 / Q8_0 / Q4_0 columns")
    parser.add_argument("--llama-cpp-dir", default=os.environ.get("LLAMA_CPP_DIR"))
    parser.add_argument("--llama-cpp-src", default=os.environ.get("LLAMA_CPP_SRC"))
    parser.add_argument(
        "--llama-repack", default="auto", help="llama-bench's --repack: auto (0 on an AMX CPU, else 1), 0, 1 or 0,1"
    )
    parser.add_argument(
        "--saved", type=Path, default=None,
        help="a folder: each compile_lm module loaded from it if saved there before, else compiled and saved there "
        "(compile once, measure later: `--routes compile_lm --rounds 0` only compiles)",
    )  # fmt: skip
    parser.add_argument("--plot", type=Path, default=None, help="also draw the decode tokens/s as bars (a .png)")
    args = parser.parse_args(argv)
    schemes = [s for s in args.schemes.split(",") if s]
    if args.isa == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        # torch reads its CPU capability when imported: run again in a child with it set
        child = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])]
        raise SystemExit(subprocess.run(child, env={**os.environ, **AVX2_ENV}).returncode)
    torch.set_num_threads(1)
    max_len = args.prompt + args.new
    model = build(args.size, max_len)
    prompt = torch.randint(
        0, SIZES[args.size]["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(1)
    )
    isa = "host ISA" if args.isa == "host" else f"AVX2 (IREE for {AVX2_CPU}, torch {AVX2_ENV})"
    setting = f"{args.size}, prompt {args.prompt}, {args.new} new tokens, 1 thread, CPU time, {isa}"
    print(f"# {setting}; {cpu_model()}; load {gen.load()}")
    print("| scheme | route | prefill ms | decode tok/s | x float32 compile_lm | tokens = eager | irpa MB |")
    print("|---|---|---:|---:|---:|---|---:|")
    bases: dict[str, float] = {}  # float32's decode tokens/s by compile_lm route: each route's ratio is to its own
    bars: list[tuple[str, float]] = []  # (route, decode tokens/s) for --plot
    for scheme in schemes:
        variant = quantize(model, scheme)
        saved = None
        if args.saved is not None:
            args.saved.mkdir(parents=True, exist_ok=True)
            saved = args.saved / f"{args.size}_{scheme}_{args.isa}_{max_len}.vmfb"
        gens, irpa = routes(variant, max_len, args.isa, tuple(args.routes.split(",")), scheme, saved)
        if args.rounds == 0:
            print(f"# {scheme}: compiled, saved as {saved}", flush=True)
            continue
        results = measure(gens, prompt, args.new, args.rounds)
        for name, value in results.items():
            if isinstance(value, str):
                print(f"| {scheme} | {name} | - | - | - | {value} | - |")
                continue
            if scheme == "float32" and name.startswith("compile_lm"):
                bases[name] = value[1]
            ref = bases.get(name, bases.get("compile_lm"))
            ratio = f"{value[1] / ref:.2f}" if ref else "-"
            size = f"{irpa:.0f}" if name == "compile_lm" and irpa else "-"
            match = {True: "yes", False: "NO", None: "-"}[value[2]]
            bars.append((f"{scheme}, {name}", value[1]))
            print(f"| {scheme} | {name} | {value[0]:.1f} | {value[1]:.2f} | {ratio} | {match} | {size} |", flush=True)
        del gens, variant
        own, children = (
            resource.getrusage(who).ru_maxrss / 1e6 for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        )
        print(f"# peak RSS after {scheme}: this process {own:.2f} GB, its children {children:.2f} GB", flush=True)
    base = bases.get("compile_lm")
    if args.llama_cpp:
        paths = llama_cpp_paths(args.llama_cpp_dir, args.llama_cpp_src)
        results = (
            {"llama.cpp": paths}
            if isinstance(paths, str)
            else llama_cpp(model, paths, args.prompt, args.new, llama_repacks(args.llama_repack))
        )
        for kind, value in results.items():
            if isinstance(value, str):
                print(f"| llama.cpp | {kind} | - | - | - | {value} | - |")
            else:
                ratio = f"{value[1] / base:.2f}" if base else "-"
                cells = f"{value[0]:.1f} | {value[1]:.2f} | {ratio} | - | {value[2]:.0f}"
                bars.append((f"llama.cpp {kind}", value[1]))
                print(f"| llama.cpp {kind} | llama-bench (decode: CPU time; wall {value[3]:.2f}) | {cells} |")
    if args.plot:
        plot(bars, f"decode tokens/s: {setting}\n{cpu_model()}", args.plot)


def plot(bars: list[tuple[str, float]], title: str, path: Path) -> None:
    """Decode tokens/s of each route as a horizontal bar, largest at the top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = zip(*sorted(bars, key=lambda b: b[1])) if bars else ((), ())
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(bars) + 1.5))
    colors = ["tab:gray" if "llama.cpp" in x else "tab:blue" if "compile_lm" in x else "tab:orange" for x in labels]
    ax.barh(labels, values, color=colors)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.1f}", va="center", fontsize=8)
    ax.set_xlabel("decode tokens/s (higher is better)")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"# plot: {path}")


if __name__ == "__main__":
    main()
