"""One MoE block alone (router, sort, experts) on IREE against eager: prefill and decode time, peak memory (issue 34).

    python benchmarks/moe_block.py --shape small --experts 64 --top 8 --tokens 2048
    python benchmarks/moe_block.py --shape qwen3-30b-a3b --experts 128 --top 8 --tokens 1024
    python benchmarks/moe_block.py ... --isa avx2          # torch at AVX2, IREE for znver3 (benchmarks/moe_sort.py)

transformers' `Qwen3MoeSparseMoeBlock` at benchmarks/moe_sort.py's sizes (`--shape`), its matrices drawn again as
randn x 0.05 (seed 0), transformers' default `grouped_mm` experts. Routes, each in its own child process (its peak
RSS its own) or all in one (`--interleave`, times interleaved):
- `eager`: the block called on [1, tokens, hidden] (prefill) and on [1, 1, hidden] (decode), torch.no_grad;
- `iree`: the block exported twice as compile_lm exports a model (a Dim on the tokens for the prefill, one token
  for the decode), the IREE rules applied (the experts as backends/iree/rules/moe.py writes them), compiled into
  one module for local-sync (`compile_module`: one copy of the weights for both functions).
One thread, CPU time (time.process_time) per call, median over rounds (round 0 warms up), the calls of every route
interleaved; peak RSS: the high-water mark reset (/proc/self/clear_refs) before a route's first calls and read
after them (its compile not counted). Each route's outputs are compared with eager's on the same inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_isa import cpu_model  # noqa: E402
from benchmarks.moe_sort import AVX2_ENV, SHAPES, _hwm_mb, _hwm_reset, iree_backend  # noqa: E402


def block(shape: str, experts: int, top: int) -> torch.nn.Module:
    from benchmarks.runtime_models import _tf

    tf = _tf()
    config = tf.Qwen3MoeConfig(**SHAPES[shape], num_experts=experts, num_experts_per_tok=top, norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    module = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return module


def _compiled(module: torch.nn.Module, tokens: int, isa: str) -> dict[str, Any]:
    """The block compiled on IREE as compile_lm compiles a model: one module (one copy of the weights) whose
    `prefill` has a Dim on the tokens and whose `decode` takes one token."""
    import fx_rewrites

    backend = iree_backend("counting", isa)
    hidden = module.gate.weight.shape[1]
    programs = {}
    start = time.perf_counter()
    for name, n, shapes in (
        ("prefill", tokens, ({1: torch.export.Dim("tokens", min=2, max=max(tokens, 2))},)),
        ("decode", 1, None),
    ):
        with torch.no_grad():
            program = torch.export.export(module, (torch.randn(1, n, hidden),), dynamic_shapes=shapes)
        result = fx_rewrites.apply(program, backend.rules)
        programs[name] = result.program
        fired = {k: v for k, v in result.report.rewrites.items() if "grouped" in k or "sort" in k}
        print(json.dumps({"function": name, "fired": fired}))
    compiled = backend.compile_module(programs)
    print(json.dumps({"compile_s": round(time.perf_counter() - start, 1)}))
    return {name: compiled.functions[name] for name in programs}


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    module = block(args.shape, args.experts, args.top)
    hidden = module.gate.weight.shape[1]
    g = torch.Generator().manual_seed(1)
    inputs = {
        "prefill": torch.randn(1, args.tokens, hidden, generator=g),
        "decode": torch.randn(1, 1, hidden, generator=g),
    }
    with torch.no_grad():
        expected = {name: module(x) for name, x in inputs.items()}
    runs: dict[str, dict[str, Any]] = {}
    for route in args.routes:
        if route == "eager":
            runs[route] = {name: module for name in inputs}
        else:
            runs[route] = _compiled(module, args.tokens, args.isa)
    times: dict[tuple[str, str], list[float]] = {(r, n): [] for r in runs for n in inputs}
    peaks: dict[str, float] = {}
    errors: dict[tuple[str, str], float] = {}
    with torch.no_grad():
        for rnd in range(args.rounds + 1):
            for route, functions in runs.items():
                if rnd == 0:
                    _hwm_reset()
                for name, x in inputs.items():
                    start = time.process_time()
                    y = functions[name](x)
                    elapsed = time.process_time() - start
                    if rnd == 0:
                        errors[route, name] = float((y - expected[name]).abs().max())
                    else:
                        times[route, name].append(elapsed)
                if rnd == 0:
                    peaks[route] = _hwm_mb()
    for route in runs:
        row: dict[str, Any] = {"route": route, "peak_mb": round(peaks[route])}
        for name in inputs:
            row[f"{name}_ms"] = round(1e3 * statistics.median(times[route, name]), 2)
            row[f"{name}_max_abs_diff"] = f"{errors[route, name]:.1e}"
        print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--routes", nargs="+", choices=["iree", "eager"], default=["iree", "eager"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--isa", choices=["host", "avx2"], default="host")
    parser.add_argument("--interleave", action="store_true", help="all routes in one child, interleaved")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    print(f"# {cpu_model()}, isa {args.isa}, load {os.getloadavg()[0]:.2f}")
    env = {**os.environ, **(AVX2_ENV if args.isa == "avx2" else {})}
    head = {"shape": args.shape, "experts": args.experts, "top": args.top, "tokens": args.tokens}
    for routes in [args.routes] if args.interleave else [[r] for r in args.routes]:
        command = [sys.executable, __file__, "--child", "--shape", args.shape, "--experts", str(args.experts),
                   "--top", str(args.top), "--tokens", str(args.tokens), "--rounds", str(args.rounds),
                   "--isa", args.isa, "--routes", *routes]  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
        if out.returncode:
            print(f"# {routes}: exit {out.returncode}\n{out.stderr[-3000:]}")
        for line in out.stdout.splitlines():
            print(json.dumps({**head, **json.loads(line)}), flush=True)
    print(f"# load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
