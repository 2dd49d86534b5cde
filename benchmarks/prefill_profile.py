"""Where a prefill call of a saved `compile_lm` module spends its time, dispatch by dispatch (issue 33).

    python benchmarks/quantized_prefill.py --saved DIR --rounds 0      # compile, save
    python benchmarks/prefill_profile.py DIR/160m_int4_g32_host_544.vmfb --cache 544 --tokens 16

benchmarks/decode_profile.py's method on the `prefill` function: `iree-benchmark-module --function=prefill`
(local-sync: one thread) of `--tokens` tokens (id 5, positions from 0, a mask of ones over the cache: a timing input)
with `--device_profiling_mode=host-execution,executable-metadata`, then `iree-profile statistics --format=jsonl`: per
call, each dispatch function's count and host wall time, and the command buffer's whole time. The times are wall
time: other processes' load moves them, not the shares. docs/performance.md, "Quantized prefill".
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile import MEDIAN, UNITS, per_call

STEP = re.compile(r"^prefill\$async_")


def command(vmfb: Path, irpa: Path, cache: int, tokens: int) -> list[str]:
    """iree-benchmark-module of one prefill call of `tokens` tokens."""
    return [
        "iree-benchmark-module", f"--module={vmfb}", f"--parameters=model={irpa}", "--device=local-sync",
        "--function=prefill", f"--input=1x{tokens}xi64=5", f"--input=1x{cache}xi64=1", f"--input=1x{tokens}xi64=0",
        "--input=1xi64=0",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vmfb", type=Path)
    parser.add_argument("--irpa", type=Path, default=None, help="default: the .irpa beside the .vmfb")
    parser.add_argument("--cache", type=int, default=544, help="the module's max_cache_len")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args(argv)
    base = command(args.vmfb, args.irpa or args.vmfb.with_suffix(".irpa"), args.cache, args.tokens)
    plain = subprocess.run([*base, f"--benchmark_repetitions={args.repetitions}"], capture_output=True, text=True)
    found = MEDIAN.search(plain.stdout)
    if not found:
        raise SystemExit(f"no median from iree-benchmark-module: {plain.stdout[-500:]} {plain.stderr[-500:]}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "prefill.ireeprof"
        flags = ["--benchmark_repetitions=3", "--device_profiling_mode=host-execution,executable-metadata"]
        subprocess.run([*base, *flags, f"--device_profiling_output={out}"], capture_output=True, check=True)
        stats = subprocess.run(
            ["iree-profile", "statistics", "--format=jsonl", str(out)], capture_output=True, text=True, check=True
        )
    calls = per_call([json.loads(line) for line in stats.stdout.splitlines() if line.strip()])
    execute, cpu = calls["execute"], float(found.group(3)) * UNITS[found.group(4)]
    print(f"# {args.vmfb.name}, prefill of {args.tokens}: plain median CPU {cpu:.2f} ms a call; profiled: "
          f"{calls['calls']} calls, the command buffer {execute:.3f} ms a call (wall)")  # fmt: skip
    print("| dispatch | a call | ms | share |\n|---|---:|---:|---:|")
    for name, count, ms in calls["functions"]:
        print(f"| `{STEP.sub('', name)}` | {count:g} | {ms:.3f} | {ms / execute:.1%} |")
    packs = sum(ms for name, _, ms in calls["functions"] if "i8xf32" in name and "pack" in name)
    print(f"# dispatches dequantizing int8 into a pack: {packs:.1f} ms, {packs / execute:.0%} of the call")


if __name__ == "__main__":
    main()
