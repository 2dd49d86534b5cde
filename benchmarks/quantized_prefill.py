"""Quantized LLM prefill (issue 33): the time to the first token for prompts of several lengths, eager against
`fx_rewrites.compile_lm` on IREE, float32 and torchao's int8 weight-only, W8A8 and int4 g32.

    python benchmarks/quantized_prefill.py                          # 160M, prompts 16,128,512, one thread
    python benchmarks/quantized_prefill.py --saved /tmp/lms --rounds 0   # compile only (outside the shared lock)
    python benchmarks/quantized_prefill.py --saved /tmp/lms              # measure the saved modules

The model and schemes are benchmarks/quantized.py's (`build`, `quantize`, `routes`); one compile_lm module per
scheme with room for the longest prompt and 32 new tokens (its prefill takes any prompt up to that). Prefill =
a generate of 1 new token (the prompt's forward and one argmax); one thread, CPU time of this process
(`time.process_time`), every (prompt, scheme, route) once a round, rounds interleaved, medians. `x f32 IREE`: the
route's time over float32 compile_lm's at that prompt length. `match`: the first token equals the same scheme's eager
model's (for W8A8 its per-token activation rounding may move it: see docs/quantized.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import generate as gen
import quantized as q
from cpu_isa import cpu_model

NEW = 32


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="160m", choices=sorted(q.SIZES))
    parser.add_argument(
        "--schemes",
        default=",".join(q.SCHEMES),
        help="scheme, scheme:tag (a saved module's tag) or scheme:eager (eager alone)",
    )
    parser.add_argument("--routes", default="eager,compile_lm")
    parser.add_argument("--prompts", default="16,128,512")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--saved", type=Path, default=None, help="a folder of compile_lm modules (quantized.py's)")
    parser.add_argument("--tag", default="", help="a suffix of the saved modules' names (two builds side by side)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    prompts = [int(p) for p in args.prompts.split(",")]
    max_len = max(prompts) + NEW
    model = q.build(args.size, max_len)
    ids = {
        p: torch.randint(0, q.SIZES[args.size]["vocab_size"], (1, p), generator=torch.Generator().manual_seed(p))
        for p in prompts
    }
    routes = tuple(args.routes.split(","))
    gens: dict[tuple[str, str], object] = {}
    eager_done: set[str] = set()
    for entry in args.schemes.split(","):
        scheme, _, tag = entry.partition(":")  # `scheme:tag`: the module saved with that tag (two builds side by side)
        tag = tag or args.tag
        saved = None
        if args.saved is not None:
            args.saved.mkdir(parents=True, exist_ok=True)
            saved = args.saved / f"{args.size}_{scheme}_host_{max_len}{tag}.vmfb"
        wanted = tuple(r for r in routes if r != "eager" or scheme not in eager_done)
        if tag == "eager":  # `scheme:eager`: the eager model alone
            wanted, tag = ("eager",), ""
        made, _ = q.routes(q.quantize(model, scheme), max_len, "host", wanted, scheme, saved)
        eager_done.add(scheme)
        for route, g in made.items():
            gens[(scheme, route if route == "eager" else f"{route}{tag}")] = g
        print(f"# {entry}: ready ({', '.join(made)})", flush=True)
    if args.rounds == 0:
        return
    print(f"# {args.size}, prefill (1 new token), 1 thread, CPU time; {cpu_model()}; load {gen.load()}")
    live = {k: g for k, g in gens.items() if not isinstance(g, str)}
    first = {(k, p): g(ids[p], 1) for p in prompts for k, g in live.items()}  # warm-up, and the tokens
    times: dict[tuple, list[float]] = {(k, p): [] for k in live for p in prompts}
    for _ in range(args.rounds):
        for p in prompts:
            for k, g in live.items():
                start = time.process_time()
                g(ids[p], 1)
                times[(k, p)].append(time.process_time() - start)
    print(f"# load after: {gen.load()}")
    print(
        "| scheme | route | " + " | ".join(f"prefill {p} ms | x f32 IREE" for p in prompts) + " | first token = eager |"
    )
    print("|---|---|" + "---:|---:|" * len(prompts) + "---|")
    for (scheme, route), g in gens.items():
        if isinstance(g, str):
            print(f"| {scheme} | {route} | {g} |")
            continue
        cells, same = [], []
        for p in prompts:
            ms = statistics.median(times[((scheme, route), p)]) * 1e3
            base = next((v for (k, pp), v in times.items() if pp == p and k[0] == "float32" and k[1] != "eager"), None)
            ratio = f"{ms / (statistics.median(base) * 1e3):.2f}" if base else "-"
            cells.append(f"{ms:.1f} | {ratio}")
            eager = first.get(((scheme, "eager"), p))
            same.append(None if eager is None else torch.equal(eager, first[((scheme, route), p)]))
        match = "-" if None in same else ("yes" if all(same) else f"NO ({same})")
        print(f"| {scheme} | {route} | " + " | ".join(cells) + f" | {match} |", flush=True)


if __name__ == "__main__":
    main()
