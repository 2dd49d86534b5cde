"""Where a decode step of a saved `compile_lm` module spends its time, dispatch by dispatch (issue 33).

    python benchmarks/quantized.py --schemes int4_g32 --routes compile_lm --saved DIR --rounds 0   # compile, save
    python benchmarks/decode_profile.py DIR/160m_int4_g32_host_48.vmfb --cache 48
    python benchmarks/decode_profile.py A/lm.vmfb B/lm.vmfb --rounds 8    # an A/B of the plain decode call

`iree-benchmark-module --function=decode` (local-sync: one thread) with
`--device_profiling_mode=host-execution,executable-metadata`, then `iree-profile statistics --format=jsonl`: per
decode call, each dispatch function's count and host wall time, the queue's allocas and copies, and the command
buffer's whole time (`execute`); the plain median CPU time of a call beside it. The module's weights are read from
the .irpa beside it (scope `model`). The times are wall time: other processes' load moves them, not the shares.
docs/performance.md, "Where an int4 g32 decode token goes". With two modules or more (each with its .irpa beside
it): no profile, `--rounds` interleaved rounds of each one's plain median CPU time (the order rotating round by
round), and the median of the rounds (the same module compiled two ways, e.g. `a8int4_dispatch.PREFETCH`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

MEDIAN = re.compile(r"real_time_median\s+([\d.]+) (\w+)\s+([\d.]+) (\w+)")
UNITS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
QUEUE_OPS = ("alloca", "dealloca", "copy", "barrier")


def command(vmfb: Path, irpa: Path, cache: int, position: int) -> list[str]:
    """iree-benchmark-module of one decode call: token 5 at `position`, a mask of ones over the cache."""
    return [
        "iree-benchmark-module", f"--module={vmfb}", f"--parameters=model={irpa}", "--device=local-sync",
        "--function=decode", "--input=1x1xi64=5", f"--input=1x{cache}xi64=1", f"--input=1x1xi64={position}",
        f"--input=1xi64={position}",
    ]  # fmt: skip


def per_call(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """`iree-profile statistics --format=jsonl` rows as ms per decode call: {"calls", "execute", "functions":
    [(name, dispatches a call, ms a call)] largest first, "queue": {op: ms a call}}."""
    executes = [r for r in rows if r.get("event_name") == "execute"]
    calls = sum(r["sample_count"] for r in executes)
    if not calls:
        raise ValueError("no command buffer executions in the profile")
    functions = [
        (name.replace("decode$async_", ""), r["sample_count"] / calls, r["total_duration_ns"] / calls / 1e6)
        for r in rows
        if r.get("row_type") == "host_execution_function" and (name := r["function_name"])
    ]
    queue: dict[str, float] = {}
    for r in rows:
        if r.get("row_type") == "host_execution_queue_operation" and r.get("event_name") in QUEUE_OPS:
            queue[r["event_name"]] = queue.get(r["event_name"], 0.0) + r["total_duration_ns"] / calls / 1e6
    return {
        "calls": calls,
        "execute": sum(r["total_duration_ns"] for r in executes) / calls / 1e6,
        "functions": sorted(functions, key=lambda f: -f[2]),
        "queue": queue,
    }


def plain_ms(vmfb: Path, irpa: Path, cache: int, position: int, repetitions: int) -> float:
    """The median CPU ms of `repetitions` decode calls (iree-benchmark-module)."""
    base = command(vmfb, irpa, cache, position)
    plain = subprocess.run([*base, f"--benchmark_repetitions={repetitions}"], capture_output=True, text=True)
    found = MEDIAN.search(plain.stdout)
    if not found:
        raise RuntimeError(f"no median from iree-benchmark-module: {plain.stdout[-500:]} {plain.stderr[-500:]}")
    return float(found.group(3)) * UNITS[found.group(4)]


def profile(vmfb: Path, irpa: Path, cache: int, position: int, repetitions: int) -> tuple[float, dict[str, Any]]:
    """(the plain median CPU ms of a call, `per_call` of a profiled run)."""
    cpu = plain_ms(vmfb, irpa, cache, position, repetitions)
    base = command(vmfb, irpa, cache, position)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decode.ireeprof"
        flags = ["--benchmark_repetitions=3", "--device_profiling_mode=host-execution,executable-metadata"]
        subprocess.run([*base, *flags, f"--device_profiling_output={out}"], capture_output=True, check=True)
        stats = subprocess.run(
            ["iree-profile", "statistics", "--format=jsonl", str(out)], capture_output=True, text=True, check=True
        )
    rows = [json.loads(line) for line in stats.stdout.splitlines() if line.strip()]
    return cpu, per_call(rows)


def ab(vmfbs: list[Path], cache: int, position: int, repetitions: int, rounds: int) -> dict[Path, list[float]]:
    """Each module's plain median CPU ms per round, `rounds` rounds, the order rotated each round."""
    times: dict[Path, list[float]] = {v: [] for v in vmfbs}
    for r in range(rounds):
        for i in range(len(vmfbs)):
            vmfb = vmfbs[(i + r) % len(vmfbs)]
            times[vmfb].append(plain_ms(vmfb, vmfb.with_suffix(".irpa"), cache, position, repetitions))
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vmfb", type=Path, nargs="+", help="two or more: an A/B of the plain decode call")
    parser.add_argument("--irpa", type=Path, default=None, help="default: the .irpa beside the .vmfb")
    parser.add_argument("--cache", type=int, default=48, help="the module's max_cache_len")
    parser.add_argument("--position", type=int, default=16)
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=6, help="the A/B's rounds")
    args = parser.parse_args(argv)
    if len(args.vmfb) > 1:
        times = ab(args.vmfb, args.cache, args.position, args.repetitions, args.rounds)
        print(f"| module | median CPU ms of {args.repetitions} decode calls, per round | median of the rounds |")
        print("|---|---|---:|")
        for vmfb, ms in times.items():
            print(f"| {vmfb} | {' / '.join(f'{m:.2f}' for m in ms)} | {statistics.median(ms):.2f} |")
        return
    vmfb = args.vmfb[0]
    irpa = args.irpa or vmfb.with_suffix(".irpa")
    cpu, calls = profile(vmfb, irpa, args.cache, args.position, args.repetitions)
    execute = calls["execute"]
    print(f"# {vmfb.name}: plain median CPU {cpu:.2f} ms a call; profiled: {calls['calls']} calls, "
          f"the command buffer {execute:.3f} ms a call (wall)")  # fmt: skip
    print("| dispatch | a call | ms | share |\n|---|---:|---:|---:|")
    for name, count, ms in calls["functions"]:
        print(f"| `{name}` | {count:g} | {ms:.3f} | {ms / execute:.1%} |")
    for op, ms in calls["queue"].items():
        print(f"| queue {op} | | {ms:.3f} | {ms / execute:.1%} |")


if __name__ == "__main__":
    main()
