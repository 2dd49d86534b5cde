"""Per-token decode time of a Llama split over 1, 2 and 4 gloo ranks, and the share spent in collectives (issue 35).

    python benchmarks/tensor_parallel.py                       # hidden 512, 4 layers, worlds 1 2 4
    python benchmarks/tensor_parallel.py --hidden 256 --worlds 1 2 --new 16 --rounds 3

Each world is a set of ranks spawned on this machine (gloo, CPU), each with one thread (torch.set_num_threads(1),
IREE `local-sync`). World 1 is the unsplit model through `compile_lm`; worlds 2 and 4 split it with
`parallelize_module` (q, k, v, gate, up column-wise; o, down row-wise: two all_reduce per layer) and compile each
rank's programs with `compile_lm` (segments between the collectives, one module per rank). The compile runs
outside the machine's lock; the timing inside it (`/tmp/fxr-heavy.lock`, taken by rank 0 while the others wait
at a barrier).

Per token = (generate(new) - generate(1)) / (new - 1), medians over rounds, per rank: CPU time of the process
(`time.process_time`: the rank's thread and gloo's) and wall time; `collectives` is the part of each spent in the
host steps (the all_reduce calls and their waits; wall includes waiting for the slowest rank). With more ranks than
cores (4 on 2) the wall time measures the oversubscription, not the split; the CPU time per rank is the figure.
The tokens of every rank are checked against the unsplit model's `generate`.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LOCK = "/tmp/fxr-heavy.lock"


def _ranks_main(
    rank: int, world: int, tmp: str, hidden: int, layers: int, new: int, rounds: int, lock: bool = True
) -> dict:
    import torch.distributed as dist

    import fx_rewrites
    from fx_rewrites.backends.iree import IreeBackend
    from tests.distributed import ranks

    model = ranks.llama(hidden, layers)
    ids, _ = ranks.prompts()
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=new, do_sample=False)
    if world > 1:
        ranks.split(model, world)
    start = time.perf_counter()
    lm = fx_rewrites.compile_lm(model, max_cache_len=ids.shape[1] + new, backend=IreeBackend(driver="local-sync"))
    compile_seconds = time.perf_counter() - start
    functions = getattr(lm.module, "functions", {})

    def host() -> tuple[float, float]:
        runs = [f.run for f in functions.values() if hasattr(f, "run")]
        return sum(r.host_cpu_seconds for r in runs), sum(r.host_seconds for r in runs)

    def timed(n: int) -> tuple[float, float, float, float, torch.Tensor]:
        dist.barrier()
        h_cpu, h_wall = host()
        cpu, wall = time.process_time(), time.perf_counter()
        out = lm.generate(ids, max_new_tokens=n)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        h_cpu2, h_wall2 = host()
        return cpu, wall, h_cpu2 - h_cpu, h_wall2 - h_wall, out

    held = open(LOCK, "w") if rank == 0 and lock else None  # noqa: SIM115 - held across the barrier below
    if held is not None:
        fcntl.flock(held, fcntl.LOCK_EX)
    dist.barrier()
    try:
        timed(new)  # warm-up
        per_token, host_cpu, host_wall, wall_token = [], [], [], []
        tokens = None
        for _ in range(rounds):
            first = timed(1)
            full = timed(new)
            tokens = full[4]
            steps = new - 1
            per_token.append((full[0] - first[0]) / steps)
            wall_token.append((full[1] - first[1]) / steps)
            host_cpu.append((full[2] - first[2]) / steps)
            host_wall.append((full[3] - first[3]) / steps)
    finally:
        dist.barrier()
        if held is not None:
            fcntl.flock(held, fcntl.LOCK_UN)
            held.close()
    return {
        "compile_seconds": compile_seconds,
        "cpu_ms": statistics.median(per_token) * 1e3,
        "wall_ms": statistics.median(wall_token) * 1e3,
        "host_cpu_ms": statistics.median(host_cpu) * 1e3,
        "host_wall_ms": statistics.median(host_wall) * 1e3,
        "match": bool(torch.equal(tokens, want)),
        "collectives_per_token": sum(
            f.run.plan.collectives for name, f in functions.items() if name == "decode" and hasattr(f, "run")
        ),
    }


def main() -> None:
    from benchmarks.cpu_isa import cpu_model
    from tests.distributed.launch import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--no-lock",
        action="store_true",
        help="time without taking the machine's lock (figures then carry the load printed above the table)",
    )
    args = parser.parse_args()
    print(
        f"# Llama hidden {args.hidden}, {args.layers} layers, 8 heads / 4 KV heads, vocab 512; prompt 7, {args.new} new"
    )
    lock = "no lock" if args.no_lock else LOCK
    print(f"# {cpu_model()}; load {os.getloadavg()[0]:.1f} ({lock}); one thread per rank, IREE local-sync, gloo")
    print(
        "| ranks | compile s | CPU ms/token/rank | collectives CPU ms (share) | wall ms/token "
        "| collectives wall ms (share) | all_reduce per token | tokens match |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for world in args.worlds:
        results = run_ranks(_ranks_main, world, args.hidden, args.layers, args.new, args.rounds, not args.no_lock)
        cpu_ms = statistics.mean(r["cpu_ms"] for r in results)
        host_cpu = statistics.mean(r["host_cpu_ms"] for r in results)
        wall = statistics.mean(r["wall_ms"] for r in results)
        host_wall = statistics.mean(r["host_wall_ms"] for r in results)
        compile_s = max(r["compile_seconds"] for r in results)
        match = all(r["match"] for r in results)
        print(
            f"| {world} | {compile_s:.0f} | {cpu_ms:.2f} | {host_cpu:.2f} ({host_cpu / cpu_ms:.0%}) | {wall:.2f} | "
            f"{host_wall:.2f} ({host_wall / wall:.0%}) | {results[0]['collectives_per_token']} | "
            f"{'yes' if match else 'NO'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
