"""A `compile_lm` model saved with `params=` and loaded: the .irpa's size, the loaded process's memory, and its speed
(issue 34 part 2).

    python benchmarks/lm_archive.py                          # the 160M float32 Llama, this host's ISA
    python benchmarks/lm_archive.py --isa avx2               # IREE for znver3, torch held to AVX2 (a child)
    python benchmarks/lm_archive.py --size tiny --rounds 1   # the smoke test's run

The model (benchmarks/quantized.py's `SIZES`: 160m is hidden 1024, 8 layers, 16 / 8 heads, MLP 2816, vocab 32000,
untied, float32) is compiled once by `compile_lm` (local-sync) and saved twice: `shared`, as the library saves it (each
weight packed once: `encoding.SHARE_PACKED`), and `per function`, as before that change (`SHARE_PACKED` off: the
encoder writes a weight once per function that packs it). For each archive:

- its size against the model's weights (`numel x element size` of its parameters);
- a fresh child process (`--child-rss`) that loads it and generates: RSS after imports, after `fx_rewrites.load`, after
  `generate` (prefill and `--new` decode steps), and the peak (`VmHWM`), with the file-backed and anonymous parts;
- speed, in this process: eager (`model.generate`), the module compiled here and never saved, and each archive loaded
  (`fx_rewrites.load`), timed in turn round after round, one thread (`torch.set_num_threads(1)`, IREE local-sync), CPU
  time: prefill = a generate of 1 new token, decode tokens/s = (N - 1) / (time(N) - time(1)), medians; `match`: the
  tokens equal eager's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu_isa
import generate as gen
import quantized

ROOT = Path(__file__).resolve().parents[1]


def rss() -> dict[str, float]:
    """This process's resident set (MB, 10^6 bytes): total, file-backed, anonymous, and its peak."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssFile", "RssAnon", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024 / 1e6
    return fields


def prompt_ids(length: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, min(vocab, 1000), (1, length), generator=torch.Generator().manual_seed(1))


def child_rss(vmfb: str, prompt: int, new: int, vocab: int) -> None:
    """In a fresh process: load `vmfb`, generate, print the RSS at each step as JSON."""
    import fx_rewrites

    steps = {"imports": rss()}
    lm = fx_rewrites.load(vmfb)
    steps["load"] = rss()
    lm.generate(prompt_ids(prompt, vocab), max_new_tokens=new)
    steps["generate"] = rss()
    print(json.dumps(steps))


def fresh_rss(vmfb: Path, prompt: int, new: int, vocab: int) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child-rss", str(vmfb), "--prompt", str(prompt), "--new", str(new)]
    argv += ["--vocab", str(vocab)]
    done = subprocess.run(
        argv, capture_output=True, text=True, check=False, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    if done.returncode:
        raise SystemExit(f"the loading child exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def save(lm: Any, folder: Path, shared: bool) -> tuple[Path, float, float]:
    """`lm` saved into `folder` with its weights packed once (`shared`) or once per function; the .vmfb, and the
    save's wall and CPU seconds (children's included: the compiles)."""
    from fx_rewrites.backends.iree import encoding

    kept = encoding.SHARE_PACKED
    encoding.SHARE_PACKED = kept if shared else None
    try:
        start, cpu = time.perf_counter(), _cpu()
        lm.save(folder / "lm.vmfb", params=folder / "lm.irpa")
        return folder / "lm.vmfb", time.perf_counter() - start, _cpu() - cpu
    finally:
        encoding.SHARE_PACKED = kept


def _cpu() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(routes: dict[str, Any], prompt: torch.Tensor, new: int, rounds: int) -> dict[str, tuple]:
    tokens = {name: run(prompt, new) for name, run in routes.items()}  # warm-up
    times: dict[str, dict[int, list[float]]] = {name: {1: [], new: []} for name in routes}
    for _ in range(rounds):
        for name, run in routes.items():
            for n in (1, new):
                start = time.process_time()
                run(prompt, n)
                times[name][n].append(time.process_time() - start)
    out = {}
    for name in routes:
        first, full = statistics.median(times[name][1]), statistics.median(times[name][new])
        rate = (new - 1) / (full - first) if full > first else float("nan")
        out[name] = (first * 1e3, rate, "yes" if torch.equal(tokens[name], tokens["eager"]) else "NO")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="160m", choices=sorted(quantized.SIZES))
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child-rss", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=1000, help=argparse.SUPPRESS)
    cpu_isa.add_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.child_rss:
        child_rss(args.child_rss, args.prompt, args.new, args.vocab)
        return 0
    if (rc := cpu_isa.run_in_child(args.isa, __file__, argv)) is not None:
        return rc
    import fx_rewrites

    print(cpu_isa.header(args.isa))
    print(f"{args.size}, prompt {args.prompt}, {args.new} new tokens, 1 thread, CPU time, rounds {args.rounds}; "
          f"load average {gen.load()}")  # fmt: skip
    max_len = args.prompt + args.new
    model = quantized.build(args.size, max_len)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    backend = cpu_isa.backend(args.isa, driver="local-sync")
    start = time.perf_counter()
    lm = fx_rewrites.compile_lm(model, max_cache_len=max_len, backend=backend)
    plain = fx_rewrites.compile_lm(model, max_cache_len=max_len, backend=backend)  # never saved (the cache: no compile)
    print(f"compiled in {time.perf_counter() - start:.0f} s wall; weights {weights / 1e6:.1f} MB", flush=True)
    vocab = model.config.vocab_size
    prompt = prompt_ids(args.prompt, vocab)
    with tempfile.TemporaryDirectory(prefix="lm-archive-") as tmp:
        saved = {}
        for name, shared in (("per function", False), ("shared", True)):
            folder = Path(tmp) / name.replace(" ", "_")
            folder.mkdir()
            vmfb, wall, cpu = save(lm, folder, shared)
            size = (folder / "lm.irpa").stat().st_size
            steps = fresh_rss(vmfb, args.prompt, args.new, vocab)
            saved[name] = fx_rewrites.load(vmfb)
            print(f"| {name} | {size / 1e6:.1f} MB | {size / weights:.2f}x | save {wall:.0f} s wall, {cpu:.0f} s CPU | "
                  + " | ".join(f"{k}: {v['VmRSS']:.0f} (file {v['RssFile']:.0f}, anon {v['RssAnon']:.0f})"
                               for k, v in steps.items())
                  + f" | peak {steps['generate']['VmHWM']:.0f} MB; above imports "
                  f"{(steps['generate']['VmHWM'] - steps['imports']['VmRSS']) * 1e6 / weights:.2f}x the weights |",
                  flush=True)  # fmt: skip
        routes = {
            "eager": gen.hf_generate(model, static=False, max_len=max_len),
            "compiled here, not saved": lambda ids, n: plain.generate(ids, max_new_tokens=n)[:, ids.shape[1] :],
            **{
                f"loaded, {name}": (lambda lm_: lambda ids, n: lm_.generate(ids, max_new_tokens=n)[:, ids.shape[1] :])(
                    loaded
                )
                for name, loaded in saved.items()
            },
        }
        results = measure(routes, prompt, args.new, args.rounds)
    eager = results["eager"]
    print("| route | prefill ms | decode tokens/s | prefill / eager | decode / eager | match |")
    print("|---|---|---|---|---|---|")
    for name, (first, rate, match) in results.items():
        print(f"| {name} | {first:.1f} | {rate:.2f} | {first / eager[0]:.2f} | {rate / eager[1]:.2f} | {match} |")
    print(f"load average at the end: {gen.load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
