"""MoE peak memory against eager, one fresh process per route (issue 34): what a user's process holds.

    python benchmarks/moe_memory.py --routes eager saved:/tmp/small.vmfb saved:/tmp/small.vmfb:heap:512
    python benchmarks/moe_memory.py --shape qwen3-30b-a3b --experts 128 --prompt 1024 \
        --routes eager saved:/tmp/l30.vmfb

Each route runs in its own child with the same imports (torch, transformers, fx_rewrites, iree.runtime): `eager`
builds `moe_sort.py`'s model from its seeded weights and calls `model.generate`; `saved:PATH.vmfb` loads a
`compile_lm` module saved with `lm.save(PATH.vmfb, params=PATH.irpa)` (`fx_rewrites.load`; the torch model is not
built) and calls its `generate`; `saved:PATH.vmfb:ALLOCATOR[:C]` with `FX_REWRITES_IREE_ALLOCATOR=ALLOCATOR`
(`bounded`, the default, `caching` or `heap`: backends/iree/allocators.py; empty: the default), prefilled in chunks
of C (`prefill_chunk_size`). A generate of 1 + `--decode` tokens warms up, then `--rounds` more are timed (prefill:
CPU ms to the first token; decode: 1 / the median step). `--distinct`: each round's prompt another one of the same
length (as a user's prompts are: a MoE prefill's transients have sizes read from the routing, so a prompt repeated
call after call reuses buffers a new one does not); each round's resident set is printed (`rss_rounds`). Peak: VmHWM
of /proc/self/status over the generate calls, the mark reset after the build or load; RSS counts the archive's file
pages as they are read (`RssFile`) beside the process's own (`RssAnon`). One thread each (IREE local-sync). Prints a
JSON line a route.

`--isa avx2`: the children run torch held to AVX2 (`cpu_isa.AVX2_ENV`, checked in the child), as moe_sort.py's
`--isa`; a saved module runs the code it was compiled for. `--save PATH.vmfb`: no routes run; the model compiled by
`compile_lm` for `--isa`'s target (max_cache_len = prompt + decode + 1, as eager's model), the rules of `--without`
left out, saved as PATH.vmfb with PATH.irpa (the module a `saved:` route loads):

    python benchmarks/moe_memory.py --isa avx2 --save /tmp/small2.vmfb
    python benchmarks/moe_memory.py --isa avx2 --save /tmp/small2n.vmfb \
        --without grouped_mm_packed_as_dispatch_for_iree_avx2 grouped_mm_packed_per_row_for_iree
    python benchmarks/moe_memory.py --isa avx2 --distinct --rounds 3 --routes eager saved:/tmp/small2.vmfb
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_isa import AVX2_ENV  # noqa: E402  (--isa avx2: what the children run with)
from benchmarks.cpu_isa import cpu_model as cpu_isa_model  # noqa: E402

FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def _status() -> dict[str, int]:
    """The process's memory fields, MB."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return {k: int(v.split()[0]) // 1024 for k, _, v in (line.partition(":") for line in lines) if k in FIELDS}


def _saved(route: str) -> tuple[str, str, str]:
    """`saved:PATH.vmfb[:ALLOCATOR[:C]]` -> (PATH.vmfb, allocator ("" the default), chunk)."""
    path, *rest = route.removeprefix("saved:").split(":")
    return path, rest[0] if rest else "", rest[1] if len(rest) > 1 else ""


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.zoo import torchvision_cpu

    torchvision_cpu.install()
    import iree.runtime  # noqa: F401  (the same imports in every route's process)
    import torch
    import transformers  # noqa: F401

    import fx_rewrites
    from benchmarks import cpu_isa
    from benchmarks.moe_sort import StepClock, _hwm_reset, _prompt, build

    torch.set_num_threads(1)
    cpu_isa.check(args.isa)  # torch at the ISA's width (the child's environment took)
    route = args.routes[0]
    out: dict = {"route": route, "imports": _status()}
    if route == "eager":
        model = build(args.experts, args.top, args.prompt + args.decode + 1, shape=args.shape)

        def run(ids: torch.Tensor, clock: StepClock) -> torch.Tensor:
            with torch.no_grad():
                mask = torch.ones_like(ids)
                new = 1 + args.decode
                return model.generate(
                    ids, attention_mask=mask, max_new_tokens=new, do_sample=False, disable_compile=True, streamer=clock
                )
    else:
        path, _, chunk = _saved(route)
        lm = fx_rewrites.load(path, driver="local-sync")
        size = int(chunk) if chunk else None

        def run(ids: torch.Tensor, clock: StepClock) -> torch.Tensor:
            return lm.generate(ids, max_new_tokens=1 + args.decode, streamer=clock, prefill_chunk_size=size)

    out["loaded"] = _status()
    ids = _prompt(args.prompt)
    _hwm_reset()
    prefill, steps, rss = [], [], []
    for r in range(args.rounds + 1):
        if args.distinct and r:
            ids = torch.randint(1, 4096, (1, args.prompt), generator=torch.Generator().manual_seed(10_000 + r))
        clock = StepClock()
        start = time.process_time()
        tokens = run(ids, clock)
        if r == 0:
            out["tokens"] = tokens[0, args.prompt :].tolist()
        else:
            prefill.append(round(1e3 * (clock.times[0] - start)))
            steps += clock.steps()
        rss.append(_status()["VmRSS"])
    out |= {"peak": _status(), "prefill_ms_rounds": prefill, "rss_rounds": rss, "load": round(os.getloadavg()[0], 2)}
    if steps:
        out["decode_tok_s"] = round(1 / statistics.median(steps), 2)
    print(json.dumps(out), flush=True)


def save(args: argparse.Namespace) -> None:
    """The model through compile_lm for `args.isa` (less `args.without`), saved as `args.save` and its .irpa."""
    sys.path.insert(0, str(ROOT))
    from tests.zoo import torchvision_cpu

    torchvision_cpu.install()
    import attrs
    import torch

    import fx_rewrites
    from benchmarks import cpu_isa
    from benchmarks.moe_sort import build

    torch.set_num_threads(1)
    max_len = args.prompt + args.decode + 1
    model = build(args.experts, args.top, max_len, shape=args.shape)
    backend = cpu_isa.backend(args.isa, driver="local-sync")
    missing = [name for name in args.without if name not in backend.rules]
    if missing:
        raise SystemExit(f"--without {missing}: not among {args.isa}'s rules")
    backend = attrs.evolve(backend, rules=backend.rules.without(*args.without)) if args.without else backend
    start = time.perf_counter()
    lm = fx_rewrites.compile_lm(model, max_cache_len=max_len, backend=backend)
    path = Path(args.save)
    lm.save(path, params=path.with_suffix(".irpa"))
    fired = {f"{name}:{k}": v for name, report in lm.reports.items() for k, v in report.rewrites.items()
             if any(word in k for word in ("grouped", "attention", "moe"))}  # fmt: skip
    size = path.with_suffix(".irpa").stat().st_size
    seconds = round(time.perf_counter() - start, 1)
    row = {"saved": str(path), "isa": args.isa, "without": args.without, "irpa_bytes": size, "compile_save_s": seconds}
    print(json.dumps(row | {"fired": fired}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routes", nargs="+", default=["eager"])
    parser.add_argument("--shape", default="small")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--distinct", action="store_true", help="a new prompt each round (same length)")
    parser.add_argument("--isa", choices=["host", "avx2"], default="host")
    parser.add_argument("--save", help="PATH.vmfb: compile and save the model for --isa instead of running routes")
    parser.add_argument("--without", nargs="*", default=[], help="rules left out of --save's compile")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.save:
        return save(args)
    print(f"# {cpu_isa_model()}, isa {args.isa}, load {os.getloadavg()[0]:.2f}", flush=True)
    eager_tokens = None
    for route in args.routes:
        env = {k: v for k, v in os.environ.items() if k != "FX_REWRITES_IREE_ALLOCATOR"}
        env |= AVX2_ENV if args.isa == "avx2" else {}
        if route != "eager" and _saved(route)[1]:
            env["FX_REWRITES_IREE_ALLOCATOR"] = _saved(route)[1]
        common = ["--shape", args.shape, "--experts", str(args.experts), "--top", str(args.top), "--isa", args.isa]
        common += ["--distinct"] if args.distinct else []
        sizes = ["--prompt", str(args.prompt), "--decode", str(args.decode), "--rounds", str(args.rounds)]
        command = [sys.executable, __file__, "--child", "--routes", route, *common, *sizes]
        proc = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
        if proc.returncode:
            print(f"# {route}: exit {proc.returncode}\n{proc.stderr[-3000:]}", flush=True)
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        if route == "eager":
            eager_tokens = row["tokens"]
        row["tokens_equal_eager"] = None if eager_tokens is None else row["tokens"] == eager_tokens
        row["tokens"] = row["tokens"][:8]
        print(json.dumps(row), flush=True)
    print(f"# load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
